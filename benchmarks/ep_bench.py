"""ORT+cannc (ONNX Runtime with cannc's execution provider), ORT CPU and cannc alone, each
engine in its own process, per model: medians, ratios, the share of nodes on cannc's EP.

    python benchmarks/ep_bench.py [A.onnx ...] [--zoo mlp resnet mobilenet bert gpt]
        [--torch] [--torch-dir /tmp/torch_out] [--cores N] [--batch 1] [--seq 16]
        [--warmup 5] [--runs 30] [--rounds 1] [--precision fp32] [--openvino]
        [--timeout 1800] [--out benchmarks/results/ep.json]

Models: the zoo models the tests use (models/zoo.py, --zoo; `--zoo` with no names for none),
the ONNX files given, and with --torch the PyTorch exports in --torch-dir that are present
(benchmarks/export_torch_models.py: bert_base, gpt2, resnet18, mobilenet_v2, minilm).
Inputs: zoo models take models.zoo.example_inputs; other files precision_bench's
make_inputs (ids within the embedding table, masks of ones, floats standard normal;
symbolic batch/seq dims take --batch/--seq). The inputs are written once per model and
every engine reads the same file.

Each engine runs in a fresh process (`python -m cannc.benchproc`, through
cannc.sidebyside.bench) at --cores threads (default: all usable cores): ORT CPU
(ORT_ENABLE_ALL, intra_op_num_threads, spinning as users run it), cannc alone
(cannc.compile(cores=N)), ORT+cannc (cannc.ort.session(cores=N) with the same ORT session
options), and with --openvino OpenVINO if it is importable in this interpreter. With
--rounds R the engines run R times in turn and the times are pooled.

Reported per model: median/p10/p90 ms per engine; ratios ORT+cannc/ORT CPU,
ORT+cannc/cannc alone, cannc/ORT CPU; the share of ORT's nodes on CanncExecutionProvider
(session.record_ep_graph_assignment_info); whether every engine's outputs agree with ORT
CPU's (float32: rtol 1e-4, atol 1e-5). The issue's bars: share >= 95%, ORT+cannc no slower
than ORT CPU, and within a few percent (5% here) of cannc alone. Results go to --out with
the CPU model (/proc/cpuinfo) and the onnxruntime version.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cannc.benchproc import PRECISIONS, time_stats
from cannc.schedule.machine import model_name, usable_cores
from cannc.sidebyside import LABELS, WorkerError, bench

ZOO_DEFAULT = ["mlp", "resnet", "mobilenet", "bert", "gpt"]
TORCH_FILES = ["bert_base.onnx", "gpt2.onnx", "resnet18.onnx", "mobilenet_v2.onnx",
               "minilm.onnx"]
ENGINES = ["ort", "cannc", "ort+cannc"]
SHARE_BAR = 0.95
NEAR_CANNC = 1.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="ONNX files")
    ap.add_argument("--zoo", nargs="*", default=ZOO_DEFAULT,
                    help=f"zoo models (default: {' '.join(ZOO_DEFAULT)})")
    ap.add_argument("--torch", action="store_true",
                    help="add the PyTorch exports present in --torch-dir")
    ap.add_argument("--torch-dir", default="/tmp/torch_out")
    ap.add_argument("--cores", type=int, default=None, help="threads of every engine")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32")
    ap.add_argument("--openvino", action="store_true",
                    help="also OpenVINO, if importable in this interpreter")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ep.json"))
    args = ap.parse_args(argv)
    for name in ("batch", "seq", "runs", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.cores is not None and args.cores < 1:
        ap.error(f"--cores must be >= 1, got {args.cores}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def model_list(args: argparse.Namespace, tmp: Path) -> list[tuple[str, Path, dict]]:
    """(label, path, feeds) of every model to run."""
    import onnx
    from precision_bench import make_inputs

    from models import zoo
    out = []
    for name in args.zoo:
        m = zoo.build(name)
        path = zoo.save(name, tmp)
        out.append((f"zoo:{name}", path, zoo.example_inputs(m, args.batch, args.seq,
                                                            args.seed)))
    files = [Path(p) for p in args.models]
    if args.torch:
        files += [Path(args.torch_dir) / f for f in TORCH_FILES
                  if (Path(args.torch_dir) / f).exists()]
    for p in files:
        if not p.exists():
            raise SystemExit(f"{p}: not found")
        proto = onnx.load(str(p), load_external_data=False)
        out.append((p.stem, p, make_inputs(proto, args.batch, args.seq, args.seed)))
        del proto
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarise(label: str, path: Path, feeds: dict, runs_: list[dict]) -> dict:
    """One model's row from its rounds (bench results): pooled times, ratios, share."""
    first = runs_[0]
    engines: dict[str, dict] = {}
    for eng in first["engines"]:
        times = [t for r in runs_ if eng in r["engines"] for t in r["engines"][eng]["times_ms"]]
        e = {k: v for k, v in first["engines"][eng].items()
             if k not in ("times_ms", "checksums", "output_names", "pid")}
        e.update(time_stats(times))
        engines[eng] = e
    med = {e: v["median_ms"] for e, v in engines.items()}
    row = {"model": label, "path": str(path),
           "shapes": {k: list(v.shape) for k, v in feeds.items()},
           "engines": engines,
           "ratios": {"ort+cannc/ort": ratio(med.get("ort+cannc"), med.get("ort")),
                      "ort+cannc/cannc": ratio(med.get("ort+cannc"), med.get("cannc")),
                      "cannc/ort": ratio(med.get("cannc"), med.get("ort"))},
           "outputs_agree": {e: c["ok"] for e, c in first["outputs"].items()},
           "max_abs": {e: c["max_abs"] for e, c in first["outputs"].items()},
           "failed": first.get("failed", {}), "skipped": first.get("skipped", {})}
    a = engines.get("ort+cannc", {}).get("assignment")
    row["assignment"] = a
    row["share_on_cannc"] = a["fraction"] if a else None
    r = row["ratios"]
    row["bars"] = {
        "share_ge_95": None if a is None else a["fraction"] >= SHARE_BAR,
        "no_slower_than_ort": None if r["ort+cannc/ort"] is None else r["ort+cannc/ort"] <= 1.0,
        "within_5pct_of_cannc": None if r["ort+cannc/cannc"] is None
        else r["ort+cannc/cannc"] <= NEAR_CANNC,
        "outputs_agree": all(row["outputs_agree"].values()) and not row["failed"]}
    return row


