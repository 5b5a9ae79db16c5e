"""The native dispatcher: one generated function that every AI Core runs.

`cannc_run(sched, nk, core, ncores, barrier, ws_base, ws_stride, times)` walks
the schedule (one 4 x i64 record per kernel: function pointer, argument table,
number of tiles, flags), runs this core's share of each kernel's tiles, and
meets the other cores at a spinning barrier between kernels, so launching a
kernel costs no Python time at all. Flags: bit 0 = run on core 0 only (small
kernels), bit 1 = no barrier needed after this kernel. When `times` is not
null, each core records a cycle stamp after each kernel (for the profiler).
"""

from __future__ import annotations

import ctypes

import llvmlite.binding as llvm
import llvmlite.ir as ir

from ..codegen import emit
from ..codegen.emit import I32, I64, PTR, VOID, for_range, i64
from ..codegen.target import default_cache, new_module

FLAG_SINGLE_CORE = 1
FLAG_NO_BARRIER = 2
RECORD_WORDS = 4
BARRIER_BYTES = 256
ENTRY = "cannc_run"
_symbols_added = False


def _add_libc_symbols() -> None:
    global _symbols_added
    if not _symbols_added:
        libc = ctypes.CDLL(None)
        llvm.add_symbol("sched_yield", ctypes.cast(libc.sched_yield, ctypes.c_void_p).value)
        _symbols_added = True


class _Callee:
    """An indirect call target: llvmlite needs the callee's function type, which an
    opaque pointer does not carry."""

    def __init__(self, value: ir.Value, fnty: ir.FunctionType) -> None:
        self.value = value
        self.type = value.type
        self.function_type = fnty

    def get_reference(self) -> str:
        return self.value.get_reference()


def _emit_barrier(m: ir.Module) -> ir.Function:
    """Sense-counting barrier: word 0 counts arrivals, word 8 (next cache line) is the generation."""
    fn = ir.Function(m, ir.FunctionType(VOID, [PTR, I64]), name="cannc_barrier")
    fn.linkage = "internal"
    bar, n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    count_p = bar
    gen_p = emit.gep(b, bar, 8, I64)
    gen = b.load_atomic(gen_p, "acquire", 8, typ=I64)
    old = b.atomic_rmw("add", count_p, i64(1), "acq_rel")
    last = b.icmp_signed("==", old, b.sub(n, i64(1)))
    last_bb = fn.append_basic_block("last")
    wait_bb = fn.append_basic_block("wait")
    done_bb = fn.append_basic_block("done")
    b.cbranch(last, last_bb, wait_bb)
    b.position_at_end(last_bb)
    b.atomic_rmw("xchg", count_p, i64(0), "monotonic")
    b.atomic_rmw("add", gen_p, i64(1), "release")
    b.branch(done_bb)
    b.position_at_end(wait_bb)
    spins = b.phi(I64)
    spins.add_incoming(i64(0), b.function.blocks[0])
    pause = ir.Function(m, ir.FunctionType(VOID, []), name="llvm.x86.sse2.pause")
    b.call(pause, [])
    cur = b.load_atomic(gen_p, "acquire", 8, typ=I64)
    moved = b.icmp_signed("!=", cur, gen)
    yield_bb = fn.append_basic_block("maybe_yield")
    b.cbranch(moved, done_bb, yield_bb)
    b.position_at_end(yield_bb)
    nspins = b.add(spins, i64(1))
    do_yield = b.icmp_signed(">", nspins, i64(2000))
    sy = ir.Function(m, ir.FunctionType(I32, []), name="sched_yield")
    yb = fn.append_basic_block("yield")
    back = fn.append_basic_block("back")
    b.cbranch(do_yield, yb, back)
    b.position_at_end(yb)
    b.call(sy, [])
    b.branch(back)
    b.position_at_end(back)
    spins.add_incoming(nspins, back)
    b.branch(wait_bb)
    b.position_at_end(done_bb)
    b.ret_void()
    return fn


def build_dispatcher() -> bytes:
    m = new_module("cannc_dispatch")
    barrier = _emit_barrier(m)
    kty = ir.FunctionType(VOID, [PTR, I64, I64, PTR])
    fnty = ir.FunctionType(VOID, [PTR, I64, I64, I64, PTR, PTR, I64, PTR])
    fn = ir.Function(m, fnty, name=ENTRY)
    sched, nk, core, ncores, bar, ws_base, ws_stride, times = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    ws = b.gep(ws_base, [b.mul(core, ws_stride)], source_etype=emit.I8)
    multi = b.icmp_signed(">", ncores, i64(1))
    cyc = ir.Function(m, ir.FunctionType(I64, []), name="llvm.readcyclecounter")
    with for_range(b, 0, nk, name="k") as k:
        rec = b.mul(k, i64(RECORD_WORDS))
        kfn = b.load(emit.gep(b, sched, rec, PTR), typ=PTR)
        kargs = b.load(emit.gep(b, sched, b.add(rec, i64(1)), PTR), typ=PTR)
        tiles = b.load(emit.gep(b, sched, b.add(rec, i64(2)), I64), typ=I64)
        flags = b.load(emit.gep(b, sched, b.add(rec, i64(3)), I64), typ=I64)
        single = b.icmp_signed("!=", b.and_(flags, i64(FLAG_SINGLE_CORE)), i64(0))
        lo_split = b.sdiv(b.mul(tiles, core), ncores)
        hi_split = b.sdiv(b.mul(tiles, b.add(core, i64(1))), ncores)
        is0 = b.icmp_signed("==", core, i64(0))
        lo = b.select(single, i64(0), lo_split)
        hi = b.select(single, b.select(is0, tiles, i64(0)), hi_split)
        with b.if_then(b.icmp_signed("<", lo, hi)):
            b.call(_Callee(kfn, kty), [kargs, lo, hi, ws])
        with b.if_then(b.icmp_unsigned("!=", b.ptrtoint(times, I64), i64(0))):
            t = b.call(cyc, [])
            b.store(t, emit.gep(b, times, b.add(b.mul(k, ncores), core), I64))
        need = b.and_(multi, b.icmp_signed("==", b.and_(flags, i64(FLAG_NO_BARRIER)), i64(0)))
        last = b.icmp_signed("==", k, b.sub(nk, i64(1)))
        with b.if_then(b.and_(multi, b.or_(need, last))):
            b.call(barrier, [bar, ncores])
    b.ret_void()
    return default_cache().compile(str(m), "cannc_dispatch", speed_level=2)


RUN_FUNC_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p)
