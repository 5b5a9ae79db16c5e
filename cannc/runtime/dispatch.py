"""The native dispatcher: one generated function that every AI Core runs.

`cannc_run(sched, nk, core, ncores, counters, ws_base, ws_stride, times)` walks
the schedule (one 4 x i64 record per kernel: function pointer, argument table,
number of tiles, flags). For each kernel the cores *claim* chunks of tiles
from atomic counters (compare-and-swap; chunks shrink as the tiles run out:
schedule/split.py claim_chunks), run them, and add them to a done counter. With up to
MAX_REGION_CORES cores the tiles are cut into one contiguous region per core, each with
its own claim counter: core c claims region c's tiles in order, then what is left of
regions c+1, c+2, ... So each core walks its weights in address order (interleaved
claims made it jump at every chunk; on 2 Zen 4 cores a chain of DRAM-bound GEMMs ran ~8%
faster, presumably for the hardware prefetchers' sake) and a late or slow core's tiles
are still taken by the others. A core moves
to the next kernel once every tile of this one is done. Launching a kernel
thus costs no Python time, and the cores never wait for each other at a
barrier: a core that the OS deschedules (the machines are shared) holds back
only the tiles it has claimed, and a core that arrives late finds the work
already done. Flags: bit 0 = one chunk (small kernels run on whichever core
gets there first). When `times` is not null, each core records a cycle stamp
for each kernel (for the profiler): PROFILE_WORDS i64 per (kernel, core) =
start of its first chunk, end of its last chunk, cycles inside kernel calls,
and the moment the kernel was complete.

`counters` holds COUNTER_WORDS i64 per kernel (claimed by a single-core kernel or on
more than MAX_REGION_CORES cores, done, then the claims of each core's region) and must
be zero at entry;
the word after them is the start gate: core 0 opens it on entry and the other
cores wait for it, so they can be woken (the native pool below) while the
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
from ..schedule.split import CHUNKS_PER_CORE, MAX_REGION_CORES, MIN_CHUNK_DIVISOR

FLAG_SINGLE_CORE = 1
RECORD_WORDS = 4
COUNTER_WORDS = 8      # claimed, done and the region claims of one kernel: one cache line
PROFILE_WORDS = 4
ENTRY = "cannc_run"
CYCLES = "cannc_cycles"
_symbols_added = False


def _add_libc_symbols() -> None:
    global _symbols_added
    if not _symbols_added:
        libc = ctypes.CDLL(None)
        for name in ("sched_yield", "syscall"):
            llvm.add_symbol(name, ctypes.cast(getattr(libc, name), ctypes.c_void_p).value)
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
    return default_cache().compile_built("cannc_dispatch", _build_dispatcher_module)


def _build_dispatcher_module() -> ir.Module:
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
    minpieces = b.mul(ncores, i64(MIN_CHUNK_DIVISOR))
    profiling = b.icmp_unsigned("!=", b.ptrtoint(times, I64), i64(0))
    zero = i64(0)
    with for_range(b, 0, nk, name="k") as k:
        rec = b.mul(k, i64(RECORD_WORDS))
        kfn = b.load(emit.gep(b, sched, rec, PTR), typ=PTR)
        kargs = b.load(emit.gep(b, sched, b.add(rec, i64(1)), PTR), typ=PTR)
        tiles = b.load(emit.gep(b, sched, b.add(rec, i64(2)), I64), typ=I64)
        flags = b.load(emit.gep(b, sched, b.add(rec, i64(3)), I64), typ=I64)
        # one chunk for a single-core kernel, and for every kernel on one core: a GEMM
        # split by rows streams all of B once per chunk (1 core, BERT-base's 128 x 768 x
        # 3072 in 6-row tiles: 5 chunks, 6.1 ms against 4.7 in one)
        single = b.or_(b.icmp_signed("!=", b.and_(flags, i64(FLAG_SINGLE_CORE)), i64(0)),
                       b.icmp_signed("==", ncores, i64(1)))
        # guided claims (schedule/split.py claim_chunks): ceil(left / pieces), at least lo
        lo = b.sdiv(b.add(tiles, b.sub(minpieces, i64(1))), minpieces)
        lo = b.select(b.icmp_signed("<", lo, i64(1)), i64(1), lo)
        line = b.mul(k, i64(COUNTER_WORDS))
        done_p = emit.gep(b, counters, b.add(line, i64(1)), I64)
        # regions (split.py): with up to MAX_REGION_CORES cores core c claims the tiles of
        # region c first, then those left in the others (c+1, c+2, ...); a single-core
        # kernel, or more cores, take one region with the shared counter (word 0)
        regions = b.and_(b.not_(single), b.icmp_signed("<=", ncores, i64(MAX_REGION_CORES)))
        nreg = b.select(regions, ncores, i64(1))
        rpieces = b.select(regions, i64(CHUNKS_PER_CORE), pieces)
        pre = b.block
        claim_bb = b.append_basic_block("claim")
        cas_bb = b.append_basic_block("cas")
        run_bb = b.append_basic_block("run")
        next_bb = b.append_basic_block("next")
        after_bb = b.append_basic_block("after")
        b.branch(claim_bb)
        b.position_at_end(claim_bb)
        first = b.phi(I64, name="first")     # profile: start of the first chunk (0: none)
        last = b.phi(I64, name="last")       # end of the last chunk
        busy = b.phi(I64, name="busy")       # cycles inside the kernel
        step = b.phi(I64, name="step")       # regions visited before this one
        for ph in (first, last, busy, step):
            ph.add_incoming(zero, pre)
        j = b.srem(b.add(core, step), nreg)
        r_lo = b.sdiv(b.mul(j, tiles), nreg)
        r_len = b.sub(b.sdiv(b.mul(b.add(j, i64(1)), tiles), nreg), r_lo)
        claim_p = emit.gep(b, counters, b.add(line, b.select(regions, b.add(j, i64(2)), zero)),
                           I64)
        off = b.load_atomic(claim_p, "monotonic", 8, typ=I64)
        b.cbranch(b.icmp_signed("<", off, r_len), cas_bb, next_bb)
        b.position_at_end(next_bb)
        step1 = b.add(step, i64(1))
        for ph in (first, last, busy):
            ph.add_incoming(ph, next_bb)
        step.add_incoming(step1, next_bb)
        b.cbranch(b.icmp_signed("<", step1, nreg), claim_bb, after_bb)
        b.position_at_end(cas_bb)
        per = b.sdiv(b.add(b.sub(r_len, off), b.sub(rpieces, i64(1))), rpieces)
        chunk = b.select(single, tiles, b.select(b.icmp_signed("<", per, lo), lo, per))
        won = b.extract_value(b.cmpxchg(claim_p, off, b.add(off, chunk), "monotonic",
                                        "monotonic"), 1)
        for ph in (first, last, busy, step):
            ph.add_incoming(ph, cas_bb)
        b.cbranch(won, run_bb, claim_bb)
        b.position_at_end(run_bb)
        start = b.add(r_lo, off)
        end = b.add(start, chunk)
        r_hi = b.add(r_lo, r_len)
        end = b.select(b.icmp_signed("<", end, r_hi), end, r_hi)
        t0 = b.select(profiling, b.call(cyc, []), zero)
        b.call(_Callee(kfn, kty), [kargs, start, end, ws])
        t1 = b.select(profiling, b.call(cyc, []), zero)
        b.atomic_rmw("add", done_p, b.sub(end, start), "release")
        first.add_incoming(b.select(b.icmp_signed("==", first, zero), t0, first), run_bb)
        last.add_incoming(t1, run_bb)
        busy.add_incoming(b.add(busy, b.sub(t1, t0)), run_bb)
        step.add_incoming(step, run_bb)
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
    return m


CYCLES_FUNC_TYPE = ctypes.CFUNCTYPE(ctypes.c_int64)
RUN_FUNC_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p)


# -- the worker pool: native AI-core threads ----------------------------------------------
# A launch is a slot in a ring of POOL_RING launch records; each worker keeps its own read
# position and runs every launch in order as core c. Idle, a worker spins (pause) for a
# bounded time (POOL_SPIN cycles) after its last launch, then sleeps on a futex, so a
# request that follows an idle gap wakes it with one system call (no Python thread
# hand-off, no interpreter lock) and an idle device burns no CPU.
# Pool memory, in i64 words (64-byte aligned):
POOL_HEAD = 0          # launches posted
POOL_WAKE = 8          # i32 futex word: bumped on every post and on quit
POOL_SLEEPERS = 16     # workers inside (or about to enter) the futex wait
POOL_QUIT = 24
POOL_SPIN = 32         # cycles a worker spins before it sleeps
POOL_CORES = 40        # cores of the device (workers are cores 1..n-1)
POOL_SLOTS = 48        # word offset of the ring
POOL_LINES = 64        # worker c's line at POOL_LINES + 8c: [launches done, pool, core]
POOL_RING = 64
SLOT_WORDS = 8         # run, sched, nk, ncores, counters, ws, ws_stride, times
POOL_POST = "cannc_pool_post"
POOL_WORKER = "cannc_pool_worker"
POOL_CYCLES = "cannc_pool_cycles"
SYS_FUTEX = 202
FUTEX_WAIT_PRIVATE = 128
FUTEX_WAKE_PRIVATE = 129


def pool_words(cores: int) -> int:
    return POOL_LINES + 8 * cores + POOL_RING * SLOT_WORDS


def _word(b: ir.IRBuilder, base: ir.Value, w: ir.Value | int) -> ir.Value:
    return emit.gep(b, base, w, I64)


def build_pool() -> bytes:
    return default_cache().compile_built("cannc_pool", _build_pool_module)


def _build_pool_module() -> ir.Module:
    m = new_module("cannc_pool")
    wait = _emit_wait(m)
    sysc = ir.Function(m, ir.FunctionType(I64, [I64], var_arg=True), name="syscall")
    pause = m.get_global("llvm.x86.sse2.pause")
    cyc = ir.Function(m, ir.FunctionType(I64, []), name="llvm.readcyclecounter")
    runty = ir.FunctionType(VOID, [PTR, I64, I64, I64, PTR, PTR, I64, PTR])

    # void post(pool, run, sched, nk, ncores, counters, ws, ws_stride, times)
    # (posters are serialised by the caller)
    post = ir.Function(m, ir.FunctionType(VOID, [PTR, PTR, PTR, I64, I64, PTR, PTR, I64, PTR]),
                       name=POOL_POST)
    pool, *fields = post.args
    b = ir.IRBuilder(post.append_basic_block("entry"))
    head_p = _word(b, pool, POOL_HEAD)
    i = b.load_atomic(head_p, "monotonic", 8, typ=I64)
    cores = b.load(_word(b, pool, POOL_CORES), typ=I64)
    # the slot is free once every worker has finished the launch POOL_RING before
    with for_range(b, 1, cores, name="c") as c:
        line = _word(b, pool, b.add(i64(POOL_LINES), b.mul(c, i64(8))))
        b.call(wait, [line, b.sub(i, i64(POOL_RING - 1))])
    slots = b.load(_word(b, pool, POOL_SLOTS), typ=I64)
    slot = _word(b, pool, b.add(slots, b.mul(b.srem(i, i64(POOL_RING)), i64(SLOT_WORDS))))
    for j, v in enumerate(fields):
        b.store(v, emit.gep(b, slot, j, v.type))
    b.atomic_rmw("xchg", head_p, b.add(i, i64(1)), "seq_cst")
    wake_p = _word(b, pool, POOL_WAKE)
    b.atomic_rmw("add", wake_p, ir.Constant(I32, 1), "seq_cst")
    sleepers = b.load_atomic(_word(b, pool, POOL_SLEEPERS), "seq_cst", 8, typ=I64)
    with b.if_then(b.icmp_signed(">", sleepers, i64(0))):
        b.call(sysc, [i64(SYS_FUTEX), b.ptrtoint(wake_p, I64), i64(FUTEX_WAKE_PRIVATE),
                      i64(2 ** 31 - 1)])
    b.ret_void()

    # void* worker(line): run every posted launch as core line[2]; spin, then sleep
    wk = ir.Function(m, ir.FunctionType(PTR, [PTR]), name=POOL_WORKER)
    line = wk.args[0]
    entry = wk.append_basic_block("entry")
    loop = wk.append_basic_block("loop")
    job = wk.append_basic_block("job")
    idle = wk.append_basic_block("idle")
    spin = wk.append_basic_block("spin")
    spin2 = wk.append_basic_block("spin_more")
    sleep = wk.append_basic_block("sleep")
    out = wk.append_basic_block("exit")
    b = ir.IRBuilder(entry)
    pool = b.inttoptr(b.load(_word(b, line, 1), typ=I64), PTR)
    core = b.load(_word(b, line, 2), typ=I64)
    head_p = _word(b, pool, POOL_HEAD)
    wake_p = _word(b, pool, POOL_WAKE)
    sleepers_p = _word(b, pool, POOL_SLEEPERS)
    quit_p = _word(b, pool, POOL_QUIT)
    slots = b.load(_word(b, pool, POOL_SLOTS), typ=I64)
    spin_cycles = b.load(_word(b, pool, POOL_SPIN), typ=I64)
    b.branch(loop)

    b.position_at_end(loop)
    mine = b.phi(I64, name="mine")
    mine.add_incoming(i64(0), entry)
    h = b.load_atomic(head_p, "acquire", 8, typ=I64)
    b.cbranch(b.icmp_signed(">", h, mine), job, idle)

    b.position_at_end(job)
    slot = _word(b, pool, b.add(slots, b.mul(b.srem(mine, i64(POOL_RING)), i64(SLOT_WORDS))))
    slot_types = (PTR, PTR, I64, I64, PTR, PTR, I64, PTR)
    f = [b.load(emit.gep(b, slot, j, t), typ=t) for j, t in enumerate(slot_types)]
    run_fn, sched, nk, ncores = f[0], f[1], f[2], f[3]
    with b.if_then(b.icmp_signed("<", core, ncores)):
        b.call(_Callee(run_fn, runty), [sched, nk, core, ncores, f[4], f[5], f[6], f[7]])
    nxt = b.add(mine, i64(1))
    b.atomic_rmw("xchg", _word(b, line, 0), nxt, "release")
    mine.add_incoming(nxt, b.block)
    b.branch(loop)

    b.position_at_end(idle)
    q = b.load_atomic(quit_p, "acquire", 8, typ=I64)
    t0 = b.call(cyc, [])
    b.cbranch(b.icmp_signed("!=", q, i64(0)), out, spin)

    b.position_at_end(spin)
    b.call(pause, [])
    h = b.load_atomic(head_p, "acquire", 8, typ=I64)
    mine.add_incoming(mine, spin)
    b.cbranch(b.icmp_signed(">", h, mine), loop, spin2)
    b.position_at_end(spin2)
    el = b.sub(b.call(cyc, []), t0)
    b.cbranch(b.icmp_signed("<", el, spin_cycles), spin, sleep)

    b.position_at_end(sleep)
    b.atomic_rmw("add", sleepers_p, i64(1), "seq_cst")
    w = b.load_atomic(wake_p, "seq_cst", 4, typ=I32)
    h = b.load_atomic(head_p, "seq_cst", 8, typ=I64)
    q = b.load_atomic(quit_p, "seq_cst", 8, typ=I64)
    none = b.and_(b.icmp_signed("==", h, mine), b.icmp_signed("==", q, i64(0)))
    with b.if_then(none):
        b.call(sysc, [i64(SYS_FUTEX), b.ptrtoint(wake_p, I64), i64(FUTEX_WAIT_PRIVATE),
                      b.zext(w, I64), i64(0)])
    b.atomic_rmw("sub", sleepers_p, i64(1), "seq_cst")
    mine.add_incoming(mine, b.block)
    b.branch(loop)

    b.position_at_end(out)
    b.ret(ir.Constant(PTR, None))

    cf = ir.Function(m, ir.FunctionType(I64, []), name=POOL_CYCLES)
    cb = ir.IRBuilder(cf.append_basic_block("entry"))
    cb.ret(cb.call(cyc, []))
    return m


POOL_POST_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
