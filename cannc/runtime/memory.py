"""Memory planning: liveness of every intermediate over the kernel order, then
offsets in one device arena so that buffers with disjoint lifetimes share
memory (greedy by size, best fit, 64-byte aligned)."""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 64


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Interval:
    value: str
    size: int
    start: int      # index of the kernel that writes it (-1: before the first kernel)
    end: int        # index of the last kernel that reads it (inclusive)


@dataclass
class MemoryPlan:
    offsets: dict[str, int]
    arena_bytes: int
    naive_bytes: int
    lower_bound_bytes: int


def plan(intervals: list[Interval]) -> MemoryPlan:
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
    return MemoryPlan(offsets, arena, naive, lb)
