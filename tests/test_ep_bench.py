"""benchmarks/ep_bench.py's pure parts: pooling rounds, ratios, the bars (no timing run)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ep_bench  # noqa: E402


def _round(ort_ms, cannc_ms, ep_ms, fraction=1.0, ok=True, failed=None):
    def eng(ms, **kw):
        return {"median_ms": float(np.median(ms)), "times_ms": list(ms), "version": "x", **kw}
    engines = {"ort": eng(ort_ms), "cannc": eng(cannc_ms)}
    if ep_ms is not None:
        engines["ort+cannc"] = eng(ep_ms, assignment={"nodes": 10, "cannc_nodes": int(
            10 * fraction), "fraction": fraction})
    return {"engines": engines, "failed": failed or {}, "skipped": {},
            "outputs": {e: {"ok": ok, "max_abs": 0.0} for e in engines if e != "ort"}}


def test_summarise_pools_rounds_and_sets_bars():
    feeds = {"x": np.zeros((1, 4), np.float32)}
    row = ep_bench.summarise("m", Path("m.onnx"), feeds,
                             [_round([10, 10], [8, 8], [8, 8]), _round([10, 10], [8, 8], [9, 9])])
    assert row["engines"]["ort+cannc"]["n"] == 4 and row["engines"]["ort+cannc"]["median_ms"] == 8.5
    assert row["ratios"]["ort+cannc/ort"] == 0.85 and row["ratios"]["cannc/ort"] == 0.8
    assert row["share_on_cannc"] == 1.0 and row["shapes"] == {"x": [1, 4]}
    assert row["bars"] == {"share_ge_95": True, "no_slower_than_ort": True,
                           "within_5pct_of_cannc": False, "outputs_agree": True}


def test_summarise_failed_engine_and_low_share():
    row = ep_bench.summarise("m", Path("m.onnx"), {}, [_round([10], [8], None,
                                                              failed={"ort+cannc": "boom"})])
    assert row["share_on_cannc"] is None and row["ratios"]["ort+cannc/ort"] is None
    assert row["bars"]["share_ge_95"] is None and row["bars"]["outputs_agree"] is False
    row = ep_bench.summarise("m", Path("m.onnx"), {}, [_round([10], [8], [12], fraction=0.9,
                                                              ok=False)])
    assert row["bars"]["share_ge_95"] is False and row["bars"]["no_slower_than_ort"] is False
    assert row["bars"]["outputs_agree"] is False
