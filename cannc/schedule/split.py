"""How a kernel's tiles are split over the AI cores, and the arithmetic the planners
and the cost model share.

The runtime's dispatcher (runtime/dispatch.py) lets the cores claim chunks of
ceil(T / (cores * CHUNKS_PER_CORE)) of a kernel's T tiles in turn; the tuner
times a GEMM's tiles split evenly (`split_even`); `gemm_groups` is the blocks one
call of a GEMM kernel processes for a tile range (as the generated code walks them).
"""

from __future__ import annotations

from collections.abc import Iterator

CHUNKS_PER_CORE = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rup(a: int, b: int) -> int:
    """`a` rounded up to a multiple of `b`."""
    return cdiv(a, b) * b


def split_even(T: int, n: int) -> list[tuple[int, int]]:
    """`T` tiles cut into `n` contiguous ranges of (nearly) equal length."""
    return [(i * T // n, (i + 1) * T // n) for i in range(n)]


def gemm_groups(batch: int, mt: int, nt: int, t0: int, t1: int
                ) -> Iterator[tuple[int, int, int, int, int]]:
    """The blocks one call of a GEMM kernel processes for tile range [t0, t1) (as the
    kernel walks them): (batch, first row block, end row block, first column block,
    end column block) of its mt x nt grid."""
    per_b = mt * nt
    t = t0
    while t < t1:
        b, r = divmod(t, per_b)
        jt, it = divmod(r, mt)
        if mt == 1:
            jt1 = min(nt, jt + (t1 - t))
            yield b, 0, 1, jt, jt1
            t += jt1 - jt
        else:
            it1 = min(mt, it + (t1 - t))
            yield b, it, it1, jt, jt + 1
            t += it1 - it
