"""LLVM on every core: modules optimised and emitted in worker processes.

llvmlite serialises every call into LLVM with one lock per process
(llvmlite.binding.ffi), so threads compile one module at a time: a cold BERT-base
compile spent 2.4 s in LLVM on 2 cores whether one thread or two asked. A compile of
several modules therefore hands them to worker processes (`_llvm_worker.py`, run as a
script: it imports llvmlite, not cannc) while the calling thread compiles too, the
largest modules first. The workers are started on first need, kept for the process
(idle, they wait on a pipe and cost no CPU) and ended with it.

A worker runs the same optimisation function as the process (`_llvm_worker.optimise`)
for a target machine made from the same triple, CPU, features and code model, so an
object is the same bytes wherever it was made. A worker that dies (an LLVM assertion
aborts the process it runs in) fails its module with a CompileError carrying the end
of its stderr; the caller's process lives on.

CANNC_LLVM_PROCS=N caps the workers (0: every module compiled in process); the default
is one fewer than the usable cores. With CANNC_DUMP_DIR set everything is compiled in
process (the dumps are written there).
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from .. import config
from ..errors import CanncError, CompileError

WORKER = Path(__file__).with_name("_llvm_worker.py")

# (name, module_ir, speed_level) -> object bytes
Job = tuple[str, str, int]


def max_workers() -> int:
    """How many worker processes a compile may use (CANNC_LLVM_PROCS, default the
    usable cores less the caller's own)."""
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
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(0, cores - 1)


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


def compile_jobs(jobs: Sequence[Job], target: tuple,
                 in_process: Callable[[Job], bytes],
                 done: Callable[[int, bytes], None]) -> None:
    """Compile every job, calling done(index, object) as each finishes: the calling
    thread compiles with `in_process`, the workers for `target` (triple, cpu, features,
    opt, reloc, codemodel) alongside it, the largest modules first. The first failure
    is raised once the modules in flight are done (a CompileError naming the kernel)."""
    order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][1]))
    workers = [] if len(jobs) < 2 or config.DUMP_DIR else _checkout(len(jobs) - 1)
    if not workers:
        for i in order:
            done(i, in_process(jobs[i]))
        return
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in order:
        todo.put(i)
    errors: list[BaseException] = []

    def next_job() -> int | None:
        if errors:
            return None
        try:
            return todo.get_nowait()
        except queue.Empty:
            return None

    def feed(w: _Worker) -> None:
        global _broken
        ok = w.start()
        if not ok:
            _broken = True
            _checkin(w, False)
            return
        try:
            while (i := next_job()) is not None:
                name = jobs[i][0]
                try:
                    status, out = w.compile(target, jobs[i])
                except WorkerDied as e:
                    ok = False
                    errors.append(CompileError(f"LLVM failed on kernel {name}: {e}"))
                    return
                if status != "ok":
                    errors.append(CompileError(f"invalid LLVM IR for kernel {name}: {out}"))
                    return
                done(i, out)
        except BaseException as e:      # done() failed: reported by the caller
            errors.append(e)
        finally:
            _checkin(w, ok)

    threads = [threading.Thread(target=feed, args=(w,), name="cannc-llvm", daemon=True)
               for w in workers]
    for t in threads:
        t.start()
    try:
        while (i := next_job()) is not None:
            done(i, in_process(jobs[i]))
    except BaseException as e:
        errors.append(e)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
