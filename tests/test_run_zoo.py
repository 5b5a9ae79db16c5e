"""benchmarks/run_zoo.py's re-measuring of two-core rows taken while the guest's vCPUs
shared no L3 (_measure), with the timing run and the round-trip probe stubbed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import run_zoo  # noqa: E402


def _args(retries: int) -> argparse.Namespace:
    return argparse.Namespace(warmup=1, runs=2, rounds=1, split_retries=retries)


@pytest.fixture
def machine(monkeypatch):
    """Stub probe and bench: `machine.rtts` are the round trips read in turn; each bench
    call returns its attempt number."""
    class M:
        rtts: list[float] = []
        calls = 0
    m = M()

    def probe() -> float:
        return m.rtts.pop(0)

    def bench(*a, **k) -> dict:
        m.calls += 1
        return {"attempt": m.calls}
    monkeypatch.setattr(run_zoo, "round_trip_ns", probe)
    monkeypatch.setattr(run_zoo, "bench", bench)
    monkeypatch.setattr(run_zoo.time, "sleep", lambda s: None)
    return m


def test_a_split_row_is_measured_again_and_the_attempt_recorded(machine):
    machine.rtts = [70.0, 350.0, 340.0, 60.0, 65.0, 72.0]
    r, rtt0, rtt1, given_up = run_zoo._measure(_args(3), "m.onnx", {}, 2, ["ort"], Path("."))
    assert r == {"attempt": 3} and (rtt0, rtt1) == (65.0, 72.0)
    assert given_up == [[70.0, 350.0], [340.0, 60.0]]


def test_the_last_attempt_is_kept_whatever_its_state(machine):
    machine.rtts = [350.0, 340.0, 330.0, 360.0]
    r, rtt0, rtt1, given_up = run_zoo._measure(_args(1), "m.onnx", {}, 2, ["ort"], Path("."))
    assert r == {"attempt": 2} and (rtt0, rtt1) == (330.0, 360.0)
    assert given_up == [[350.0, 340.0]]


def test_no_retry_by_default_nor_on_one_core(machine):
    machine.rtts = [350.0, 340.0]
    r, *_, given_up = run_zoo._measure(_args(0), "m.onnx", {}, 2, ["ort"], Path("."))
    assert r == {"attempt": 1} and given_up == []
    r, rtt0, rtt1, given_up = run_zoo._measure(_args(5), "m.onnx", {}, 1, ["ort"], Path("."))
    assert r == {"attempt": 2} and rtt0 is None and rtt1 is None and given_up == []
