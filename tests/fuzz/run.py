"""Differential checking of random graphs: cannc against onnxruntime.

`check(case)` compiles a generated model with cannc, runs it on the case's feeds and
compares every output with onnxruntime (float32: rtol 1e-4, atol 1e-5; float16: rtol and
atol 1e-2, about ten float16 epsilons (9.8e-4), for chains of up to ~6 float16 ops each
rounding once in one implementation and maybe not in the other (fused); ints and bools
exact).
A failing case is written as a reproducer: `<dir>/<kind>-seed<N>/model.onnx`,
`feeds.npz` and `report.txt` (the error or the worst mismatch, and the op list).

A mismatch that onnxruntime itself shows when its float inputs move by a few ulps is
`ill_conditioned`, not a failure: random graphs make chains such as Sin(Pow(x, -3)) with x
near 0.04, where one ulp of Pow (a legitimate rounding difference) is 0.001 after the Sin.
Each differing element must lie within twice onnxruntime's own spread under those
perturbations; the case is still saved and counted, so a campaign shows how many it had.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import cannc
from cannc.errors import CanncError

from .gen import Case, random_model

RTOL, ATOL = 1e-4, 1e-5
F16_TOL = 1e-2


@dataclass
class Result:
    seed: int
    # ok | mismatch | error (a cannc error) | crash (any other) | invalid (onnxruntime
    # refuses the model) | ort_bug (cannc matches onnxruntime without its graph
    # optimisations, which disagree with it: e.g. Transpose -> MatMul with a 1-D B) |
    # ill_conditioned (onnxruntime moves as far when its inputs move by a few ulps)
    kind: str
    detail: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.kind in ("mismatch", "error", "crash")


def ort_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
                optimize: bool = True) -> list[np.ndarray]:
    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _tolerances(e: np.ndarray, rtol: float, atol: float) -> tuple[float, float]:
    return (max(rtol, F16_TOL), max(atol, F16_TOL)) if e.dtype == np.float16 else (rtol, atol)


def compare(got: list[np.ndarray], expected: list[np.ndarray], names: list[str],
            rtol: float = RTOL, atol: float = ATOL) -> str:
    """'' when every output matches, else what differs first."""
    if len(got) != len(expected):
        return f"{len(got)} outputs, onnxruntime gives {len(expected)}"
    for g, e, n in zip(got, expected, names):
        g, e = np.asarray(g), np.asarray(e)
        if g.dtype != e.dtype or g.shape != e.shape:
            return f"{n}: {g.dtype}{g.shape} != onnxruntime's {e.dtype}{e.shape}"
        if e.dtype.kind in "fc":
            rt, at = _tolerances(e, rtol, atol)
            g, e = g.astype(np.float64), e.astype(np.float64)
            bad = ~np.isclose(g, e, rtol=rt, atol=at, equal_nan=True)
            if bad.any():
                i = np.unravel_index(int(np.argmax(np.where(bad, np.abs(g - e), -1))), e.shape)
                return (f"{n}: {int(bad.sum())}/{e.size} elements differ, worst at {i}: "
                        f"{g[i]!r} vs onnxruntime {e[i]!r} (max abs diff "
                        f"{float(np.nanmax(np.abs(g - e)[bad])):.3g})")
        elif not np.array_equal(g, e):
            return f"{n}: integer values differ"
    return ""


ULP_TRIALS = 4


def _nudged(model: onnx.ModelProto, feeds: dict[str, np.ndarray], rng: np.random.Generator
            ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model and feeds with every float32 input and initializer element moved by -2..2
    ulps at random."""
    def nudge(a: np.ndarray) -> np.ndarray:
        if a.dtype != np.float32 or not a.size:
            return a
        steps = rng.integers(-2, 3, a.shape).astype(np.float32)
        return (a * (1 + steps * np.float32(2.0 ** -23))).astype(np.float32)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        a = onnx.numpy_helper.to_array(t)
        if a.dtype == np.float32:
            t.CopyFrom(onnx.numpy_helper.from_array(nudge(a), t.name))
    return m, {k: nudge(v) for k, v in feeds.items()}


def ill_conditioned(case: Case, got: list[np.ndarray], expected: list[np.ndarray],
                    trials: int = ULP_TRIALS) -> bool:
    """True when every element where cannc and onnxruntime differ is within twice the spread
    of onnxruntime's own results over `trials` runs on inputs moved by a few ulps."""
    rng = np.random.default_rng(case.seed & 0xFFFFFFFF)
    spread = [np.zeros(np.shape(e)) for e in expected]
    for _ in range(trials):
        m, feeds = _nudged(case.model, case.feeds, rng)
        for i, (e, n) in enumerate(zip(expected, ort_outputs(m, feeds))):
            if np.asarray(e).dtype.kind == "f" and np.shape(n) == np.shape(e):
                d = np.abs(np.asarray(n, np.float64) - np.asarray(e, np.float64))
                spread[i] = np.fmax(spread[i], np.nan_to_num(d, nan=np.inf))
    for g, e, sp in zip(got, expected, spread):
        g, e = np.asarray(g), np.asarray(e)
        if e.dtype.kind != "f" or g.shape != e.shape:
            if not np.array_equal(g, e):
                return False
            continue
        rt, at = _tolerances(e, RTOL, ATOL)
        g64, e64 = g.astype(np.float64), e.astype(np.float64)
        bad = ~np.isclose(g64, e64, rtol=rt, atol=at, equal_nan=True)
        if (np.abs(g64 - e64)[bad] > 2 * sp[bad] + at).any():
            return False
    return True


