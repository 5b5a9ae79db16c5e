"""The simulated accelerator: contexts, concurrency, streams/events, async runs, profiler."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

import cannc
from cannc.runtime.corechoice import CoreChoice
from cannc.runtime.device import Device
from cannc.runtime.memory import device_ready_empty, is_device_ready
from cannc.runtime.stream import Event, is_pinned
from models import zoo


@pytest.fixture(scope="module")
def mlp():
    model = zoo.build("mlp")
    sess = cannc.compile(model, cores=2, shapes={"x": (4, 256)})
    feeds = zoo.example_inputs(model, batch=4)
    return sess, feeds, sess.run(None, feeds)


def test_many_threads_get_correct_results(mlp):
    sess, feeds, ref = mlp
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((4, 256)).astype(np.float32) for _ in range(6)]
    refs = [sess.run(None, {"x": x})[0] for x in inputs]
    errors = []

    def worker(i):
        for r in range(8):
            j = (i + r) % len(inputs)
            out = sess.run(None, {"x": inputs[j]})[0]
            if not np.array_equal(out, refs[j]):
                errors.append((i, j))

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    (prog,) = sess.programs.values()
    assert 1 <= prog.num_contexts <= 8


def test_run_async_pipeline(mlp):
    sess, feeds, ref = mlp
    futs = [sess.run_async(None, feeds) for _ in range(5)]
    for f in futs:
        out = f.result(timeout=60)
        np.testing.assert_array_equal(out[0], ref[0])
    pinned = sess.device.malloc_host(feeds["x"].shape, np.float32)
    pinned[...] = feeds["x"]
    assert is_pinned(pinned)
    np.testing.assert_array_equal(sess.run_async(["logits"], {"x": pinned}).result()[0], ref[0])


def test_run_async_reports_bad_inputs_at_submit(mlp):
    sess, _, _ = mlp
    with pytest.raises(cannc.InputError):
        sess.run_async(None, {"x": np.zeros((4, 3), np.float32)})


def test_streams_events_and_copy_semantics():
    dev = Device(2)
    s1, s2 = dev.stream("a"), dev.stream("b")
    src = dev.malloc_host((1 << 20,), np.float32)
    src[...] = 3.0
    dst = np.zeros(1 << 20, np.float32)
    order = []
    gate = threading.Event()
    s1.enqueue(lambda: (gate.wait(5), order.append("s1")))
    s1.memcpy_async(dst, src)          # pinned: returns before the copy (s1 is blocked)
    assert not dst.any()
    ev = Event().record(s1)
    s2.wait_event(ev)
    s2.enqueue(lambda: order.append("s2"))
    gate.set()
    s2.synchronize()
    assert order == ["s1", "s2"] and (dst == 3.0).all()
    pageable = np.full(1000, 7.0, np.float32)
    dst2 = np.zeros(1000, np.float32)
    s1.memcpy_async(dst2, pageable)    # pageable: done when the call returns
    assert (dst2 == 7.0).all()
    e0, e1 = Event().record(s1), None
    e1 = Event().record(s1)
    e1.synchronize()
    assert e0.elapsed_ms(e1) >= 0
    dev.close()


def test_device_memory_accounting(mlp):
    sess, _, _ = mlp
    info = sess.mem_info()
    (prog,) = sess.programs.values()
    assert info["weights_bytes"] >= prog.weights_bytes > 0
    assert info["arena_bytes"] >= prog.plan.arena_bytes
    assert info["peak_bytes"] >= info["used_bytes"] > 0


def test_packed_weights_are_adopted_not_copied(mlp):
    # prepack_b writes the panels into page-aligned memory of their own, which the
    # device reads in place (no second copy of the weights); other constants are copied
    sess, feeds, ref = mlp
    (prog,) = sess.programs.values()
    consts = prog.spec.constants
    adopted = [c for c, b in prog.wbuf.items() if np.shares_memory(b, consts[c])]
    copied = [c for c in prog.wbuf if c not in adopted]
    assert adopted, "no packed weight was adopted"
    for c in adopted:
        assert is_device_ready(consts[c]) and not consts[c].flags.writeable
        assert prog.wbuf[c].ctypes.data % 4096 == 0
    for c in copied:
        assert not is_device_ready(consts[c])
    assert prog.weights_bytes <= sess.mem_info()["weights_bytes"]
    assert np.array_equal(sess.run(None, feeds)[0], ref[0])


def test_weight_pool_lets_go_of_collected_constants():
    """The pool's entry of a constant goes with the constant: copied or adopted (a view
    of the constant's own pages, which the entry must not keep alive), its device memory
    is free once no program holds it (a specialisation evicted, or a compile that failed
    after its upload). Hits return the same memory while the constant lives."""
    import gc

    from cannc.runtime.program import WeightPool

    dev = Device(1)
    pool = WeightPool(dev)
    keep = np.ones(10, np.float32)
    pool.upload(keep)
    base = dev.mem_info()["weights_bytes"]
    copied = np.ones(100_000, np.float32)
    packed = device_ready_empty((50_000,), np.float32)
    packed[:] = 2
    b1, b2 = pool.upload(copied), pool.upload(packed)
    assert pool.upload(copied) is b1 and np.shares_memory(pool.upload(packed), packed)
    assert not np.shares_memory(b1, copied)
    assert dev.mem_info()["weights_bytes"] - base == 600_000
    held = pool.upload(packed)          # a program's copy outlives the pool's entry
    del copied, packed, b1, b2
    gc.collect()
    pool.upload(keep)
    assert dev.mem_info()["weights_bytes"] - base == 200_000 and held[0:4].view(
        np.float32)[0] == 2
    del held
    gc.collect()
    pool.upload(keep)
    assert dev.mem_info()["weights_bytes"] == base and len(pool._bufs) == 1
    dev.close()


def test_device_ready_arrays_are_page_aligned_whole_lines():
    a = device_ready_empty((3, 5), np.float32)
    assert a.shape == (3, 5) and a.flags.c_contiguous and a.ctypes.data % 4096 == 0
    assert is_device_ready(a)
    assert not is_device_ready(a.reshape(-1)) and not is_device_ready(np.zeros(3))
    # the allocation behind it holds whole 64-byte lines
    owner = a
    while owner.base is not None:
        owner = owner.base
    assert owner.nbytes - (a.ctypes.data - owner.ctypes.data) >= 64


def test_profiler_and_chrome_trace(mlp, tmp_path):
    sess, feeds, _ = mlp
    prof = sess.profile(feeds, runs=5, warmup=1)
    (prog,) = sess.programs.values()
    assert len(prof.kernels) == len(prog.kernels)
    assert all(k["time_ms"] >= 0 and k["nodes"] for k in prof.kernels)
    # the kernels partition the compute phase (measured by the caller around the launch)
    assert 0 < prof.kernel_ms <= prof.compute_ms * 1.10 + 0.05
    assert prof.peaks["fp32_gflops_per_core"] > 1
    gemm = max(prof.kernels, key=lambda k: k["flops"])
    assert gemm["gflops"] > 0 and "MatMul" in gemm["op_types"]
    assert all(n in prof.onnx_nodes for k in prog.kernels for n in k.nodes)
    path = tmp_path / "trace.json"
    prof.write_chrome_trace(path)
    trace = json.loads(path.read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"AI Core 0", "AI Core 1", "copy engine"} <= names
    assert any(e.get("ph") == "X" and e.get("tid") == 0 and "onnx_nodes" in e.get("args", {})
               for e in trace["traceEvents"])
    assert "run" in prof.table()


def test_cycle_rate_survives_a_preemption_between_counter_and_clock():
    """The profiler converts the dispatcher's cycle stamps to time with a rate it
    measures once. A thread descheduled right after reading the counter (a busy 2-vCPU
    guest) must not skew it: unbracketed, a 6 ms stall put a 1 GHz counter at 1.3 GHz,
    and every kernel time 23% short."""
    from cannc.runtime.profiler import _cycle_rate

    class StallingCounter:
        """A 1 GHz counter; some reads stall 6 ms after taking the value."""

        def __init__(self, stall_on):
            self.calls = 0
            self.stall_on = stall_on

        def cycles(self):
            c = int(time.perf_counter() * 1e9)
            if self.calls in self.stall_on:
                time.sleep(0.006)
            self.calls += 1
            return c

    for stall_on in ({0}, {0, 1, 2}, {1}, set()):
        rate = _cycle_rate(StallingCounter(stall_on))
        assert abs(rate / 1e9 - 1) < 0.01, (stall_on, rate)


def test_in_place_reuse_keeps_results_right():
    from onnx import TensorProto, helper
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Exp", ["a"], ["b"]),
             helper.make_node("ReduceSum", ["b"], ["s"], keepdims=1),
             helper.make_node("Div", ["b", "s"], ["y"])]
    g = helper.make_graph(nodes, "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    sess = cannc.compile(m, cores=2, fusion=False)
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    e = np.exp(np.maximum(x, 0))
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], e / e.sum(), rtol=1e-5)
    (prog,) = sess.programs.values()
    assert prog.storage, "an elementwise output took over its input's buffer"
    assert prog.plan.arena_bytes < prog.plan.naive_bytes


def test_run_async_streams_end_with_their_session():
    """A session's copy-in / compute / copy-out stream threads end when it is collected
    (they outlived it: three threads per session that ever ran run_async)."""
    import gc

    m = zoo.build("mlp")
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    gc.collect()
    before = threading.active_count()
    for _ in range(4):
        s = cannc.compile(m, cores=2)
        s.run_async(None, {s.get_inputs()[0].name: x}).result()
        del s
    gc.collect()
    for _ in range(50):          # the threads see their stop marker and exit
        if threading.active_count() <= before + 3:   # (+ the shared device's, if new)
            break
        threading.Event().wait(0.02)
    assert threading.active_count() <= before + 3


def test_checked_shapes_fast_path_still_refuses_bad_inputs(mlp):
    """A run remembers input shapes a full check accepted; what differs in dtype, shape,
    names or type still takes the full check and its errors."""
    sess, feeds, ref = mlp
    x = feeds["x"]
    assert np.array_equal(sess.run(None, {"x": x})[0], ref[0])
    assert ((4, 256),) in sess._accepted
    bad = [({"x": x.astype(np.float64)}, "dtype float64"),
           ({"x": x[:, :255]}, "shape \\(4, 255\\)"),
           ({"x": x, "y": x}, "unknown input name"),
           ({"y": x}, "missing input"),
           ({"x": x.reshape(4, 16, 16)}, "rank 3")]
    for feed, msg in bad:
        with pytest.raises(cannc.InputError, match=msg):
            sess.run(None, feed)
    # a strided view of an accepted shape takes the fast path and is read correctly
    wide = np.zeros((4, 512), np.float32)
    wide[:, ::2] = x
    assert np.array_equal(sess.run(None, {"x": wide[:, ::2]})[0], ref[0])
    # an ndarray subclass takes the full check and is not remembered
    class Sub(np.ndarray):
        pass

    sess._accepted.clear()
    assert np.array_equal(sess.run(None, {"x": x.view(Sub)})[0], ref[0])
    assert not sess._accepted


def test_launch_counters_reused_only_when_every_worker_is_done(mlp):
    sess, feeds, ref = mlp
    prog = sess.programs[((4, 256),)]
    ctx = prog.acquire()
    try:
        nk = len(prog.kernels)
        # core 0 returns before a worker has left the launch: wait until it has (a
        # loaded machine can keep it behind for a while)
        deadline = time.monotonic() + 10
        while not all(launch < 0 or prog.device.launch_finished(launch)
                      for launch in ctx.counter_launch):
            assert time.monotonic() < deadline, "a worker never finished its launches"
            time.sleep(0.001)
        held, cptr, slot = prog._counters(ctx, nk)
        assert held is None and cptr in ctx.counter_addrs and slot is not None
        off = ctx.counter_offs[slot]
        assert not ctx.counters[off:off + nk * 8 + 16].any()
        # a slot whose launch a worker may still walk is not reused: fresh counters
        ctx.counter_launch = [1 << 60] * len(ctx.counter_launch)
        held, cptr2, slot2 = prog._counters(ctx, nk)
        assert held is not None and slot2 is None and cptr2 not in ctx.counter_addrs
        assert cptr2 % 64 == 0 and not held.any()
        # whatever cores the next launch uses (core_choice): the slot's last launch decides
        held, cptr3, slot3 = prog._counters(ctx, nk)
        assert held is not None and slot3 is None
        # a slot no worker launch used is reused by either
        ctx.counter_launch = [-1] * len(ctx.counter_launch)
        held, cptr4, slot4 = prog._counters(ctx, nk)
        assert held is None and slot4 is not None
    finally:
        prog.release(ctx)
    prog.core_choice = CoreChoice(prog.device.cores, enable=False)   # every launch on 2
    for _ in range(3 * len(ctx.counter_addrs)):
        assert np.array_equal(sess.run(None, feeds)[0], ref[0])
    assert all(launch >= 0 for launch in ctx.counter_launch) or prog.device.cores == 1


def test_a_launch_keeps_its_memory_until_every_worker_has_run_it():
    """The pool keeps what a launch's pointers point into (its counters, buffers) until
    every worker has finished it. The case that once freed them early: the workers a
    whole ring behind at one post and caught up to the next launch by the following one
    (the launches released then span every slot of the ring). The native post is
    replaced (the worker never runs) and the worker's progress is written by hand."""
    import gc
    import weakref

    from cannc.runtime import dispatch
    from cannc.runtime.device import _Pool

    class Held:
        pass

    ring, line = dispatch.POOL_RING, dispatch.POOL_LINES + 8
    pool = _Pool(2)
    try:
        pool._post = lambda *args: None
        refs = []

        def post(want):
            h = Held()
            refs.append(weakref.ref(h))
            assert pool.post(0, 0, 0, 2, 0, 0, 0, None, h) == want   # (h: the pool's only)

        for i in range(ring):                    # the worker has run none of them
            post(i)
        pool.mem[line] = ring                    # ... then caught up with all of them
        post(ring)
        gc.collect()
        assert all(r() is None for r in refs[:ring])   # finished launches are released
        assert refs[ring]() is not None, "a launch no worker has run lost its memory"
        pool.mem[line] = ring + 1
        post(ring + 1)
        gc.collect()
        assert refs[ring]() is None and refs[ring + 1]() is not None
    finally:
        pool.mem[line] = 0
        pool.close()