def _f(x: float | None, spec: str) -> str:
    width = int(spec.split(".")[0])
    return "-".rjust(width) if x is None or not math.isfinite(x) else format(x, spec)


def print_table(rows: list[dict]) -> None:
    hdr = (f"{'model':<16} {'ORT CPU':>9} {'cannc':>9} {'ORT+cannc':>9} {'EP/ORT':>7} "
           f"{'EP/cannc':>8} {'cannc/ORT':>9} {'on cannc':>8}  outputs")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if r.get("error"):
            print(f"{r['model']:<16} error: {r['error']}")
            continue
        med = {e: v["median_ms"] for e, v in r["engines"].items()}
        share = r["share_on_cannc"]
        agree = "agree" if r["bars"]["outputs_agree"] else "DIFFER/FAILED: " + ", ".join(
            [e for e, ok in r["outputs_agree"].items() if not ok] + list(r["failed"]))
        print(f"{r['model']:<16} {_f(med.get('ort'), '9.3f')} {_f(med.get('cannc'), '9.3f')} "
              f"{_f(med.get('ort+cannc'), '9.3f')} {_f(r['ratios']['ort+cannc/ort'], '7.3f')} "
              f"{_f(r['ratios']['ort+cannc/cannc'], '8.3f')} "
              f"{_f(r['ratios']['cannc/ort'], '9.3f')} "
              f"{'-' if share is None else f'{100 * share:.1f}%':>8}  {agree}")
        for e, msg in r["failed"].items():
            print(f"{'':<16} {LABELS[e]} failed: {msg[:300]}")
    print(f"median ms; EP = ORT+cannc; bars: >= {100 * SHARE_BAR:.0f}% of nodes on cannc, "
          f"EP/ORT <= 1, EP/cannc <= {NEAR_CANNC}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import onnxruntime as ort
    cores = args.cores or usable_cores()
    engines = ENGINES + (["openvino"] if args.openvino else [])
    machine = {"cpu_model": model_name(), "usable_cores": usable_cores(),
               "onnxruntime": ort.__version__, "platform": platform.platform(),
               "python": platform.python_version()}
    print(f"CPU: {machine['cpu_model']}; onnxruntime {ort.__version__}; {cores} thread(s) "
          f"per engine, each in its own process; warmup {args.warmup}, runs {args.runs} x "
          f"rounds {args.rounds}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ep_bench_") as tmpd:
        for label, path, feeds in model_list(args, Path(tmpd)):
            try:
                rounds = [bench(str(path), feeds, threads=cores, warmup=args.warmup,
                                runs=args.runs, engines=engines, precision=args.precision,
                                timeout=args.timeout, workdir=tmpd, errors="record")
                          for _ in range(args.rounds)]
            except WorkerError as e:   # ORT CPU itself failed: no reference
                rows.append({"model": label, "path": str(path), "error": str(e)})
                print(f"  {label}: {e}", flush=True)
                continue
            row = summarise(label, path, feeds, rounds)
            rows.append(row)
            med = {e: f"{v['median_ms']:.3f}" for e, v in row["engines"].items()}
            print(f"  {label}: {med}" + (f" failed: {sorted(row['failed'])}"
                                          if row["failed"] else ""), flush=True)
    print()
    print_table(rows)
    out = {"machine": machine, "threads": cores, "settings": vars(args), "engines": engines,
           "rows": rows, "share_bar": SHARE_BAR, "near_cannc": NEAR_CANNC,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
