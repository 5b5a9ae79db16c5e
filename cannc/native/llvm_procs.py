"""LLVM on every core: modules optimised and emitted in worker processes.

llvmlite serialises every call into LLVM with one lock per process
(llvmlite.binding.ffi), so threads compile one module at a time: a cold BERT-base
compile spent 2.4 s in LLVM on 2 cores whether one thread or two asked. Modules are
therefore handed to worker processes (`_llvm_worker.py`, run as a script: it imports
llvmlite, not cannc; ready in ~0.07 s), as soon as each is lowered (`Batch`), while
the compiling thread goes on lowering. The workers are started on first need, kept for
the process (idle, they wait on a pipe and cost no CPU) and ended with it.

A worker runs the same optimisation function as the process (`_llvm_worker.optimise`)
for a target machine made from the same triple, CPU, features and code model, so an
object is the same bytes wherever it was made. While workers run, no module is
compiled in the caller's process: a worker that dies (an LLVM assertion aborts the
process it runs in) fails its module with a CompileError carrying the end of its
stderr, and the caller lives on.

CANNC_LLVM_PROCS=N caps the workers (0: every module compiled in process); the default
is the usable cores, and none when sys.executable is not a Python interpreter (Python
embedded in another program). Workers that cannot start leave the modules to the
process. With CANNC_DUMP_DIR set everything is compiled in process (the dumps are
written there).
"""

from __future__ import annotations

import atexit
import os
import pickle
import re
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from .. import config
from ..errors import CanncError, CompileError

WORKER = Path(__file__).with_name("_llvm_worker.py")

# (name, module_ir, speed_level) -> object bytes
Job = tuple[str, str, int]


def max_workers() -> int:
    """How many worker processes a compile may use (CANNC_LLVM_PROCS, default the
    usable cores: the caller waits while they compile)."""
    v = os.environ.get("CANNC_LLVM_PROCS", "").strip()
    if v:
        try:
            n = int(v)
        except ValueError:
            raise CanncError(f"CANNC_LLVM_PROCS={v!r}: expected a number of processes "
                             "(0: compile in process)") from None
        if n < 0:
            raise CanncError(f"CANNC_LLVM_PROCS={v!r}: expected 0 or more")
        return n
    if not _python_interpreter():
        return 0
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores)


def _python_interpreter() -> bool:
    """Whether sys.executable is a Python interpreter to start the worker with (in a
    program that embeds Python -- onnxruntime's execution provider inside a C++ host --
    it may be the host program itself, which must not be started)."""
    exe = sys.executable
    return bool(exe) and os.path.isfile(exe) and \
        re.fullmatch(r"(python|pypy)[0-9.]*(\.exe)?", os.path.basename(exe).lower()) is not None


class WorkerDied(Exception):
    pass


