"""A short soak: 16 threads on one session (the long one: `python -m tests.soak`)."""

from __future__ import annotations

from tests.soak import soak


def test_sixteen_threads_on_one_session_agree_and_do_not_grow():
    r = soak("mlp", threads=16, runs=400, cores=2)
    assert r.wrong == 0 and not r.errors, r.errors[:3]
    # resident memory after the warm-up (every execution context made) stays flat: a leak
    # of 40 KiB or more per run would show (9,000 runs of BERT measured +3 MiB, flat)
    assert r.growth_mib < 16, f"resident memory grew {r.growth_mib:.1f} MiB in {r.runs} runs"
