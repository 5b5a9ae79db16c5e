"""The zoo side by side with onnxruntime and OpenVINO: every model at 1 and 2 threads,
batch 1 and 8.

    python benchmarks/run_zoo.py [--models mlp bert ...] [--onnx A.onnx B.onnx]
                                 [--cores 1 2] [--batch 1 8] [--seq 128]
                                 [--engines ort cannc openvino]
                                 [--runs 30] [--rounds 5] [--no-gemm]
                                 [--out benchmarks/results/zoo.json]

Each engine runs in its own process (cannc.sidebyside.bench: cannc alone, onnxruntime
with its own defaults -- ORT_ENABLE_ALL, the same thread count, spinning on -- and
OpenVINO's CPU plugin when it is importable: fp32 inference precision, the latency hint,
one stream, the same thread count, reshaped to the static shapes), on the same inputs:
in one process ORT's pool threads spin after each run and steal the second core from
whichever session runs next. The processes stay alive and take turns, --rounds batches
of the runs each (default 5; one untimed run starts each batch), so that a shared
machine's drift over seconds falls on every engine alike. Medians, spreads and the ratios
cannc/onnxruntime and cannc/OpenVINO (< 1: cannc is faster) are printed and written as
JSON with the CPU model, plus the geometric mean of the ratios per thread count; every
output is compared with onnxruntime's. OpenVINO is a benchmark rival, never a cannc
dependency (`pip install openvino`); without it its column is empty. ``--onnx`` adds
models from files (e.g. PyTorch exports; symbolic dims named batch/seq take
--batch/--seq).
Last, a 1024^3 fp32 MatMul with a constant B, compiled by cannc and run on one
core, against the machine's measured fp32 peak and onnxruntime's MatMul.
The machines are shared: compare ratios, not absolute times, and repeat noisy runs.
Two-core rows record the cache-line round trip between the two CPUs before and after
(benchmarks/corelat.py): on the 2-vCPU guests it flips between ~55 ns and 330-440 ns,
and every engine's two-core times with it; --split-retries N measures such a row again
(up to N times) when either reading is over SPLIT_NS, and records the readings of the
attempts given up. Outputs that differ from onnxruntime's beyond
the float32 tolerance are judged against the model evaluated in float64
(sidebyside.float64_referee).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onnx

import cannc
from cannc.native.target import host
from cannc.schedule.machine import family_model, model_name
from cannc.sidebyside import bench, bench_interleaved, ort_session, referee_summary
from models import zoo

sys.path.insert(0, str(ROOT / "benchmarks"))
from corelat import round_trip_ns


def gemm_figure(runs: int) -> dict:
    """GFLOP/s of a compiled 1024^3 MatMul with constant weights on one core, next to
    onnxruntime (one thread) and the measured fp32 peak of one core."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from cannc.schedule.machine import measure_fma_peak

    n = 1024
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, n)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"])], "gemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, n])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"a": rng.standard_normal((n, n)).astype(np.float32)}
    sess = cannc.compile(model, cores=1)
    r = bench_interleaved(sess, ort_session(model.SerializeToString(), 1, spinning=False),
                          feeds, 3, runs)
    flop = 2.0 * n ** 3
    peak = measure_fma_peak()
    out = {"shape": [n, n, n], "peak_gflops": peak,
           "cannc_gflops": flop / r["cannc"]["min_ms"] / 1e6,
           "cannc_median_gflops": flop / r["cannc"]["median_ms"] / 1e6,
           "ort_median_gflops": flop / r["ort"]["median_ms"] / 1e6}
    out["cannc_pct_of_peak"] = 100 * out["cannc_gflops"] / peak
    out["cannc_median_pct_of_peak"] = 100 * out["cannc_median_gflops"] / peak
    print(f"GEMM 1024^3 fp32, constant B, 1 core (session.run, copies included): "
          f"cannc {out['cannc_median_gflops']:.1f} GFLOP/s median "
          f"({out['cannc_median_pct_of_peak']:.0f}% of the measured peak {peak:.0f}), "
          f"best {out['cannc_gflops']:.1f} ({out['cannc_pct_of_peak']:.0f}%); "
          f"onnxruntime {out['ort_median_gflops']:.1f} GFLOP/s median")
    return out


