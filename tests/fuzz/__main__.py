"""The long fuzzing campaign: random valid graphs, cannc against onnxruntime.

    python -m tests.fuzz --minutes 30 [--seed N] [--out DIR] [--cores 2]
    python -m tests.fuzz --repro DIR          # re-check one saved reproducer

Seeds run from --seed upwards until the time is up; every failing case is saved under
--out (default ./fuzz-failures) as model.onnx + feeds.npz + report.txt.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

# the IR verifier after every pass: a broken invariant is caught where it is made
os.environ.setdefault("CANNC_VERIFY", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1_000_000, help="first seed")
    ap.add_argument("--count", type=int, default=None, help="at most this many graphs")
    ap.add_argument("--out", default="fuzz-failures", help="directory for reproducers")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--repro", default=None, help="re-check a saved reproducer directory")
    ap.add_argument("--only", default=None,
                    help="comma-separated op types the random choices take (targeted runs)")
    ap.add_argument("--nodes", type=int, default=None, help="nodes per graph (default 2-11)")
    a = ap.parse_args(argv)

    from .gen import random_model
    from .run import campaign, check, load_reproducer, summary
    if a.repro:
        from .gen import Case
        model, feeds = load_reproducer(a.repro)
        r = check(Case(-1, model, feeds, []), a.cores)
        print(r.kind, r.detail)
        return 1 if r.failed else 0
    seeds = itertools.count(a.seed) if a.count is None else range(a.seed, a.seed + a.count)
    t0 = time.monotonic()
    only = frozenset(a.only.split(",")) if a.only else None
    results = campaign(seeds, a.out, deadline=t0 + 60 * a.minutes, cores=a.cores,
                       log=lambda s: print(s, flush=True),
                       gen=lambda seed: random_model(seed, a.nodes, only))
    print(summary(results), flush=True)
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
