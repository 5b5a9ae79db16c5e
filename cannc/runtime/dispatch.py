"""The native dispatcher: one generated function that every AI Core runs.

`cannc_run(sched, nk, core, ncores, counters, ws_base, ws_stride, times)` walks
the schedule (one 4 x i64 record per kernel: function pointer, argument table,
number of tiles, flags). For each kernel the cores *claim* chunks of tiles
from an atomic counter, run them, and add them to a done counter; a core moves
to the next kernel once every tile of this one is done. Launching a kernel
thus costs no Python time, and the cores never wait for each other at a
barrier: a core that the OS deschedules (the machines are shared) holds back
only the tiles it has claimed, and a core that arrives late finds the work
already done. Flags: bit 0 = one chunk (small kernels run on whichever core
gets there first). When `times` is not null, each core records a cycle stamp
for each kernel (for the profiler): PROFILE_WORDS i64 per (kernel, core) =
start of its first chunk, end of its last chunk, cycles inside kernel calls,
and the moment the kernel was complete.

`counters` holds two i64 per kernel (claimed, done) and must be zero at entry;
the word after them is the start gate: core 0 opens it on entry and the other
cores wait for it, so they can be woken (a Python thread hand-off) while the
caller is still copying the inputs in, and be spinning, ready, when it starts.
`cannc_cycles()` reads the same cycle counter (for calibration).
"""

from __future__ import annotations

import ctypes

import llvmlite.binding as llvm
import llvmlite.ir as ir

from ..native import emit
from ..native.emit import I32, I64, PTR, VOID, for_range, i64
from ..native.target import default_cache, new_module
from ..schedule.split import CHUNKS_PER_CORE

FLAG_SINGLE_CORE = 1
RECORD_WORDS = 4
COUNTER_WORDS = 8      # claimed and done of one kernel on their own cache line
PROFILE_WORDS = 4
ENTRY = "cannc_run"
CYCLES = "cannc_cycles"
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


def _emit_wait(m: ir.Module) -> ir.Function:
    """Spin (with pause) until *p >= target; yield the CPU after a while."""
    fn = ir.Function(m, ir.FunctionType(VOID, [PTR, I64]), name="cannc_wait_done")
    fn.linkage = "internal"
    p, target = fn.args
    entry = fn.append_basic_block("entry")
    loop = fn.append_basic_block("loop")
    spin = fn.append_basic_block("spin")
    yld = fn.append_basic_block("yield")
    done = fn.append_basic_block("done")
    b = ir.IRBuilder(entry)
    b.branch(loop)
    b.position_at_end(loop)
    n = b.phi(I64)
    n.add_incoming(i64(0), entry)
    cur = b.load_atomic(p, "acquire", 8, typ=I64)
    b.cbranch(b.icmp_signed(">=", cur, target), done, spin)
    b.position_at_end(spin)
    pause = ir.Function(m, ir.FunctionType(VOID, []), name="llvm.x86.sse2.pause")
    b.call(pause, [])
    n1 = b.add(n, i64(1))
    n.add_incoming(n1, spin)
    n.add_incoming(i64(0), yld)
    b.cbranch(b.icmp_signed(">", n1, i64(4000)), yld, loop)
    b.position_at_end(yld)
    sy = ir.Function(m, ir.FunctionType(I32, []), name="sched_yield")
    b.call(sy, [])
    b.branch(loop)
    b.position_at_end(done)
    b.ret_void()
    return fn


