"""`cannc.ops.benchmark`: time any callable, robustly."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CanncError


@dataclass(frozen=True)
class Timing:
    """Per-call wall times of a benchmark, in seconds (`.to_dict()` in microseconds)."""

    median: float
    p10: float
    p90: float
    mean: float
    min: float
    runs: int

    def to_dict(self) -> dict[str, float]:
        return {"median_us": self.median * 1e6, "p10_us": self.p10 * 1e6,
                "p90_us": self.p90 * 1e6, "mean_us": self.mean * 1e6,
                "min_us": self.min * 1e6, "runs": self.runs}

    def __str__(self) -> str:
        return (f"median {self.median * 1e6:.2f} us (p10 {self.p10 * 1e6:.2f}, "
                f"p90 {self.p90 * 1e6:.2f}, {self.runs} runs)")


def benchmark(fn: Callable[..., Any], *args: Any, warmup: int = 100, runs: int | None = None,
              min_time: float = 0.2, max_runs: int = 100_000, **kwargs: Any) -> Timing:
    """Call ``fn(*args, **kwargs)`` ``warmup`` times, then time each of ``runs`` calls
    (each call timed on its own with time.perf_counter_ns); returns the median, p10 and
    p90 (and mean, min) per call in seconds. Without ``runs``: as many calls as fit in
    ``min_time`` seconds (at least 10, at most ``max_runs``)."""
    if not callable(fn):
        raise CanncError(f"benchmark: {fn!r} is not callable")
    if not isinstance(warmup, int) or warmup < 0:
        raise CanncError(f"benchmark: warmup must be a non-negative integer, got {warmup!r}")
    if runs is not None and (not isinstance(runs, int) or runs < 1):
        raise CanncError(f"benchmark: runs must be a positive integer, got {runs!r}")
    for _ in range(warmup):
        fn(*args, **kwargs)
    clock = time.perf_counter_ns
    times: list[int] = []
    if runs is not None:
        for _ in range(runs):
            t0 = clock()
            fn(*args, **kwargs)
            times.append(clock() - t0)
    else:
        end = clock() + int(min_time * 1e9)
        while len(times) < max_runs and (len(times) < 10 or clock() < end):
            t0 = clock()
            fn(*args, **kwargs)
            times.append(clock() - t0)
    a = np.asarray(times, dtype=np.float64) * 1e-9
    p10, med, p90 = np.percentile(a, [10, 50, 90])
    return Timing(median=float(med), p10=float(p10), p90=float(p90), mean=float(a.mean()),
                  min=float(a.min()), runs=len(times))
