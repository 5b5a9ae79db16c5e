"""The native AI-core pool: idle workers sleep (no CPU burnt), wake for the next launch,
results stay right across idle gaps and ring wrap-around; the dispatcher's guided claims."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import cannc
from cannc.compiler import snapshot
from cannc.native.target import JitLibrary
from cannc.runtime import dispatch
from cannc.runtime.device import IDLE_SPIN_US, Device
from cannc.runtime.program import dispatcher_object
from cannc.schedule.split import claim_chunks, min_chunk, region_chunks, split_even
from models import zoo


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


@pytest.fixture(scope="module", params=[2, 1], ids=["2cores", "1core"])
def mlp2(request):
    model = zoo.build("mlp")
    sess = cannc.compile(model, cores=request.param, shapes={"x": (8, 256)})
    feeds = zoo.example_inputs(model, batch=8)
    return sess, feeds, sess.run(None, feeds)


def test_results_right_after_idle_gaps_and_ring_wrap(mlp2):
    # (1 core: the launch's counters must outlive prepare_launch; freed early, the
    # dispatcher wrote into the heap and results went wrong or the process crashed)
    sess, feeds, ref = mlp2
    n = dispatch.POOL_RING + 8        # back to back: the launch ring wraps around
    for _ in range(n):
        assert np.array_equal(sess.run(None, feeds)[0], ref[0])
    # gaps longer than the idle spin: the worker sleeps and is woken by the next launch
    for gap in (0.0, 0.002, 3 * IDLE_SPIN_US * 1e-6, 0.06):
        time.sleep(gap)
        assert np.array_equal(sess.run(None, feeds)[0], ref[0])


def test_idle_device_burns_no_cpu(mlp2):
    sess, feeds, _ = mlp2
    for _ in range(5):
        sess.run(None, feeds)
    # (the program cache's writer thread finishes this and earlier tests' entries first:
    # its CPU is this process's too, and in a full run it read 0.56-0.67 s here)
    assert snapshot.wait_stores(timeout=120)
    c0 = _cpu()
    time.sleep(0.6)
    # a worker still spinning would show ~0.6 s; sleeping ones ~0
    assert _cpu() - c0 < 0.15


def test_sleeping_worker_wakes_and_close_joins():
    lib = JitLibrary([dispatcher_object()])
    run = lib.address(dispatch.ENTRY)
    dev = Device(2)
    counters = np.zeros(32, np.int64)
    cptr = (counters.ctypes.data + 63) // 64 * 64
    counters[(cptr - counters.ctypes.data) // 8] = 1      # the gate of a 0-kernel launch
    sched = np.zeros(8, np.uint64)
    for i in range(1, 4):
        time.sleep(0.03)                                  # asleep on its futex by now
        dev.launch(run, sched.ctypes.data, 0, 2, cptr, 0, 0, None, (lib, counters, sched))
        t = time.monotonic()
        while dev.launches_done(1) < i:
            assert time.monotonic() - t < 10, "the worker core never woke up"
            time.sleep(0.0005)
    dev.close()
    dev.close()                                           # idempotent
    with pytest.raises(RuntimeError):
        dev.launch(run, sched.ctypes.data, 0, 2, cptr, 0, 0, None, None)


def test_workers_keep_off_the_posting_cpu(monkeypatch):
    """A launch lets the workers run anywhere but on the CPU of the thread that posts it
    (a worker woken after an idle gap landed there and shared it with core 0)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to keep off")
    lib = JitLibrary([dispatcher_object()])
    run = lib.address(dispatch.ENTRY)
    dev = Device(2)
    pool = dev._pool
    assert pool.affinity(0) == set(cpus)               # before any launch: anywhere
    counters = np.zeros(64, np.int64)
    sched = np.zeros(8, np.uint64)
    try:
        for i, cpu in enumerate([cpus[0], cpus[1], cpus[1], cpus[0]], start=1):
            monkeypatch.setattr(pool, "_getcpu", lambda cpu=cpu: cpu)
            cptr = (counters.ctypes.data + 63) // 64 * 64
            counters[:] = 0
            counters[(cptr - counters.ctypes.data) // 8] = 1   # gate of a 0-kernel launch
            dev.launch(run, sched.ctypes.data, 0, 2, cptr, 0, 0, None, (lib, counters, sched))
            assert pool.affinity(0) == set(cpus) - {cpu}
            t = time.monotonic()
            while dev.launches_done(1) < i:
                assert time.monotonic() - t < 10, "the worker core never ran the launch"
                time.sleep(0.0005)
        pool.keep_off(10 ** 6)                 # not one of the process's CPUs: unchanged
        assert pool.affinity(0) == set(cpus) - {cpus[0]}
    finally:
        dev.close()


@pytest.mark.parametrize("T,cores", [(1, 2), (2, 2), (7, 2), (100, 2), (1000, 2), (37, 4),
                                     (5, 1)])
def test_claim_chunks_cover_and_shrink(T, cores):
    ch = claim_chunks(T, cores)
    assert ch[0][0] == 0 and ch[-1][1] == T
    assert all(a[1] == b[0] for a, b in zip(ch, ch[1:]))
    sizes = [b - a for a, b in ch]
    assert all(x >= y for x, y in zip(sizes, sizes[1:]))
    if cores > 1:
        assert all(s >= min(min_chunk(T, cores), T) for s in sizes[:-1])


@pytest.mark.parametrize("T,cores", [(1, 2), (22, 2), (100, 2), (37, 3), (5, 1), (0, 2)])
def test_region_chunks_follow_the_dispatcher(T, cores):
    """Each core's chunks (as the dispatcher claims them from its region, nobody taking
    another's) cover its region in order, shrinking; one chunk on one core."""
    per_core = region_chunks(T, cores)
    assert len(per_core) == cores
    flat = [c for chunks in per_core for c in chunks]
    assert [t for a, b in flat for t in range(a, b)] == list(range(T))
    for (r0, r1), chunks in zip(split_even(T, cores), per_core):
        if r1 > r0:
            assert chunks[0][0] == r0 and chunks[-1][1] == r1
        sizes = [b - a for a, b in chunks]
        assert all(x >= y for x, y in zip(sizes, sizes[1:]))
    if cores == 1:
        assert len(per_core[0]) <= 1
    if (T, cores) == (22, 2):
        assert [b - a for a, b in per_core[0]] == [6, 3, 1, 1]


def test_failed_copy_in_does_not_strand_the_workers(mlp2):
    # the workers are woken before the inputs are copied in; a copy that fails must still
    # let them through the start gate, or they wait there for good (spinning) and take
    # no part in any later launch
    sess, feeds, ref = mlp2
    prog = next(iter(sess._programs.values()))
    with pytest.raises(TypeError):
        prog.execute({"x": feeds["x"].astype(np.float64)})
    assert np.array_equal(sess.run(None, feeds)[0], ref[0])
    pool = sess.device._pool
    if pool is not None:
        t = time.monotonic()
        while sess.device.launches_done(1) < pool._posted:
            assert time.monotonic() - t < 10, "worker core stuck at a launch's start gate"
            time.sleep(0.001)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_its_own_workers(mlp2):
    sess, feeds, ref = mlp2
    n = dispatch.POOL_RING + 4        # more launches than the ring holds
    pid = os.fork()
    if pid == 0:                      # child: no thread of the parent's pool exists here
        ok = False
        try:
            ok = all(np.array_equal(sess.run(None, feeds)[0], ref[0]) for _ in range(n))
        finally:
            os._exit(0 if ok else 1)
    t = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t > 60:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung launching on its inherited device")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
