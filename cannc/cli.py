"""The `cannc` command line.

    cannc compile model.onnx -o model.cnc [--cores N] [--shape x=1x256] [--dump-after PASS]
    cannc run model.cnc --check                 # cannc vs onnxruntime on the same inputs
    cannc check model.onnx                      # every node: supported, folded, or why not
    cannc inspect model.onnx --json             # kernels, FLOPs, bytes, memory plan, passes
    cannc bench model.onnx --cores 4 [--ep]     # cannc, onnxruntime (+ cannc's EP), each
                                                # in its own process
    cannc tune model.onnx --budget 60           # measure GEMM tilings, keep winners (cache)
    cannc ops                                   # the supported ops

Every cannc.CanncError is reported as `error: <message>` on stderr with exit code 2
(`--debug` adds the traceback). `run --check` exits 1 when an output differs from
onnxruntime, `check` exits 1 when a node cannot be compiled, `bench` exits 1 when an
engine's outputs differ from ORT CPU's.

This module parses and prints; the reports are the library's (`cannc.check` /
`cannc.compiler.report`, `Session.inspect` / `cannc.compiler.inspect`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import config, progress
from ._version import __version__
from .compiler.inspect import annotate_profile
from .compiler.pipeline import DEFAULT_PIPELINE, PIPELINES
from .compiler.report import support_report
from .compiler.shapes import Shapes, complete_input_shapes, type_string
from .compiler.support import supported_ops
from .config import fmt_bytes
from .custom_op import load_ops_file
from .errors import CacheError, CanncError, InputError, ModelError
from .passes.precision import PRECISIONS
from .progress import show_progress
from .schedule.machine import cpu_model, usable_cores
from .session import Session, load
from .sidebyside import LABELS, bench, compare, ort_run, ort_session, referee_summary

# onnxruntime is imported inside the verbs that use it (run --check, bench): it takes a
# few tenths of a second to import, which `cannc check` or `cannc --version` need not wait.


class CliError(CanncError):
    """A command-line problem argparse cannot see (an unknown pass name, ORT refusing a model)."""


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return v


# ---------------------------------------------------------------------------------------
# argument types
# ---------------------------------------------------------------------------------------

def _shape_arg(text: str) -> tuple[str, tuple[int, ...]]:
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=DIMS (e.g. x=1x128), got {text!r}")
    dims = dims.strip()
    if dims in ("", "()", "scalar"):
        return name, ()
    try:
        shape = tuple(int(d) for d in dims.replace(",", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"dims must be integers separated by 'x' (e.g. {name}=1x128), got {dims!r}") from None
    if any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"dims must be >= 0, got {dims!r}")
    return name, shape


def _input_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=FILE.npy, got {text!r}")
    return name, path


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


# ---------------------------------------------------------------------------------------
# opening models and making inputs
# ---------------------------------------------------------------------------------------

def _is_artifact(path: str) -> bool:
    p = Path(path)
    return p.suffix == ".cnc" or (p.is_file() and zipfile.is_zipfile(p))


def _require_file(path: str) -> None:
    if not Path(path).is_file():
        raise ModelError(f"model file not found: {path}")


def _onnx_source(path: str) -> str | bytes:
    """What onnxruntime (and the frontend) should read: the path of an .onnx model,
    or the bytes of the model stored inside a .cnc artifact."""
    if not _is_artifact(path):
        return path
    try:
        with zipfile.ZipFile(path) as z:
            return z.read("model.onnx")
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise CacheError(f"{path} is not a valid cannc artifact: {e}") from e


def _open(path: str, *, cores: int | None, pipeline: str = "O1",
          dump_after: Sequence[str] = (), fusion: Any = True,
          precision: dict[str, Any] | None = None) -> Any:
    """A Session for an ONNX model (not yet specialised) or a loaded .cnc artifact (which
    keeps the precision it was compiled with)."""
    _require_file(path)
    if _is_artifact(path):
        if precision and precision.get("precision", "fp32") != "fp32":
            raise CliError(f"{path} is a compiled artifact: its precision was chosen when it "
                           "was compiled (--precision applies to .onnx models)")
        return load(path, cores=cores)
    return Session(path, cores=cores, pipeline=pipeline, dump_after=list(dump_after),
                   eager=False, fusion=fusion, **(precision or {}))


def _precision_opt(args: argparse.Namespace, sess_inputs: bool = False) -> dict[str, Any]:
    """compile()'s precision options from --precision, --allow/--deny/--follow and
    --keep-fp32 (and, for compile, the accuracy guard's --accuracy-feeds)."""
    out: dict[str, Any] = {"precision": getattr(args, "precision", None) or "fp32"}
    lists = {k: getattr(args, k) for k in ("allow", "deny", "follow") if getattr(args, k, None)}
    if lists:
        out["precision_lists"] = lists
    if getattr(args, "keep_fp32", None):
        out["keep_fp32"] = list(args.keep_fp32)
    feeds = getattr(args, "accuracy_feeds", None)
    if feeds:
        acc: dict[str, Any] = {"feeds": _read_feeds(feeds)}
        for key in ("rtol", "atol", "min_cosine"):
            if getattr(args, key, None) is not None:
                acc[key] = getattr(args, key)
        if getattr(args, "min_cosine", None) is not None:
            acc["metric"] = "cosine"
        out["accuracy"] = acc
    return out


def _read_feeds(path: str) -> list[dict[str, np.ndarray]]:
    """An .npz of feeds: arrays named INPUT (one feed) or K/INPUT (feed K = 0, 1, ...)."""
    _require_file(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:
        raise CliError(f"cannot read the accuracy feeds {path}: {e}") from e
    if not arrays:
        raise CliError(f"{path} holds no arrays")
    if all("/" in k for k in arrays):
        feeds: dict[str, dict[str, np.ndarray]] = {}
        for k, v in arrays.items():
            i, _, name = k.partition("/")
            feeds.setdefault(i, {})[name] = v
        return [feeds[i] for i in sorted(feeds, key=lambda x: (len(x), x))]
    return [arrays]


def _fusion_opt(args: argparse.Namespace) -> Any:
    if getattr(args, "no_fusion", False):
        return False
    return getattr(args, "fusion_switch", None) or True


def _specialize(sess: Any, given: Shapes) -> Any:
    return sess.specialize(complete_input_shapes(sess.io, given, list(sess.programs)))


def _key_of(sess: Any, prog: Any) -> tuple:
    """The input shapes a program was specialised for."""
    return next(k for k, p in sess.programs.items() if p is prog)


def _random_array(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...],
                  int_high: int) -> np.ndarray:
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.kind in "iu":
        return rng.integers(0, int_high, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _make_feeds(sess: Any, files: list[tuple[str, str]], shapes: Shapes, seed: int,
                int_high: int) -> dict[str, np.ndarray]:
    """Inputs read from .npy files, the rest random (floats: standard normal; ints: uniform
    in [0, int_high) so ids and masks stay valid; bools: fair coin)."""
    names = sess.io.inputs
    unknown = sorted({n for n, _ in files} - set(names))
    if unknown:
        raise InputError(f"--input given for unknown input(s) {unknown}; "
                         f"the model's inputs are {names}")
    arrays = {}
    for name, path in files:
        try:
            arrays[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise InputError(f"cannot read input '{name}' from {path}: {e}") from e
    given = {**shapes, **{n: a.shape for n, a in arrays.items()}}
    full = complete_input_shapes(sess.io, given, list(sess.programs))
    rng = np.random.default_rng(seed)
    feeds = {}
    for name in names:
        if name in arrays:
            feeds[name] = arrays[name]
        else:
            dt = np.dtype(sess.io.values[name].dtype)
            feeds[name] = _random_array(rng, dt, full[name], int_high)
    return feeds


# ---------------------------------------------------------------------------------------
# formatting
# ---------------------------------------------------------------------------------------

def _fmt_count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _fmt_shapes(shapes: Shapes) -> str:
    return ", ".join(f"{n}={'x'.join(map(str, s)) or 'scalar'}" for n, s in shapes.items())


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
           right: Sequence[int] = ()) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  " + "  ".join(parts).rstrip())
    return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str))


