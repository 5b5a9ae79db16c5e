"""One benchmark worker: times ONE engine in this process and prints one JSON line.

    python -m cannc.benchproc --engine cannc|ort|ort+cannc|openvino --model M.onnx
        --feeds FEEDS.npz --threads N [--warmup 5] [--runs 50] [--precision fp32|bf16|fp16]
        [--options JSON] [--outputs OUT.npz] [--no-spin]

`cannc.sidebyside.bench` (and `cannc bench`, benchmarks/ep_bench.py) runs one of these per
engine, one after the other, with the same feeds file (written by
`cannc.sidebyside.save_arrays`) and thread count: each engine gets the machine to itself,
since ORT's spinning pool threads steal cores from a neighbour in the same process.

Engines, all at N threads:
  cannc      cannc.compile(model, cores=N, precision=P, **options) (a .cnc: cannc.load)
  ort        ORT's CPU provider, cannc.sidebyside.ort_session(model, N): ORT_ENABLE_ALL,
             intra_op_num_threads=N, spinning on (as users run it; --no-spin turns it off)
  ort+cannc  ORT with cannc's execution provider, cannc.ort.session(model, cores=N,
             precision_mode=P) on the same ORT session options; reports the share of
             ORT's nodes assigned to CanncExecutionProvider
             (session.record_ep_graph_assignment_info)
  openvino   OpenVINO's CPU plugin if it is importable here (never a dependency; else the
             report says "skipped")

The worker builds the session, runs once (timed as the first run: cannc specialises
there), runs `warmup` more, then times `runs` single inferences.

With --serve the worker stays alive so that a parent can alternate engines in rounds
(the machines are shared: their speed drifts over seconds, and engines timed one after
the other would each see a different machine): after the warmup it writes the outputs
and prints {"status": "ready", ...}, then answers each stdin line `run N` with one
untimed run (the engine's threads slept while the others ran) and N timed ones,
printed as {"status": "ok", "times_ms": [...]}; `done` ends it with the report of all
timed runs (--runs is then ignored). The JSON line holds
status ("ok", "skipped" or "error"), median/p10/p90/min ms, every run's time, build and
first-run seconds, the engine's version, the outputs' names, shapes and checksums; the
outputs themselves go to --outputs (an .npz in save_arrays' layout) for the parent to
compare with ORT CPU's. A failure is reported as {"status": "error", "error": ...} and
exit code 1 (argument errors: exit 2, argparse's message on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CanncError
from .sidebyside import ENGINES, load_arrays, ort_session, ort_session_options, save_arrays

PRECISIONS = ("fp32", "bf16", "fp16")
OV_HINT = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}


def time_stats(times_ms: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90, min and count of per-run times in ms."""
    t = np.asarray(times_ms, dtype=np.float64)
    if t.size == 0:
        raise CanncError("no run times to summarise")
    return {"median_ms": float(np.median(t)), "p10_ms": float(np.percentile(t, 10)),
            "p90_ms": float(np.percentile(t, 90)), "min_ms": float(t.min()), "n": int(t.size)}


def timed(run: Callable[[], Any], warmup: int, runs: int) -> tuple[float, list[float], Any]:
    """(first run in s, `runs` timed runs in ms after `warmup` untimed ones, first outputs)."""
    t = time.perf_counter()
    out = run()
    first = time.perf_counter() - t
    for _ in range(warmup):
        run()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - t))
    return first, times, out


def savable(a: Any) -> np.ndarray:
    """An output as .npz can hold it without pickling: bfloat16 / float8 widen to float32."""
    a = np.asarray(a)
    if a.dtype.kind == "V" or a.dtype.name == "bfloat16" or a.dtype.name.startswith("float8"):
        a = a.astype(np.float32)
    return a


