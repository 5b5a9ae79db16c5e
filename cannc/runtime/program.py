"""An executable specialisation: kernels loaded, memory laid out, ready to run.

Device memory is laid out once per program: every constant is uploaded once
into the session's WeightPool (shared by every run and by the programs of
other input shapes), and per *execution context* one
arena for every intermediate (offsets from the specialisation's memory plan,
made at compile time by cannc.compiler.planning), a per-core
workspace, the argument table of every kernel and the schedule that the native
dispatcher walks. A run takes a free context (so runs from many threads, or
several requests in flight, never share an intermediate buffer), copies the
inputs into its arena (host -> device), launches the dispatcher on every AI
Core, and copies the outputs out (device -> host).

A synchronous run (Program.execute) maps host memory instead where the memory
plan allows, as a device that shares host memory does (zero-copy): kernels read
an input from the caller's array when no kernel writes into that input's
buffer, and write an output into the array the run returns when that buffer
holds nothing the caller gets besides that output (HostIO). Asynchronous runs
(Session.run_async) copy through the streams.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..artifact import ALIGN, Kernel, MemoryPlan, Specialization, align_up
from ..native.target import JitLibrary
from . import dispatch
from .corechoice import CoreChoice
from .device import Device
from .memory import aligned_empty, is_device_ready

MAX_CONTEXTS = 8
COUNTER_SLOTS = 4   # launch counter sets per context (see Context.counters)
# inputs and outputs smaller than this are copied, not placed in host memory (HostIO):
# placing one costs a run 3-5 us of Python (its address, the table slots set and
# restored, an aligned array for an output), copying 64 KiB about 1.5 (Zen 4 guest; the
# zoo MLP at batch 1, one 1 KiB input and one 40-byte output: 10 us of the run's 22 us
# of Python went to placing them)
PLACE_MIN_BYTES = 64 << 10


@dataclass
class Context:
    """The per-run state of a program: arena, workspace, argument tables, schedule."""

    arena: np.ndarray
    workspace: np.ndarray
    table: np.ndarray
    sched: np.ndarray
    busy: bool = False
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: list[np.ndarray] = field(default_factory=list)
    # addresses looked up once (each .ctypes.data costs about a microsecond)
    sched_addr: int = 0
    ws_addr: int = 0
    # the launch counters, COUNTER_SLOTS sets of them: a set is reused once every worker
    # has finished the launch that last used it (a late core still walking that launch
    # reads only its finished counters), else a launch takes fresh ones
    counters: np.ndarray | None = None
    counter_addrs: list[int] = field(default_factory=list)
    counter_offs: list[int] = field(default_factory=list)     # in words, into counters
    counter_launch: list[int] = field(default_factory=list)   # device launch id, -1: free
    counter_next: int = 0
    # storage root -> (argument-table slot, byte offset in the root, its address in the
    # arena) of every slot holding an address in it, for the roots a run may place in
    # host memory (HostIO); plain ints: a run sets and restores them one by one
    slots: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)


@dataclass
class RunTimes:
    """Host timestamps (time.perf_counter) of one run and the cores' cycle stamps."""

    t_start: float = 0.0
    t_h2d_end: float = 0.0
    t_compute_end: float = 0.0
    t_end: float = 0.0
    cycles: np.ndarray | None = None     # [kernels, cores, PROFILE_WORDS]
    cycles0: int = 0
    t0: float = 0.0


_NOTHING: dict = {}    # (read only) no input or output placed in host memory


@dataclass
class HostIO:
    """Where a synchronous run may use host memory in place of the arena (zero-copy).

    - ``inputs``: graph input -> its storage root, for inputs whose buffer holds nothing
      else (no alias of another input) and which no kernel writes (no in-place update):
      the kernels read the caller's array where it is C-contiguous and aligned;
    - ``outputs``: graph output -> its storage root, for outputs at the start of a buffer
      that holds no other output and no input: the kernels write the array returned
      (intermediates that lived in that buffer before the output live in it too);
    - ``sizes``: those roots' buffer sizes (a returned array's padding, up to ALIGN).

    Only buffers of PLACE_MIN_BYTES or more are placed: smaller ones cost a run less
    copied."""

    inputs: dict[str, str]
    outputs: dict[str, str]
    sizes: dict[str, int]


