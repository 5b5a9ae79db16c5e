"""The simulated accelerator: AI Cores (worker threads) and device memory.

Core 0 is the calling thread; cores 1..N-1 are persistent worker threads. A
launch hands every core the same native entry point (the dispatcher) and its
core index; the cores then synchronise among themselves in native code, so
Python is involved once per launch, not once per kernel or tile.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
from typing import Callable

import numpy as np

PAGE = mmap.PAGESIZE


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover
        return max(1, os.cpu_count() or 1)


def aligned_empty(nbytes: int, align: int = PAGE) -> np.ndarray:
    """A uint8 buffer whose data pointer is `align`-aligned (page-aligned by default)."""
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    buf = raw[off:off + nbytes]
    assert buf.ctypes.data % align == 0
    return buf


class Device:
    """N AI Cores sharing device memory.

    `launch(job)` runs job(0) on the calling thread and queues job(c) for the
    worker of each other core, then returns as soon as job(0) returns: the
    native dispatcher makes core 0 return only when all the work is done, so
    there is no need to wait for a worker the OS has not scheduled yet (it will
    find its share already taken).
    """

    def __init__(self, cores: int | None = None) -> None:
        n = usable_cores() if cores is None else int(cores)
        if n < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.cores = n
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(n)]
        self._workers = []
        for c in range(1, n):
            t = threading.Thread(target=self._worker, args=(c,), daemon=True,
                                 name=f"cannc-aicore-{c}")
            t.start()
            self._workers.append(t)

    def _worker(self, core: int) -> None:
        q = self._queues[core]
        while True:
            job = q.get()
            if job is None:
                return
            job(core)

    def launch(self, job: Callable[[int], None]) -> None:
        for c in range(1, self.cores):
            self._queues[c].put(job)
        job(0)

    def close(self) -> None:
        for c in range(1, self.cores):
            self._queues[c].put(None)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def address(arr: np.ndarray) -> int:
    return int(arr.ctypes.data)


c_void_p = ctypes.c_void_p
