"""The tuning search behind `cannc tune`: measure the candidate plans of a model's GEMMs
against their modelled default plans and store the winners in the tuning cache.

`gemm_candidates` lists legal planner overrides (ranked by the cost model),
`GemmBench` runs one GEMM through the kernel ABI as the cores would, and
`measure_pair` times a candidate side by side with the default. `tune_gemm`
tunes one GEMM signature; `tune_gemms` tunes every distinct GEMM of a compiled
model within a time budget and writes the cache (schedule.tuning), which later
compiles read through codegen.plans.gemm_tuning. The CLI parses and prints.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..artifact import Kernel
from ..codegen.gemm import (
    GemmSpec,
    _distinct_splits,
    _dot_able,
    emit_gemm,
    gemm_plan,
    np_elem,
    prepack_b,
)
from ..codegen.plans import gemm_record, gemm_spec_of
from ..errors import CanncError
from ..native.target import jit_kernel, new_module
from ..runtime.memory import aligned_empty
from ..schedule.costmodel import predict_gemm_us
from ..schedule.split import cdiv
from ..schedule.tuning import lookup, store

__all__ = ["GemmBench", "gemm_candidates", "gemm_items", "gemm_label", "measure_pair",
           "tune_gemm", "tune_gemms"]


# ---------------------------------------------------------------------------
# measuring GEMM candidates
# ---------------------------------------------------------------------------

def gemm_candidates(spec: GemmSpec, cores: int) -> list[dict[str, Any]]:
    """Legal planner overrides worth measuring for this GEMM, most promising first: the
    tile grid (ranked by the cost model for `cores` cores), K blocking, the micro-tile,
    A packing and the B access mode, interleaved so that a short budget tries each kind.
    Tunings that plan the same as the default (or as an earlier candidate) are dropped."""
    p0 = gemm_plan(spec)
    M, N, K = spec.M, spec.N, spec.K
    groups: dict[str, list[dict[str, Any]]] = {"grid": [], "KC": [], "micro": [], "A/B": []}
    # the tile grid: rows-only or columns-only splits, like the planner's own choice
    P, Q = cdiv(M, p0.MR), cdiv(N, p0.NR)
    grids = {(mt, 1) for mt, _ in _distinct_splits(P)} | {(1, nt) for nt, _ in _distinct_splits(Q)}
    groups["grid"] = [{"grid": [mt, nt]} for mt, nt in sorted(grids)
                      if spec.batch * mt * nt <= max(512, spec.batch)]
    if p0.b_mode == "dot":
        for mr in (1, 2, 4, 8):
            for nr in (4, 8, 16):
                if mr <= M:
                    groups["micro"].append({"MR": mr, "NR": nr})
    else:
        groups["KC"] = [{"KC": kc} for kc in (64, 96, 128, 192, 256, 384, 512, 1024) if kc < K]
        if K <= 4096:
            groups["KC"].append({"KC": K})
        for mr, nv in ((6, 2), (8, 2), (4, 2), (4, 4), (5, 2), (3, 4), (2, 6), (1, 8), (12, 2)):
            if mr <= M and 16 * nv <= 32 * cdiv(N, 32):
                groups["micro"].append({"MR": mr, "NV": nv})
        groups["A/B"].append({"pack_a": not p0.pack_a})
        if not spec.b_prepacked:
            modes = ["pack"] + (["direct"] if not spec.trans_b else [])
            modes += ["dot"] if _dot_able(spec) else []
            groups["A/B"] += [{"b_mode": m} for m in modes if m != p0.b_mode]
    seen = {p0}
    ranked: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for g, tuns in groups.items():
        ranked[g] = []
        for t in tuns:
            try:
                plan = gemm_plan(spec, t)
                cost = predict_gemm_us(gemm_record(spec, t), cores)
            except (ValueError, AssertionError, ZeroDivisionError):
                continue
            if plan in seen:
                continue
            seen.add(plan)
            ranked[g].append((cost, t))
        ranked[g].sort(key=lambda ct: ct[0])
    out: list[dict[str, Any]] = []
    while any(ranked.values()):
        for lst in ranked.values():
            if lst:
                out.append(lst.pop(0)[1])
    return out


class GemmBench:
    """One GEMM on random data, run through the kernel ABI as `cores` cores would run it:
    the tile range split evenly, each core's range timed alone and the slowest taken
    (so that the other tenants of a shared machine do not decide the winner)."""

    def __init__(self, spec: GemmSpec, cores: int, seed: int = 0) -> None:
        self.spec, self.cores = spec, max(1, int(cores))
        rng = np.random.default_rng(seed)
        s = spec

        def buf(n: int, t: str = "float32") -> Any:   # (t: a GemmSpec element type)
            dt = np_elem(t)
            a = aligned_empty(dt.itemsize * max(n, 1), 64).view(dt)
            a[:] = rng.standard_normal(a.size, dtype=np.float32).astype(dt)
            return a

        ra, ca = (s.K, s.M) if s.trans_a else (s.M, s.K)
        rb, cb = (s.N, s.K) if s.trans_b else (s.K, s.N)
        na = s.batch if s.a_batch_stride else 1
        nb = s.batch if s.b_batch_stride else 1
        self.A = buf((na - 1) * s.a_batch_stride + (ra - 1) * s.lda_ + ca, s.a_type)
        braw = buf((nb - 1) * s.b_batch_stride + (rb - 1) * s.ldb_ + cb, s.b_type)
        if s.b_prepacked:
            packed = prepack_b(s, braw)
            self.B = aligned_empty(packed.nbytes, 64).view(packed.dtype)
            self.B[:] = packed
        else:
            self.B = braw
        self.bias = None
        if s.bias:
            self.bias = buf((s.M - 1) * s.bias_row_stride + (s.N - 1) * s.bias_col_stride + 1,
                            s.bias_type)
        self.c_len = (s.batch - 1) * s.c_batch_stride_ + (s.M - 1) * s.ldc_ + s.N
        self.C = buf(self.c_len, s.c_type)

    def build(self, tuning: dict[str, Any] | None) -> Any:
        """(kernel, tiles, workspace) of the plan `tuning` (None: the default plan)."""
        plan = gemm_plan(self.spec, tuning)
        m = new_module("tune")
        emit_gemm(m, "cannc_tune_gemm", self.spec, tuning=tuning)
        fn = jit_kernel(m, "cannc_tune_gemm", speed_level=2)   # as the compiler builds it
        ws = aligned_empty(max(plan.ws_bytes, 64), 64)
        ptrs = [self.A.ctypes.data, self.B.ctypes.data]
        if self.bias is not None:
            ptrs.append(self.bias.ctypes.data)
        ptrs.append(self.C.ctypes.data)
        args = (ctypes.c_void_p * len(ptrs))(*ptrs)
        return _Built(fn, args, plan.num_tiles(self.spec.batch), ws)

    def result(self, k: _Built) -> Any:
        self.C[:] = 0.0
        k.run(0, k.tiles)
        return self.C[:self.c_len].astype(np.float32)

    def time_us(self, k: _Built, reps: int, blocks: int = 3) -> float:
        """µs of one call of the kernel on `cores` cores (the slowest core's range); each
        range runs `blocks` blocks of `reps` calls and the fastest block counts (other
        tenants of a shared machine only ever add time)."""
        T = k.tiles
        worst = 0.0
        for i in range(self.cores):
            lo, hi = i * T // self.cores, (i + 1) * T // self.cores
            if lo == hi:
                continue
            best = float("inf")
            for _ in range(blocks):
                t0 = time.perf_counter()
                for _ in range(reps):
                    k.run(lo, hi)
                best = min(best, (time.perf_counter() - t0) / reps)
            worst = max(worst, best)
        return worst * 1e6


class _Built:
    def __init__(self, fn: Any, args: Any, tiles: int, ws: Any) -> None:
        self.fn, self.args, self.tiles, self.ws = fn, args, tiles, ws
        self.ws_ptr = ws.ctypes.data

    def run(self, lo: int, hi: int) -> None:
        self.fn(self.args, lo, hi, self.ws_ptr)


def measure_pair(bench: GemmBench, base: _Built, cand: _Built, rounds: int = 5,
                 sample_us: float = 600.0) -> tuple[float, float]:
    """(base, cand) µs: the median of `rounds` samples of the base, and that divided by the
    median of the paired ratios base/cand (the rounds alternate which runs first, so the
    noise of a shared machine hits both sides of each pair alike)."""
    est = max(bench.time_us(base, 1, 1), bench.time_us(cand, 1, 1), 0.5)
    reps = max(1, min(10_000, int(sample_us / est)))
    tb, ratios = [], []
    for r in range(rounds):
        if r % 2 == 0:
            b, c = bench.time_us(base, reps), bench.time_us(cand, reps)
        else:
            c, b = bench.time_us(cand, reps), bench.time_us(base, reps)
        tb.append(b)
        ratios.append(b / c)
    base_us = statistics.median(tb)
    return base_us, base_us / statistics.median(ratios)


# ---------------------------------------------------------------------------
# the search
# ---------------------------------------------------------------------------

def gemm_label(sig: dict[str, Any]) -> str:
    """A GEMM signature in a few characters: ``4x[64x96x128] B^T +bias``."""
    s = f"{sig['M']}x{sig['N']}x{sig['K']}"
    if sig.get("batch", 1) > 1:
        s = f"{sig['batch']}x[{s}]"
    flags = [f for f, on in (("A^T", sig.get("trans_a")), ("B^T", sig.get("trans_b")),
                             ("B-prepacked", sig.get("b_prepacked")), ("+bias", sig.get("bias")),
                             ("+epilogue", sig.get("epilogue"))) if on]
    return " ".join([s] + flags)


def tune_gemm(sig: dict[str, Any], threads: int, deadline: float,
              progress: Callable[[str], None] = lambda s: None,
              min_speedup: float = 1.03) -> dict[str, Any]:
    """Measure the candidate plans of one GEMM (until `deadline`, a perf_counter time)
    against its default plan; a candidate wins when it is more than `min_speedup` times
    as fast (twice: once in the sweep, again side by side with more rounds).

    Returns {signature, gemm (its label), candidates, tried, wrong (candidates that
    computed something else), tuning (the winner, or None), default_us, best_us,
    speedup, existing (the tuning the cache held)}."""
    spec = gemm_spec_of(sig)
    bench = GemmBench(spec, threads)
    base = bench.build(None)
    ref = bench.result(base)
    atol = 1e-4 * max(1.0, spec.K ** 0.5) * 4
    cands = gemm_candidates(spec, threads)
    existing = lookup("gemm", sig)
    if existing and existing not in cands:
        cands.insert(0, existing)
    res: dict[str, Any] = {"signature": sig, "gemm": gemm_label(sig), "candidates": len(cands),
                           "tried": 0, "wrong": 0, "tuning": None, "default_us": None,
                           "best_us": None, "speedup": 1.0, "existing": existing}
    wins: list[tuple[float, dict[str, Any], float, float]] = []  # (speedup, tuning, base, cand)
    base_times: list[float] = []

    def trial(tun: dict[str, Any]) -> None:
        try:
            k = bench.build(tun)
        except (CanncError, ValueError, AssertionError):
            return
        res["tried"] += 1
        # (a narrow C: plans that sum in another order may round to the next value)
        rtol = 1e-3 if spec.c_type == "float32" else 2.0 ** -7
        if not np.allclose(bench.result(k), ref, rtol=rtol, atol=atol):
            res["wrong"] += 1   # never keep a plan that computes something else
            return
        tb, tc = measure_pair(bench, base, k)
        base_times.append(tb)
        wins.append((tb / tc, tun, tb, tc))

    for j, tun in enumerate(cands):
        if time.perf_counter() >= deadline:
            break
        progress(f"candidate {j + 1}/{len(cands)}")
        trial(tun)
    # the two best improvements on different knobs, together
    good = sorted((w for w in wins if w[0] > 1.0), key=lambda w: -w[0])
    if len(good) >= 2 and time.perf_counter() < deadline:
        a, b = good[0][1], next((w[1] for w in good[1:] if not set(w[1]) & set(good[0][1])), None)
        if b is not None:
            progress("combining the two best")
            res["candidates"] += 1
            trial({**a, **b})
    if not base_times:   # no candidate measured in the budget: the default stays
        res["default_us"] = res["best_us"] = measure_pair(bench, base, base, rounds=3)[0]
        return res
    res["default_us"] = float(np.median(base_times))
    speedup, tun, tb, tc = max(wins, key=lambda w: w[0])
    if speedup > min_speedup:
        # confirm side by side with more rounds: a lucky sample must not win
        progress("confirming the winner")
        tb, tc = measure_pair(bench, base, bench.build(tun), rounds=9)
        speedup = tb / tc
        res["default_us"] = tb
    if speedup > min_speedup:
        res.update(tuning=tun, best_us=tc, speedup=speedup)
    else:
        res.update(best_us=res["default_us"], speedup=1.0)
    return res


def gemm_items(kernels: Iterable[Kernel]) -> list[dict[str, Any]]:
    """The distinct GEMM signatures of a compiled model, the ones the cost model says take
    longest first: [{signature, kernels (their indices), predicted_us (their sum)}]."""
    found: dict[str, dict[str, Any]] = {}
    for i, k in enumerate(kernels):
        rec = k.notes.get("plan")
        if not (isinstance(rec, dict) and rec.get("kind") == "gemm"):
            continue
        key = json.dumps(rec["signature"], sort_keys=True)
        item = found.setdefault(key, {"signature": rec["signature"], "kernels": [],
                                      "predicted_us": 0.0})
        item["kernels"].append(i)
        item["predicted_us"] += float(k.notes.get("predicted_us", 0.0))
    return sorted(found.values(), key=lambda it: -it["predicted_us"])


def tune_gemms(kernels: Iterable[Kernel], threads: int, deadline: float,
               path: str | Path | None = None,
               progress: Callable[[str, bool], None] = lambda text, force: None,
               min_speedup: float = 1.03) -> list[dict[str, Any]]:
    """Tune every distinct GEMM of a compiled model (its kernels, annotated by the cost
    model) on `threads` threads until `deadline` (a perf_counter time), each an even
    share of the time left, and store the winners in the tuning cache at `path`
    (default: the configured one). A stored tuning that no longer beats the default
    is replaced by the default.

    Returns one dict per GEMM, longest predicted first: tune_gemm's result plus
    kernels, predicted_us, skipped (the budget was spent before it) and stored; a
    skipped one has only signature, kernels, predicted_us, gemm and skipped.
    `progress(text, force)` reports what is being measured (force: a new GEMM)."""
    items = gemm_items(kernels)
    results = []
    for i, it in enumerate(items):
        now = time.perf_counter()
        label = f"kernel {i + 1}/{len(items)} (GEMM {gemm_label(it['signature'])})"
        if now >= deadline:
            results.append({**it, "gemm": gemm_label(it["signature"]), "skipped": True})
            continue
        # an even share of what is left, so every kernel gets measured
        share_end = now + (deadline - now) / (len(items) - i)
        progress(label, True)
        r = tune_gemm(it["signature"], threads, share_end,
                      lambda s, label=label: progress(f"{label}: {s}", False),
                      min_speedup=min_speedup)
        r.update(kernels=it["kernels"], predicted_us=it["predicted_us"], skipped=False)
        if r["tuning"] is not None:
            store("gemm", it["signature"], r["tuning"], r["best_us"], path=path,
                         default_us=r["default_us"], speedup=r["speedup"], threads=threads)
            r["stored"] = True
        elif r["existing"]:
            # a stored tuning that no longer beats the default is replaced by the default
            store("gemm", it["signature"], {}, r["default_us"], path=path,
                         default_us=r["default_us"], speedup=1.0, threads=threads)
            r["stored"] = True
        else:
            r["stored"] = False
        results.append(r)
    return results
