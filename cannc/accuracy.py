"""The accuracy guard of reduced precision: `cannc.compile(model, precision="bf16",
accuracy={"feeds": [...], "rtol": r, "atol": a})`.

It compiles the model in float32 (the reference) and in the reduced precision, runs the
feeds through both, and while the reduced outputs are out of tolerance moves nodes back to
float32 — only the nodes that cause it. The search is a bisection over the reduced nodes
in graph order (as onnxruntime's auto_mixed_precision does on GPUs): the shortest prefix
of the candidates whose move to float32 brings the error within tolerance ends in a node
that is needed; that node stays float32, and the search repeats over the candidates
before it until the whole model is within tolerance. Each culprit costs about log2(nodes)
compiles, and kernels that did not change come from the object cache.

Tolerances: ``metric="allclose"`` (the default) asks |reduced - fp32| <= atol + rtol *
|fp32| for every element of every output; ``metric="cosine"`` asks the cosine similarity
of every output with its float32 value to be at least ``min_cosine`` (default 0.999).
The report (`Session.accuracy_report`, and `Session.inspect()["accuracy"]`) names the
nodes moved and the error before and after.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import CanncError

METRICS = ("allclose", "cosine")
NARROW = ("bf16", "fp16")
_KEYS = ("feeds", "rtol", "atol", "metric", "min_cosine", "max_compiles")


@dataclass(frozen=True)
class Tolerance:
    metric: str = "allclose"
    rtol: float = 1e-2
    atol: float = 1e-3
    min_cosine: float = 0.999


def output_error(got: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Max abs error, max rel error (over |ref| > 0) and cosine similarity of one output."""
    g = np.asarray(got, dtype=np.float64).ravel()
    r = np.asarray(ref, dtype=np.float64).ravel()
    if g.size == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "cosine": 1.0}
    diff = np.abs(g - r)
    finite = np.isfinite(diff)
    same_nonfinite = ~finite & ((g == r) | (np.isnan(g) & np.isnan(r)))
    diff = np.where(same_nonfinite, 0.0, diff)
    nz = np.abs(r) > 0
    rel = float(np.max(diff[nz] / np.abs(r[nz]))) if nz.any() else 0.0
    ng, nr = float(np.linalg.norm(np.where(same_nonfinite, 0, g))), float(
        np.linalg.norm(np.where(same_nonfinite, 0, r)))
    if ng == 0.0 and nr == 0.0:
        cos = 1.0
    elif ng == 0.0 or nr == 0.0 or not (np.isfinite(ng) and np.isfinite(nr)):
        cos = 0.0
    else:
        cos = float(np.dot(np.where(same_nonfinite, 0, g), np.where(same_nonfinite, 0, r))
                    / (ng * nr))
    return {"max_abs": float(np.max(diff)), "max_rel": rel, "cosine": cos}


def within(got: np.ndarray, ref: np.ndarray, tol: Tolerance) -> bool:
    if tol.metric == "cosine":
        return output_error(got, ref)["cosine"] >= tol.min_cosine
    g = np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if g.shape != r.shape:
        return False
    return bool(np.all(np.isclose(g, r, rtol=tol.rtol, atol=tol.atol, equal_nan=True)))


@dataclass
class GuardResult:
    keep_fp32: list[str]
    report: dict[str, Any] = field(default_factory=dict)


