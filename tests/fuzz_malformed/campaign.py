"""The campaign driver: cases in a worker subprocess, each under a timeout; a crashed or
hung worker is recorded against its case and restarted at the next one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue

ROOT = Path(__file__).resolve().parents[2]
# the worker's device memory budget: legal-but-big shapes are refused, not allocated
WORKER_MEMORY = "2G"
# A fresh worker every so many cases (0 = never). The LLVM abort after thousands of JIT
# engines (RuntimeDyldELF `isInt<32>(RealOffset)`: a 32-bit PC-relative relocation between
# sections MCJIT placed > 2 GiB apart) is gone since the large code model
# (native/target.py CODE_MODEL: 0 aborts in 212k cases with one worker); recycling still
# bounds what one worker's leaks could do to the campaign.
CASES_PER_WORKER = 1000


@dataclass
class Report:
    cases: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    failures: list[tuple[int, str, str]] = field(default_factory=list)   # (case, outcome, detail)
    slowest: tuple[float, int] = (0.0, -1)

    def add(self, index: int, outcome: str, detail: str, seconds: float) -> None:
        self.cases += 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome not in ("ok", "error"):
            self.failures.append((index, outcome, detail))
        if seconds > self.slowest[0]:
            self.slowest = (seconds, index)


def _reader(stream, q: Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


def _start(seed: int, start: int, cache_dir: str | None,
           stderr_path: str | None = None) -> tuple[subprocess.Popen, Queue]:
    env = dict(os.environ)
    env.setdefault("CANNC_DEVICE_MEMORY", WORKER_MEMORY)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if cache_dir:
        env["CANNC_CACHE_DIR"] = cache_dir
    err = open(stderr_path, "a") if stderr_path else subprocess.DEVNULL
    p = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "tests.fuzz_malformed",
                          "--worker", "--seed", str(seed), "--case", str(start)],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                         text=True, bufsize=1)
    if err is not subprocess.DEVNULL:
        err.close()
    q: Queue = Queue()
    threading.Thread(target=_reader, args=(p.stdout, q), daemon=True).start()
    return p, q


def campaign(seed: int, seconds: float, timeout: float = 30.0, max_cases: int | None = None,
             save_dir: str | None = None, cache_dir: str | None = None,
             log=None, cases_per_worker: int = CASES_PER_WORKER) -> Report:
    """Run cases seed/0, seed/1, ... for `seconds` (or `max_cases`), in a worker process
    replaced every `cases_per_worker` cases (0: never)."""
    from . import make_case, save_reproducer
    rep = Report()
    t_end = time.monotonic() + seconds
    index = 0
    errlog = os.path.join(save_dir, "worker-stderr.log") if save_dir else None
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    proc, q = _start(seed, index, cache_dir, errlog)
    current, t0 = None, time.monotonic()
    started = False
    done_here = 0          # cases the current worker has finished
    try:
        while time.monotonic() < t_end and (max_cases is None or rep.cases < max_cases):
            try:
                line = q.get(timeout=timeout if started else max(timeout, 60.0))
            except Empty:
                line = "TIMEOUT"
            if line is None or line == "TIMEOUT":
                # the worker died (a crash) or hung on `current`
                if line is None:
                    try:
                        proc.wait(timeout=10)      # its exit status (a signal: negative)
                    except subprocess.TimeoutExpired:
                        pass
                outcome = "timeout" if line == "TIMEOUT" else f"crash (exit {proc.poll()})"
                if current is not None:
                    detail = make_case(seed, current).describe()
                    rep.add(current, outcome.split()[0], detail, time.monotonic() - t0)
                    if save_dir:
                        save_reproducer(make_case(seed, current), outcome.split()[0], detail,
                                        save_dir)
                    if log:
                        log(f"case {current}: {outcome}: {detail}")
                    index = current + 1
                proc.kill()
                proc.wait()
                proc, q = _start(seed, index, cache_dir, errlog)
                current, started, done_here = None, False, 0
                continue
            started = True
            if line.startswith("BEGIN "):
                current, t0 = int(line.split()[1]), time.monotonic()
            elif line.startswith("END "):
                d = json.loads(line[4:])
                rep.add(d["case"], d["outcome"], d["detail"], time.monotonic() - t0)
                if d["outcome"] not in ("ok", "error"):
                    if save_dir:
                        save_reproducer(make_case(seed, d["case"]), d["outcome"], d["detail"],
                                        save_dir)
                    if log:
                        log(f"case {d['case']}: {d['outcome']}: {d['detail']}")
                current = None
                index = d["case"] + 1
                done_here += 1
                if cases_per_worker and done_here >= cases_per_worker:
                    proc.kill()
                    proc.wait()
                    proc, q = _start(seed, index, cache_dir, errlog)
                    started, done_here = False, 0
    finally:
        proc.kill()
        proc.wait()
    return rep