def test_profile_peak_share_of_a_winograd_conv_counts_its_real_multiplies():
    """A Winograd conv does ~2.25x fewer multiply-adds than the direct conv its op GFLOP/s
    count: %peak is taken from what the kernel executes (its gemm_flops), GFLOP/s from the
    op, so %peak / GFLOP/s is the executed share over the peak."""
    from tests.helpers import single_node_model
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64, 28, 28)).astype(np.float32)
    w = (rng.standard_normal((64, 64, 3, 3)) / 24).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    m, feeds = single_node_model("Conv", [x, w, b], const_inputs=(1, 2), pads=[1, 1, 1, 1])
    sess = cannc.compile(m, cores=1)
    prof = sess.profile(feeds, runs=3, warmup=1)
    (k,) = [k for k in prof.kernels if "Conv" in k["op_types"]]
    (kern,) = [kk for kk in sess.programs[next(iter(sess.programs))].kernels
               if "Conv" in kk.op_types]
    assert "gemm_flops" in kern.notes, "a 3x3 64->64 conv at 28x28 takes Winograd"
    assert k["executed_flops"] == kern.notes["gemm_flops"] < k["flops"]
    peak = prof.peaks["fp32_gflops_per_core"]
    want = 100 * k["gflops"] * k["executed_flops"] / k["flops"] / peak
    assert abs(k["flops_peak_pct"] - want) < 1e-6 * max(want, 1)
