"""The simulated accelerator: AI Cores (worker threads) and device memory.

Core 0 is the calling thread; cores 1..N-1 are persistent worker threads. A
launch hands every core the same native entry point (the dispatcher) and its
core index; the cores then synchronise among themselves in native code, so
Python is involved once per launch, not once per kernel or tile.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable

import numpy as np

from ..schedule.machine import usable_cores
from .memory import aligned_empty
from .stream import CopyEngine, Stream


class Device:
    """N AI Cores sharing device memory.

    `post(job)` queues job(c) for the worker of each other core; the caller then
    runs job(0) itself (Program.prepare_launch). The native dispatcher makes
    core 0 return only when all the work is done, so nobody waits for a worker
    the OS has not scheduled yet (it will find its share already taken).
    """

    def __init__(self, cores: int | None = None) -> None:
        n = usable_cores() if cores is None else int(cores)
        if n < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.cores = n
        self._mem_lock = threading.Lock()
        self._used: dict[str, int] = {}
        self.peak_bytes = 0
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

    @property
    def copy_engine(self) -> CopyEngine:
        """The device's copy engine (its own thread), started on first use."""
        with self._mem_lock:
            if getattr(self, "_copy_engine", None) is None:
                self._copy_engine = CopyEngine()
            return self._copy_engine

    def stream(self, name: str = "stream") -> Stream:
        return Stream(self.copy_engine, name)

    # -- device memory (the aclrtMalloc / aclrtGetMemInfo analogues) ---------------------
    def malloc(self, nbytes: int, kind: str = "other") -> np.ndarray:
        """Page-aligned device memory; accounted by kind until the buffer is collected."""
        buf = aligned_empty(int(nbytes))
        with self._mem_lock:
            self._used[kind] = self._used.get(kind, 0) + int(nbytes)
            self.peak_bytes = max(self.peak_bytes, sum(self._used.values()))
        weakref.finalize(buf.base if buf.base is not None else buf, self._free, kind, int(nbytes))
        return buf

    def _free(self, kind: str, nbytes: int) -> None:
        with self._mem_lock:
            self._used[kind] = self._used.get(kind, 0) - nbytes

    def mem_info(self) -> dict[str, int]:
        """Bytes of device memory in use, by kind and in total, and the peak."""
        with self._mem_lock:
            info = {f"{k}_bytes": v for k, v in self._used.items()}
            info["used_bytes"] = sum(self._used.values())
            info["peak_bytes"] = self.peak_bytes
        return info

    @staticmethod
    def malloc_host(shape: tuple[int, ...] | int, dtype: object = np.float32) -> np.ndarray:
        """Page-aligned ("pinned") host memory: the aclrtMallocHost analogue. Copies from
        it are truly asynchronous (see Stream.memcpy_async)."""
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, int) else tuple(shape)
        n = int(np.prod(shp)) * dt.itemsize
        return aligned_empty(max(n, 1), zero=False)[:n].view(dt).reshape(shp)

    def post(self, job: Callable[[int], None]) -> None:
        """Queue job(c) for every worker core c >= 1 (core 0 is the caller's)."""
        for c in range(1, self.cores):
            self._queues[c].put(job)

    def close(self) -> None:
        for c in range(1, self.cores):
            self._queues[c].put(None)
        ce = getattr(self, "_copy_engine", None)
        if ce is not None:
            ce.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


_shared: dict[int, Device] = {}
_shared_lock = threading.Lock()


def shared_device(cores: int | None = None) -> Device:
    """The process's device with `cores` AI Cores (default: usable CPU cores). Sessions
    share it, as programs share one chip: its worker threads are started once."""
    n = usable_cores() if cores is None else int(cores)
    with _shared_lock:
        dev = _shared.get(n)
        if dev is None:
            dev = _shared[n] = Device(n)
        return dev

