"""cannc and onnxruntime side by side: the reference session, output comparison, timing.

What `cannc run --check`, `cannc bench`, the benchmarks and the tests use to hold cannc
against onnxruntime: an ORT CPU session set up the same way every time, a comparison of
one output within the dtype's tolerance, and interleaved timing of both engines.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .compiler.shapes import type_string
from .errors import CanncError


def ort_session(source: str | bytes, threads: int, spinning: bool = True) -> Any:
    """An onnxruntime CPU session as cannc is compared with it: ORT_ENABLE_ALL, `threads`
    intra-op threads, sequential; `spinning=False` for interleaved timing."""
    import onnxruntime as ort  # lazy: only the comparisons need it (CLI start-up time)

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if not spinning:
        # ORT's idle pool threads otherwise busy-wait after each run and take the cores
        # from the cannc run that follows in an interleaved benchmark.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise CanncError(f"onnxruntime cannot load the model: {e}") from e


def ort_run(ort_sess: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    try:
        return ort_sess.run(None, feeds)
    except Exception as e:
        raise CanncError(f"onnxruntime failed to run the model: {e}") from e


def tolerance(dtype: np.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    loose = np.dtype(dtype).itemsize <= 2  # float16 / bfloat16
    return (rtol if rtol is not None else (1e-3 if loose else 1e-4),
            atol if atol is not None else (1e-3 if loose else 1e-4))


def compare(name: str, got: np.ndarray, exp: np.ndarray, rtol: float | None = None,
            atol: float | None = None) -> dict[str, Any]:
    """One output against the reference: floats within rtol/atol (NaN matches NaN),
    everything else exactly. Max rel error is |got - exp| / max(|exp|, atol)."""
    exp = np.asarray(exp)
    res: dict[str, Any] = {"name": name, "shape": list(got.shape), "dtype": str(got.dtype),
                           "max_abs": 0.0, "max_rel": 0.0, "ok": True, "problem": None}
    if got.shape != exp.shape or got.dtype != exp.dtype:
        res.update(ok=False, problem=f"cannc gives {type_string(got.dtype, got.shape)}, "
                                     f"onnxruntime {type_string(exp.dtype, exp.shape)}")
        return res
    if got.size == 0:
        return res
    if got.dtype.kind in "fcV":
        rt, at = tolerance(got.dtype, rtol, atol)
        g, e = got.astype(np.float64), exp.astype(np.float64)
        diff = np.abs(g - e)
        diff[(g == e) | (np.isnan(g) & np.isnan(e))] = 0.0   # equal infinities, both NaN
        diff[np.isnan(diff)] = np.inf                         # NaN on one side only
        rel = diff / np.maximum(np.abs(np.nan_to_num(e)), at)
        res.update(max_abs=float(diff.max()), max_rel=float(rel.max()), rtol=rt, atol=at,
                   ok=bool(np.all(diff <= at + rt * np.abs(np.nan_to_num(e)))))
    else:
        diff = np.abs(got.astype(np.int64) - exp.astype(np.int64)) if got.dtype != np.uint64 \
            else (got != exp).astype(np.int64)
        res.update(max_abs=float(diff.max()), max_rel=0.0, ok=bool(np.array_equal(got, exp)))
    if not res["ok"]:
        res["problem"] = "values differ"
    return res


def bench(sess: Any, ort_sess: Any, feeds: dict[str, np.ndarray], warmup: int,
          runs: int) -> dict[str, Any]:
    """Time cannc and onnxruntime alternately (which goes first alternates too), so both
    see the same machine noise. Times in ms."""
    def cannc_run() -> None:
        sess.run(None, feeds)

    def ort_run() -> None:
        ort_sess.run(None, feeds)

    times: dict[str, list[float]] = {"cannc": [], "ort": []}
    pairs = [("cannc", cannc_run), ("ort", ort_run)]
    for i in range(warmup + runs):
        for name, fn in (pairs if i % 2 == 0 else pairs[::-1]):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(dt * 1e3)
    out: dict[str, Any] = {}
    for name, ts in times.items():
        p10, p50, p90 = np.percentile(ts, [10, 50, 90])
        out[name] = {"median_ms": float(p50), "p10_ms": float(p10), "p90_ms": float(p90),
                     "min_ms": float(min(ts))}
    out["ratio"] = out["cannc"]["median_ms"] / out["ort"]["median_ms"]
    return out