def checksums(outputs: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Per output: name, shape, dtype, sum and sum of absolute values (float64)."""
    out = []
    for name, a in outputs.items():
        a = savable(a)
        f = a.astype(np.float64) if a.dtype.kind in "biuf" else np.zeros(0)
        out.append({"name": name, "shape": list(a.shape), "dtype": str(a.dtype),
                    "sum": float(f.sum()), "abs_sum": float(np.abs(f).sum())})
    return out


def is_artifact(path: str) -> bool:
    p = Path(path)
    return p.suffix == ".cnc" or (p.is_file() and zipfile.is_zipfile(p))


def assignment_summary(assign: dict[str, list[str]], ep_name: str) -> dict[str, Any]:
    """ORT's node assignment (ep name -> node names) as counts and the share on `ep_name`."""
    total = sum(len(v) for v in assign.values())
    mine = len(assign.get(ep_name, []))
    others = [n for ep, ns in assign.items() if ep != ep_name for n in ns]
    return {"nodes": total, "cannc_nodes": mine,
            "fraction": (mine / total) if total else 0.0,
            "by_ep": {ep: len(ns) for ep, ns in assign.items()},
            "not_on_cannc": others[:50]}


# ---------------------------------------------------------------------------------------
# the engines: each returns (report, {output name: array}, run) with the session built
# ---------------------------------------------------------------------------------------

def _cannc(model: str, threads: int, precision: str, options: dict[str, Any],
           spinning: bool, feeds: dict[str, np.ndarray]) -> tuple[dict, list[str], Callable]:
    from . import __version__, compile, load
    if is_artifact(model):
        if precision != "fp32" or options:
            raise CanncError(f"{model} is a compiled artifact: its precision and fusion were "
                             "chosen when it was compiled")
        sess = load(model, cores=threads)
    else:
        sess = compile(model, cores=threads, precision=precision, **options)
    names = [o.name for o in sess.get_outputs()]

    def run() -> Any:
        return sess.run(None, feeds)

    def settle() -> dict[str, Any]:
        # a program on 2+ cores times launches on every core and on one before it keeps
        # one (runtime/corechoice.py): the timed runs come after that trial
        for _ in range(64):
            if sess.settled:
                break
            run()
        return {"core_choice": [p.core_choice.describe() for p in sess.programs.values()
                                if getattr(p, "core_choice", None) is not None
                                and not p.core_choice.unlaunched]}

    run.settle = settle  # type: ignore[attr-defined]
    return {"version": __version__, "cores": sess.cores}, names, run


def _ort(model: str, threads: int, precision: str, options: dict[str, Any], spinning: bool,
         feeds: dict[str, np.ndarray]) -> tuple[dict, list[str], Callable]:
    import onnxruntime as ort
    sess = ort_session(model, threads, spinning=spinning)
    names = [o.name for o in sess.get_outputs()]
    return ({"version": ort.__version__, "spinning": spinning}, names,
            lambda: sess.run(None, feeds))


def _ort_cannc(model: str, threads: int, precision: str, options: dict[str, Any],
               spinning: bool, feeds: dict[str, np.ndarray]) -> tuple[dict, list[str], Callable]:
    import onnxruntime as ort

    from .ort import EP_NAME, assignment, session
    so = ort_session_options(threads, spinning)
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    try:
        sess = session(model, sess_options=so, cores=threads, precision_mode=precision,
                       **options)
    except CanncError:
        raise
    except Exception as e:
        raise CanncError(f"onnxruntime with cannc's execution provider cannot load the "
                         f"model: {e}") from e
    names = [o.name for o in sess.get_outputs()]
    rep = {"version": ort.__version__, "spinning": spinning,
           "providers": list(sess.get_providers()),
           "assignment": assignment_summary(assignment(sess), EP_NAME)}
    return rep, names, lambda: sess.run(None, feeds)


def _openvino(model: str, threads: int, precision: str, options: dict[str, Any],
              spinning: bool, feeds: dict[str, np.ndarray]) -> tuple[dict, list[str], Callable]:
    import openvino as ov
    core = ov.Core()
    m = core.read_model(model)

    def feed_name(port: Any) -> str | None:
        # a port has every name of its tensor (an input that feeds a Reshape may
        # answer get_any_name() with the Reshape's output): the one the feeds use
        names = sorted(n for n in port.get_names() if n in feeds)
        return names[0] if names else None

    m.reshape({n: list(feeds[n].shape) for n in map(feed_name, m.inputs) if n is not None})
    cfg = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
           "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": OV_HINT[precision]}
    c = core.compile_model(m, "CPU", cfg)
    req = c.create_infer_request()
    missing = [i.get_any_name() for i in c.inputs if feed_name(i) is None]
    if missing:
        raise CanncError(f"OpenVINO's inputs {missing} are not among the feeds {sorted(feeds)}")
    inputs = {feed_name(i): feeds[feed_name(i)] for i in c.inputs}
    ports = list(c.outputs)
    names = [p.get_any_name() for p in ports]

    def run() -> list[np.ndarray]:
        res = req.infer(inputs)
        return [np.array(res[p], copy=True) for p in ports]
    return {"version": ov.__version__, "precision_hint": OV_HINT[precision]}, names, run


_ENGINES = {"cannc": _cannc, "ort": _ort, "ort+cannc": _ort_cannc, "openvino": _openvino}
assert set(_ENGINES) == set(ENGINES)


