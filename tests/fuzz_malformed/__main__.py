"""python -m tests.fuzz_malformed --minutes N [--seed S] [--save DIR] [--timeout T]
python -m tests.fuzz_malformed --seed S --case I [-v]     one case, in this process"""

from __future__ import annotations

import argparse
import json
import random
import sys

from . import make_case, run_case


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz_malformed")
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--case", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    ap.add_argument("--save", default="fuzz_malformed_failures",
                    help="where failing cases are saved as reproducers")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cases-per-worker", type=int, default=None,
                    help="a fresh worker process every N cases (0: never; default: "
                         "campaign.CASES_PER_WORKER)")
    ap.add_argument("-v", action="store_true")
    a = ap.parse_args(argv)
    if a.worker:     # the subprocess: cases from --case on, one line per begin and end
        i = a.case or 0
        while True:
            print(f"BEGIN {i}", flush=True)
            outcome, detail = run_case(make_case(a.seed, i))
            print("END " + json.dumps({"case": i, "outcome": outcome, "detail": detail}),
                  flush=True)
            i += 1
    if a.case is not None:
        case = make_case(a.seed or 0, a.case)
        outcome, detail = run_case(case)
        print(case.describe())
        print(f"{outcome}: {detail}" if a.v or outcome not in ("ok", "error") else outcome)
        return 0 if outcome in ("ok", "error") else 1
    from .campaign import campaign
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 30)
    minutes = a.minutes if a.minutes is not None else 1.0
    print(f"seed {seed}, {minutes} min, {a.timeout:.0f} s per case; reproducers -> {a.save}")
    per = {} if a.cases_per_worker is None else {"cases_per_worker": a.cases_per_worker}
    rep = campaign(seed, minutes * 60, timeout=a.timeout, save_dir=a.save,
                   log=lambda s: print(s, flush=True), **per)
    print(f"{rep.cases} cases: {rep.outcomes}; slowest {rep.slowest[0]:.1f} s "
          f"(case {rep.slowest[1]})")
    return 0 if not rep.failures else 1


if __name__ == "__main__":
    sys.exit(main())
