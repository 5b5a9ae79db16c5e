"""The core choice of a program (runtime/corechoice.py): every core, or core 0 alone where
that measured faster; the trial's state machine on synthetic times, and its wiring into
Program launches."""

from __future__ import annotations

import numpy as np
import pytest

import cannc
from cannc.runtime import corechoice as cc
from cannc.runtime.corechoice import CoreChoice
from models import zoo


def drive(choice: CoreChoice, every: float, one: float, limit: int = 200) -> list[int]:
    """Launch until decided: each timed launch takes `every` s on every core and `one` on
    one; the cores of every launch."""
    used = []
    for _ in range(limit):
        if choice.decided:
            break
        cores, tag = choice.next()
        used.append(cores)
        if tag == "warm":
            choice.record(cores, every, tag)
        elif tag is not None:
            choice.record(cores, one if cores == 1 else every, tag)
    return used


def test_one_core_kept_where_it_is_faster():
    c = CoreChoice(2, enable=True)
    used = drive(c, every=120e-6, one=100e-6)
    assert c.decided and c.use == 1
    assert used[:cc.WARM] == [2] * cc.WARM
    # blocks of BLOCK launches, every core first; decided after MIN_PAIRS pairs
    trial = used[cc.WARM:]
    assert trial == ([2] * cc.BLOCK + [1] * cc.BLOCK) * cc.MIN_PAIRS
    assert c.next() == (1, None) and c.next() == (1, None)
    every, one, pairs = c.measured
    assert (every, one, pairs) == pytest.approx((0.12, 0.1, cc.MIN_PAIRS))
    assert c.describe().startswith("1 of 2 AI cores")


def test_every_core_kept_where_one_is_plainly_slower_after_min_pairs():
    c = CoreChoice(2, enable=True)
    used = drive(c, every=100e-6, one=200e-6)
    assert c.decided and c.use == 2 and len(used) == cc.WARM + 2 * cc.BLOCK * cc.MIN_PAIRS
    assert c.next() == (2, None)
    assert c.describe().startswith("all 2 AI cores")


def test_a_tie_keeps_every_core_after_every_pair():
    c = CoreChoice(2, enable=True)
    used = drive(c, every=100e-6, one=99e-6)      # within MARGIN: not worth a switch
    assert c.decided and c.use == 2 and len(used) == cc.WARM + 2 * cc.BLOCK * cc.PAIRS


def test_long_launches_skip_the_trial():
    c = CoreChoice(2, enable=True)
    used = drive(c, every=cc.TRIAL_MAX_S, one=0.0)
    assert used == [2] * cc.WARM and c.decided and c.use == 2
    assert "no trial" in c.describe()


def test_the_first_launch_of_a_block_is_not_timed():
    c = CoreChoice(2, enable=True)
    tags = [c.next() for _ in range(cc.WARM + 2 * cc.BLOCK)]
    assert [t for _, t in tags[:cc.WARM]] == [None] * (cc.WARM - 1) + ["warm"]
    for b in range(2):
        block = tags[cc.WARM + b * cc.BLOCK:cc.WARM + (b + 1) * cc.BLOCK]
        assert [t for _, t in block] == [None] + ["trial"] * (cc.BLOCK - 1)
        assert {n for n, _ in block} == {2 if b == 0 else 1}


def test_the_trial_runs_again_after_recheck_launches_on_one_core():
    c = CoreChoice(2, enable=True)
    drive(c, every=120e-6, one=100e-6)
    assert c.use == 1
    for _ in range(cc.RECHECK):
        assert c.next() == (1, None)
    c.next()                                       # the trial again: every core wins now
    assert not c.decided
    drive(c, every=100e-6, one=200e-6)
    assert c.decided and c.use == 2
    # a choice of every core stands: no more launches on one
    assert all(c.next() == (2, None) for _ in range(2 * cc.RECHECK))


def test_a_close_choice_of_every_core_is_tried_again():
    """Every core chosen with core 0 alone within RECLOSE (a near tie that noise can
    decide wrongly): the trial runs again after RECHECK launches and can switch to core
    0 alone; chosen by more, it stands (test above)."""
    c = CoreChoice(2, enable=True)
    drive(c, every=100e-6, one=99e-6)              # a tie: every core
    assert c.use == 2 and c.measured[1] < cc.RECLOSE * c.measured[0]
    for _ in range(cc.RECHECK):
        assert c.next() == (2, None)
    c.next()
    assert not c.decided
    drive(c, every=120e-6, one=100e-6)
    assert c.decided and c.use == 1
    c = CoreChoice(2, enable=True)
    drive(c, every=100e-6, one=100e-6 * cc.RECLOSE * 1.05)   # not close: it stands
    assert c.decided and c.use == 2
    assert all(c.next() == (2, None) for _ in range(2 * cc.RECHECK))