def _bytes_of(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class WeightPool:
    """Device copies of constants, shared by the programs of a session: a new input
    shape re-plans the activations but uploads (and packs) no weight again. Keyed
    by array identity (compile-time constants are never mutated)."""

    def __init__(self, device: Device) -> None:
        self.device = device
        # id(constant) -> (its reference, its copy; None: adopted, `a`'s own pages)
        self._bufs: dict[int, tuple[weakref.ref, np.ndarray | None]] = {}
        self._lock = threading.Lock()
        # the references of constants collected since: their entries are dropped at the
        # next upload (a weakref callback may run inside a locked section, so it only
        # appends). Programs hold the device copies they read; an entry whose constant is
        # gone (a compile that failed after its upload, the packed weights of a
        # specialisation given up) would keep its copy for the session's life.
        self._dead: deque[tuple[int, weakref.ref]] = deque()

    def upload(self, a: np.ndarray) -> np.ndarray:
        """The device copy of `a`: a copy in Device.malloc memory, or `a`'s own pages
        when cannc allocated them for the purpose (memory.device_ready_empty: packed
        weights, written once where the device reads them, not copied a second time)."""
        if is_device_ready(a):
            return self.adopt(a)
        return self._copy(a)

    def _ref(self, a: np.ndarray) -> weakref.ref:
        dead, key = self._dead, id(a)
        return weakref.ref(a, lambda r: dead.append((key, r)))

    def _drop_dead(self) -> None:
        """Forget the entries whose constants were collected (the caller holds _lock; only
        it pops, callbacks only append)."""
        while self._dead:
            key, ref = self._dead.popleft()
            if self._bufs.get(key, (None,))[0] is ref:   # (not a newer array of that id)
                del self._bufs[key]

    def _copy(self, a: np.ndarray) -> np.ndarray:
        with self._lock:
            self._drop_dead()
            hit = self._bufs.get(id(a))
            if hit is not None and hit[0]() is a:
                return hit[1] if hit[1] is not None else _bytes_of(a)
            # copied, not adopted in place: packed weights used where numpy allocated
            # them ran an MLP's GEMM at a third of its speed, depending on the process
            # (0.25 vs 0.8 ms; a fresh copy was always fast)
            buf = self.device.malloc(align_up(max(a.nbytes, 1)), "weights")
            buf[:a.nbytes] = _bytes_of(a)
            self._bufs[id(a)] = (self._ref(a), buf)
            return buf

    def adopt(self, a: np.ndarray) -> np.ndarray:
        """`a`'s own pages as the device copy, without a copy: for constants that already
        live in page-aligned memory of their own (a program-cache entry's weights, read
        by cannc.compiler.snapshot); accounted as device weights while they live."""
        with self._lock:
            self._drop_dead()
            hit = self._bufs.get(id(a))
            if hit is not None and hit[0]() is a:
                return hit[1] if hit[1] is not None else _bytes_of(a)
            buf = _bytes_of(a)
            if buf.ctypes.data % ALIGN:
                buf = None
        if buf is None:
            return self._copy(a)
        self.device.account(buf, "weights")
        with self._lock:
            # (no buffer kept: it is a view of `a`, and would keep `a` alive for good)
            self._bufs[id(a)] = (self._ref(a), None)
        return buf


class Program:
    def __init__(self, spec: Specialization, device: Device, dispatcher_obj: bytes,
                 pool: WeightPool | None = None, adopt: bool = False) -> None:
        self.spec = spec
        self.device = device
        g = spec.graph
        kernels = spec.kernels

        # -- weights: every constant a kernel reads, uploaded once per session ------
        self.pool = pool if pool is not None else WeightPool(device)
        used = list(dict.fromkeys(v for k in kernels for v in k.inputs
                                  if v and v in spec.constants))
        put = self.pool.adopt if adopt else self.pool.upload
        self.wbuf = {c: put(spec.constants[c]) for c in used}
        self.waddr = {c: b.ctypes.data for c, b in self.wbuf.items()}
        self.weights_bytes = sum(align_up(max(spec.constants[c].nbytes, 1)) for c in used)

        # -- memory: the plan made at compile time -------------------------------------
        self.plan: MemoryPlan = spec.memory
        self.storage = spec.memory.storage   # value -> the value whose buffer it uses
        self.ws_stride = align_up(max((k.workspace_bytes for k in kernels), default=0))
        self.lib = JitLibrary(list(dict.fromkeys(spec.objects.values())) + [dispatcher_obj])
        self._fn = [self.lib.address(k.symbol) for k in kernels]
        self._run_addr = self.lib.address(dispatch.ENTRY)
        self._run = dispatch.RUN_FUNC_TYPE(self._run_addr)
        self._cycles = dispatch.CYCLES_FUNC_TYPE(self.lib.address(dispatch.CYCLES))
        self._contexts: list[Context] = []
        self._cv = threading.Condition()
        # every core, or core 0 alone where that measured faster (runtime/corechoice.py)
        self.core_choice = CoreChoice(device.cores)
        self.input_names = list(g.inputs)
        self.host_io = self._host_io()
        self._placing = bool(self.host_io.inputs or self.host_io.outputs)
        # per graph output: (written into the array returned, storage root, offset in it)
        self._out_src = [(o in self.host_io.outputs, *self._locate(o)) for o in g.outputs]
        self.release(self.acquire())   # the first context, allocated up front

    # -- addresses ------------------------------------------------------------------------
    def _locate(self, v: str) -> tuple[str, int]:
        """The storage root of `v` (through views, in-place sharing and Concats written
        in place) and v's byte offset in it."""
        while v in self.spec.aliases:
            v = self.spec.aliases[v]
        return self.plan.locate(v)

    def _host_io(self) -> HostIO:
        """The storage roots a synchronous run may place in host memory (HostIO)."""
        g, plan = self.spec.graph, self.plan
        written = {self._locate(v)[0] for k in self.spec.kernels for v in k.outputs if v}

        def root_of(v: str) -> tuple[str, int] | None:
            r, off = self._locate(v)
            return (r, off) if r in plan.offsets and r not in self.wbuf else None

        def small(r: str) -> bool:
            return g.values[r].nbytes < PLACE_MIN_BYTES

        ins: dict[str, str] = {}
        roots = [root_of(v) for v in g.inputs]
        for v, ro in zip(g.inputs, roots):
            # the whole of a buffer that only ever holds this input, read-only
            if ro is None or ro[1] or ro[0] in written or roots.count(ro) > 1 or \
                    g.values[ro[0]].nbytes != g.values[v].nbytes or small(ro[0]):
                continue
            ins[v] = ro[0]
        in_roots = {ro[0] for ro in roots if ro is not None}
        out_roots = [ro[0] for ro in (root_of(o) for o in g.outputs) if ro is not None]
        outs: dict[str, str] = {}
        for o in g.outputs:
            # a buffer that holds this output at its start and no other output or input
            # (intermediates that lived in it before do not matter: the array is theirs
            # until the output is written)
            ro = root_of(o)
            if ro is None or ro[1] or ro[0] not in written or ro[0] in in_roots or \
                    out_roots.count(ro[0]) > 1 or \
                    g.values[ro[0]].nbytes != g.values[o].nbytes or small(ro[0]):
                continue
            outs[o] = ro[0]
        return HostIO(inputs=ins, outputs=outs,
                      sizes={r: align_up(max(g.values[r].nbytes, 1))
                             for r in {*ins.values(), *outs.values()}})

    def _view(self, arena: np.ndarray, v: str) -> np.ndarray:
        t = self.spec.graph.values[v]
        r, off = self._locate(v)
        if r in self.wbuf:
            base = self.wbuf[r]
        elif r in self.spec.constants:
            return self.spec.constants[r]
        else:
            base, off = arena, self.plan.offsets[r] + off
        return base[off:off + t.nbytes].view(t.dtype).reshape(t.shape)

    def _new_context(self) -> Context:
        dev, kernels = self.device, self.spec.kernels
        arena = dev.malloc(max(self.plan.arena_bytes, ALIGN), "arena")
        ws = dev.malloc(max(self.ws_stride * dev.cores, ALIGN), "workspace")
        ntab = sum(len(k.inputs) + len(k.outputs) + len(k.dims) for k in kernels)
        table = np.zeros(max(ntab, 8), np.uint64)
        sched = np.zeros(max(len(kernels) * dispatch.RECORD_WORDS, 8), np.uint64)

        def addr(v: str) -> int:
            if not v:
                return 0
            r, off = self._locate(v)
            if r in self.waddr:
                return self.waddr[r]
            return arena.ctypes.data + self.plan.offsets[r] + off

        host = set(self.host_io.inputs.values()) | set(self.host_io.outputs.values())
        slots: dict[str, tuple[list[int], list[int]]] = {r: ([], []) for r in host}
        pos = 0
        for i, k in enumerate(kernels):
            vals = list(k.inputs) + list(k.outputs)
            table[pos:pos + len(vals)] = [addr(v) for v in vals]
            for j, v in enumerate(vals):
                r, off = self._locate(v) if v else ("", 0)
                if r in slots:
                    slots[r][0].append(pos + j)
                    slots[r][1].append(off)
            # runtime dimensions follow the pointers (codegen/ABI.md)
            table[pos + len(vals):pos + len(vals) + len(k.dims)] = k.dims
            flags = dispatch.FLAG_SINGLE_CORE if k.single_core else 0
            r = i * dispatch.RECORD_WORDS
            sched[r:r + 4] = [self._fn[i], table.ctypes.data + pos * 8, k.num_tiles, flags]
            pos += len(vals) + len(k.dims)
        g = self.spec.graph
        words = align_up((len(kernels) * dispatch.COUNTER_WORDS + 16) * 8, 64) // 8
        counters = np.zeros(COUNTER_SLOTS * words + 8, np.int64)
        base = counters.ctypes.data
        c0 = (base + 63) // 64 * 64
        return Context(arena, ws, table, sched,
                       inputs={v: self._view(arena, v) for v in g.inputs},
                       outputs=[self._view(arena, o) for o in g.outputs],
                       sched_addr=sched.ctypes.data, ws_addr=ws.ctypes.data,
                       counters=counters,
                       counter_addrs=[c0 + i * words * 8 for i in range(COUNTER_SLOTS)],
                       counter_offs=[(c0 - base) // 8 + i * words
                                     for i in range(COUNTER_SLOTS)],
                       counter_launch=[-1] * COUNTER_SLOTS,
                       slots={r: [(i, o, int(table[i])) for i, o in zip(ix, of)]
                              for r, (ix, of) in slots.items()})

    def acquire(self) -> Context:
        """A free execution context (a new one while fewer than MAX_CONTEXTS exist)."""
        with self._cv:
            while True:
                for c in self._contexts:
                    if not c.busy:
                        c.busy = True
                        return c
                if len(self._contexts) < MAX_CONTEXTS:
                    c = self._new_context()
                    c.busy = True
                    self._contexts.append(c)
                    return c
                self._cv.wait()

    def release(self, ctx: Context) -> None:
        with self._cv:
            ctx.busy = False
            self._cv.notify()

    @property
    def num_contexts(self) -> int:
        return len(self._contexts)

    # -- running ---------------------------------------------------------------------------
    def execute(self, feeds: dict[str, np.ndarray], times: RunTimes | None = None
                ) -> list[np.ndarray]:
        """Inputs must already be checked (names, dtypes, shapes)."""
        ctx = self.acquire()
        placing = self._placing
        try:
            if times is not None:
                times.t_start = time.perf_counter()
            ins, outs = self._place(ctx, feeds) if placing else (_NOTHING, _NOTHING)
            # wake the other cores first: they wait at the start gate while we copy in
            core0 = self.prepare_launch(ctx, times)
            try:
                self.copy_in(ctx, {k: a for k, a in feeds.items() if k not in ins}
                             if ins else feeds)
            except BaseException:
                core0()     # the workers wait at the start gate: let the launch finish
                raise
            if times is not None:
                times.t_h2d_end = time.perf_counter()
            core0()
            if times is not None:
                times.t_compute_end = time.perf_counter()
            out = self._outputs(ctx, ins, outs)
            if times is not None:
                times.t_end = time.perf_counter()
            return out
        finally:
            if placing:
                self._unplace(ctx)
            self.release(ctx)

    def _place(self, ctx: Context, feeds: dict[str, np.ndarray]
               ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Point the argument tables at host memory for this run (HostIO). Returns the
        inputs read in place (name -> the caller's array) and the outputs' buffers (root
        -> a fresh ALIGN-aligned byte array that the run returns)."""
        io, table, slots = self.host_io, ctx.table, ctx.slots
        ins: dict[str, np.ndarray] = {}
        for name, r in io.inputs.items():
            a, v = feeds.get(name), ctx.inputs[name]
            # (anything else is copied in, which refuses what it always refused)
            if not (isinstance(a, np.ndarray) and a.dtype == v.dtype and a.shape == v.shape
                    and a.flags.c_contiguous and a.flags.aligned):
                continue
            ins[name] = a
            base = a.ctypes.data
            for i, off, _ in slots[r]:
                table[i] = base + off
        outs: dict[str, np.ndarray] = {}
        for r in io.outputs.values():
            # (numpy's own memory, 64-byte aligned: a fresh huge mapping a run would be
            # faulted in every time; numpy's is handed out again)
            outs[r] = buf = aligned_empty(io.sizes[r], ALIGN, zero=False, huge=False)
            base = buf.ctypes.data
            for i, off, _ in slots[r]:
                table[i] = base + off
        return ins, outs

    def _unplace(self, ctx: Context) -> None:
        """The argument tables back at the arena (a context is released as it was made)."""
        table = ctx.table
        for placed in ctx.slots.values():
            for i, _, home in placed:
                table[i] = home

    def _outputs(self, ctx: Context, ins: dict[str, np.ndarray], outs: dict[str, np.ndarray]
                 ) -> list[np.ndarray]:
        """The run's outputs: the arrays the kernels wrote in place, copies of the rest
        (from the arena, or from an input read in place that an output views)."""
        in_root = {r: ins[n] for n, r in self.host_io.inputs.items() if n in ins} \
            if ins else _NOTHING
        res = []
        for (host, r, off), v in zip(self._out_src, ctx.outputs):
            if host:
                res.append(outs[r][:v.nbytes].view(v.dtype).reshape(v.shape))
                continue
            if r in in_root:
                src = in_root[r].reshape(-1).view(np.uint8)
                v = src[off:off + v.nbytes].view(v.dtype).reshape(v.shape)
            res.append(np.array(v, copy=True))
        return res

    def copy_in(self, ctx: Context, feeds: dict[str, np.ndarray]) -> None:
        for name, arr in feeds.items():
            np.copyto(ctx.inputs[name], arr, casting="no")

    def launch(self, ctx: Context, times: RunTimes | None = None) -> None:
        self.prepare_launch(ctx, times)()

    def prepare_launch(self, ctx: Context, times: RunTimes | None = None) -> Callable[[], None]:
        """Hand the launch to the worker cores (they wait at the start gate) and return
        the function that runs core 0's share and opens the gate; it returns when all
        the work is done."""
        nk = len(self.spec.kernels)
        if nk == 0:
            return lambda: None
        choice = self.core_choice
        tag = None
        if times is None:
            # (a launch takes part in the trial only when it has the cores to itself)
            ncores, tag = choice.next(choice.decided or
                                      sum(c.busy for c in self._contexts) == 1)
        else:
            ncores = choice.use
        t_start = time.perf_counter() if tag is not None else 0.0
        sched, ws, stride = ctx.sched_addr, ctx.ws_addr, self.ws_stride
        # claim/done counters (and gate) that no core reads any more: a late core still
        # walking an earlier launch only ever sees that launch's (finished) counters
        counters, cptr, slot = self._counters(ctx, nk)
        tptr = None
        if times is not None:
            times.cycles = np.zeros((nk, ncores, dispatch.PROFILE_WORDS), np.int64)
            tptr = times.cycles.ctypes.data
        run = self._run
        if ncores > 1:
            launch = self.device.launch(self._run_addr, sched, nk, ncores, cptr, ws, stride,
                                        tptr, (self, ctx, counters, times))
            if slot is not None:
                ctx.counter_launch[slot] = -1 if launch is None else launch

        def core0() -> None:
            if times is not None:
                times.t0 = time.perf_counter()
                times.cycles0 = self._cycles()
            run(sched, nk, 0, ncores, cptr, ws, stride, tptr)
            if tag is not None:
                choice.record(ncores, time.perf_counter() - t_start, tag)

        # the counters live as long as core 0's share can run (cptr points into them)
        core0.keep = (self, ctx, counters, times)  # type: ignore[attr-defined]

        return core0

    def _counters(self, ctx: Context, nk: int) -> tuple[np.ndarray | None, int, int | None]:
        """(what keeps them alive, their address, the context's slot or None) of zeroed
        launch counters: a slot of the context whose last launch every worker has
        finished (a launch on core 0 alone is over when the call returns; a worker may
        still walk an earlier one), else a fresh set."""
        n = nk * dispatch.COUNTER_WORDS + 16
        i = ctx.counter_next
        last = ctx.counter_launch[i]
        if last < 0 or self.device.launch_finished(last):
            ctx.counter_next = (i + 1) % COUNTER_SLOTS
            off = ctx.counter_offs[i]
            ctx.counters[off:off + n] = 0
            ctx.counter_launch[i] = -1
            return None, ctx.counter_addrs[i], i
        counters = np.zeros(n, np.int64)
        return counters, (counters.ctypes.data + 63) // 64 * 64, None

    def cycles(self) -> int:
        return int(self._cycles())

    @property
    def kernels(self) -> list[Kernel]:
        return self.spec.kernels


_dispatcher: bytes | None = None
_dlock = threading.Lock()


def dispatcher_object() -> bytes:
    global _dispatcher
    with _dlock:
        if _dispatcher is None:
            dispatch._add_libc_symbols()
            _dispatcher = dispatch.build_dispatcher()
    return _dispatcher
