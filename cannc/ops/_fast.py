"""The lean launch of a cached eager op: its compiled program's kernels run directly on the
caller's arrays.

`Program.execute` (what Session.run ends in) copies every input into the program's arena,
launches, and copies every output out. For a one-node graph that is most of the cost at
small sizes. A `FastLaunch` instead keeps, per concurrent caller, a private copy of the
program's argument table and schedule (and its own arena for intermediates and its own
workspace), and per call writes into the table the addresses of the caller's input
buffers and of freshly allocated output arrays, then calls the native dispatcher once.

What reaches native code is checked first: the cache key already fixes every input's
dtype and shape (the caller looks the launch up by them), and `__call__` makes a
non-contiguous or misaligned input contiguous before its address is taken. Only table
slots that name a graph input or output (or a view of one) are patched; every other
slot keeps its address in the private arena, so an intermediate that the memory plan put
where a graph input would have lived never writes the caller's array.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..runtime import dispatch
from ..runtime.program import Program

# A NumPy array's data pointer is the first field after PyObject_HEAD (PyArrayObject_fields,
# stable across NumPy 1.x and 2.x): read it directly, ~0.15 us instead of ~0.8 us for
# `a.ctypes.data`. Verified at import; if the layout ever differs, the slow way is used.
_U64 = ctypes.c_uint64.from_address
_DATA_OFFSET = 16


def _probe() -> bool:
    try:
        for a in (np.arange(7, dtype=np.float32), np.empty((3, 5), np.int64),
                  np.zeros(0, np.float64)):
            if _U64(id(a) + _DATA_OFFSET).value != a.ctypes.data:
                return False
        return True
    except Exception:  # pragma: no cover
        return False


_DIRECT = _probe()


def data_address(a: np.ndarray) -> int:
    return _U64(id(a) + _DATA_OFFSET).value if _DIRECT else a.ctypes.data


# Below this many FLOPs + bytes moved, a launch runs on the calling core only: waking the
# other AI Cores (a Python thread hand-off) costs more than they save.
MULTICORE_WORK = 1 << 21


class _Slots:
    """One caller's private argument table, schedule, arena and workspace."""

    __slots__ = ("table", "tab", "sched", "arena", "ws", "counters", "cptr", "sptr", "wptr")

    def __init__(self, prog: Program, ncores: int) -> None:
        ctx = prog._new_context()        # the program's own layout, freshly allocated
        self.arena, self.ws = ctx.arena, ctx.workspace
        self.table = ctx.table
        self.sched = ctx.sched
        self.tab = (ctypes.c_uint64 * len(self.table)).from_buffer(self.table)
        # reused by single-core launches only (nobody else reads them)
        self.counters = np.zeros(len(prog.spec.kernels) * dispatch.COUNTER_WORDS + 16, np.int64)
        self.cptr = (self.counters.ctypes.data + 63) // 64 * 64
        self.sptr = self.sched.ctypes.data
        self.wptr = self.ws.ctypes.data


class FastLaunch:
    """Calls a Program's kernels on the caller's buffers. `FastLaunch.build(prog)` is None
    when the program cannot run this way (no kernel, an output that is an input or a
    constant, ...): its caller then uses Program.execute."""

    def __init__(self, prog: Program, in_slots: list[list[int]], out_slots: list[list[int]],
                 out_types: list[tuple[np.dtype, tuple[int, ...]]]) -> None:
        self.prog = prog
        self.in_slots = in_slots
        self.out_slots = out_slots
        self.out_types = out_types
        self.nk = len(prog.spec.kernels)
        work = sum(k.flops + k.bytes_read + k.bytes_written for k in prog.spec.kernels)
        self.ncores = prog.device.cores if work >= MULTICORE_WORK else 1
        self.stride = prog.ws_stride
        self._run = prog._run
        self._pool: list[_Slots] = [_Slots(prog, self.ncores)]

    @classmethod
    def build(cls, prog: Any) -> FastLaunch | None:
        if not isinstance(prog, Program) or not prog.spec.kernels:
            return None
        spec = prog.spec
        g = spec.graph

        def base(v: str) -> str:
            seen = set()
            while v in spec.aliases and v not in seen:
                seen.add(v)
                v = spec.aliases[v]
            return v

        ins = {base(v): i for i, v in enumerate(g.inputs)}
        outs = {}
        for i, v in enumerate(g.outputs):
            b = base(v)
            if b in ins or b in outs or b in spec.constants or v in g.inputs:
                return None          # an output that is an input, a constant or repeated
            outs[b] = i
        if len(ins) != len(g.inputs):
            return None
        in_slots: list[list[int]] = [[] for _ in g.inputs]
        out_slots: list[list[int]] = [[] for _ in g.outputs]
        written = set()
        pos = 0
        for k in spec.kernels:
            vals = list(k.inputs) + list(k.outputs)
            for j, v in enumerate(vals):
                if not v:
                    continue
                b = base(v)
                if b in ins:
                    if j >= len(k.inputs):
                        return None  # a kernel writing a graph input's buffer
                    in_slots[ins[b]].append(pos + j)
                elif b in outs:
                    out_slots[outs[b]].append(pos + j)
                    if j >= len(k.inputs):
                        written.add(b)
            pos += len(vals) + len(k.dims)
        if len(written) != len(outs):
            return None              # an output no kernel writes
        out_types = []
        for v in g.outputs:
            t = g.values[v]
            if not all(isinstance(d, int) for d in t.shape):
                return None
            out_types.append((np.dtype(t.dtype), tuple(t.shape)))
        return cls(prog, in_slots, out_slots, out_types)

    def __call__(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """`arrays`: the graph inputs in order, of the dtypes and shapes the program was
        compiled for (the caller's cache key guarantees it)."""
        pool = self._pool
        try:
            s = pool.pop()
        except IndexError:
            s = _Slots(self.prog, self.ncores)
        try:
            tab = s.tab
            keep = []
            for a, slots in zip(arrays, self.in_slots):
                f = a.flags
                if not (f.c_contiguous and f.aligned):
                    a = np.ascontiguousarray(a)
                    keep.append(a)
                p = data_address(a)
                for j in slots:
                    tab[j] = p
            outs = [np.empty(shape, dt) for dt, shape in self.out_types]
            for o, slots in zip(outs, self.out_slots):
                p = data_address(o)
                for j in slots:
                    tab[j] = p
            self._launch(s)
            return outs
        finally:
            pool.append(s)

    def _launch(self, s: _Slots) -> None:
        sched, ws = s.sptr, s.wptr
        if self.ncores == 1:
            s.counters.fill(0)
            self._run(sched, self.nk, 0, 1, s.cptr, ws, self.stride, None)
            return
        # several cores: fresh counters per launch (a late core still walking this launch
        # only ever sees its finished counters, never the next caller's), kept alive by
        # the job that the workers run
        ncores = self.ncores
        counters = np.zeros(self.nk * dispatch.COUNTER_WORDS + 16, np.int64)
        cptr = (counters.ctypes.data + 63) // 64 * 64
        self.prog.device.launch(self.prog._run_addr, sched, self.nk, ncores, cptr, ws,
                                self.stride, None, (self, s, counters))
        self._run(sched, self.nk, 0, ncores, cptr, ws, self.stride, None)