def _stats(a: np.ndarray) -> str:
    if a.size == 0:
        return "empty"
    if a.dtype == np.bool_:
        return f"true {int(a.sum())}/{a.size}"
    if a.dtype.kind in "iu":
        return f"min {a.min()}  max {a.max()}"
    f = a.astype(np.float64)
    nan = int(np.isnan(f).sum())
    finite = f[np.isfinite(f)]
    if finite.size == 0:
        return f"no finite values (nan {nan})"
    s = (f"min {finite.min():.4g}  max {finite.max():.4g}  mean {finite.mean():.4g}  "
         f"std {finite.std():.4g}")
    return s + (f"  nan {nan}" if nan else "")


# ---------------------------------------------------------------------------------------
# compile
# ---------------------------------------------------------------------------------------

def cmd_compile(args: argparse.Namespace) -> int:
    passes = list(args.dump_after or [])
    bad = [p for p in passes if p not in PIPELINES[args.pipeline] and p != "all"]
    if bad:
        raise CliError(f"unknown pass(es) {bad} for --dump-after; pipeline {args.pipeline} "
                       f"runs: {', '.join(PIPELINES[args.pipeline])} (or 'all')")
    with _dump_dir(passes, args.dump_dir) as dump_dir:
        sess = _open(args.model, cores=args.cores, pipeline=args.pipeline, dump_after=passes,
                     fusion=_fusion_opt(args), precision=_precision_opt(args))
        prog = _specialize(sess, dict(args.shape or []))
        if passes and args.dump_dir is None:
            for name in passes if "all" not in passes else PIPELINES[args.pipeline]:
                f = Path(dump_dir) / f"after_{name}.txt"
                if f.exists():
                    print(f"// ---- IR after pass '{name}' ----\n{f.read_text()}")
    out = Path(args.output)
    sess.save(out)
    spec = prog.spec
    shapes = dict(zip(sess.io.inputs, _key_of(sess, prog)))
    plan = prog.plan
    print(f"compiled {args.model} -> {out}: {len(spec.kernels)} kernel(s) from "
          f"{sess.graph.num_nodes()} ONNX node(s) for {_fmt_shapes(shapes) or 'no inputs'} on "
          f"{sess.cores} core(s), pipeline {sess.options.pipeline}, "
          f"in {spec.compile_seconds:.2f} s "
          f"(object cache: {spec.cache_hits} hit(s), {spec.cache_misses} miss(es)); "
          f"arena {fmt_bytes(plan.arena_bytes)} (naive {fmt_bytes(plan.naive_bytes)}), "
          f"weights {fmt_bytes(prog.weights_bytes)}; artifact {fmt_bytes(out.stat().st_size)}.")
    if passes and args.dump_dir is not None:
        print(f"IR dumps written to {args.dump_dir}")
    _print_precision(sess.precision_map(), sess.accuracy_report)
    return 0


