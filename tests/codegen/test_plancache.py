"""The planners' results persist in the cache directory (codegen/plancache.py)."""

from __future__ import annotations

from pathlib import Path

from cannc.codegen import conv, winograd
from cannc.codegen.conv import ConvGeom


def _geom(c: int = 48, m: int = 80, hw: int = 14) -> ConvGeom:
    return ConvGeom(N=1, C=c, M=m, G=1, isz=(1, hw, hw), osz=(1, hw, hw), k=(1, 3, 3),
                    pb=(0, 1, 1), bias=True)


def test_default_plans_are_kept_on_disk_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("CANNC_CACHE_DIR", str(tmp_path))
    conv._plan_conv_default.cache_clear()
    winograd._plan_winograd_default.cache_clear()
    g = _geom()
    plan = conv.plan_conv(g, cores=2)
    wplan = winograd.plan_winograd(g, cores=2)
    files = sorted((tmp_path / "plans").iterdir())
    assert len(files) == 2
    # a new process (the memory forgotten) reads them instead of planning
    conv._plan_conv_default.cache_clear()
    winograd._plan_winograd_default.cache_clear()
    monkeypatch.setattr(conv, "_plan_conv", lambda *a: (_ for _ in ()).throw(
        AssertionError("planned again")))
    assert conv.plan_conv(g, cores=2) == plan
    assert winograd.plan_winograd(g, cores=2) == wplan
    # an explicit tuning is never served from the cache
    monkeypatch.undo()
    monkeypatch.setenv("CANNC_CACHE_DIR", str(tmp_path))
    assert conv.plan_conv(g, cores=2, tuning={"swap": False}).swap is False


def test_a_damaged_plan_file_is_planned_again(tmp_path, monkeypatch):
    monkeypatch.setenv("CANNC_CACHE_DIR", str(tmp_path))
    conv._plan_conv_default.cache_clear()
    g = _geom(32, 64, 7)
    plan = conv.plan_conv(g, cores=1)
    (f,) = Path(tmp_path, "plans").iterdir()
    f.write_bytes(f.read_bytes()[:-3] + b"xyz")     # checksum no longer matches
    conv._plan_conv_default.cache_clear()
    assert conv.plan_conv(g, cores=1) == plan
    f.write_bytes(b"garbage")
    conv._plan_conv_default.cache_clear()
    assert conv.plan_conv(g, cores=1) == plan


def test_no_cache_directory_plans_in_memory_only(tmp_path, monkeypatch):
    monkeypatch.setenv("CANNC_CACHE_DIR", "off")
    conv._plan_conv_default.cache_clear()
    g = _geom(16, 32, 28)
    assert conv.plan_conv(g, cores=2) == conv._plan_conv(g, True, 2, {})
    assert not any(tmp_path.iterdir())


def test_plans_are_kept_per_measured_fma_pipes(tmp_path, monkeypatch):
    """The conv planner weighs micro-tile loads against the FMA pipes measured on this
    machine, so a plan made under one measurement is not served under another."""
    from cannc.schedule import machine
    monkeypatch.setenv("CANNC_CACHE_DIR", str(tmp_path))
    conv._plan_conv_default.cache_clear()
    monkeypatch.setattr(machine, "fma_pipes", lambda: 1)
    conv.plan_conv(_geom(), cores=2)
    monkeypatch.setattr(machine, "fma_pipes", lambda: 2)
    conv.plan_conv(_geom(), cores=2)
    assert len(list((tmp_path / "plans").iterdir())) == 2
    conv._plan_conv_default.cache_clear()