class _Worker:
    def __init__(self) -> None:
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.err, close_fds=True)
        self.ready = False

    def _answer(self) -> tuple:
        try:
            head = self.proc.stdout.read(8)
            if len(head) == 8:
                n = struct.unpack("<Q", head)[0]
                body = self.proc.stdout.read(n)
                if len(body) == n:
                    return pickle.loads(body)
        except (OSError, ValueError, EOFError, pickle.UnpicklingError):
            pass
        raise WorkerDied(self._death())

    def start(self) -> bool:
        """Wait for the worker to say it is ready (False: it could not start, e.g. no
        llvmlite for this interpreter; then the caller's process compiles)."""
        if not self.ready:
            try:
                self.ready = self._answer()[0] == "ready"
            except WorkerDied:
                return False
        return self.ready

    def compile(self, target: tuple, job: Job) -> tuple:
        name, module_ir, speed_level = job
        data = pickle.dumps(target + (speed_level, name, module_ir),
                            protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
            self.proc.stdin.flush()
        except (OSError, ValueError):
            raise WorkerDied(self._death()) from None
        return self._answer()

    def _death(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.err.seek(0)
        tail = self.err.read()[-2000:].decode("utf-8", "replace").strip()
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        return f"the LLVM worker process died ({how})" + (f": {tail}" if tail else "")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


_idle: list[_Worker] = []
_started = 0
_broken = False            # a worker could not start: this process compiles in process
_lock = threading.Lock()


def _checkout(n: int) -> list[_Worker]:
    """Up to `n` workers for one compile: idle ones first, new ones up to the cap."""
    global _started
    got: list[_Worker] = []
    with _lock:
        while _idle and len(got) < n:
            w = _idle.pop()
            if w.alive():
                got.append(w)
            else:
                _started -= 1
                w.close()
        cap = 0 if _broken else max_workers()
        while len(got) < n and _started < cap:
            try:
                got.append(_Worker())
            except OSError:
                break                   # cannot start a process: compile in process
            _started += 1
    return got


def _checkin(w: _Worker, ok: bool) -> None:
    global _started
    with _lock:
        if ok and w.alive():
            _idle.append(w)
            return
        _started -= 1
    w.close()


def shutdown() -> None:
    """End the idle workers (at exit, and in tests)."""
    global _started
    with _lock:
        ws, _idle[:] = list(_idle), []
        _started -= len(ws)
    for w in ws:
        w.close()


def _forget_in_child() -> None:
    # a forked child shares the parent's pipes: it must not talk to its workers
    global _started
    _idle.clear()
    _started = 0


atexit.register(shutdown)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class Batch:
    """Modules compiled as they are submitted: worker processes (started as the work
    arrives, up to `max_workers()`) take them while the submitting thread goes on with
    its own work (lowering the next kernels); `finish` waits for them and raises the
    first failure (a CompileError naming the kernel). Only when no worker could be had
    does the submitting thread compile (`in_process`). done(index, object) is called as
    each module is ready, from any thread."""

    def __init__(self, target: tuple, in_process: Callable[[Job], bytes],
                 done: Callable[[int, bytes], None]) -> None:
        self.target, self.in_process, self.done = target, in_process, done
        self.jobs: list[Job] = []
        self._todo: list[int] = []
        self._cv = threading.Condition()
        self._closed = False
        self._waiting = 0                   # feed threads waiting for a job
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self._cap = 0 if config.DUMP_DIR else max_workers()

    def submit(self, job: Job) -> int:
        with self._cv:
            i = len(self.jobs)
            self.jobs.append(job)
            self._todo.append(i)
            grow = self._waiting == 0 and len(self._threads) < self._cap
            self._cv.notify()
        if grow:
            self._grow()
        return i

    def _grow(self) -> None:
        got = _checkout(1)
        if not got:
            self._cap = len(self._threads)      # no more workers to be had
            return
        t = threading.Thread(target=self._feed, args=(got[0],), name="cannc-llvm",
                             daemon=True)
        self._threads.append(t)
        t.start()

    def _next(self, wait: bool) -> int | None:
        with self._cv:
            while True:
                if self.errors:
                    return None
                if self._todo:
                    return self._todo.pop(0)
                if self._closed or not wait:
                    return None
                self._waiting += 1
                self._cv.wait()
                self._waiting -= 1

    def _feed(self, w: _Worker) -> None:
        global _broken
        if not w.start():
            _broken = True
            _checkin(w, False)
            return
        ok = True
        try:
            while (i := self._next(wait=True)) is not None:
                name = self.jobs[i][0]
                try:
                    status, out = w.compile(self.target, self.jobs[i])
                except WorkerDied as e:
                    ok = False
                    self._fail(CompileError(f"LLVM failed on kernel {name}: {e}"))
                    return
                if status != "ok":
                    self._fail(CompileError(f"invalid LLVM IR for kernel {name}: {out}"))
                    return
                self.done(i, out)
        except BaseException as e:          # done() failed: raised by finish
            self._fail(e)
        finally:
            _checkin(w, ok)

    def _fail(self, e: BaseException) -> None:
        with self._cv:
            self.errors.append(e)
            self._cv.notify_all()

    def finish(self) -> None:
        """Wait for the workers to compile what is left (or compile it here, if none
        could be had or they could not start); raise the first failure."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        try:
            while (i := self._next(wait=False)) is not None:
                self.done(i, self.in_process(self.jobs[i]))
        except BaseException as e:
            self._fail(e)
        if self.errors:
            raise self.errors[0]

    def abandon(self) -> None:
        """Stop (the submitter failed): nothing more is compiled; the modules in flight
        finish in their workers, which are then idle again."""
        with self._cv:
            self._closed = True
            self._todo.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join()
