"""The zoo side by side with onnxruntime: every model at 1 and 2 threads, batch 1 and 8.

    python benchmarks/run_zoo.py [--models mlp bert ...] [--cores 1 2] [--batch 1 8]
                                 [--runs 30] [--out benchmarks/results/zoo.json]

cannc and onnxruntime (ORT_ENABLE_ALL, the same thread count, spinning off) run
alternately in one process on the same inputs; medians, spreads and the ratio
cannc/onnxruntime (< 1: cannc is faster) are printed and written as JSON, plus
the geometric mean of the ratios per thread count. The machines are shared:
compare ratios, not absolute times, and repeat noisy runs.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cannc  # noqa: E402
from cannc.cli import _ort_session, bench  # noqa: E402
from models import zoo  # noqa: E402

SEQ = {"bert": 128, "gpt": 128}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(zoo.ZOO))
    ap.add_argument("--cores", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--batch", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "zoo.json"))
    args = ap.parse_args(argv)
    rows = []
    print(f"{'model':<10} {'batch':>5} {'cores':>5} {'cannc ms':>9} {'ort ms':>9} {'ratio':>6}"
          f"  {'compile s':>9}")
    for name in args.models:
        model = zoo.build(name)
        data = model.SerializeToString()
        for cores in args.cores:
            ort_sess = _ort_session(data, cores, spinning=False)
            for batch in args.batch:
                feeds = zoo.example_inputs(model, batch=batch, seq=SEQ.get(name, 16))
                t0 = time.perf_counter()
                sess = cannc.compile(model, cores=cores,
                                     shapes={k: v.shape for k, v in feeds.items()})
                compile_s = time.perf_counter() - t0
                r = bench(sess, ort_sess, feeds, args.warmup, args.runs)
                rows.append({"model": name, "batch": batch, "cores": cores,
                             "shapes": {k: list(v.shape) for k, v in feeds.items()},
                             "cannc": r["cannc"], "ort": r["ort"], "ratio": r["ratio"],
                             "compile_s": compile_s})
                print(f"{name:<10} {batch:>5} {cores:>5} {r['cannc']['median_ms']:9.3f} "
                      f"{r['ort']['median_ms']:9.3f} {r['ratio']:6.3f}  {compile_s:9.2f}",
                      flush=True)
    geo = {}
    for cores in args.cores:
        rs = [r["ratio"] for r in rows if r["cores"] == cores]
        if rs:
            geo[str(cores)] = math.exp(sum(math.log(x) for x in rs) / len(rs))
            print(f"geomean ratio cannc/ort at {cores} thread(s): {geo[str(cores)]:.3f}")
    out = {"machine": platform.processor() or platform.machine(),
           "cannc": cannc.__version__, "rows": rows, "geomean_ratio": geo,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
