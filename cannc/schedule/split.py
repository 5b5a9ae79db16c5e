"""How a kernel's tiles are split over the AI cores, and the arithmetic the planners
and the cost model share.

The runtime's dispatcher (runtime/dispatch.py) lets the cores claim a kernel's T
tiles in chunks that shrink as the work runs out (guided self-scheduling): each claim
takes ceil(R / (cores * CHUNKS_PER_CORE)) of the R tiles left, but no fewer than
ceil(T / (cores * MIN_CHUNK_DIVISOR)) (`claim_chunks` lists them). A core that starts
late or runs slow (woken from an idle state, descheduled on a shared machine) thus
holds back at most a small last chunk, not a quarter of the kernel. On up to
MAX_REGION_CORES cores each core claims such chunks from a contiguous region of its own
first (T * c / cores onwards), then from the others' (the cost model's `claim_chunks`
walk, one shared sequence, stands for both: the first chunks are the same size, T /
(2 cores)); the tuner
times a GEMM's tiles split evenly (`split_even`); `gemm_groups` is the blocks one
call of a GEMM kernel processes for a tile range (as the generated code walks them).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

CHUNKS_PER_CORE = 2
# the smallest chunk is ceil(T / (cores * MIN_CHUNK_DIVISOR)). 8 left 3 of a 35-tile GEMM
# in each last claim: on 2 cores of a Zen 4 guest each core waited ~3% of BERT-base's batch-1
# run at GEMM tails (cannc profile --trace); with 32 (last claims of one tile up to 64
# tiles) bert_base b1 2 cores ran 113.6 -> 109.3 ms, minilm 15.5 -> 15.1, resnet18 13.1 ->
# 12.9, mobilenet_v2 level (4.25 -> 4.13 and 3.91 -> 4.00 in two A/Bs)
MIN_CHUNK_DIVISOR = 32
# regions: with up to this many cores a kernel's tiles are cut into one contiguous region
# per core (the dispatcher's spare counter words hold their claims, runtime/dispatch.py)
MAX_REGION_CORES = 6


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rup(a: int, b: int) -> int:
    """`a` rounded up to a multiple of `b`."""
    return cdiv(a, b) * b


def split_even(T: int, n: int) -> list[tuple[int, int]]:
    """`T` tiles cut into `n` contiguous ranges of (nearly) equal length."""
    return [(i * T // n, (i + 1) * T // n) for i in range(n)]


@functools.lru_cache(maxsize=4096)
def region_chunks(T: int, cores: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The chunks each core claims from its own region (the dispatcher with up to
    MAX_REGION_CORES cores, when no core takes another's tiles): region c is
    split_even's c-th range, claimed ceil(left / CHUNKS_PER_CORE) tiles at a time, at
    least ceil(T / (cores * MIN_CHUNK_DIVISOR)); one chunk on one core. Each chunk is
    one call of the kernel: a GEMM block that a chunk cuts reads its A rows and B
    columns again."""
    if cores <= 1:
        return (((0, T),) if T > 0 else (),)
    lo = min_chunk(T, cores)
    return tuple(tuple(_guided(r0, r1, lo, CHUNKS_PER_CORE)) for r0, r1 in split_even(T, cores))


def _guided(t0: int, t1: int, lo: int, pieces: int) -> Iterator[tuple[int, int]]:
    """Tiles [t0, t1) claimed as the dispatcher claims them: ceil(left / pieces) at a
    time, at least lo."""
    t = t0
    while t < t1:
        c = max(lo, cdiv(t1 - t, pieces))
        yield t, min(t1, t + c)
        t += c


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


def min_chunk(T: int, cores: int) -> int:
    return max(1, cdiv(T, cores * MIN_CHUNK_DIVISOR))


@functools.lru_cache(maxsize=4096)
def claim_chunks(T: int, cores: int) -> tuple[tuple[int, int], ...]:
    """The tile ranges the dispatcher's claims take, in order (whichever core claims).
    Memoised: the conv planner asks for the same few (T, cores) thousands of times."""
    return tuple(_claim_chunks(T, cores))


def _claim_chunks(T: int, cores: int) -> list[tuple[int, int]]:
    if cores <= 1:
        return [(0, T)] if T > 0 else []
    return list(_guided(0, T, min_chunk(T, cores), cores * CHUNKS_PER_CORE))
