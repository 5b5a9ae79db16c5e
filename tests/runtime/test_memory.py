"""The memory planner (a compile step, cannc.compiler.planning): live buffers never
overlap; reuse gets near the lower bound."""

from hypothesis import given, settings
from hypothesis import strategies as st

from cannc.artifact import ALIGN
from cannc.compiler.planning import Interval, place


def _check(intervals, p):
    for a in intervals:
        for b in intervals:
            if a.value >= b.value:
                continue
            if a.end < b.start or b.end < a.start:
                continue
            oa, ob = p.offsets[a.value], p.offsets[b.value]
            assert oa + a.size <= ob or ob + b.size <= oa, (a, b, oa, ob)
    for iv in intervals:
        assert p.offsets[iv.value] % ALIGN == 0
        assert p.offsets[iv.value] + iv.size <= p.arena_bytes
    assert p.lower_bound_bytes <= p.arena_bytes <= p.naive_bytes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(-1, 30), st.integers(0, 10)),
                min_size=1, max_size=40))
def test_no_two_live_buffers_overlap(items):
    intervals = [Interval(f"v{i}", size, s, s + d) for i, (size, s, d) in enumerate(items)]
    _check(intervals, place(intervals))


def test_chain_reuses_memory():
    # a chain a -> b -> c -> d: only two buffers are live at once
    ivs = [Interval(f"v{i}", 1024, i, i + 1) for i in range(10)]
    p = place(ivs)
    assert p.arena_bytes == 2 * 1024 == p.lower_bound_bytes
    assert p.naive_bytes == 10 * 1024


def test_plan_is_made_at_compile_time_and_read_by_the_runtime():
    import dataclasses

    import numpy as np
    import pytest
    from onnx import TensorProto, helper

    import cannc
    from cannc.artifact import MemoryPlan
    from cannc.compiler.planning import plan_memory

    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Exp", ["a"], ["b"]),
             helper.make_node("ReduceSum", ["b"], ["s"], keepdims=1),
             helper.make_node("Div", ["b", "s"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [32, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 32])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    sess = cannc.compile(m, cores=2, fusion=False)
    x = np.ones((32, 32), np.float32)
    sess.run(None, {"x": x})
    (prog,) = sess.programs.values()
    spec = prog.spec
    assert isinstance(spec.memory, MemoryPlan) and prog.plan is spec.memory
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.memory.arena_bytes = 0  # type: ignore[misc]
    assert spec.memory.storage            # an elementwise output took over its input
    assert spec.memory.lower_bound_bytes <= spec.memory.arena_bytes < spec.memory.naive_bytes
    # planning again gives the same plan
    assert plan_memory(spec.graph, spec.kernels, spec.aliases, spec.constants) == spec.memory


def test_a_buffer_collected_while_the_memory_lock_is_held_does_not_deadlock():
    # a garbage collection can run a buffer's finalizer inside Device.malloc, where the
    # thread holds the memory lock: the finalizer must not wait for that lock (it did,
    # and hung an xdist worker for good)
    import gc
    import threading

    from cannc.runtime.device import Device
    dev = Device(cores=1)
    done = threading.Event()

    def finalizer_under_the_lock():
        with dev._mem_lock:
            dev._free("other", 4096)
        done.set()
    t = threading.Thread(target=finalizer_under_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set(), "a finalizer run under the memory lock deadlocked"
    assert dev.mem_info().get("other_bytes") == -4096
    b = dev.malloc(8192, "weights")
    used = dev.mem_info()["weights_bytes"]
    del b
    gc.collect()
    assert dev.mem_info()["weights_bytes"] == used - 8192
