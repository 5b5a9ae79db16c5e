"""Latency after an idle gap (low-rate serving), cannc and onnxruntime each in its own process.

    python benchmarks/idle_bench.py [--models gpt mobilenet bert] [--cores 1 2]
                                    [--gaps 0.05 0.2 1] [--out benchmarks/results/idle.json]
                                    [--label after]

For every model (models/zoo.py, batch 1, sequence 128) and core count, each engine
runs in a fresh process with its own defaults (onnxruntime: intra-op threads = cores,
its default spinning policy): a few warm-up runs, the median of back-to-back runs,
then the median latency of one run following each idle gap (sleep, run, sleep, run...),
and the process CPU time burnt over a 2 s idle period after a run (a core that keeps
spinning while idle shows ~2 s here). cannc also reports where a run's time went for
the first run after the longest gap (host copy-in, compute, copy-out, and how late
core 1 started its first kernel relative to core 0).

The machines are shared (VMs with 2 vCPUs): compare ratios, repeat noisy figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def child(engine: str, model_name: str, cores: int, gaps: list[float], reps: int) -> dict:
    import numpy as np

    from models import zoo
    model = zoo.build(model_name)
    feeds = zoo.example_inputs(model, batch=1, seq=128)
    if engine == "cannc":
        import cannc
        sess = cannc.compile(model, cores=cores, shapes={k: v.shape for k, v in feeds.items()})
    else:
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.intra_op_num_threads = cores
        sess = ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
    ref = sess.run(None, feeds)
    calls: list[float] = []

    def one() -> float:
        t = time.perf_counter()
        out = sess.run(None, feeds)
        dt = time.perf_counter() - t
        for a, b in zip(out, ref):
            if not np.array_equal(a, b):
                d = np.abs(a.astype(np.float64) - b)
                raise SystemExit(f"{engine} {model_name}: outputs changed between runs (run "
                                 f"{len(calls)}, max |diff| {d.max():.3g} at {int((d > 0).sum())}"
                                 f" of {d.size} elements)")
        calls.append(dt)
        return dt * 1e3

    for _ in range(5):
        one()
    for _ in range(64):   # past a program's trial of core 0 alone (runtime/corechoice.py)
        if getattr(sess, "settled", True):   # (a checkout without the choice: True)
            break
        one()
    res: dict = {"engine": engine, "model": model_name, "cores": cores}
    b2b = [one() for _ in range(40)]
    res["back_to_back_ms"] = statistics.median(b2b)
    res["gaps"] = {}
    for gap in gaps:
        lat = []
        for _ in range(reps if gap < 1 else max(3, reps // 2)):
            time.sleep(gap)
            lat.append(one())
        res["gaps"][str(gap)] = {"median_ms": statistics.median(lat), "max_ms": max(lat),
                                 "min_ms": min(lat)}
    one()
    c0 = _cpu_s()
    time.sleep(2.0)
    res["idle_cpu_s_over_2s"] = _cpu_s() - c0
    if engine == "cannc":
        res["breakdown_after_gap"] = breakdown(sess, feeds, max(gaps))
    return res


def breakdown(sess, feeds: dict, gap: float) -> dict:
    """Where the first run after an idle gap spends its time (cannc's RunTimes)."""
    from cannc.runtime.program import RunTimes
    prog = next(iter(sess._programs.values()))
    rows = []
    for _ in range(3):
        time.sleep(gap)
        t = RunTimes()
        prog.execute({k: v for k, v in feeds.items() if k in prog.input_names}, t)
        cyc = t.cycles
        row = {"copy_in_ms": (t.t_h2d_end - t.t_start) * 1e3,
               "compute_ms": (t.t_compute_end - t.t_h2d_end) * 1e3,
               "copy_out_ms": (t.t_end - t.t_compute_end) * 1e3}
        if cyc is not None and cyc.shape[1] > 1:
            per_ms = _cycles_per_ms(prog)
            starts = [int(cyc[:, c, 0][cyc[:, c, 0] > 0].min()) if (cyc[:, c, 0] > 0).any()
                      else None for c in range(cyc.shape[1])]
            if starts[1] is not None:
                row["core1_late_ms"] = (starts[1] - t.cycles0) / per_ms
                row["core1_kernels_worked"] = int((cyc[:, 1, 0] > 0).sum())
            row["kernels"] = int(cyc.shape[0])
            row["core0_busy_ms"] = float(cyc[:, 0, 2].sum()) / per_ms
            row["core1_busy_ms"] = float(cyc[:, 1, 2].sum()) / per_ms
        rows.append(row)
    return {"gap_s": gap, "runs": rows}


_CPM: float | None = None


def _cycles_per_ms(prog) -> float:
    global _CPM
    if _CPM is None:
        c0, t0 = prog.cycles(), time.perf_counter()
        time.sleep(0.05)
        _CPM = (prog.cycles() - c0) / ((time.perf_counter() - t0) * 1e3)
    return _CPM


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["gpt", "mobilenet", "bert"])
    ap.add_argument("--cores", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--engines", nargs="*", default=["cannc", "ort"])
    ap.add_argument("--gaps", nargs="*", type=float, default=[0.05, 0.2, 1.0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "idle.json"))
    ap.add_argument("--label", default="after", help="key of this set in the results file")
    ap.add_argument("--child", nargs=3, metavar=("ENGINE", "MODEL", "CORES"))
    args = ap.parse_args(argv)
    if args.child:
        e, m, c = args.child
        print(json.dumps(child(e, m, int(c), args.gaps, args.reps)))
        return 0
    rows = []
    for m in args.models:
        for c in args.cores:
            for e in args.engines:
                cmd = [sys.executable, __file__, "--child", e, m, str(c), "--reps",
                       str(args.reps), "--gaps", *map(str, args.gaps)]
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if p.returncode != 0:
                    print(p.stderr, file=sys.stderr)
                    return 1
                r = json.loads(p.stdout.strip().splitlines()[-1])
                rows.append(r)
                gaps = "  ".join(f"{g}s {v['median_ms']:.3f}" for g, v in r["gaps"].items())
                print(f"{m:10s} {c} cores {e:5s}: back-to-back {r['back_to_back_ms']:.3f} ms; "
                      f"after idle {gaps} ms; idle CPU {r['idle_cpu_s_over_2s']:.3f} s/2 s",
                      flush=True)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    # each set names its machine (the top-level cpu_model/nproc describe the sets that
    # do not: the file's first machine, never overwritten by a later one)
    data.setdefault("cpu_model", cpu_model())
    data.setdefault("nproc", os.cpu_count())
    data.setdefault("sets", {})[args.label] = {"date": time.strftime("%Y-%m-%d %H:%M"),
                                               "cpu_model": cpu_model(),
                                               "nproc": os.cpu_count(), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