def check(case: Case, cores: int = 2) -> Result:
    t0 = time.perf_counter()
    names = [o.name for o in case.model.graph.output]
    try:
        onnx.checker.check_model(case.model)
        expected = ort_outputs(case.model, case.feeds)
    except Exception as e:     # the generator made something onnxruntime refuses
        return Result(case.seed, "invalid", f"{type(e).__name__}: {e}",
                      time.perf_counter() - t0)
    try:
        sess = cannc.compile(case.model, cores=cores,
                             shapes={k: v.shape for k, v in case.feeds.items()})
        got = sess.run(None, case.feeds)
    except CanncError as e:
        return Result(case.seed, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                      time.perf_counter() - t0)
    except Exception as e:
        return Result(case.seed, "crash", f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                      time.perf_counter() - t0)
    diff = compare(got, expected, names)
    if diff:
        plain = ort_outputs(case.model, case.feeds, optimize=False)
        if not compare(got, plain, names) and compare(expected, plain, names):
            return Result(case.seed, "ort_bug", f"onnxruntime's optimised graph: {diff}",
                          time.perf_counter() - t0)
        if ill_conditioned(case, got, expected):
            return Result(case.seed, "ill_conditioned",
                          f"within onnxruntime's spread under ulp-sized input changes: {diff}",
                          time.perf_counter() - t0)
    return Result(case.seed, "mismatch" if diff else "ok", diff, time.perf_counter() - t0)


def save_reproducer(case: Case, res: Result, out_dir: str | os.PathLike) -> Path:
    d = Path(out_dir) / f"{res.kind}-seed{case.seed}"
    d.mkdir(parents=True, exist_ok=True)
    onnx.save(case.model, str(d / "model.onnx"))
    np.savez(d / "feeds.npz", **case.feeds)
    (d / "report.txt").write_text(
        f"seed {case.seed}: {res.kind}\nops: {' '.join(case.ops)}\n\n{res.detail}\n\n"
        f"{onnx.helper.printable_graph(case.model.graph)}\n")
    return d


def load_reproducer(d: str | os.PathLike) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    d = Path(d)
    with np.load(d / "feeds.npz") as f:
        feeds = {k: f[k] for k in f.files}
    return onnx.load(str(d / "model.onnx")), feeds


def campaign(seeds, out_dir: str | None = None, deadline: float | None = None,
             cores: int = 2, log=print, gen=random_model) -> list[Result]:
    """Check every seed (until `deadline`, a time.monotonic() value); failing cases are
    saved under `out_dir`."""
    results = []
    for seed in seeds:
        if deadline is not None and time.monotonic() > deadline:
            break
        try:
            case = gen(seed)
        except Exception as e:
            results.append(Result(seed, "invalid", f"generator: {type(e).__name__}: {e}"))
            continue
        res = check(case, cores)
        results.append(res)
        if res.failed or res.kind in ("ort_bug", "ill_conditioned"):
            where = save_reproducer(case, res, out_dir) if out_dir else ""
            log(f"seed {seed}: {res.kind}: {res.detail.splitlines()[0][:300]} {where}")
    return results


def summary(results: list[Result]) -> str:
    kinds: dict[str, int] = {}
    for r in results:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    t = sum(r.seconds for r in results)
    return (f"{len(results)} graphs in {t:.1f} s: "
            + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))


def prune(model: onnx.ModelProto, outputs: list[str]) -> onnx.ModelProto:
    """`model` with only these outputs, and only the nodes, inputs and initializers they
    need."""
    g = model.graph
    need = set(outputs)
    keep = []
    for nd in reversed(list(g.node)):
        if any(o in need for o in nd.output):
            keep.append(nd)
            need.update(v for v in nd.input if v)
    outs = [o for o in g.output if o.name in outputs]
    m = onnx.helper.make_model(
        onnx.helper.make_graph(list(reversed(keep)), g.name,
                               [i for i in g.input if i.name in need],
                               sorted(outs, key=lambda o: outputs.index(o.name)),
                               initializer=[t for t in g.initializer if t.name in need]),
        opset_imports=list(model.opset_import))
    m.ir_version = model.ir_version
    return m


def shrink(case: Case, cores: int = 2, kinds: tuple[str, ...] | None = None) -> Case:
    """A smaller case that fails the same way: graph outputs dropped one at a time (and
    what only they needed) while the failure stays of the same kind."""
    first = check(case, cores)
    kinds = kinds or (first.kind,)
    cur = case
    changed = True
    while changed:
        changed = False
        names = [o.name for o in cur.model.graph.output]
        for o in names:
            if len(names) == 1:
                break
            m = prune(cur.model, [n for n in names if n != o])
            feeds = {i.name: cur.feeds[i.name] for i in m.graph.input}
            cand = Case(cur.seed, m, feeds, cur.ops)
            if check(cand, cores).kind in kinds:
                cur, changed = cand, True
                break
    return cur
