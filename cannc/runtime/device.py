"""The simulated accelerator: AI Cores (worker threads) and device memory.

Core 0 is the calling thread; cores 1..N-1 are persistent native worker threads
(pthreads running generated code, runtime/dispatch.py `build_pool`): they never
touch the interpreter. A launch is posted to a ring they all read; every core
runs the same native entry point (the dispatcher) with its core index, and the
cores then synchronise among themselves in native code, so Python is involved
once per launch, not once per kernel or tile.

Idle policy (like onnxruntime's pool): after its last launch a worker spins for
IDLE_SPIN_US (back-to-back requests find it running), then sleeps on a futex, so
an idle device burns no CPU and a request after an idle gap costs one wake-up
system call. The Python-thread hand-off this replaces (a queue and the
interpreter lock) took 0.2-0.6 ms, sometimes several, to start core 1 after an
idle gap: core 0 often finished a small model alone, or waited for core 1's late
share.

The workers keep off the CPU of the thread that posts (`_Pool.keep_off`, on Linux): a
worker woken after an idle gap was placed on the poster's own CPU and stayed there for
several milliseconds, the two cores' shares time-sliced on one CPU (KVM guests, whose
idle vCPUs look busy to the waker's scheduler: the zoo MLP at batch 1 on 2 cores, runs
after 50 ms of idle, 287 us against 161 back to back; so, 164).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

from ..native.target import JitLibrary
from ..schedule.machine import usable_cores
from . import dispatch
from .memory import aligned_empty
from .stream import CopyEngine, Stream

IDLE_SPIN_US = 100.0     # a worker spins this long after its last launch, then sleeps

_pool_lib: JitLibrary | None = None
_pool_lock = threading.Lock()
_cycles_per_us: float | None = None
_live: weakref.WeakSet = weakref.WeakSet()


def _pool_library() -> JitLibrary:
    """The pool's code, loaded once per process and never unloaded (worker threads run it
    until they are joined)."""
    global _pool_lib, _cycles_per_us
    with _pool_lock:
        if _pool_lib is None:
            dispatch._add_libc_symbols()
            lib = JitLibrary([dispatch.build_pool()])
            cyc = ctypes.CFUNCTYPE(ctypes.c_int64)(lib.address(dispatch.POOL_CYCLES))
            c0, t0 = cyc(), time.perf_counter()
            time.sleep(0.0005)   # (it sets how long idle cores spin: 10% off is fine)
            _cycles_per_us = max((cyc() - c0) / ((time.perf_counter() - t0) * 1e6), 1.0)
            _pool_lib = lib
        return _pool_lib


class _Pool:
    """The native worker threads of a device (cores 1..n-1) and their launch ring."""

    def __init__(self, cores: int) -> None:
        lib = _pool_library()
        self.cores = cores
        self.mem = aligned_empty(dispatch.pool_words(cores) * 8, 64).view(np.int64)
        m = self.mem
        m[dispatch.POOL_SPIN] = int(IDLE_SPIN_US * (_cycles_per_us or 1.0))
        m[dispatch.POOL_CORES] = cores
        m[dispatch.POOL_SLOTS] = dispatch.POOL_LINES + 8 * cores
        self.base = m.ctypes.data
        self._done_words = [dispatch.POOL_LINES + 8 * c for c in range(1, cores)]
        self._post = dispatch.POOL_POST_TYPE(lib.address(dispatch.POOL_POST))
        self._lock = threading.Lock()
        self._keep: list[Any] = [None] * dispatch.POOL_RING
        self._posted = 0
        self._released = 0
        self._threads: list[ctypes.c_ulong] = []
        libc = ctypes.CDLL(None)
        self._create, self._join = libc.pthread_create, libc.pthread_join
        self._create.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p]
        self._join.argtypes = [ctypes.c_ulong, ctypes.c_void_p]
        # the CPUs this process may use, and the one the workers keep off (keep_off)
        try:
            self._cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self._cpus = []
        self._avoided = -1
        self._setaffinity = getattr(libc, "pthread_setaffinity_np", None)
        self._getcpu = getattr(libc, "sched_getcpu", None)
        worker = lib.address(dispatch.POOL_WORKER)
        for c in range(1, cores):
            line = dispatch.POOL_LINES + 8 * c
            m[line:line + 3] = [0, self.base, c]
            tid = ctypes.c_ulong()
            if self._create(ctypes.byref(tid), None, worker, self.base + line * 8) != 0:
                self.close()
                raise OSError(f"cannot start AI core {c}: pthread_create failed")
            self._threads.append(tid)
        self.closed = False

    def post(self, run: int, sched: int, nk: int, ncores: int, counters: int, ws: int,
             stride: int, times: int | None, keep: Any) -> int:
        """Post a launch to the workers; its id (see finished)."""
        with self._lock:
            if self.closed:
                raise RuntimeError("the device is closed")
            if self._getcpu is not None:
                self.keep_off(self._getcpu())
            # waits (natively) until every worker is done with the launch this slot held
            self._post(self.base, run, sched, nk, ncores, counters, ws, stride, times)
            launch = self._posted
            self._posted += 1
            # drop what launches every worker has finished held (a closed session's
            # memory is not kept for a whole turn of the ring), then keep this one's. In
            # that order: when the workers were a whole ring behind at the last post and
            # have since caught up to this launch, the launches released here span every
            # slot of the ring, this one's among them (launch - POOL_RING's); released
            # after it was stored, this launch's counters and buffers were freed before
            # a worker ran it (a worker then waited forever on freed counters)
            done = self._done_min(launch)
            while self._released < min(done, launch):
                self._keep[self._released % dispatch.POOL_RING] = None
                self._released += 1
            self._keep[launch % dispatch.POOL_RING] = keep
            return launch

    def keep_off(self, cpu: int) -> None:
        """Let the workers run on every CPU of the process but `cpu` (the poster's): a
        syscall per worker when the poster's CPU changed since the last post, none
        otherwise. Nothing where the process has one CPU, or on a failure (the workers
        then keep their CPUs)."""
        if cpu == self._avoided or cpu < 0 or self._setaffinity is None:
            return
        others = [c for c in self._cpus if c != cpu]
        if not others or cpu not in self._cpus:
            return
        mask = (ctypes.c_ubyte * (max(128, max(self._cpus) // 8 + 1)))()
        for c in others:
            mask[c // 8] |= 1 << (c % 8)
        for t in self._threads:
            self._setaffinity(ctypes.c_ulong(t.value), ctypes.c_size_t(ctypes.sizeof(mask)),
                              mask)
        self._avoided = cpu

    def affinity(self, worker: int) -> set[int] | None:
        """The CPUs worker `worker` (0: core 1's) may run on (None where not readable)."""
        get = getattr(ctypes.CDLL(None), "pthread_getaffinity_np", None)
        if get is None:
            return None
        mask = (ctypes.c_ubyte * 128)()
        if get(ctypes.c_ulong(self._threads[worker].value), ctypes.c_size_t(128), mask):
            return None
        return {i for i in range(1024) if mask[i // 8] >> (i % 8) & 1}

    def launches_done(self, core: int) -> int:
        return int(self.mem[dispatch.POOL_LINES + 8 * core])

    def _done_min(self, upto: int) -> int:
        """The launches every worker has finished, or `upto` if that is fewer (a loop over
        the workers' words: a run posts a launch, and this is on its path)."""
        m, done = self.mem, upto
        for w in self._done_words:
            d = int(m[w])
            if d < done:
                done = d
        return done

    def finished(self, launch: int) -> bool:
        """Every worker has finished launch `launch` (an id post returned) and reads
        nothing of it any more."""
        return self._done_min(launch + 1) > launch

    def close(self) -> None:
        with self._lock:
            if getattr(self, "closed", True) and not self._threads:
                return
            self.closed = True
            m = self.mem
            m[dispatch.POOL_QUIT] = 1
            wake = ctypes.c_int32.from_address(self.base + dispatch.POOL_WAKE * 8)
            wake.value += 1
            libc = ctypes.CDLL(None)
            libc.syscall(dispatch.SYS_FUTEX, ctypes.c_void_p(ctypes.addressof(wake)),
                         dispatch.FUTEX_WAKE_PRIVATE, 2 ** 31 - 1)
            for t in self._threads:
                self._join(t.value, None)
            self._threads = []
            self._keep = [None] * dispatch.POOL_RING


class Device:
    """N AI Cores sharing device memory.

    `launch(...)` posts a dispatcher launch to the workers of cores 1..N-1; the caller
    then runs core 0's share itself (Program.prepare_launch). The native dispatcher
    makes core 0 return only when all the work is done, so nobody waits for a worker
    the OS has not scheduled yet (it will find its share already taken).
    """

    def __init__(self, cores: int | None = None) -> None:
        n = usable_cores() if cores is None else int(cores)
        if n < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.cores = n
        self._mem_lock = threading.Lock()
        self._used: dict[str, int] = {}
        # (kind, bytes) of buffers collected since the last accounting: a buffer's
        # finalizer may run inside any allocation -- a garbage collection triggered while
        # this thread holds _mem_lock -- so it only appends here and never takes the lock
        # (taking it deadlocked a test worker inside malloc)
        self._freed: collections.deque[tuple[str, int]] = collections.deque()
        self.peak_bytes = 0
        self._pool = _Pool(n) if n > 1 else None
        _live.add(self)

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
            self._account_freed()
            self._used[kind] = self._used.get(kind, 0) + int(nbytes)
            self.peak_bytes = max(self.peak_bytes, sum(self._used.values()))
        weakref.finalize(buf.base if buf.base is not None else buf, self._free, kind, int(nbytes))
        return buf

    def account(self, buf: np.ndarray, kind: str) -> None:
        """Count memory that is not Device.malloc's (weights read from the program cache)
        as device memory of `kind` until `buf`'s memory is collected."""
        n = int(buf.nbytes)
        with self._mem_lock:
            self._account_freed()
            self._used[kind] = self._used.get(kind, 0) + n
            self.peak_bytes = max(self.peak_bytes, sum(self._used.values()))
        owner = buf
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        weakref.finalize(owner, self._free, kind, n)

    def _free(self, kind: str, nbytes: int) -> None:
        self._freed.append((kind, nbytes))      # (a finalizer: no lock, see __init__)

    def _account_freed(self) -> None:
        """Subtract the buffers collected so far (the caller holds _mem_lock)."""
        while True:
            try:
                kind, nbytes = self._freed.popleft()
            except IndexError:
                return
            self._used[kind] = self._used.get(kind, 0) - nbytes

    def mem_info(self) -> dict[str, int]:
        """Bytes of device memory in use, by kind and in total, and the peak."""
        with self._mem_lock:
            self._account_freed()
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

    def launch(self, run: int, sched: int, nk: int, ncores: int, counters: int, ws: int,
               stride: int, times: int | None, keep: Any) -> int | None:
        """Post `run(sched, nk, c, ncores, counters, ws, stride, times)` (the dispatcher's
        entry point) to every worker core c in 1..ncores-1; core 0 is the caller's. `keep`
        holds what the launch's pointers point into until no worker can read it again.
        Returns the launch's id (None when there are no workers): see launch_finished."""
        if self._pool is not None and ncores > 1:
            return self._pool.post(run, sched, nk, ncores, counters, ws, stride, times, keep)
        return None

    def launch_finished(self, launch: int) -> bool:
        """Every worker has finished launch `launch` (an id launch returned): the memory
        its pointers point into may be reused."""
        pool = self._pool
        return pool is None or pool.finished(launch)

    def launches_done(self, core: int) -> int:
        """Launches worker `core` has finished (tests, diagnostics)."""
        return self._pool.launches_done(core) if self._pool is not None else 0

    def close(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.close()
        ce = getattr(self, "_copy_engine", None)
        if ce is not None:
            ce.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


@atexit.register
def _close_all() -> None:
    # join the native workers before the interpreter tears down the code they run
    for dev in list(_live):
        try:
            dev.close()
        except Exception:
            pass


def _after_fork_in_child() -> None:
    # a forked child has none of the parent's worker threads: give its devices new ones
    # (their launch ring would otherwise fill up and block the 64th launch)
    global _pool_lock
    _pool_lock = threading.Lock()
    for dev in list(_live):
        if getattr(dev, "_pool", None) is not None:
            dev._pool = _Pool(dev.cores)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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

