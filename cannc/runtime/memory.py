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


def aligned_empty(nbytes: int, align: int = PAGE, zero: bool = True) -> np.ndarray:
    """A uint8 buffer whose data pointer is `align`-aligned (page-aligned by default)."""
    raw = (np.zeros if zero else np.empty)(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    buf = raw[off:off + nbytes]
    assert buf.ctypes.data % align == 0
    return buf


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