def build_dispatcher() -> bytes:
    m = new_module("cannc_dispatch")
    wait = _emit_wait(m)
    kty = ir.FunctionType(VOID, [PTR, I64, I64, PTR])
    fnty = ir.FunctionType(VOID, [PTR, I64, I64, I64, PTR, PTR, I64, PTR])
    fn = ir.Function(m, fnty, name=ENTRY)
    sched, nk, core, ncores, counters, ws_base, ws_stride, times = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    ws = b.gep(ws_base, [b.mul(core, ws_stride)], source_etype=emit.I8)
    gate = emit.gep(b, counters, b.mul(nk, i64(COUNTER_WORDS)), I64)
    is0 = b.icmp_signed("==", core, i64(0))
    with b.if_else(is0) as (then, otherwise):
        with then:
            b.atomic_rmw("xchg", gate, i64(1), "release")
        with otherwise:
            b.call(wait, [gate, i64(1)])
    cyc = ir.Function(m, ir.FunctionType(I64, []), name="llvm.readcyclecounter")
    pieces = b.mul(ncores, i64(CHUNKS_PER_CORE))
    profiling = b.icmp_unsigned("!=", b.ptrtoint(times, I64), i64(0))
    zero = i64(0)
    with for_range(b, 0, nk, name="k") as k:
        rec = b.mul(k, i64(RECORD_WORDS))
        kfn = b.load(emit.gep(b, sched, rec, PTR), typ=PTR)
        kargs = b.load(emit.gep(b, sched, b.add(rec, i64(1)), PTR), typ=PTR)
        tiles = b.load(emit.gep(b, sched, b.add(rec, i64(2)), I64), typ=I64)
        flags = b.load(emit.gep(b, sched, b.add(rec, i64(3)), I64), typ=I64)
        single = b.icmp_signed("!=", b.and_(flags, i64(FLAG_SINGLE_CORE)), i64(0))
        per = b.sdiv(b.add(tiles, b.sub(pieces, i64(1))), pieces)
        chunk = b.select(single, tiles, b.select(b.icmp_signed("<", per, i64(1)), i64(1), per))
        claim_p = emit.gep(b, counters, b.mul(k, i64(COUNTER_WORDS)), I64)
        done_p = emit.gep(b, counters, b.add(b.mul(k, i64(COUNTER_WORDS)), i64(1)), I64)
        # claim chunks until none is left
        pre = b.block
        claim_bb = b.append_basic_block("claim")
        run_bb = b.append_basic_block("run")
        after_bb = b.append_basic_block("after")
        b.branch(claim_bb)
        b.position_at_end(claim_bb)
        first = b.phi(I64, name="first")     # profile: start of the first chunk (0: none)
        last = b.phi(I64, name="last")       # end of the last chunk
        busy = b.phi(I64, name="busy")       # cycles inside the kernel
        first.add_incoming(zero, pre)
        last.add_incoming(zero, pre)
        busy.add_incoming(zero, pre)
        start = b.atomic_rmw("add", claim_p, chunk, "monotonic")
        b.cbranch(b.icmp_signed("<", start, tiles), run_bb, after_bb)
        b.position_at_end(run_bb)
        end = b.add(start, chunk)
        end = b.select(b.icmp_signed("<", end, tiles), end, tiles)
        t0 = b.select(profiling, b.call(cyc, []), zero)
        b.call(_Callee(kfn, kty), [kargs, start, end, ws])
        t1 = b.select(profiling, b.call(cyc, []), zero)
        b.atomic_rmw("add", done_p, b.sub(end, start), "release")
        first.add_incoming(b.select(b.icmp_signed("==", first, zero), t0, first), run_bb)
        last.add_incoming(t1, run_bb)
        busy.add_incoming(b.add(busy, b.sub(t1, t0)), run_bb)
        b.branch(claim_bb)
        b.position_at_end(after_bb)
        b.call(wait, [done_p, tiles])
        with b.if_then(profiling):
            t = b.call(cyc, [])
            base = b.mul(b.add(b.mul(k, ncores), core), i64(PROFILE_WORDS))
            for j, v in enumerate((first, last, busy, t)):
                b.store(v, emit.gep(b, times, b.add(base, i64(j)), I64))
    b.ret_void()
    cf = ir.Function(m, ir.FunctionType(I64, []), name=CYCLES)
    cb = ir.IRBuilder(cf.append_basic_block("entry"))
    cb.ret(cb.call(cyc, []))
    return default_cache().compile(str(m), "cannc_dispatch", speed_level=2)


CYCLES_FUNC_TYPE = ctypes.CFUNCTYPE(ctypes.c_int64)
RUN_FUNC_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p)
