"""The native dispatcher (runtime/dispatch.py) on its own: with a kernel that records,
for every tile, how often it ran and on which core, every tile runs exactly once for
any tile count and core count; on up to MAX_REGION_CORES cores each core starts on a
contiguous region of its own; a core that never comes leaves its region to the others."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from llvmlite import ir

from cannc.native import emit
from cannc.native.emit import I64, PTR, VOID, for_range, i64
from cannc.native.target import JitLibrary, jit_library, new_module
from cannc.runtime import dispatch
from cannc.runtime.program import dispatcher_object
from cannc.schedule.split import MAX_REGION_CORES

WS_STRIDE = 64


def _recorder() -> JitLibrary:
    """kernel(args, t0, t1, ws): args[0] -> i64 run counts, args[1] -> i64 core of each
    tile, args[2] -> i64 order of each tile's claim; the core is (ws - ws_base) / 64 with
    ws_base in args[3]."""
    m = new_module("recorder")
    fn = ir.Function(m, ir.FunctionType(VOID, [PTR, I64, I64, PTR]), name="record")
    args, t0, t1, ws = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    ptrs = [b.load(emit.gep(b, args, i, PTR), typ=PTR) for i in range(4)]
    counts, cores, order, base = ptrs
    core = b.sdiv(b.sub(b.ptrtoint(ws, I64), b.ptrtoint(base, I64)), i64(WS_STRIDE))
    seq = b.atomic_rmw("add", emit.gep(b, order, -1, I64), i64(1), "seq_cst")
    with for_range(b, t0, t1, name="t") as t:
        b.atomic_rmw("add", emit.gep(b, counts, t, I64), i64(1), "seq_cst")
        b.store(core, emit.gep(b, cores, t, I64))
        b.store(seq, emit.gep(b, order, t, I64))
    b.ret_void()
    return jit_library(m, "recorder")


def _run(tiles: list[int], ncores: int, flags: int = 0, present: list[int] | None = None):
    """Dispatch kernels of the given tile counts on `ncores` cores (threads); the cores not
    in `present` never come (their share must be taken by the others)."""
    rec = _recorder()
    lib = JitLibrary([dispatcher_object()])
    run = dispatch.RUN_FUNC_TYPE(lib.address(dispatch.ENTRY))
    nk = len(tiles)
    ws = np.zeros(ncores * WS_STRIDE // 8 + 8, np.int64)
    keep, sched = [], np.zeros(nk * dispatch.RECORD_WORDS, np.int64)
    out = []
    for k, T in enumerate(tiles):
        counts, cores = np.zeros(T + 1, np.int64), np.full(T + 1, -1, np.int64)
        order = np.zeros(T + 2, np.int64)
        table = np.array([counts.ctypes.data, cores.ctypes.data, order.ctypes.data + 8,
                          ws.ctypes.data], np.int64)
        keep += [counts, cores, order, table]
        sched[k * 4:k * 4 + 4] = [rec.address("record"), table.ctypes.data, T, flags]
        out.append((counts, cores, order))
    counters = np.zeros(nk * dispatch.COUNTER_WORDS + 16 + 8, np.int64)
    cptr = (counters.ctypes.data + 63) // 64 * 64
    present = list(range(ncores)) if present is None else present
    threads = [threading.Thread(target=run, args=(sched.ctypes.data, nk, c, ncores, cptr,
                                                  ws.ctypes.data, WS_STRIDE, None))
               for c in present if c != 0]
    for t in threads:
        t.start()
    run(sched.ctypes.data, nk, 0, ncores, cptr, ws.ctypes.data, WS_STRIDE, None)
    for t in threads:
        t.join()
    return [(c[:-1], k[:-1], o[1:-1]) for c, k, o in out]


@pytest.mark.parametrize("ncores", [1, 2, 3, MAX_REGION_CORES, MAX_REGION_CORES + 2])
@pytest.mark.parametrize("T", [1, 2, 5, 24, 35, 200])
def test_every_tile_runs_exactly_once(T, ncores):
    for counts, cores, _ in _run([T, T + 3], ncores):
        assert (counts == 1).all()
        assert ((cores >= 0) & (cores < ncores)).all()


def test_single_core_kernels_run_whole_on_one_core():
    (counts, cores, _), = _run([40], 2, flags=dispatch.FLAG_SINGLE_CORE)
    assert (counts == 1).all() and len(set(cores.tolist())) == 1


def test_one_core_runs_each_kernel_in_one_call():
    """On one core every kernel's tiles are one claim, so one call: a GEMM split into row
    blocks read all of B once per call (five guided claims of 22 tiles)."""
    for counts, cores, order in _run([22, 7, 1], 1):
        assert (counts == 1).all() and (cores == 0).all()
        assert len(set(order.tolist())) == 1


@pytest.mark.parametrize("ncores", [2, 3])
def test_each_core_claims_its_own_region_first(ncores):
    T = 96
    for _ in range(5):
        (counts, cores, order), = _run([T], ncores)
        assert (counts == 1).all()
        for c in set(cores.tolist()):
            lo, hi = c * T // ncores, (c + 1) * T // ncores
            first = order[cores == c].min()
            ran = np.flatnonzero(order == first)
            # its first chunk lies in its region, unless the others had claimed all of it
            assert (lo <= ran).all() and (ran < hi).all() or order[lo:hi].max() < first


def test_a_core_that_never_comes_leaves_its_region_to_the_others():
    # cores 0 and 2 of 3 run; core 1's region is claimed by them
    (counts, cores, _), = _run([90], 3, present=[0, 2])
    assert (counts == 1).all()
    assert set(cores.tolist()) <= {0, 2}
    assert (cores[30:60] >= 0).all()