def referee_note(r: dict) -> str:
    """One line on outputs that disagree: the largest errors, and what the float64
    referee (sidebyside.float64_referee) says of them."""
    errs = ", ".join(f"{e} max_abs {c['max_abs']:.3g} max_rel {c['max_rel']:.3g}"
                     for e, c in (r.get("outputs") or {}).items() if not c.get("ok"))
    return f"{errs}; float64 referee: {referee_summary(r.get('float64_referee') or {})}"


SPLIT_NS = 250.0   # a cache-line round trip above this: the two vCPUs share no L3


def _measure(args: argparse.Namespace, path: str, feeds: dict, cores: int,
             engines: list[str], tmp: Path) -> tuple[dict, float | None, float | None, list]:
    """One row: (bench's result, round trip before, after, the round trips of attempts
    given up). A two-core row measured while the guest's vCPUs shared no L3 at its start
    or end (corelat.py) is measured again, --split-retries times at most, after a pause;
    the last attempt is kept whatever its state. Which attempt counts depends only on
    the machine's state, never on the times measured, and every engine of a row is
    measured in the same attempt."""
    given_up: list[list[float]] = []
    while True:
        rtt0 = round_trip_ns() if cores > 1 else None
        r = bench(path, feeds, threads=cores, warmup=args.warmup, runs=args.runs,
                  engines=engines, errors="record", workdir=str(tmp), rounds=args.rounds)
        rtt1 = round_trip_ns() if cores > 1 else None
        if rtt0 is None or rtt1 is None or max(rtt0, rtt1) <= SPLIT_NS or \
                len(given_up) >= args.split_retries:
            return r, rtt0, rtt1, given_up
        given_up.append([rtt0, rtt1])
        print(f"  round trip {rtt0:.0f} / {rtt1:.0f} ns: the vCPUs shared no L3; measuring "
              "the row again", flush=True)
        time.sleep(5)


