"""Two cannc checkouts on one model, each run in its own process, taking turns.

    git worktree add /tmp/before <rev>
    python benchmarks/ab.py /tmp/before . MODEL.onnx SHAPE [--cores 2] [--rounds 4] [--runs N]

SHAPE is every input's shape (e.g. 1x128 for input_ids and attention_mask, or
1x3x224x224): integer inputs get ids below 1000 (masks: ones), float inputs normal
values. Per round each checkout compiles the model in a fresh process (its own cache
directory, so nothing is shared), runs 5 warm-up and `--runs` timed runs; the rounds
alternate so a shared machine's drift falls on both alike. Prints medians and minimums
of all timed runs and after/before: the figures of this repository's A/B commit
messages. (Rivals are compared by run_zoo.py; this compares cannc with itself.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r'''
import sys, time, json, numpy as np
import cannc
sess = cannc.compile(sys.argv[1], cores=int(sys.argv[3]))
shape = [int(v) for v in sys.argv[2].split("x")]
rng = np.random.default_rng(0)
feeds = {}
for inp in sess.get_inputs():
    if "int" in inp.type:
        feeds[inp.name] = (np.ones(shape, np.int64) if "mask" in inp.name
                           else rng.integers(0, 1000, shape).astype(np.int64))
    else:
        feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
for _ in range(5):
    sess.run(None, feeds)
for _ in range(64):   # past a program's trial of core 0 alone (runtime/corechoice.py)
    if getattr(sess, "settled", True):   # (a checkout without the choice: True)
        break
    sess.run(None, feeds)
ts = []
for _ in range(int(sys.argv[4])):
    t = time.perf_counter()
    sess.run(None, feeds)
    ts.append(time.perf_counter() - t)
print(json.dumps(ts))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", help="checkout directory of the 'before' code")
    ap.add_argument("after", help="checkout directory of the 'after' code")
    ap.add_argument("model")
    ap.add_argument("shape")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--runs", type=int, default=0,
                    help="timed runs per round (default 40 at batch 1, else 8)")
    a = ap.parse_args()
    runs = a.runs or (40 if a.shape.startswith("1x") else 8)
    model = str(Path(a.model).resolve())
    res: dict[str, list[float]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.rounds):
            for name, root in (("before", a.before), ("after", a.after)):
                env = dict(os.environ, PYTHONPATH=str(Path(root).resolve()),
                           CANNC_CACHE_DIR=os.path.join(tmp, name))
                out = subprocess.run([sys.executable, "-c", CHILD, model, a.shape,
                                      str(a.cores), str(runs)],
                                     env=env, capture_output=True, text=True, cwd=tmp)
                if out.returncode:
                    sys.exit(f"{name}: {out.stderr[-2000:]}")
                res[name] += json.loads(out.stdout.strip().splitlines()[-1])
    for k, v in res.items():
        print(f"{k:7s} median {1e3 * statistics.median(v):8.3f} ms  min {1e3 * min(v):8.3f}"
              f"  n={len(v)}")
    ratio = statistics.median(res["after"]) / statistics.median(res["before"])
    print(f"after/before {ratio:.3f}")


if __name__ == "__main__":
    main()
