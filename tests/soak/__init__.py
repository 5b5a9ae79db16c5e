"""A soak of one session: many threads calling run at once, many runs, resident memory
watched. `python -m tests.soak [--threads 16] [--runs 3000] [--model bert]`; a short
version runs in the test suite (tests/runtime/test_soak.py)."""

from __future__ import annotations

import resource
import threading
from dataclasses import dataclass

import numpy as np


def _rss_mib() -> float:
    """Resident memory now (from /proc; ru_maxrss is the peak)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class SoakReport:
    runs: int
    threads: int
    wrong: int
    errors: list[str]
    rss_after_warmup_mib: float
    rss_end_mib: float

    @property
    def growth_mib(self) -> float:
        return self.rss_end_mib - self.rss_after_warmup_mib


def soak(model: str = "mlp", threads: int = 16, runs: int = 3000, cores: int = 2,
         seed: int = 0) -> SoakReport:
    """`runs` calls of Session.run on one session from `threads` threads at once, each
    thread with its own inputs; every result is compared with the single-threaded one."""
    import cannc
    from models import zoo

    sess = cannc.compile(zoo.build(model), cores=cores)
    rng = np.random.default_rng(seed)
    feeds_per_thread, expected = [], []
    for _ in range(threads):
        feeds = {}
        for i in sess.get_inputs():
            shape = [2 if isinstance(d, str) else d for d in i.shape]
            feeds[i.name] = (rng.integers(0, 100, shape).astype(np.int64) if "int" in i.type
                             else rng.standard_normal(shape).astype(np.float32))
        feeds_per_thread.append(feeds)
        expected.append(sess.run(None, feeds))
    wrong, errors = [0], []
    lock = threading.Lock()

    def pool(n: int) -> None:
        counter = iter(range(n))

        def worker(t: int) -> None:
            while True:
                with lock:
                    if next(counter, None) is None:
                        return
                try:
                    outs = sess.run(None, feeds_per_thread[t])
                except Exception as e:
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")
                    continue
                if not all(np.array_equal(a, b) for a, b in zip(outs, expected[t])):
                    with lock:
                        wrong[0] += 1

        ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    # warm, on all threads: every execution context the session will ever make exists
    pool(max(200, runs // 10))
    rss0 = _rss_mib()
    pool(runs)
    return SoakReport(runs, threads, wrong[0], errors, rss0, _rss_mib())
