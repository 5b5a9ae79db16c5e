"""Streams, events and the copy engine (the aclrtStream / aclrtEvent analogues).

A Stream is an ordered queue of operations executed by its own thread. Copies
between host and device are performed by the Device's copy engine (one thread,
like one DMA engine): `memcpy_async` from page-aligned ("pinned") host memory
returns at once and the copy runs in the background in stream order; from
ordinary (pageable) host memory it completes before the call returns, as with
aclrtMemcpyAsync. Events order work across streams and time it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from .memory import PAGE


def is_pinned(a: np.ndarray) -> bool:
    """Page-aligned and contiguous: what the copy engine can read asynchronously."""
    return a.flags.c_contiguous and a.ctypes.data % PAGE == 0


class CopyEngine:
    """Host<->device copies in submission order, one lane (thread) per direction, as a
    device with separate upload and download DMA engines: the copy-in of one request
    and the copy-out of another proceed together."""

    def __init__(self) -> None:
        self._qs = {k: queue.SimpleQueue() for k in ("h2d", "d2h")}
        self.log: list[tuple[str, float, float, int]] = []   # (kind, t0, t1, bytes)
        self.keep_log = False
        self._threads = [threading.Thread(target=self._loop, args=(q,), daemon=True,
                                          name=f"cannc-copy-{k}") for k, q in self._qs.items()]
        for t in self._threads:
            t.start()

    def _loop(self, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            kind, dst, src, fut = item
            t0 = time.perf_counter()
            try:
                np.copyto(dst, src, casting="no")
                if self.keep_log:
                    self.log.append((kind, t0, time.perf_counter(), int(src.nbytes)))
                fut.set_result(None)
            except BaseException as e:  # pragma: no cover
                fut.set_exception(e)

    def submit(self, kind: str, dst: np.ndarray, src: np.ndarray) -> Future:
        fut: Future = Future()
        self._qs["d2h" if kind == "d2h" else "h2d"].put((kind, dst, src, fut))
        return fut

    def close(self) -> None:
        for q in self._qs.values():
            q.put(None)


class Event:
    def __init__(self) -> None:
        self._done = threading.Event()
        self.time: float | None = None

    def _fire(self) -> None:
        self.time = time.perf_counter()
        self._done.set()

    def record(self, stream: Stream) -> Event:
        self._done.clear()
        stream.enqueue(self._fire)
        return self

    def synchronize(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def query(self) -> bool:
        return self._done.is_set()

    def elapsed_ms(self, later: Event) -> float:
        assert self.time is not None and later.time is not None, "events not recorded"
        return (later.time - self.time) * 1e3


class Stream:
    """An ordered queue of launches, copies and event operations."""

    def __init__(self, copy_engine: CopyEngine, name: str = "stream") -> None:
        self.copy_engine = copy_engine
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._errors: list[BaseException] = []
        self._t = threading.Thread(target=self._loop, daemon=True, name=f"cannc-{name}")
        self._t.start()

    def _loop(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException as e:
                self._errors.append(e)
            # drop the finished job while waiting for the next: its closure may hold the
            # session, whose finaliser ends this thread
            fn = None

    def enqueue(self, fn: Callable[[], Any]) -> None:
        self._q.put(fn)

    def memcpy_async(self, dst: np.ndarray, src: np.ndarray, kind: str = "h2d") -> None:
        """Copy src to dst in stream order. From pinned memory the call returns at once;
        from pageable memory it returns when the copy is done."""
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"memcpy: {src.dtype}{list(src.shape)} -> "
                             f"{dst.dtype}{list(dst.shape)}")
        if is_pinned(src) or kind == "d2h":
            self.enqueue(lambda: self.copy_engine.submit(kind, dst, src).result())
        else:
            done = threading.Event()
            self.enqueue(lambda: (self.copy_engine.submit(kind, dst, src).result(), done.set()))
            done.wait()

    def wait_event(self, ev: Event) -> None:
        self.enqueue(ev.synchronize)

    def synchronize(self) -> None:
        ev = Event()
        ev.record(self)
        ev.synchronize()
        if self._errors:
            err = self._errors.pop(0)
            raise err

    def close(self) -> None:
        """End the stream's thread once the work already queued is done."""
        self._q.put(None)
