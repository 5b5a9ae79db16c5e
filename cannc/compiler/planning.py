"""Memory planning, a compile step: Concats written in place, liveness of every
intermediate over the kernel order, in-place sharing, then offsets in one device arena
so that buffers with disjoint lifetimes share memory (greedy by size, best fit,
ALIGN-aligned).

A Concat whose pieces are contiguous in its output (nothing before the axis but ones:
channels at batch 1) needs no kernel: each piece's producer writes straight into its
range of the output buffer (`concat_in_place`). DenseNet's concatenations of every
earlier feature map nest: the buffer of layer k's Concat is the front of layer k+1's,
so one buffer per block holds them all.

The result is an `artifact.MemoryPlan` stored in the Specialization; the runtime
only reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..artifact import ALIGN, Kernel, MemoryPlan, align_up
from ..errors import CompileError
from ..ir.graph import Graph


@dataclass(frozen=True)
class Interval:
    value: str
    size: int
    start: int      # index of the kernel that writes it (-1: before the first kernel)
    end: int        # index of the last kernel that reads it (inclusive)


def plan_memory(g: Graph, kernels: Sequence[Kernel], aliases: dict[str, str],
                constants: dict[str, np.ndarray], placed: dict[str, tuple[str, int]] | None = None,
                in_place: Sequence[str] = ()) -> MemoryPlan:
    """The memory plan of a lowered graph: kernels in launch order, the views' aliases,
    the constants (which live outside the arena) and the values `concat_in_place`
    placed inside others (with the Concat nodes it removed)."""
    placed = dict(placed or {})
    intervals, storage, naive = liveness(g, kernels, aliases, constants, placed)
    check_outputs(g, kernels, aliases, constants, placed)
    # naive: every intermediate in its own buffer (in-place sharing counted as two)
    return replace(place(intervals), storage=storage, naive_bytes=naive, placed=placed,
                   in_place=tuple(in_place))


def concat_in_place(g: Graph, kernels: Sequence[Kernel], constants: dict[str, np.ndarray]
                    ) -> tuple[list[Kernel], dict[str, tuple[str, int]], list[str]]:
    """Remove the Concat kernels whose pieces can be written in place. Returns the
    kernels left, where each placed value lives (value -> (root, byte offset), resolved to
    roots no other value contains) and the names of the Concat nodes removed.

    A Concat qualifies when its pieces are contiguous ranges of its output (the
    dimensions before the axis are all 1), each piece is an intermediate some kernel
    writes (not an input or a constant) and starts ALIGN-aligned, and every piece
    already placed inside another Concat's buffer brings that whole buffer along at a
    consistent offset with no two buffers overlapping. Kernel inputs are alias-resolved,
    so a piece reached through a view places the view's source."""
    written = {v for k in kernels for v in k.outputs if v}
    parent: dict[str, tuple[str, int]] = {}      # root placed inside another, at offset

    def resolve(v: str) -> tuple[str, int]:
        off = 0
        while v in parent:
            v, o = parent[v]
            off += o
        return v, off

    kept: list[Kernel] = []
    removed: list[str] = []
    for k in kernels:
        moves = _concat_moves(g, k, constants, written, resolve)
        if moves is None:
            kept.append(k)
            continue
        c = k.outputs[0]
        for r, d in moves.items():
            parent[r] = (c, d)
        written.add(c)
        removed.extend(k.nodes)
    placed = {v: resolve(v) for v in parent}
    return kept, placed, removed


def _concat_moves(g: Graph, k: Kernel, constants: dict[str, np.ndarray], written: set[str],
                  resolve: Callable[[str], tuple[str, int]]) -> dict[str, int] | None:
    """For a Concat kernel that can be removed: the roots to place inside its output and
    their byte offsets there; None when it must run."""
    if k.op_types != ["Concat"] or len(k.outputs) != 1:
        return None
    c = k.outputs[0]
    n = g.producer(c)
    if n is None or n.op_type != "Concat" or n.domain not in ("", "ai.onnx"):
        return None
    t = g.values[c]
    shape = tuple(t.shape)
    axis = int(n.attrs.get("axis", 0))
    axis += len(shape) if axis < 0 else 0
    if not 0 <= axis < len(shape) or any(int(d) != 1 for d in shape[:axis]):
        return None
    if c in constants or c in g.inputs or not k.inputs or len(set(k.inputs)) != len(k.inputs):
        return None
    moves: dict[str, int] = {}
    prefix = 0
    for v in k.inputs:
        vt = g.values.get(v)
        if (not v or vt is None or v in constants or v in g.inputs or v not in written
                or vt.nbytes == 0 or prefix % ALIGN or np.dtype(vt.dtype) != np.dtype(t.dtype)):
            return None
        r, o = resolve(v)
        d = prefix - o
        if r == c or d < 0 or d % ALIGN or d + g.values[r].nbytes > t.nbytes \
                or moves.get(r, d) != d:
            return None
        moves[r] = d
        prefix += vt.nbytes
    if prefix != t.nbytes:
        return None
    spans = sorted((d, d + g.values[r].nbytes) for r, d in moves.items())
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return None
    return moves


def check_outputs(g: Graph, kernels: Sequence[Kernel], aliases: dict[str, str],
                  constants: dict[str, np.ndarray],
                  placed: dict[str, tuple[str, int]] | None = None) -> None:
    """Every graph output must live somewhere the runtime can read it: a graph input, a
    constant, or a buffer a kernel writes (directly, or through a chain of views, or
    piece by piece: a Concat written in place). A value no kernel writes would have no
    place in the arena."""
    written = {v for k in kernels for v in k.outputs if v}
    written |= {r for r, _ in (placed or {}).values()}
    written |= {v for v in (placed or {}) if v in g.values}
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
             constants: dict[str, np.ndarray],
             placed: dict[str, tuple[str, int]] | None = None
             ) -> tuple[list[Interval], dict[str, str], int]:
    """Lifetimes of every buffer over the kernel order, and in-place sharing: an output
    of an elementwise kernel, or of one that names the input it may overwrite
    (Kernel.overwrites), takes over a same-sized input that dies at that kernel.
    A value `placed` inside another lives in that one's interval, and takes no part in
    in-place sharing (its buffer is a range of a larger one that outlives it)."""
    placed = placed or {}
    holders = {r for r, _ in placed.values()}
    grouped = set(placed) | holders

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
            if not (k.inplace or k.overwrites) or o in grouped:
                continue
            ot = g.values[o]
            for v in (k.inputs if k.inplace else [k.overwrites]):
                if not v or v in constants or v in taken:
                    continue
                r = root(v)
                s = storage.get(r, r)
                if last.get(r) != i or r in g.inputs and r in g.outputs or r in grouped:
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
    # a Concat written in place has no kernel: its buffer lives from its first piece's
    # write (its pieces' spans) to its last read
    for v, s0 in [*start.items(), *((h, last[h]) for h in holders - start.keys() if h in last)]:
        s = storage.get(v, v)
        s = placed.get(s, (s, 0))[0]
        lo, hi = s0, max(last.get(v, s0), s0)
        if s in span:
            span[s][0] = min(span[s][0], lo)
            span[s][1] = max(span[s][1], hi)
        else:
            span[s] = [lo, hi]
    intervals = [Interval(s, g.values[s].nbytes, lo, hi) for s, (lo, hi) in span.items()]
    naive = sum(align_up(max(g.values[v].nbytes, 1)) for v in start.keys() | holders)
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