def prepare_engine(engine: str, model: str, feeds: dict[str, np.ndarray], *, threads: int,
                   warmup: int, precision: str = "fp32", options: dict[str, Any] | None = None,
                   spinning: bool = True
                   ) -> tuple[dict[str, Any], dict[str, np.ndarray], Callable[[], Any] | None]:
    """Build `engine`'s session for `model`, run it once (timed) and `warmup` times:
    (report without run times, outputs by name, run); run is None when skipped."""
    if engine == "openvino":
        try:
            import openvino  # noqa: F401
        except ImportError as e:
            return {"status": "skipped", "engine": engine,
                    "note": f"openvino is not importable here ({e})"}, {}, None
    t = time.perf_counter()
    rep, names, run = _ENGINES[engine](model, threads, precision, dict(options or {}),
                                       spinning, feeds)
    build_s = time.perf_counter() - t
    first, _, out = timed(run, warmup, 0)
    if hasattr(run, "settle"):
        rep = {**rep, **run.settle()}
    outs = {n: savable(a) for n, a in zip(names, out)}
    rep = {"status": "ok", "engine": engine, "pid": os.getpid(), "threads": threads,
           "precision": precision, "build_s": build_s, "first_run_s": first,
           **rep, "output_names": names, "checksums": checksums(outs)}
    return rep, outs, run


def run_engine(engine: str, model: str, feeds: dict[str, np.ndarray], *, threads: int,
               warmup: int, runs: int, precision: str = "fp32",
               options: dict[str, Any] | None = None,
               spinning: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Build `engine`'s session for `model`, time it; (report, outputs by name)."""
    rep, outs, run = prepare_engine(engine, model, feeds, threads=threads, warmup=warmup,
                                    precision=precision, options=options, spinning=spinning)
    if run is None:
        return rep, outs
    _, times, _ = timed(run, 0, runs)
    return with_times(rep, times), outs


def with_times(rep: dict[str, Any], times: list[float]) -> dict[str, Any]:
    """The report with the statistics of the timed runs (kept in run order)."""
    return {**rep, **time_stats(times), "times_ms": times}


def serve(rep: dict[str, Any], run: Callable[[], Any], commands: Any, reply: Any) -> dict:
    """The --serve loop: `run N` -> one untimed run, N timed ones, their times replied;
    `done` -> the report of every timed run. Anything else is a CanncError."""
    times: list[float] = []
    rounds = 0
    for line in commands:
        words = line.split()
        if words == ["done"]:
            return {**with_times(rep, times), "rounds": rounds}
        if len(words) != 2 or words[0] != "run" or not words[1].isdigit() \
                or int(words[1]) < 1:
            raise CanncError(f"benchmark worker: expected 'run N' or 'done', got {line!r}")
        _, batch, _ = timed(run, 0, int(words[1]))
        times += batch
        rounds += 1
        print(json.dumps({"status": "ok", "times_ms": batch}), file=reply, flush=True)
    raise CanncError("benchmark worker: its parent closed the command pipe before 'done'")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cannc.benchproc",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, choices=ENGINES)
    ap.add_argument("--model", required=True, help="ONNX model (cannc also takes a .cnc)")
    ap.add_argument("--feeds", required=True, help=".npz written by sidebyside.save_arrays")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32")
    ap.add_argument("--options", default=None,
                    help="JSON object: cannc.compile options (cannc) or EP options "
                         "(ort+cannc) besides cores and precision")
    ap.add_argument("--outputs", default=None, help="write the outputs to this .npz")
    ap.add_argument("--no-spin", action="store_true",
                    help="ORT engines: idle pool threads do not busy-wait")
    ap.add_argument("--serve", action="store_true",
                    help="after the warmup, time batches of runs on request (stdin: "
                         "'run N' ... 'done'), so a parent can alternate engines")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.threads < 1 or args.runs < 1 or args.warmup < 0:
        ap.error("--threads and --runs must be >= 1, --warmup >= 0")
    real_stdout, sys.stdout = sys.stdout, sys.stderr   # stray prints must not mix in
    rc = 0
    try:
        options = json.loads(args.options) if args.options else {}
        if not isinstance(options, dict):
            raise CanncError(f"--options must be a JSON object, got {args.options!r}")
        if not Path(args.model).is_file():
            raise CanncError(f"model file not found: {args.model}")
        feeds = load_arrays(args.feeds)
        rep, outs, run = prepare_engine(args.engine, args.model, feeds, threads=args.threads,
                                        warmup=args.warmup, precision=args.precision,
                                        options=options, spinning=not args.no_spin)
        if args.outputs and run is not None:
            save_arrays(args.outputs, outs)
        if run is not None and args.serve:
            print(json.dumps({"status": "ready", "engine": args.engine, "pid": os.getpid()}),
                  file=real_stdout, flush=True)
            rep = serve(rep, run, sys.stdin, real_stdout)
        elif run is not None:
            _, times, _ = timed(run, 0, args.runs)
            rep = with_times(rep, times)
    except CanncError as e:
        rep, rc = {"status": "error", "engine": args.engine, "error": str(e), "clean": True}, 1
    except Exception as e:
        traceback.print_exc()
        rep, rc = {"status": "error", "engine": args.engine,
                   "error": f"{type(e).__name__}: {e}"}, 1
    finally:
        sys.stdout = real_stdout
    print(json.dumps(rep), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
