"""Host and device buffers: page-aligned allocation, and what counts as pinned memory.

Device memory (Device.malloc) and page-aligned ("pinned") host memory, which the
copy engine reads asynchronously (stream.is_pinned), are both `aligned_empty`
buffers. Where the intermediates of a program live in its arena is the
specialisation's compile-time memory plan (artifact.MemoryPlan).
"""

from __future__ import annotations

import mmap

import numpy as np

PAGE = mmap.PAGESIZE


def aligned_empty(nbytes: int, align: int = PAGE, zero: bool = True) -> np.ndarray:
    """A uint8 buffer whose data pointer is `align`-aligned (page-aligned by default)."""
    raw = (np.zeros if zero else np.empty)(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    buf = raw[off:off + nbytes]
    assert buf.ctypes.data % align == 0
    return buf
