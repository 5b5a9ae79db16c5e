"""Speed of the zoo models under the small (PIC) and the large (static) code model.

    python benchmarks/codemodel_bench.py [--models bert gpt resnet] [--rounds 5]
                                         [--runs 40] [--batch 1] [--seq 16] [--cores 1]

cannc alone (no onnxruntime in the process). Every measurement is a fresh Python
process that compiles the model (from a warm per-setting cache directory, so only the
first round generates code) and times --runs runs after 5 warm-up runs; its median is
one sample. Rounds alternate small/large (small, large, large, small, ...) so drift of
a shared machine falls on both; printed per model: the median over rounds of the
per-process medians, the spread, and large/small (> 1: the large model is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import json, statistics, sys, time
    name, model, runs, batch, cores, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), \\
        int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    import cannc
    from cannc.native import target
    from models import zoo
    target.CODE_MODEL = {"small": ("default", "pic"), "large": ("large", "static")}[model]
    m = zoo.build(name)
    feeds = zoo.example_inputs(m, batch=batch, seq=seq)
    sess = cannc.compile(m, cores=cores)
    for _ in range(5):
        sess.run(None, feeds)
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        sess.run(None, feeds)
        ts.append(time.perf_counter() - t)
    print(json.dumps(statistics.median(ts)))
""")


def sample(name: str, model: str, cache: str, a) -> float:
    env = dict(os.environ, CANNC_CACHE_DIR=cache,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", CHILD, name, model, str(a.runs), str(a.batch),
                          str(a.cores), str(a.seq)], env=env, capture_output=True,
                         text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["bert", "gpt", "resnet"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cores", type=int, default=1)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--out")
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        caches = {m: str(Path(tmp) / m) for m in ("small", "large")}
        for name in a.models:
            got: dict[str, list[float]] = {"small": [], "large": []}
            for r in range(a.rounds):
                order = ("small", "large") if r % 2 == 0 else ("large", "small")
                for model in order:
                    got[model].append(sample(name, model, caches[model], a))
            med = {m: statistics.median(v) for m, v in got.items()}
            results[name] = {"small_ms": [round(t * 1e3, 3) for t in got["small"]],
                             "large_ms": [round(t * 1e3, 3) for t in got["large"]],
                             "ratio_large_small": med["large"] / med["small"]}
            print(f"{name:8s} small {med['small'] * 1e3:8.3f} ms "
                  f"[{min(got['small']) * 1e3:.3f}-{max(got['small']) * 1e3:.3f}]  "
                  f"large {med['large'] * 1e3:8.3f} ms "
                  f"[{min(got['large']) * 1e3:.3f}-{max(got['large']) * 1e3:.3f}]  "
                  f"large/small {med['large'] / med['small']:.3f}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