def _print_precision(pm: dict[str, str], acc: dict[str, Any] | None, width: int = 110) -> None:
    """The precision of the nodes (when not all float32) and what the accuracy guard did."""
    if all(p in ("fp32", "folded") for p in pm.values()):
        return
    by: dict[str, list[str]] = {}
    for n, p in pm.items():
        by.setdefault(p, []).append(n)
    print("precision: " + "; ".join(f"{p} {len(ns)} node(s): {_clip(', '.join(ns), width)}"
                                    for p, ns in sorted(by.items())))
    if acc is not None:
        def worst(errs: dict[str, dict[str, float]]) -> str:
            if not errs:
                return "-"
            return (f"max abs {max(e['max_abs'] for e in errs.values()):.3g}, max rel "
                    f"{max(e['max_rel'] for e in errs.values()):.3g}, min cosine "
                    f"{min(e['cosine'] for e in errs.values()):.6f}")
        moved = acc.get("moved_to_fp32", [])
        print(f"accuracy guard ({acc['metric']}, rtol {acc['rtol']:g}, atol {acc['atol']:g}, "
              f"{acc['feeds']} feed(s)): before {worst(acc['error_before'])}; "
              f"moved {len(moved)} node(s) to fp32"
              + (f" ({_clip(', '.join(moved), width)})" if moved else "")
              + f"; after {worst(acc['error_after'])}"
              + ("" if acc.get("within_after", True) else " - STILL OUT OF TOLERANCE")
              + f"; {acc['trials']} trial(s), {acc['seconds']:.1f} s")


@contextlib.contextmanager
def _dump_dir(passes: list[str], given: str | None) -> Iterator[str | None]:
    """--dump-after needs a dump directory (the pass manager writes its dumps there): the
    one given with --dump-dir, else a temporary one whose IR dumps the caller prints."""
    if not passes:
        yield None
        return
    saved = config.DUMP_DIR
    with contextlib.ExitStack() as stack:
        if given is None:
            given = stack.enter_context(tempfile.TemporaryDirectory(prefix="cannc-dump-"))
        config.DUMP_DIR = given
        try:
            yield given
        finally:
            config.DUMP_DIR = saved


# ---------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    sess = _open(args.model, cores=args.cores, fusion=_fusion_opt(args),
                 precision=_precision_opt(args))
    feeds = _make_feeds(sess, list(args.input or []), dict(args.shape or []), args.seed,
                        args.int_high)
    before = set(sess.programs)
    t0 = time.perf_counter()
    outs = sess.run(None, feeds)
    dt = time.perf_counter() - t0
    key = tuple(tuple(int(d) for d in feeds[n].shape) for n in sess.io.inputs)
    compiled = key not in before
    print(f"{args.model}: inputs {_fmt_shapes({n: a.shape for n, a in feeds.items()})}; "
          f"{sess.cores} core(s); run {dt * 1e3:.2f} ms"
          + (f" (includes compiling, {sess.programs[key].spec.compile_seconds:.2f} s)"
             if compiled else ""))
    names = sess.io.outputs
    print(_table(["output", "type", "stats"],
                 [[n, type_string(o.dtype, o.shape), _stats(o)] for n, o in zip(names, outs)]))
    if args.save_outputs:
        d = Path(args.save_outputs)
        d.mkdir(parents=True, exist_ok=True)
        for n, o in zip(names, outs):
            np.save(d / (_safe_name(n) + ".npy"), o)
        print(f"outputs saved to {d}/")
    if not args.check:
        return 0
    import onnxruntime as ort

    expected = ort_run(ort_session(_onnx_source(args.model), sess.cores), feeds)
    results = [compare(n, g, e, args.rtol, args.atol) for n, g, e in zip(names, outs, expected)]
    print(f"check against onnxruntime {ort.__version__} (CPUExecutionProvider):")
    rows = []
    for r in results:
        verdict = "PASS" if r["ok"] else f"FAIL ({r['problem']})"
        tol = f"rtol {r['rtol']:g} atol {r['atol']:g}" if "rtol" in r else "exact"
        rows.append([r["name"], f"{r['max_abs']:.3g}", f"{r['max_rel']:.3g}", tol, verdict])
    print(_table(["output", "max abs err", "max rel err", "tolerance", "result"], rows,
                 right=(1, 2)))
    failed = [r["name"] for r in results if not r["ok"]]
    if failed:
        print(f"FAIL: {len(failed)} of {len(results)} output(s) differ: {failed}")
        return 1
    print(f"PASS: all {len(results)} output(s) match onnxruntime")
    return 0


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip(".") or "output"


# ---------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------

_STATUS_TEXT = {"ok": "ok", "folded": "ok (folded at compile time)",
                "view": "ok (view: shares its input's buffer)",
                "unused": "ok (nothing needs it: removed)", "rewritten": "ok (rewritten by a pass)"}


