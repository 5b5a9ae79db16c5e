import argparse
import sys

from . import soak


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--cores", type=int, default=2)
    a = ap.parse_args()
    r = soak(a.model, a.threads, a.runs, a.cores)
    print(f"{a.model}: {r.runs} runs on {r.threads} threads, {a.cores} AI cores: "
          f"{r.wrong} wrong, {len(r.errors)} errors; resident memory "
          f"{r.rss_after_warmup_mib:.1f} -> {r.rss_end_mib:.1f} MiB "
          f"({r.growth_mib:+.1f})")
    for e in r.errors[:5]:
        print("  ", e)
    return 0 if not r.wrong and not r.errors else 1


if __name__ == "__main__":
    sys.exit(main())