def test_launches_in_flight_together_leave_the_trial_alone():
    c = CoreChoice(2, enable=True)
    drive(c, every=120e-6, one=100e-6, limit=cc.WARM + cc.BLOCK + 1)   # into block 2
    assert not c.decided
    n = c._n
    # pipelined requests: every core, untimed, and the trial does not move on
    assert all(c.next(alone=False) == (2, None) for _ in range(50))
    assert c._n == n
    drive(c, every=120e-6, one=100e-6)
    assert c.decided and c.use == 1


def test_disabled_and_single_core(monkeypatch):
    monkeypatch.setenv("CANNC_CORE_CHOICE", "0")
    c = CoreChoice(2)
    assert c.decided and [c.next() for _ in range(50)] == [(2, None)] * 50
    assert "CANNC_CORE_CHOICE=0" in c.describe()
    monkeypatch.delenv("CANNC_CORE_CHOICE")
    one = CoreChoice(1)
    assert one.decided and one.next() == (1, None)


def test_program_on_one_core_leaves_the_workers_asleep():
    """A program that chose core 0 alone posts nothing to the workers; its results are
    the same, and the profile says what its launches use."""
    model = zoo.build("mlp")
    feeds = zoo.example_inputs("mlp")
    ref = cannc.compile(model, cores=1).run(None, feeds)
    sess = cannc.compile(model, cores=2)
    out = sess.run(None, feeds)
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-5, atol=1e-6)
    prog = next(iter(sess._programs.values()))
    choice = CoreChoice(2, enable=True)
    drive(choice, every=120e-6, one=100e-6)        # decided: core 0 alone
    prog.core_choice = choice
    pool = sess.device._pool
    posted = pool._posted
    for _ in range(5):
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref[0], rtol=1e-5, atol=1e-6)
    assert pool._posted == posted
    prof = cannc.runtime.profiler.profile(sess, feeds, runs=3, warmup=1)
    assert prof.core_busy_ms[1] == 0 and prof.core_busy_ms[0] > 0
    assert "launches on 1 of 2 AI cores" in prof.table()
    # and back on every core: the worker takes part again
    prog.core_choice = CoreChoice(2, enable=False)
    for _ in range(3):
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref[0], rtol=1e-5, atol=1e-6)
    assert pool._posted == posted + 3


def test_a_fresh_program_times_itself_into_a_choice():
    """Without help: a 2-core program of the zoo decides within its first few dozen
    launches (which way depends on the machine), and keeps its results."""
    model = zoo.build("mobilenet")
    feeds = zoo.example_inputs("mobilenet")
    sess = cannc.compile(model, cores=2)
    ref = sess.run(None, feeds)
    assert not sess.settled
    prog = next(iter(sess.programs.values()))
    for _ in range(cc.WARM + 2 * cc.BLOCK * cc.PAIRS):
        np.testing.assert_array_equal(sess.run(None, feeds)[0], ref[0])
    assert prog.core_choice.decided and prog.core_choice.use in (1, 2)
    assert prog.core_choice.measured is not None and sess.settled
    assert cannc.compile(model, cores=1).settled


def test_a_program_never_run_does_not_hold_settled_back():
    """The program `compile` makes for the default shapes, when every run uses other
    shapes, never launches, so never chooses: `settled` (which benchmarks wait for)
    follows the programs that run (a Hugging Face DeBERTa: its 1x1 program kept it false
    for good, and run_zoo's report named its trial as not finished)."""
    model = zoo.build("bert")
    feeds = zoo.example_inputs("bert", batch=1, seq=16)
    sess = cannc.compile(model, cores=2, shapes={k: (1, 8) for k in feeds})
    assert sess.settled            # one program, never run
    idle = next(iter(sess.programs.values())).core_choice
    assert idle.unlaunched and not idle.decided
    sess.run(None, feeds)
    assert not sess.settled        # the (1, 16) program is in its trial
    for _ in range(cc.WARM + 2 * cc.BLOCK * cc.PAIRS):
        sess.run(None, feeds)
    assert sess.settled and idle.unlaunched and len(sess.programs) == 2
