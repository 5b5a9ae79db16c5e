"""Memory planning, a compile step: liveness of every intermediate over the kernel
order, in-place sharing, then offsets in one device arena so that buffers with
disjoint lifetimes share memory (greedy by size, best fit, ALIGN-aligned).

The result is an `artifact.MemoryPlan` stored in the Specialization; the runtime
only reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..artifact import Kernel, MemoryPlan, align_up
from ..errors import CompileError
from ..ir.graph import Graph


@dataclass(frozen=True)
class Interval:
    value: str
    size: int
    start: int      # index of the kernel that writes it (-1: before the first kernel)
    end: int        # index of the last kernel that reads it (inclusive)


def plan_memory(g: Graph, kernels: Sequence[Kernel], aliases: dict[str, str],
                constants: dict[str, np.ndarray]) -> MemoryPlan:
    """The memory plan of a lowered graph: kernels in launch order, the views' aliases
    and the constants (which live outside the arena)."""
    intervals, storage, naive = liveness(g, kernels, aliases, constants)
    check_outputs(g, kernels, aliases, constants)
    # naive: every intermediate in its own buffer (in-place sharing counted as two)
    return replace(place(intervals), storage=storage, naive_bytes=naive)


def check_outputs(g: Graph, kernels: Sequence[Kernel], aliases: dict[str, str],
                  constants: dict[str, np.ndarray]) -> None:
    """Every graph output must live somewhere the runtime can read it: a graph input, a
    constant, or a buffer a kernel writes (directly, or through a chain of views). A
    value no kernel writes would have no place in the arena."""
    written = {v for k in kernels for v in k.outputs if v}
    for o in g.outputs:
        r = o
        while r in aliases:
            r = aliases[r]
        if r in g.inputs or r in constants or r in written:
            continue
        via = f" (a view of '{r}')" if r != o else ""
        raise CompileError(f"graph output '{o}'{via} is not computed by any kernel, nor "
                           f"is it an input or a constant: an optimisation dropped it "
                           f"(internal error; compile with pipeline='O0' to avoid it)")


def liveness(g: Graph, kernels: Sequence[Kernel], aliases: dict[str, str],
             constants: dict[str, np.ndarray]
             ) -> tuple[list[Interval], dict[str, str], int]:
    """Lifetimes of every buffer over the kernel order, and in-place sharing: an output
    of an elementwise kernel takes over a same-sized input that dies at that kernel."""

    def root(v: str) -> str:
        while v in aliases:
            v = aliases[v]
        return v

    end = len(kernels)
    last: dict[str, int] = {}
    for i, k in enumerate(kernels):
        for v in k.inputs:
            if v and v not in constants:
                last[root(v)] = i
    for o in g.outputs:
        last[root(o)] = end
    storage: dict[str, str] = {}          # value -> the value whose buffer it uses
    start: dict[str, int] = {}
    for v in g.inputs:
        start[v] = -1
    for i, k in enumerate(kernels):
        taken: set[str] = set()
        for o in k.outputs:
            if not o:
                continue
            start.setdefault(o, i)
            if not k.inplace:
                continue
            ot = g.values[o]
            for v in k.inputs:
                if not v or v in constants or v in taken:
                    continue
                r = root(v)
                s = storage.get(r, r)
                if last.get(r) != i or r in g.inputs and r in g.outputs:
                    continue
                vt = g.values[r]
                if vt.nbytes == ot.nbytes and tuple(g.values[v].shape) == tuple(ot.shape) \
                        and np.dtype(vt.dtype).itemsize == np.dtype(ot.dtype).itemsize \
                        and not any(last.get(x, -2) > i for x, y in storage.items() if y == s
                                    and x != r):
                    storage[o] = s
                    taken.add(v)
                    break
    # one interval per storage root, covering every value that lives in it
    span: dict[str, list[int]] = {}
    for v, s0 in start.items():
        s = storage.get(v, v)
        lo, hi = s0, max(last.get(v, s0), s0)
        if s in span:
            span[s][0] = min(span[s][0], lo)
            span[s][1] = max(span[s][1], hi)
        else:
            span[s] = [lo, hi]
    intervals = [Interval(s, g.values[s].nbytes, lo, hi) for s, (lo, hi) in span.items()]
    naive = sum(align_up(max(g.values[v].nbytes, 1)) for v in start)
    return intervals, storage, naive


def place(intervals: list[Interval]) -> MemoryPlan:
    """Arena offsets for `intervals` (no sharing: ``storage`` is empty)."""
    placed: list[tuple[int, int, Interval]] = []   # (offset, size, interval)
    offsets: dict[str, int] = {}
    for iv in sorted(intervals, key=lambda i: (-i.size, i.start, i.value)):
        size = align_up(max(iv.size, 1))
        conflicts = sorted((o, s) for o, s, other in placed
                           if not (other.end < iv.start or iv.end < other.start))
        best, best_gap, cursor = None, None, 0
        for o, s in conflicts:
            if o - cursor >= size:
                gap = o - cursor
                if best_gap is None or gap < best_gap:
                    best, best_gap = cursor, gap
            cursor = max(cursor, o + s)
        if best is None:
            best = cursor
        offsets[iv.value] = best
        placed.append((best, size, iv))
    arena = max((o + s for o, s, _ in placed), default=0)
    naive = sum(align_up(max(i.size, 1)) for i in intervals)
    lb = 0
    if intervals:
        lo = min(i.start for i in intervals)
        hi = max(i.end for i in intervals)
        for t in range(lo, hi + 1):
            live = sum(align_up(max(i.size, 1)) for i in intervals if i.start <= t <= i.end)
            lb = max(lb, live)
    return MemoryPlan(offsets, {}, arena, naive, lb)
