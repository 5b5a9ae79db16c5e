"""Pipelined throughput: requests in flight through Session.run_async (copy-in, compute
and copy-out on their own streams) against one Session.run at a time, on a model whose
host<->device copies are a visible share of its time (16 MiB in and out, a light map).

    python benchmarks/pipeline_bench.py [--trials 10] [--requests 12] [--cores 1]

Trials alternate the two modes; medians of the per-trial throughputs are printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cannc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--cores", type=int, default=1)
    ap.add_argument("--elems", type=int, default=1 << 22)
    args = ap.parse_args()
    n = args.elems
    g = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Mul", ["t", "x"], ["y"])],
        "copy_heavy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    sess = cannc.compile(m, cores=args.cores)
    x = sess.device.malloc_host((n,), np.float32)    # pinned: copied asynchronously
    x[...] = np.random.default_rng(0).random(n, dtype=np.float32)
    feeds = {"x": x}
    prof = sess.profile(feeds, runs=10)
    k = args.requests
    sync, pipe = [], []
    for _ in range(args.trials):
        t = time.perf_counter()
        for _ in range(k):
            sess.run(None, feeds)
        sync.append(k / (time.perf_counter() - t))
        t = time.perf_counter()
        futs = [sess.run_async(None, feeds) for _ in range(k)]
        for f in futs:
            f.result()
        pipe.append(k / (time.perf_counter() - t))
    s, p = statistics.median(sync), statistics.median(pipe)
    print(f"one run: copy-in {prof.h2d_ms:.2f} ms, compute {prof.compute_ms:.2f} ms, "
          f"copy-out {prof.d2h_ms:.2f} ms ({args.cores} AI core(s))")
    print(f"one at a time: {s:.1f} req/s (median of {args.trials}); "
          f"{sess.inflight} in flight: {p:.1f} req/s; x{p / s:.2f}")


if __name__ == "__main__":
    main()
