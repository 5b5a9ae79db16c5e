"""An executable specialisation: kernels loaded, memory planned, ready to run.

Device memory is laid out once: one weights buffer for every constant, one
arena for every intermediate (offsets from the memory planner), one argument
table per kernel and the schedule that the native dispatcher walks. A run
copies the inputs into the arena (host -> device), launches the dispatcher on
every AI Core, and copies the outputs out (device -> host).
"""

from __future__ import annotations


import threading
from dataclasses import dataclass

import numpy as np

from ..codegen.target import JitLibrary
from ..compiler import Specialization
from . import dispatch
from .device import Device, aligned_empty
from .memory import ALIGN, Interval, MemoryPlan, align_up, plan


@dataclass
class BufferInfo:
    kind: str      # 'arena' | 'weights'
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]


class Program:
    def __init__(self, spec: Specialization, device: Device,
                 dispatcher_obj: bytes) -> None:
        self.spec = spec
        self.device = device
        g = spec.graph
        kernels = spec.kernels
        aliases = spec.aliases

        def root(v: str) -> str:
            while v in aliases:
                v = aliases[v]
            return v

        # -- weights: every constant a kernel reads, 64-byte aligned --------------
        used_consts = []
        for k in kernels:
            for v in k.inputs:
                if v and v in spec.constants and v not in used_consts:
                    used_consts.append(v)
        woff, wsize = {}, 0
        for c in used_consts:
            woff[c] = wsize
            wsize += align_up(max(spec.constants[c].nbytes, 1))
        self.weights = aligned_empty(max(wsize, ALIGN))
        for c in used_consts:
            a = spec.constants[c]
            self.weights[woff[c]:woff[c] + a.nbytes] = a.reshape(-1).view(np.uint8)
        self.weights_bytes = wsize

        # -- arena: liveness over the kernel order --------------------------------
        end = len(kernels)
        start: dict[str, int] = {}
        last: dict[str, int] = {}
        for v in g.inputs:
            start[v] = -1
            last[v] = -1
        for i, k in enumerate(kernels):
            for v in k.inputs:
                if v and v not in spec.constants:
                    last[v] = max(last.get(v, i), i)
            for v in k.outputs:
                if v:
                    start.setdefault(v, i)
                    last.setdefault(v, i)
        for o in g.outputs:
            r = root(o)
            if r in start:
                last[r] = end
        intervals = []
        for v, s in start.items():
            t = g.values[v]
            intervals.append(Interval(v, t.nbytes, s, last.get(v, s)))
        self.plan: MemoryPlan = plan(intervals)
        self.arena = aligned_empty(max(self.plan.arena_bytes, ALIGN))

        def addr(v: str) -> int:
            if not v:
                return 0
            v = root(v)
            if v in woff:
                return self.weights.ctypes.data + woff[v]
            return self.arena.ctypes.data + self.plan.offsets[v]

        # -- per-kernel argument tables and the schedule ---------------------------
        self.lib = JitLibrary(list(dict.fromkeys(spec.objects.values())) + [dispatcher_obj])
        ntab = sum(len(k.inputs) + len(k.outputs) for k in kernels)
        self.table = aligned_empty(max(ntab * 8, ALIGN), ALIGN).view(np.uint64)
        self.sched = aligned_empty(max(len(kernels) * 32, ALIGN), ALIGN).view(np.uint64)
        pos = 0
        for i, k in enumerate(kernels):
            vals = list(k.inputs) + list(k.outputs)
            for j, v in enumerate(vals):
                self.table[pos + j] = addr(v)
            flags = dispatch.FLAG_SINGLE_CORE if k.single_core else 0
            self.sched[i * 4:i * 4 + 4] = [self.lib.address(k.symbol),
                                           self.table.ctypes.data + pos * 8,
                                           k.num_tiles, flags]
            pos += len(vals)
        self.ws_stride = align_up(max((k.workspace_bytes for k in kernels), default=0))
        self.workspace = aligned_empty(max(self.ws_stride * device.cores, ALIGN))
        self._run = dispatch.RUN_FUNC_TYPE(self.lib.address(dispatch.ENTRY))
        self._lock = threading.Lock()

        # -- host views of inputs and outputs ----------------------------------------
        def view(v: str) -> np.ndarray:
            t = g.values[v]
            r = root(v)
            if r in spec.constants and r not in woff:
                return spec.constants[r]
            base, off = (self.weights, woff[r]) if r in woff else (self.arena,
                                                                   self.plan.offsets[r])
            nbytes = t.nbytes
            return base[off:off + nbytes].view(t.dtype).reshape(t.shape)

        self.input_views = {v: view(v) for v in g.inputs}
        self.output_views = [view(o) for o in g.outputs]

    def execute(self, feeds: dict[str, np.ndarray], times: np.ndarray | None = None
                ) -> list[np.ndarray]:
        """Inputs must already be checked (names, dtypes, shapes)."""
        with self._lock:
            for name, arr in feeds.items():
                np.copyto(self.input_views[name], arr, casting="no")
            self.launch(times)
            return [np.array(v, copy=True) for v in self.output_views]

    def launch(self, times: np.ndarray | None = None) -> None:
        nk = len(self.spec.kernels)
        if nk == 0:
            return
        ncores = self.device.cores
        sched = self.sched.ctypes.data
        # fresh claim/done counters per launch: a late core still walking an earlier
        # launch only ever sees that launch's (finished) counters
        counters = aligned_empty(nk * dispatch.COUNTER_WORDS * 8, 64)
        cptr = counters.ctypes.data
        ws = self.workspace.ctypes.data
        stride = self.ws_stride
        tptr = times.ctypes.data if times is not None else None
        run = self._run
        if ncores == 1:
            run(sched, nk, 0, 1, cptr, ws, stride, tptr)
            return
        keep = (self, counters)

        def job(core: int) -> None:
            run(sched, nk, core, ncores, cptr, ws, stride, tptr)
            del core

        job.keep = keep  # type: ignore[attr-defined]  (buffers live while a core may run)
        self.device.launch(job)


_dispatcher: bytes | None = None
_dlock = threading.Lock()


def dispatcher_object() -> bytes:
    global _dispatcher
    with _dlock:
        if _dispatcher is None:
            dispatch._add_libc_symbols()
            _dispatcher = dispatch.build_dispatcher()
    return _dispatcher