def cmd_check(args: argparse.Namespace) -> int:
    _require_file(args.model)
    rep = support_report(_onnx_source(args.model), dict(args.shape or []), args.pipeline,
                         name=args.model).to_dict()
    if args.json:
        _print_json(rep)
    else:
        print(f"{args.model}: opsets {rep['opsets']}; inputs "
              + (", ".join(f"{n}: {t}" for n, t in rep["inputs"].items()) or "none"))
        rows = [[i, r["name"] + (" (inserted)" if r.get("inserted_by_compiler") else ""),
                 r["op"], r["domain"], r["opset"], ", ".join(d or "-" for d in r["input_dtypes"]),
                 _STATUS_TEXT.get(r["status"], f"UNSUPPORTED: {r['reason']}")]
                for i, r in enumerate(rep["nodes"])]
        print(_table(["#", "node", "op", "domain", "opset", "input dtypes", "status"], rows,
                     right=(0, 4)))
        c = rep["counts"]
        print(f"summary: {len(rep['nodes'])} node(s): {c['ok']} compiled to kernels, "
              f"{c['folded']} folded at compile time, {c['view']} view(s), {c['unused']} unused, "
              + (f"{c['rewritten']} rewritten, " if c["rewritten"] else "")
              + f"{c['unsupported']} unsupported")
        if rep["shape_inference_error"]:
            print(f"compile-time shape inference fails: {rep['shape_inference_error']}")
        if not rep["supported"]:
            print("the model cannot be compiled yet; supported ops: `cannc ops`")
    return 0 if rep["supported"] else 1


# ---------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------

# kernel notes the tiling/pred columns already show (the plan itself: --json)
_MODEL_NOTES = ("plan", "tiling", "predicted_us", "predicted_bound", "path")


def cmd_inspect(args: argparse.Namespace) -> int:
    sess = _open(args.model, cores=args.cores, pipeline=args.pipeline, fusion=_fusion_opt(args),
                 precision=_precision_opt(args))
    # a loaded artifact is not recompiled without fusion for the with/without comparison
    rep = sess.inspect(dict(args.shape or []), without_fusion=not _is_artifact(args.model))
    if args.export_fused:
        from .export import save_fused_graph  # (imports onnx: only for this option)

        save_fused_graph(sess.specialize(rep["input_shapes"]).spec, args.export_fused)
    if args.json:
        _print_json(rep)
        return 0
    shapes = ", ".join(f"{n}: {'x'.join(map(str, s)) or 'scalar'}"
                       for n, s in rep["input_shapes"].items())
    print(f"{args.model}: {shapes} -> "
          + ", ".join(f"{n}: {t}" for n, t in rep["outputs"].items())
          + f"  ({rep['cores']} core(s), pipeline {rep['pipeline']})")
    rows = []
    for k in rep["kernels"]:
        nodes = ", ".join(k["nodes"])
        rows.append([k["index"], k["symbol"], _clip(nodes, 44), "+".join(k["op_types"]),
                     _clip(", ".join(type_string(o["dtype"], o["shape"])
                                     for o in k["outputs"]), 32),
                     _fmt_count(k["flops"]), fmt_bytes(k["bytes_read"]),
                     fmt_bytes(k["bytes_written"]), k["tiles"],
                     "1" if k["single_core"] else "all",
                     ("any: " if k["shape_polymorphic"] else "static: ") + k["tiling"],
                     f"{k['predicted_us']:.1f}",
                     " ".join(f"{a}={b}" for a, b in k["notes"].items()
                              if a not in _MODEL_NOTES)])
    print(_table(["#", "symbol", "nodes", "ops", "outputs", "FLOPs", "read", "written", "tiles",
                  "cores", "shapes|tiling", "pred µs", "notes"], rows, right=(0, 5, 6, 7, 8, 11)))
    npoly = sum(k["shape_polymorphic"] for k in rep["kernels"])
    print(f"shapes: {npoly} of {len(rep['kernels'])} kernel(s) take their sizes at run time "
          f"('any'): a new batch/sequence size re-plans them on the host without generating code")
    m = rep["memory"]
    print(f"predicted: {rep['predicted_us']:.1f} µs for the kernels on {rep['cores']} core(s) "
          f"(cost model: {cpu_model().summary()})")
    print(f"totals: {rep['num_kernels']} kernel(s) from {rep['onnx_nodes']} ONNX node(s) "
          f"({rep['views']} view(s)), {_fmt_count(rep['total_flops'])}FLOP, read "
          f"{fmt_bytes(rep['bytes_read'])}, written {fmt_bytes(rep['bytes_written'])} "
          f"(intermediates {fmt_bytes(rep['intermediate_bytes_written'])})")
    print(f"memory: arena {fmt_bytes(m['arena_bytes'])} (naive {fmt_bytes(m['naive_bytes'])}, "
          f"lower bound {fmt_bytes(m['lower_bound_bytes'])}), "
          f"weights {fmt_bytes(m['weights_bytes'])}")
    if m["concats_in_place"]:
        print(f"in place: {len(m['concats_in_place'])} Concat(s) run no kernel, their "
              f"producers write into them: {', '.join(m['concats_in_place'][:6])}"
              + (", ..." if len(m["concats_in_place"]) > 6 else ""))
    _print_precision(rep.get("precision", {}), rep.get("accuracy"))
    fu = rep["fusion"]
    if "without_fusion" in fu:
        wf = fu["without_fusion"]
        saved = 1 - rep['intermediate_bytes_written'] / max(wf['intermediate_bytes_written'], 1)
        print(f"fusion: {rep['num_kernels']} kernel(s) vs {wf['num_kernels']} without "
              f"(x{wf['num_kernels'] / max(rep['num_kernels'], 1):.2f} fewer); intermediates "
              f"written {fmt_bytes(rep['intermediate_bytes_written'])} vs "
              f"{fmt_bytes(wf['intermediate_bytes_written'])} without "
              f"(-{100 * saved:.0f}%)")
    if fu["not_fused"]:
        print(f"not fused ({len(fu['not_fused'])} neighbouring pair(s)):")
        for d in fu["not_fused"][:args.why_limit]:
            print(f"  {d['producer']} -> {d['consumer']}: [{d['rule']}] {d['reason']}")
        if len(fu["not_fused"]) > args.why_limit:
            print(f"  ... {len(fu['not_fused']) - args.why_limit} more (--json lists all)")
    print("passes: " + ", ".join(f"{p['name']} {p['seconds'] * 1e3:.1f} ms"
                                 + ("" if p["changed"] else " (no change)")
                                 for p in rep["passes"])
          + f"; compile {rep['compile_seconds']:.2f} s (object cache: {rep['cache_hits']} "
          f"hit(s), {rep['cache_misses']} miss(es))")
    return 0