def _rows(args: argparse.Namespace, models: list, engines: list[str], tmp: Path
          ) -> list[dict]:
    """Each model at each core count and batch, every engine in its own process."""
    rows: list[dict] = []
    for name, model in models:
        path = tmp / f"{name}.onnx"
        onnx.save(model, path)
        for cores in args.cores:
            for batch in args.batch:
                feeds = zoo.example_inputs(model, batch=batch, seq=args.seq)
                r, rtt0, rtt1, split = _measure(args, str(path), feeds, cores, engines, tmp)
                c, o = r["engines"].get("cannc", {}), r["engines"].get("ort", {})
                v = r["engines"].get("openvino", {})
                if "median_ms" not in c or "median_ms" not in o:
                    print(f"{name:<12} {batch:>5} {cores:>5} failed: "
                          f"{r.get('failed')}", flush=True)
                    continue
                rows.append({"model": name, "batch": batch, "cores": cores,
                             "shapes": {k: list(v.shape) for k, v in feeds.items()},
                             "cannc": c, "ort": o, "ratio": r["ratios"]["cannc"],
                             "outputs_agree": r.get("outputs_agree"),
                             "outputs": r.get("outputs"),
                             "float64_referee": r.get("float64_referee"),
                             # the guest's state (corelat.py): before and after the row
                             "cross_core_rtt_ns": None if rtt0 is None else [rtt0, rtt1],
                             "compile_s": c.get("build_s"), "first_run_s": c.get("first_run_s")})
                if split:
                    # (the round trips before and after each attempt given up)
                    rows[-1]["split_attempts_ns"] = split
                if "median_ms" in v:
                    rows[-1]["openvino"] = v
                    rows[-1]["ratio_openvino"] = c["median_ms"] / v["median_ms"]
                elif "openvino" in engines:
                    rows[-1]["openvino_missing"] = (r["skipped"].get("openvino")
                                                    or r["failed"].get("openvino"))
                ov_ms = f"{v['median_ms']:9.3f}" if "median_ms" in v else f"{'-':>9}"
                ov_r = (f"{rows[-1]['ratio_openvino']:6.3f}" if "ratio_openvino" in rows[-1]
                        else f"{'-':>6}")
                print(f"{name:<12} {batch:>5} {cores:>5} {c['median_ms']:9.3f} "
                      f"{o['median_ms']:9.3f} {ov_ms} {rows[-1]['ratio']:6.3f} {ov_r}  "
                      f"{c.get('build_s') or 0:9.2f} {c.get('first_run_s') or 0:9.2f}",
                      flush=True)
                if cores > 1 and c.get("core_choice"):
                    print(f"  cannc launches on {'; '.join(c['core_choice'])}")
                if rows[-1]["cross_core_rtt_ns"]:
                    a, b = rows[-1]["cross_core_rtt_ns"]
                    print(f"  cache-line round trip between the CPUs {a:.0f} / {b:.0f} ns "
                          "before / after (~55: shared L3; 300+: not, 2-core figures slower)")
                if not r.get("outputs_agree"):
                    print(f"  outputs differ from onnxruntime's: {referee_note(r)}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(zoo.ZOO))
    ap.add_argument("--onnx", nargs="*", default=[], help="more models from ONNX files")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--no-gemm", action="store_true", help="skip the 1024^3 GEMM figure")
    ap.add_argument("--cores", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--batch", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5,
                    help="the engines take turns in this many batches of the runs")
    ap.add_argument("--engines", nargs="*", default=["ort", "cannc", "openvino"],
                    help="engines to time (ORT CPU always runs: it is the reference)")
    ap.add_argument("--split-retries", type=int, default=0,
                    help="measure a two-core row again, up to this many times, when the "
                         "cache-line round trip before or after it says the two CPUs "
                         f"shared no L3 (over {SPLIT_NS:.0f} ns; corelat.py)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "zoo.json"))
    args = ap.parse_args(argv)
    engines = ["ort"] + [e for e in dict.fromkeys(args.engines) if e != "ort"]
    print(f"{'model':<12} {'batch':>5} {'cores':>5} {'cannc ms':>9} {'ort ms':>9} {'ov ms':>9}"
          f" {'c/ort':>6} {'c/ov':>6}  {'compile s':>9} {'1st run s':>9}")
    models = [(name, zoo.build(name)) for name in args.models]
    models += [(Path(p).stem, onnx.load(p)) for p in args.onnx]
    import tempfile

    with tempfile.TemporaryDirectory(prefix="cannc-run-zoo-") as d:
        rows = _rows(args, models, engines, Path(d))
    geo: dict[str, float] = {}
    geo_ov: dict[str, float] = {}
    for cores in args.cores:
        rs = [r["ratio"] for r in rows if r["cores"] == cores]
        if rs:
            geo[str(cores)] = math.exp(sum(math.log(x) for x in rs) / len(rs))
            print(f"geomean ratio cannc/ort at {cores} thread(s): {geo[str(cores)]:.3f}")
        rs = [r["ratio_openvino"] for r in rows if r["cores"] == cores and "ratio_openvino" in r]
        if rs:
            geo_ov[str(cores)] = math.exp(sum(math.log(x) for x in rs) / len(rs))
            print(f"geomean ratio cannc/openvino at {cores} thread(s) ({len(rs)} rows): "
                  f"{geo_ov[str(cores)]:.3f}")
    gemm = None if args.no_gemm else gemm_figure(args.runs)
    out = {"machine": platform.processor() or platform.machine(), "cpu_model": model_name(),
           "llvm_cpu": host().cpu, "cpu_family_model": family_model(),
           "engines": "each in its own process",
           # instruction-set limits the engines ran under (inherited by their processes):
           # cannc's CANNC_ISA, oneDNN's (OpenVINO's CPU plugin) ONEDNN_MAX_CPU_ISA;
           # onnxruntime has none
           "isa_limits": {k: os.environ[k] for k in ("CANNC_ISA", "ONEDNN_MAX_CPU_ISA")
                          if os.environ.get(k)},
           "cannc": cannc.__version__, "rows": rows, "geomean_ratio": geo,
           "geomean_ratio_openvino": geo_ov, "gemm": gemm,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
