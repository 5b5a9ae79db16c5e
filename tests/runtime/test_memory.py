"""The memory planner (a compile step, cannc.compiler.planning): live buffers never
overlap; reuse gets near the lower bound."""

import pytest
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


def _vma_of(addr: int) -> tuple[tuple[int, int], list[str]] | None:
    """The mapping of this process that holds addr: ((start, end), its VmFlags)."""
    with open("/proc/self/smaps") as f:
        span = None
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                span = (lo, hi) if lo <= addr < hi else None
            elif span and head == "VmFlags:":
                return span, line.split()[1:]
    return None


def test_large_buffers_are_huge_page_aligned_and_advised():
    """aligned_empty from one huge page (2 MiB) up: memory of its own, starting at a
    2 MiB boundary, zeroed, advised as huge pages (VmFlags "hg") up to the buffer's last
    small page and no further; unmapped when the array is collected."""
    import gc
    import mmap
    import os

    import pytest

    from cannc.runtime import memory

    if not memory.HUGE_PAGES or not os.path.exists("/proc/self/smaps"):
        pytest.skip("no MADV_HUGEPAGE here")
    n = memory.HUGE_PAGE + 12345
    buf = memory.aligned_empty(n, zero=False)
    addr = buf.ctypes.data
    assert buf.nbytes == n and addr % memory.HUGE_PAGE == 0
    assert not buf.any()
    buf[:] = 7
    assert int(buf[-1]) == 7
    (lo, hi), flags = _vma_of(addr)
    assert "hg" in flags and lo == addr
    assert hi == addr + -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
    small = memory.aligned_empty(memory.HUGE_PAGE - 4096)
    assert small.ctypes.data % mmap.PAGESIZE == 0 and not small.any()
    del buf
    gc.collect()
    found = _vma_of(addr)
    assert found is None or "hg" not in found[1]


def test_a_refused_mapping_falls_back_to_numpy(monkeypatch):
    """Where the kernel refuses the mapping (address space limits), a large buffer is an
    ordinary page-aligned numpy allocation."""
    import mmap

    from cannc.runtime import memory

    def refuse(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(memory.mmap, "mmap", refuse)
    buf = memory.aligned_empty(memory.HUGE_PAGE + 100)
    assert buf.nbytes == memory.HUGE_PAGE + 100 and buf.ctypes.data % mmap.PAGESIZE == 0
    assert not buf.any()


def _residual_block(C: int, M: int, HW: int):
    """r = Conv(z) (the residual, an intermediate); Conv(x) + r -> Relu -> y."""
    import numpy as np
    from helpers import model_of
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((M, C, 1, 1)) * 0.1).astype(np.float32),
                                "w")
    w2 = numpy_helper.from_array((rng.standard_normal((M, M, 1, 1)) * 0.1).astype(np.float32),
                                 "w2")
    vi = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, HW, HW]),
          helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, M, HW, HW])]
    m = model_of([helper.make_node("Conv", ["z", "w2"], ["r"]),
                  helper.make_node("Conv", ["x", "w"], ["c"]),
                  helper.make_node("Add", ["c", "r"], ["a"]),
                  helper.make_node("Relu", ["a"], ["y"])],
                 vi, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, w2])
    feeds = {"x": rng.standard_normal((1, C, HW, HW)).astype(np.float32),
             "z": rng.standard_normal((1, M, HW, HW)).astype(np.float32)}
    return m, feeds


@pytest.mark.parametrize("tuning,shares", [
    ({"swap": False}, True),                 # one K block: y takes r's buffer
    ({"swap": False, "KC": 32}, False),      # partial sums in y before r is read
    ({"swap": True}, False),                 # (measured slower on 2 cores: its own)
])
def test_conv_output_takes_its_residuals_buffer(monkeypatch, tuning, shares):
    """A 1x1 conv whose fused epilogue adds a residual of its shape writes its output
    over the residual (Kernel.overwrites) only where the kernel reads each residual
    element just before writing the output there; the results are right either way."""
    from helpers import assert_matches_ort

    import cannc
    import cannc.codegen.conv as cc
    monkeypatch.setattr(cc, "FORCE_TUNING", tuning)
    m, feeds = _residual_block(64, 64, 16)
    sess = cannc.compile(m, cores=2, cache=False)
    (prog,) = sess.programs.values()
    # (fusion picks which conv takes the Add: the other one's output is the residual)
    first, k = prog.kernels
    assert k.op_types == ["Conv", "Add", "Relu"] and first.outputs[0] in k.inputs
    res = first.outputs[0]
    assert (k.overwrites == res) == shares
    assert (prog.plan.root("y") == prog.plan.root(res)) == shares
    assert_matches_ort(m, feeds, cores=2, cache=False)


def test_conv_output_never_takes_its_own_inputs_buffer(monkeypatch):
    """Add(Conv(x), x): the residual is the conv's input too, read for every output
    channel; the output keeps a buffer of its own (and the results are right)."""
    import numpy as np
    from helpers import assert_matches_ort, model_of
    from onnx import TensorProto, helper, numpy_helper

    import cannc
    import cannc.codegen.conv as cc
    monkeypatch.setattr(cc, "FORCE_TUNING", {"swap": False})
    C, HW = 32, 16
    w = numpy_helper.from_array(
        (np.random.default_rng(0).standard_normal((C, C, 1, 1)) * 0.1).astype(np.float32), "w")
    vi = [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, C, HW, HW])]
    m = model_of([helper.make_node("Sigmoid", ["z"], ["x"]),
                  helper.make_node("Conv", ["x", "w"], ["c"]),
                  helper.make_node("Add", ["c", "x"], ["y"])],
                 vi, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    sess = cannc.compile(m, cores=2, cache=False)
    (prog,) = sess.programs.values()
    k = prog.kernels[-1]
    assert "Conv" in k.op_types and not k.overwrites
    assert prog.plan.root("y") != prog.plan.root(k.inputs[0])
    feeds = {"z": np.random.default_rng(1).standard_normal((1, C, HW, HW)).astype(np.float32)}
    assert_matches_ort(m, feeds, cores=2, cache=False)