# ---------------------------------------------------------------------------------------
# tune
# ---------------------------------------------------------------------------------------

class _Progress:
    """tune's progress on stderr: on a terminal a bar of the GEMMs (cannc.progress; what is
    being measured and the time spent in its postfix); elsewhere plain status lines, one
    per GEMM and at most every few seconds between."""

    def __init__(self, budget: float, total: int, stream: Any = None,
                 every: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.budget, self.every = budget, every
        self.t0 = time.perf_counter()
        self.last = -every
        self.gemms = 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = progress.stage("tune", total, "GEMM") if self.tty else progress.Stage()

    def update(self, text: str, force: bool = False) -> None:
        now = time.perf_counter() - self.t0
        status = f"{text}; {now:.1f}/{self.budget:.0f} s"
        if self.tty:
            # a new GEMM (force): the one before it is done
            self.bar.advance(1 if force and self.gemms else 0, status)
            self.gemms += force
        elif force or now - self.last >= self.every:
            print(f"tune: {status}", file=self.stream, flush=True)
            self.last = now

    def done(self) -> None:
        self.bar.close()


def cmd_tune(args: argparse.Namespace) -> int:
    # (here: the search imports the code generators, which `cannc run x.cnc` never needs)
    from .compiler.tune import gemm_items, tune_gemms

    path = Path(args.cache) if args.cache else config.tuning_cache_path()
    if path is None:
        raise CliError("no tuning cache file: give --cache PATH or set CANNC_TUNING_CACHE "
                       "(CANNC_CACHE_DIR is 'off')")
    threads = args.threads or usable_cores()
    t_start = time.perf_counter()
    sess = _open(args.model, cores=threads)
    prog = _specialize(sess, dict(args.shape or []))
    status = _Progress(args.budget, len(gemm_items(prog.spec.kernels)))
    results = tune_gemms(prog.spec.kernels, threads, t_start + args.budget, path=path,
                         progress=lambda text, force: status.update(text, force=force),
                         min_speedup=1.0 + args.min_gain / 100)
    status.done()
    elapsed = time.perf_counter() - t_start
    if args.json:
        _print_json({"model": args.model, "cache": str(path), "threads": threads,
                     "budget_s": args.budget, "elapsed_s": elapsed, "kernels": results})
        return 0
    rows = []
    for r in results:
        ks = ",".join(f"#{k}" for k in r["kernels"])
        if r.get("skipped"):
            rows.append([ks, r["gemm"], "-", "-", "-", "-", "skipped (budget spent)"])
            continue
        verdict = (" ".join(f"{a}={b}" for a, b in r["tuning"].items()) if r["tuning"]
                   else "default kept")
        if r["wrong"]:
            verdict += f" ({r['wrong']} wrong candidate(s) rejected)"
        rows.append([ks, r["gemm"], f"{r['default_us']:.1f}", f"{r['best_us']:.1f}",
                     f"x{r['speedup']:.2f}", f"{r['tried']}/{r['candidates']}", verdict])
    print(f"{args.model}: {len(results)} distinct GEMM(s) tuned on {threads} thread(s) in "
          f"{elapsed:.1f} s (budget {args.budget:g} s)")
    print(_table(["kernels", "gemm", "default µs", "best µs", "speedup", "tried", "tuning"],
                 rows, right=(2, 3, 4, 5)))
    stored = sum(bool(r.get("stored")) for r in results)
    print(f"{stored} entr{'y' if stored == 1 else 'ies'} written to {path}; compiles on this "
          "CPU use them" + ("" if args.cache is None else
                           f" with CANNC_TUNING_CACHE={path}"))
    return 0


# ---------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------

def cmd_bench(args: argparse.Namespace) -> int:
    # the parent only opens the model (checking the options) and makes the feeds; every
    # engine compiles and runs in a process of its own (cannc.sidebyside.bench)
    prec, fusion = _precision_opt(args), _fusion_opt(args)
    sess = _open(args.model, cores=args.cores, fusion=fusion, precision=prec)
    feeds = _make_feeds(sess, [], dict(args.shape or []), args.seed, args.int_high)
    prec = dict(prec)
    precision = prec.pop("precision")
    options = {**prec, **({} if fusion is True else {"fusion": fusion})}
    if args.ep and options:
        raise CliError("--ep: cannc's execution provider takes --precision only (not "
                       "--allow/--deny/--follow/--keep-fp32/--no-fusion/--fusion-switch), so "
                       "the engines would not compile the same thing")
    engines = ["ort", "cannc"] + (["ort+cannc"] if args.ep else [])
    threads = sess.cores
    with tempfile.TemporaryDirectory(prefix="cannc_bench_") as tmp:
        onnx_model = args.model
        if _is_artifact(args.model):   # ORT reads the model stored in the artifact
            onnx_model = str(Path(tmp) / "model.onnx")
            Path(onnx_model).write_bytes(_onnx_source(args.model))  # type: ignore[arg-type]
        res = bench(args.model, feeds, threads=threads, warmup=args.warmup, runs=args.runs,
                    engines=engines, precision=precision, options=options or None,
                    onnx_model=onnx_model, spinning=args.ort_spin, rtol=args.rtol,
                    atol=args.atol, timeout=args.timeout, workdir=tmp, rounds=args.rounds)
    res.update(model=args.model, cores=threads, warmup=args.warmup, runs=args.runs,
               rounds=min(args.rounds, args.runs),
               precision=precision, ort_spinning=args.ort_spin, processes="one per engine",
               input_shapes={n: list(a.shape) for n, a in feeds.items()},
               onnxruntime=res["ort"]["version"])
    rc = 0 if res["outputs_agree"] else 1
    if args.json:
        _print_json(res)
        return rc
    print(f"{args.model}: {_fmt_shapes({n: a.shape for n, a in feeds.items()})}; "
          f"{threads} thread(s) each, each engine in its own process; {args.warmup} warmup "
          f"+ {args.runs} runs" + (f" in {res['rounds']} alternating rounds"
                                   if res["rounds"] > 1 else "")
          + ("" if precision == "fp32" else f"; cannc {precision}")
          + ("" if args.ort_spin else "; onnxruntime thread spinning off"))
    rows = []
    for eng in engines:
        r = res["engines"].get(eng)
        label = LABELS[eng] + (f" (onnxruntime {r['version']})" if r and eng == "ort" else "")
        if r is None:
            rows.append([label, "-", "-", "-", "-", res["skipped"].get(eng, "skipped")])
            continue
        if eng == "ort":
            agree = "reference"
        else:
            cmp = res["outputs"][eng]
            agree = (f"agree (max abs {cmp['max_abs']:.2g})" if cmp["ok"] else
                     "DIFFER: " + "; ".join(f"{o['name']}: {o['problem']} (max abs "
                                            f"{o.get('max_abs', 0):.3g})"
                                            for o in cmp["outputs"] if not o["ok"]))
        if eng == "ort+cannc":
            a = r["assignment"]
            agree += (f"; {100 * a['fraction']:.1f}% of nodes ({a['cannc_nodes']}/"
                      f"{a['nodes']}) on CanncExecutionProvider")
        rows.append([label, f"{r['median_ms']:.3f}", f"{r['p10_ms']:.3f}",
                     f"{r['p90_ms']:.3f}", f"{res['ratios'][eng]:.3f}", agree])
    print(_table(["", "median ms", "p10 ms", "p90 ms", "/ORT CPU", "outputs"], rows,
                 right=(1, 2, 3, 4)))
    ratio = res["ratio"]
    verdict = (f"cannc is {1 / ratio:.2f}x faster" if ratio < 1
               else f"cannc is {ratio:.2f}x slower")
    print(f"ratio cannc/ort: {ratio:.3f} ({verdict})")
    if "ort+cannc" in res["engines"]:
        r = res["ratios"]["ort+cannc"]
        print(f"ratio ORT+cannc/ORT CPU: {r:.3f}; ORT+cannc/cannc alone: {r / ratio:.3f}")
    if res.get("float64_referee") is not None:
        print("float64 referee: "
              + referee_summary(res["float64_referee"], lambda e: LABELS.get(e, e)))
    if rc:
        print("outputs differ from ORT CPU's (see above)", file=sys.stderr)
    return rc


# ---------------------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------------------

def cmd_profile(args: argparse.Namespace) -> int:
    sess = _open(args.model, cores=args.cores, fusion=_fusion_opt(args),
                 precision=_precision_opt(args))
    feeds = _make_feeds(sess, args.input or [], dict(args.shape or []), args.seed, args.int_high)
    prof = sess.profile(feeds, runs=args.runs, warmup=args.warmup,
                        pipeline_requests=args.pipeline_requests)
    if args.trace:
        prof.write_chrome_trace(args.trace)
    predicted = annotate_profile(prof, sess.programs.values(), sess.cores)
    if args.json:
        _print_json(prof.to_dict())
        return 0
    print(f"{args.model}: {_fmt_shapes({k: v.shape for k, v in feeds.items()})}; "
          f"{sess.cores} AI core(s); median of {prof.runs} run(s); fp32 peak "
          f"{prof.peaks['fp32_gflops_per_core']:.0f} GFLOP/s per core, copy bandwidth "
          f"{prof.peaks['mem_gbps']:.1f} GB/s (measured)")
    print(prof.table(args.top))
    if predicted:
        _print_predictions(prof, args.top)
    if args.trace:
        print(f"chrome trace: {args.trace} (open in chrome://tracing or ui.perfetto.dev)")
    return 0


def _print_predictions(prof: Any, top: int) -> None:
    rows = []
    for k in sorted(prof.kernels, key=lambda k: -k["time_ms"])[:top]:
        ratio = k["time_ms"] / k["predicted_ms"] if k["predicted_ms"] > 0 else float("inf")
        rows.append([f"#{k['index']}", "+".join(k["op_types"][:3]), f"{k['time_ms']:.3f}",
                     f"{k['predicted_ms']:.3f}", f"{ratio:.2f}", _clip(k["tiling"], 70)])
    meas = sum(k["time_ms"] for k in prof.kernels)
    pred = sum(k["predicted_ms"] for k in prof.kernels)
    print("measured vs predicted (cost model):")
    print(_table(["kernel", "ops", "measured ms", "predicted ms", "meas/pred", "tiling"], rows,
                 right=(2, 3, 4)))
    print(f"kernels: measured {meas:.3f} ms, predicted {pred:.3f} ms "
          f"(x{meas / pred if pred else float('inf'):.2f})")


def cmd_ops(args: argparse.Namespace) -> int:
    ops = supported_ops()
    if args.json:
        _print_json(ops)
        return 0
    rows = [[o["op"], o["domain"], o["category"], o["min_opset"], _fmt_dtypes(o["dtypes"]),
             "yes" if o["fusible"] else ""] for o in ops]
    print(_table(["op", "domain", "category", "min opset", "dtypes", "fusible"], rows,
                 right=(3,)))
    print(f"{len(ops)} op(s)")
    return 0


# ---------------------------------------------------------------------------------------
# the parser and main
# ---------------------------------------------------------------------------------------

def _fmt_dtypes(dtypes: str | list[str]) -> str:
    """['float16', 'float32', 'int8', 'int16'] -> 'float16/32, int8/16'."""
    if isinstance(dtypes, str):
        return dtypes
    groups: dict[str, list[str]] = {}
    for d in dtypes:
        base = d.rstrip("0123456789")
        groups.setdefault(base, []).append(d[len(base):])
    return ", ".join(b + "/".join(sorted(bits, key=lambda x: int(x or 0)))
                     for b, bits in groups.items())


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="cannc", description="cannc: an ahead-of-time compiler for ONNX models.",
        epilog="errors print `error: <message>` and exit 2; --debug shows the traceback")
    ap.add_argument("--version", action="version", version=f"cannc {__version__}")
    ap.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, fn: Callable[[argparse.Namespace], int], helptext: str
             ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks of errors")
        p.set_defaults(func=fn)
        return p

    def ops_opt(p: argparse.ArgumentParser) -> None:
        p.add_argument("--ops", action="append", default=[], metavar="FILE.py",
                       help="import custom op registrations (@cannc.custom_op) first")

    def shape_opt(p: argparse.ArgumentParser) -> None:
        p.add_argument("--shape", action="append", type=_shape_arg, metavar="NAME=DIMS",
                       help="concrete shape of an input, e.g. x=1x256 (repeatable); symbolic "
                            "dims not given take their value from other inputs, else 1")

    def cores_opt(p: argparse.ArgumentParser) -> None:
        p.add_argument("--cores", type=_int_at_least(1), default=None,
                       help="number of AI Cores (default: usable CPU cores)")

    def pipeline_opt(p: argparse.ArgumentParser) -> None:
        p.add_argument("--pipeline", choices=sorted(PIPELINES), default=DEFAULT_PIPELINE,
                       help=f"optimisation pipeline (default {DEFAULT_PIPELINE})")

    def fusion_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--no-fusion", action="store_true", help="compile without fusion")
        p.add_argument("--fusion-switch", metavar="FILE.json", default=None,
                       help="per-rule fusion switches, e.g. {\"gemm_epilogue\": false}")

    def precision_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                       help="compute precision: fp32 (default), or bf16/fp16 mixed precision "
                            "by policy (contractions narrow with float32 sums)")
        for kind in ("allow", "deny", "follow"):
            p.add_argument(f"--{kind}", action="append", metavar="OP",
                           help=f"put this op type in the '{kind}' precision list "
                                "(repeatable)")
        p.add_argument("--keep-fp32", action="append", metavar="NODE",
                       help="keep this node in float32 (repeatable)")

    def inputs_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
        p.add_argument("--int-high", type=_int_at_least(1), default=2, metavar="H",
                       help="random int inputs are uniform in [0, H) (default 2)")

    p = verb("compile", cmd_compile, "compile a model and save a .cnc artifact")
    ops_opt(p)
    p.add_argument("model", help="ONNX model")
    p.add_argument("-o", "--output", required=True, help="the .cnc file to write")
    fusion_opts(p)
    precision_opts(p)
    p.add_argument("--accuracy-feeds", metavar="FEEDS.npz", default=None,
                   help="accuracy guard: run these feeds (arrays INPUT, or K/INPUT for "
                        "several) in reduced precision and float32, and move the nodes that "
                        "put the outputs out of tolerance back to float32")
    p.add_argument("--rtol", type=float, default=None, help="accuracy guard rtol (1e-2)")
    p.add_argument("--atol", type=float, default=None, help="accuracy guard atol (1e-3)")
    p.add_argument("--min-cosine", type=float, default=None, metavar="C",
                   help="accuracy guard by cosine similarity >= C instead of rtol/atol")
    cores_opt(p)
    shape_opt(p)
    pipeline_opt(p)
    p.add_argument("--dump-after", action="append", metavar="PASS",
                   help="dump the IR after this pass ('all' for every pass; repeatable)")
    p.add_argument("--dump-dir", default=None,
                   help="write dumps (IR after passes, kernel LLVM IR) here instead of "
                        "printing the IR after passes")

    p = verb("run", cmd_run, "run a model (.onnx or .cnc) on given or random inputs")
    p.add_argument("model", help="ONNX model or .cnc artifact")
    precision_opts(p)
    p.add_argument("--input", action="append", type=_input_arg, metavar="NAME=FILE.npy",
                   help="read an input from a .npy file (repeatable); others are random")
    shape_opt(p)
    cores_opt(p)
    inputs_opts(p)
    p.add_argument("--check", action="store_true",
                   help="compare every output with onnxruntime (exit 1 on mismatch)")
    p.add_argument("--rtol", type=float, default=None, help="float rtol (default 1e-4)")
    p.add_argument("--atol", type=float, default=None, help="float atol (default 1e-4)")
    p.add_argument("--save-outputs", metavar="DIR", help="save every output as DIR/NAME.npy")
    fusion_opts(p)

    p = verb("check", cmd_check, "report, before compiling, whether every node is supported")
    ops_opt(p)
    p.add_argument("model", help="ONNX model (or .cnc artifact)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    shape_opt(p)
    pipeline_opt(p)

    p = verb("inspect", cmd_inspect, "show the kernels, their costs and the memory plan")
    p.add_argument("model", help="ONNX model or .cnc artifact")
    precision_opts(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    shape_opt(p)
    cores_opt(p)
    pipeline_opt(p)
    fusion_opts(p)
    p.add_argument("--export-fused", metavar="OUT.onnx", default=None,
                   help="write the fused graph (one node per kernel, domain 'cannc') for Netron")
    p.add_argument("--why-limit", type=int, default=20, metavar="N",
                   help="how many not-fused pairs to print (default 20)")

    p = verb("bench", cmd_bench, "benchmark cannc against onnxruntime on the same inputs, "
                                 "each engine in its own process")
    p.add_argument("model", help="ONNX model or .cnc artifact")
    precision_opts(p)
    cores_opt(p)
    shape_opt(p)
    inputs_opts(p)
    fusion_opts(p)
    p.add_argument("--warmup", type=_int_at_least(0), default=5)
    p.add_argument("--runs", type=_int_at_least(1), default=50)
    p.add_argument("--rounds", type=_int_at_least(1), default=5,
                   help="the engines take turns in this many batches of the runs, each "
                        "process kept alive (default 5; 1: one engine after the other)")
    spin = p.add_mutually_exclusive_group()
    spin.add_argument("--ort-spin", dest="ort_spin", action="store_true", default=True,
                      help="let onnxruntime's idle pool threads busy-wait (its default, and "
                           "here: each engine runs in its own process)")
    spin.add_argument("--ort-no-spin", dest="ort_spin", action="store_false",
                      help="onnxruntime's idle pool threads sleep "
                           "(session.intra_op.allow_spinning=0)")
    p.add_argument("--ep", action="store_true",
                   help="also time ORT with cannc's execution provider (ORT+cannc) and report "
                        "the share of nodes it takes")
    p.add_argument("--rtol", type=float, default=None,
                   help="output rtol against ORT CPU (1e-4; 5e-2 for bf16/fp16)")
    p.add_argument("--atol", type=float, default=None,
                   help="output atol against ORT CPU (1e-5; 5e-2 for bf16/fp16)")
    p.add_argument("--timeout", type=_positive_seconds, default=3600.0, metavar="SECONDS",
                   help="per engine process (default 3600)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = verb("profile", cmd_profile, "per-kernel time, GFLOP/s, GB/s, core use; Chrome trace")
    p.add_argument("model", help="ONNX model or .cnc artifact")
    precision_opts(p)
    p.add_argument("--input", action="append", type=_input_arg, metavar="NAME=FILE.npy")
    cores_opt(p)
    shape_opt(p)
    inputs_opts(p)
    fusion_opts(p)
    p.add_argument("--warmup", type=_int_at_least(0), default=3)
    p.add_argument("--runs", type=_int_at_least(1), default=20)
    p.add_argument("--top", type=_int_at_least(1), default=25, help="kernels to list")
    p.add_argument("--trace", metavar="OUT.json", default=None, help="write a Chrome trace")
    p.add_argument("--pipeline-requests", type=_int_at_least(0), default=0, metavar="N",
                   help="also measure throughput with N requests in flight (run_async)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = verb("tune", cmd_tune, "measure tiling candidates of the model's GEMMs and keep the "
                               "winners in the tuning cache")
    p.add_argument("model", help="ONNX model")
    shape_opt(p)
    p.add_argument("--budget", type=_positive_seconds, default=60.0, metavar="SECONDS",
                   help="time to spend measuring (default 60)")
    p.add_argument("--threads", type=_int_at_least(1), default=None, metavar="N",
                   help="cores the kernels are tuned for (default: usable CPU cores)")
    p.add_argument("--cache", default=None, metavar="PATH",
                   help="the tuning cache to write (default: CANNC_TUNING_CACHE, else "
                        "<cache dir>/tuning.json)")
    p.add_argument("--min-gain", type=float, default=3.0, metavar="PERCENT",
                   help="keep a plan only if it beats the default by more than this "
                        "(default 3; -100 keeps the best candidate whatever it measured)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = verb("ops", cmd_ops, "list the supported ops")
    p.add_argument("--json", action="store_true", help="print JSON")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """The `cannc` console script. Returns the exit code."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    debug = bool(getattr(args, "debug", False)) or config.DEBUG
    try:
        for f in getattr(args, "ops", None) or ():
            load_ops_file(f)
        with show_progress():     # long compiles draw their stages on a terminal
            return int(args.func(args))
    except CanncError as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `cannc ops | head`: stop quietly (the Python docs' recipe)
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except OSError as e:  # an unwritable -o path, a full disk
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if debug:
            traceback.print_exc()
        print(f"internal error: {type(e).__name__}: {e}\n(this is a cannc bug; "
              "rerun with --debug for the traceback)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
