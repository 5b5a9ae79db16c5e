"""Host and device buffers: page-aligned allocation, and what counts as pinned memory.

Device memory (Device.malloc) and page-aligned ("pinned") host memory, which the
copy engine reads asynchronously (stream.is_pinned), are both `aligned_empty`
buffers. Where the intermediates of a program live in its arena is the
specialisation's compile-time memory plan (artifact.MemoryPlan).
"""

from __future__ import annotations

import mmap
import weakref

import numpy as np

PAGE = mmap.PAGESIZE


# Buffers of at least one huge page (2 MiB) get memory of their own, mapped at a huge-page
# boundary and advised to the kernel as huge pages (transparent huge pages, where the
# kernel has them): packed weights and arenas that kernels stream through. With 4 KiB pages
# every 4 KiB of a stream is a TLB miss (and, in a virtual machine, a two-level page
# walk). numpy advises huge pages for its own allocations of 4 MiB and more, but those
# are malloc'd at no particular alignment, so a buffer gets only the 2 MiB blocks that
# fall wholly inside it, and one under 4 MiB (BERT-base's 768 x 768 weights) none.
# Sapphire Rapids guest (KVM), the GEMM kernel alone over 40 copies of its prepacked B
# (each call finds its B out of the caches): 128 x 768 x 768 (2.3 MiB) 58 -> 96 GFLOP/s,
# 128 x 3072 x 768 (9.4 MiB, numpy's blocks before) 74 -> 98; single convs (weights and
# arena): ResNet-50's 1x1 at 56x56 and 512->2048 at 7x7 9-11% faster, 3x3 at 7x7 7%,
# two 3x3 at 56x56 3-5% slower (benchmark noise there is ~3%).
HUGE_PAGE = 2 << 20
HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE")


def aligned_empty(nbytes: int, align: int = PAGE, zero: bool = True,
                  huge: bool = True) -> np.ndarray:
    """A uint8 buffer whose data pointer is `align`-aligned (page-aligned by default);
    from HUGE_PAGE bytes on, huge-page aligned memory of its own (see HUGE_PAGES) unless
    not ``huge``: memory numpy's allocator hands out again (a buffer made per run, which
    a fresh mapping would fault in every time)."""
    if huge and HUGE_PAGES and nbytes >= HUGE_PAGE and HUGE_PAGE % align == 0:
        buf = _huge_aligned(nbytes)
        if buf is not None:
            return buf
    raw = (np.zeros if zero else np.empty)(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    buf = raw[off:off + nbytes]
    assert buf.ctypes.data % align == 0
    return buf


def _huge_aligned(nbytes: int) -> np.ndarray | None:
    """nbytes of zeroed anonymous memory from a huge-page boundary, advised as huge pages
    (whole ones: the tail past the last 2 MiB boundary keeps small pages, so no memory is
    spent on pages nothing uses). The mapping is unmapped when the array is collected.
    None where the mapping is refused (the caller's numpy allocation then says why)."""
    span = -(-nbytes // PAGE) * PAGE
    try:
        m = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    raw = np.frombuffer(m, dtype=np.uint8)
    off = (-raw.ctypes.data) % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, off, span)
    except OSError:     # a kernel without transparent huge pages: small pages
        pass
    return raw[off:off + nbytes]


# Arrays that cannc allocated with `device_ready_empty` (packed weights): page-aligned
# memory of their own that nothing outside cannc holds, which a WeightPool may adopt
# as the device copy instead of copying it (id -> array; an entry goes with its array).
_DEVICE_READY: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def device_ready_empty(shape: int | tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array in page-aligned memory of its own, marked so
    that WeightPool adopts it as its device copy (`is_device_ready`) rather than copying
    it: for constants cannc computes (packed weights) and never changes once written."""
    dt = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = int(np.prod(shape, dtype=np.int64))
    nbytes = n * dt.itemsize
    # whole 64-byte lines, as Device.malloc's copies have: a kernel's vector access at
    # the end stays inside the allocation
    a = aligned_empty(max(-(-nbytes // 64) * 64, 64), zero=False)[:nbytes]
    a = a.view(dt).reshape(shape)
    _DEVICE_READY[id(a)] = a
    return a


def is_device_ready(a: np.ndarray) -> bool:
    """Whether `a` is the very array `device_ready_empty` returned."""
    return _DEVICE_READY.get(id(a)) is a