def parse_accuracy(spec: Any) -> tuple[list[dict[str, Any]], Tolerance, int]:
    """`accuracy=` as a user gives it, checked: (feeds, tolerance, compile budget)."""
    if not isinstance(spec, dict):
        raise CanncError(f"accuracy must be a dict like {{'feeds': [feed dicts], 'rtol': r, "
                         f"'atol': a}}, got {type(spec).__name__}")
    unknown = sorted(set(map(str, spec)) - set(_KEYS))
    if unknown:
        raise CanncError(f"unknown accuracy option(s) {', '.join(unknown)}; the options are "
                         f"{', '.join(_KEYS)}")
    feeds = spec.get("feeds")
    if isinstance(feeds, dict):
        feeds = [feeds]
    if not isinstance(feeds, (list, tuple)) or not feeds or not all(
            isinstance(f, dict) for f in feeds):
        raise CanncError("accuracy['feeds'] must be a non-empty list of feed dicts "
                         "({input name: array}), as Session.run takes")
    metric = spec.get("metric", "allclose")
    if metric not in METRICS:
        raise CanncError(f"unknown accuracy metric {metric!r}; choose one of "
                         f"{', '.join(METRICS)}")
    kw: dict[str, Any] = {"metric": metric}
    for key in ("rtol", "atol", "min_cosine"):
        if key in spec:
            v = spec[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise CanncError(f"accuracy[{key!r}] must be a non-negative number, got {v!r}")
            kw[key] = float(v)
    budget = spec.get("max_compiles", 64)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise CanncError(f"accuracy['max_compiles'] must be a positive integer, got {budget!r}")
    return list(feeds), Tolerance(**kw), budget


def search(candidates: Sequence[str], passes: Callable[[set[str]], bool],
           budget: int) -> tuple[list[str], int, bool]:
    """The nodes to keep in float32: (kept, trials used, whether within tolerance).
    `passes(keep)` says whether the model is within tolerance with `keep` in float32;
    with every candidate kept it is assumed to be (that is the float32 model)."""
    keep: set[str] = set()
    trials = 0
    remaining = list(candidates)
    while True:
        if trials >= budget:   # out of budget: what is known to pass (all not cleared)
            return [c for c in candidates if c in keep or c in remaining], trials, True
        trials += 1
        if passes(keep):
            return [c for c in candidates if c in keep], trials, True
        if not remaining:
            return [c for c in candidates if c in keep], trials, False
        lo, hi = 0, len(remaining)        # keep | remaining[:hi] passes, [:lo] does not
        while hi - lo > 1 and trials < budget:
            mid = (lo + hi) // 2
            trials += 1
            if passes(keep | set(remaining[:mid])):
                hi = mid
            else:
                lo = mid
        keep.add(remaining[hi - 1])
        remaining = remaining[:hi - 1]


def candidates(sess: Any) -> list[str]:
    """The reduced nodes the search may move, most likely culprits first. A reduced value
    is rounded only where a kernel stores it narrow (a fused chain computes in float32
    registers) and where a contraction narrows its operands; so first the ONNX nodes whose
    narrow results are stored (in graph order), then the other reduced non-contractions,
    then the contractions."""
    pm = sess.precision_map()
    stored: list[str] = []
    for prog in sess.programs.values():
        g = prog.spec.graph
        for n in g.nodes():
            for v in n.outputs:          # what the kernel stores
                t = g.values.get(v) if v else None
                if t is None or np.dtype(t.dtype).name not in ("bfloat16", "float16"):
                    continue
                for b in n.attrs.get("body") or [n]:
                    if v not in b.outputs:
                        continue
                    for name in b.attrs.get("fused_from", [b.name]):
                        if pm.get(name) in NARROW and name not in stored:
                            stored.append(name)
    order = {n.name: i for i, n in enumerate(sess.graph.nodes())}
    contractions = set(sess.contraction_nodes())
    stored = sorted((n for n in stored if n not in contractions), key=order.get)
    rest = [n for n in order if pm[n] in NARROW and n not in stored]
    return stored + [n for n in rest if n not in contractions] + \
        [n for n in rest if n in contractions]


def accuracy_guard(session: Any, spec: Any) -> GuardResult:
    """Run the guard for a Session being built (its model, options and cores): the nodes
    its precision policy must keep in float32 to meet `spec`, and the report."""
    feeds, tol, budget = parse_accuracy(spec)
    amp = session.options.pass_options.get("mixed_precision")
    if amp is None or amp.get("precision", "fp32") == "fp32":
        raise CanncError("accuracy= checks a reduced precision: give precision='bf16' or "
                         "'fp16' with it")
    t0 = time.perf_counter()
    make = type(session)

    def build(keep: Sequence[str]) -> Any:
        opts = {k: v for k, v in session.options.pass_options.items()
                if k != "mixed_precision"}
        lists = {k: amp[k] for k in ("allow", "deny", "follow") if amp.get(k)}
        return make(session._proto, cores=session.cores, pipeline=session.options.pipeline,
                    eager=False, cache=session.options.cache, fusion=session.options.fusion,
                    pass_options=opts, precision=amp["precision"], precision_lists=lists,
                    keep_fp32=list(amp.get("keep_fp32", ())) + list(keep))

    ref_sess = make(session._proto, cores=session.cores, pipeline=session.options.pipeline,
                    eager=False, cache=session.options.cache, fusion=session.options.fusion,
                    pass_options={k: v for k, v in session.options.pass_options.items()
                                  if k != "mixed_precision"})
    refs = []
    for i, f in enumerate(feeds):
        try:
            refs.append(ref_sess.run(None, f))
        except CanncError as e:   # the same error, saying which feed
            raise type(e)(f"accuracy['feeds'][{i}]: {e}") from e
    names = [o.name for o in ref_sess.get_outputs()]

    def errors(sess: Any) -> tuple[bool, dict[str, dict[str, float]]]:
        ok, worst = True, {}
        for f, ref in zip(feeds, refs):
            for name, got, r in zip(names, sess.run(None, f), ref):
                if np.dtype(np.asarray(r).dtype).kind not in "fc" and \
                        np.asarray(r).dtype.name != "bfloat16":
                    ok &= bool(np.array_equal(got, r))
                    continue
                e = output_error(got, r)
                w = worst.setdefault(name, {"max_abs": 0.0, "max_rel": 0.0, "cosine": 1.0})
                w["max_abs"] = max(w["max_abs"], e["max_abs"])
                w["max_rel"] = max(w["max_rel"], e["max_rel"])
                w["cosine"] = min(w["cosine"], e["cosine"])
                ok &= within(got, r, tol)
        return ok, worst

    first = build([])
    ok0, before = errors(first)
    reduced = candidates(first)
    report: dict[str, Any] = {"metric": tol.metric, "rtol": tol.rtol, "atol": tol.atol,
                              "min_cosine": tol.min_cosine, "feeds": len(feeds),
                              "error_before": before, "within_before": ok0,
                              "reduced_nodes": len(reduced)}
    if ok0:
        report.update(moved_to_fp32=[], error_after=before, within_after=True, trials=1,
                      seconds=time.perf_counter() - t0)
        return GuardResult([], report)

    cache: dict[frozenset[str], bool] = {}

    def passes(keep: set[str]) -> bool:
        key = frozenset(keep)
        if key not in cache:
            cache[key] = errors(build(sorted(keep)))[0] if keep else ok0
        return cache[key]

    keep, trials, ok = search(reduced, passes, budget)
    after = errors(build(keep))[1]
    report.update(moved_to_fp32=keep, error_after=after, within_after=ok, trials=trials + 1,
                  seconds=time.perf_counter() - t0)
    return GuardResult(keep, report)
