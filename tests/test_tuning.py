"""The tuning cache (cannc/schedule/tuning.py), the search (cannc/compiler/tune.py) and
`cannc tune`: round trip, damaged files, keys, CANNC_TUNING=0, and a tune run whose
winners a later compile uses. Never asserts on a measured time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import cannc
from cannc.cli import main
from cannc.codegen.gemm import GemmSpec, gemm_plan
from cannc.codegen.plans import gemm_spec_of, gemm_tuning
from cannc.compiler import tune
from cannc.errors import CanncError
from cannc.schedule import tuning
from models import zoo
from tests.helpers import ort_run

SIG = tuning.gemm_signature(GemmSpec(64, 96, 128, b_prepacked=True), epilogue=True)


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("CANNC_TUNING_CACHE", str(path))
    monkeypatch.delenv("CANNC_TUNING", raising=False)
    return path


def test_round_trip(cache_file):
    assert tuning.lookup("gemm", SIG) is None
    assert tuning.fingerprint() == "none"
    tuning.store("gemm", SIG, {"KC": 64, "grid": [2, 1]}, 12.5, default_us=14.0)
    assert tuning.lookup("gemm", SIG) == {"KC": 64, "grid": [2, 1]}
    assert tuning.lookup("conv", SIG) is None                      # the kind is in the key
    assert tuning.lookup("gemm", {**SIG, "epilogue": False}) is None
    data = json.loads(cache_file.read_text())
    assert data["format"] == "cannc-tuning"
    (entry,) = data["entries"].values()
    assert entry["measured_us"] == 12.5 and entry["default_us"] == 14.0
    assert entry["cpu"] == tuning.cpu_identity() and entry["cannc"] == cannc.__version__
    fp = tuning.fingerprint()
    assert fp not in ("none", "off")
    tuning.store("gemm", SIG, {"KC": 128}, 12.0)
    assert tuning.fingerprint() != fp                               # entries in effect changed
    assert tuning.lookup("gemm", SIG) == {"KC": 128}
    assert not list(cache_file.parent.glob("*.tmp"))                # atomic write left no temp


def test_damaged_file_is_ignored(cache_file):
    cache_file.write_text('{"format": "cannc-tuning", "version": 1, "entries": {"x": ')
    with pytest.warns(RuntimeWarning, match="damaged tuning cache"):
        assert tuning.lookup("gemm", SIG) is None
    assert gemm_tuning(gemm_spec_of(SIG), epilogue=True) is None
    # the next store replaces the garbage with a valid file
    tuning.store("gemm", SIG, {"KC": 64}, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.lookup("gemm", SIG) == {"KC": 64}
    # a damaged entry costs only itself
    data = json.loads(cache_file.read_text())
    data["entries"]["junk"] = [1, 2]
    cache_file.write_text(json.dumps(data))
    assert tuning.lookup("gemm", SIG) == {"KC": 64}


def test_illegal_stored_tuning_is_ignored(cache_file):
    spec = gemm_spec_of(SIG)
    tuning.store("gemm", SIG, {"NV": 3}, 1.0)       # NV must be even: the planner refuses
    with pytest.warns(RuntimeWarning, match="ignoring tuning"):
        assert gemm_tuning(spec, epilogue=True) is None


def test_key_depends_on_cpu_and_version(cache_file, monkeypatch):
    cpu = tuning.cpu_identity()
    k = tuning.entry_key("gemm", SIG)
    assert tuning.entry_key("gemm", SIG, cpu={**cpu, "llvm_cpu": "other"}) != k
    assert tuning.entry_key("gemm", SIG, cpu={**cpu, "features": "0" * 16}) != k
    assert tuning.entry_key("gemm", SIG, cpu={**cpu, "model": "Other CPU"}) != k
    assert tuning.entry_key("gemm", SIG, version="9.9.9") != k
    assert tuning.entry_key("gemm", dict(reversed(list(SIG.items())))) == k  # order-free
    tuning.store("gemm", SIG, {"KC": 64}, 1.0)
    assert tuning.lookup("gemm", SIG) == {"KC": 64}
    monkeypatch.setattr(tuning, "cpu_identity", lambda: {**cpu, "features": "f" * 16})
    assert tuning.lookup("gemm", SIG) is None
    assert tuning.fingerprint() == "none"
    monkeypatch.undo()
    monkeypatch.setenv("CANNC_TUNING_CACHE", str(cache_file))
    monkeypatch.setattr(tuning, "_version", lambda: "0.0.0-other")
    assert tuning.lookup("gemm", SIG) is None


def test_disabled(cache_file, monkeypatch):
    tuning.store("gemm", SIG, {"KC": 64}, 1.0)
    monkeypatch.setenv("CANNC_TUNING", "0")
    assert tuning.lookup("gemm", SIG) is None
    assert tuning.fingerprint() == "off"


def test_candidates_are_legal_and_distinct():
    for spec in (GemmSpec(8, 1024, 256, b_prepacked=True), GemmSpec(200, 64, 120),
                 GemmSpec(29, 75, 410, trans_b=True), GemmSpec(9, 8, 100),
                 GemmSpec(7, 20, 9, batch=3, a_batch_stride=63, b_batch_stride=180)):
        cands = tune.gemm_candidates(spec, cores=2)
        plans = [gemm_plan(spec, t) for t in cands]
        assert gemm_plan(spec) not in plans
        assert len(set(plans)) == len(plans)


@pytest.fixture(scope="module")
def tiny_mlp(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune")
    m = zoo.build("mlp", in_features=64, hidden=(96,), num_classes=10)
    path = d / "mlp.onnx"
    path.write_bytes(m.SerializeToString())
    return m, str(path)


def test_tune_then_compile_uses_entries(tiny_mlp, cache_file, capsys):
    model, path = tiny_mlp
    # --min-gain -100: keep each GEMM's best candidate whatever it measured, so that the
    # test does not depend on timing
    rc = main(["tune", path, "--shape", "x=16x64", "--budget", "8", "--threads", "2",
               "--cache", str(cache_file), "--min-gain", "-100", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "tune: kernel 1/" in err                                 # progress on stderr
    rep = json.loads(out)
    tuned = [r for r in rep["kernels"] if not r["skipped"] and r["tuning"]]
    assert tuned, rep
    entries = tuning.entries(cache_file)
    assert len(entries) == len(tuned)
    for r in rep["kernels"]:
        assert r["tried"] >= (1 if r["tuning"] else 0)

    sess = cannc.compile(path, shapes={"x": (16, 64)}, cores=2)
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    got = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ort_run(model, {"x": x})[0], rtol=1e-4, atol=1e-4)
    (prog,) = sess.programs.values()
    by_sig = {json.dumps(r["signature"], sort_keys=True): r["tuning"] for r in tuned}
    used = 0
    for k in prog.spec.kernels:
        plan = k.notes.get("plan")
        if not (isinstance(plan, dict) and plan.get("kind") == "gemm"):
            continue
        want = by_sig.get(json.dumps(plan["signature"], sort_keys=True))
        if want:
            assert plan["tuning"] == want
            assert "[tuned]" in k.notes["tiling"]
            used += 1
    assert used == len(tuned)

    # text output: the summary table
    rc = main(["tune", path, "--shape", "x=16x64", "--budget", "1", "--cache", str(cache_file)])
    out, err = capsys.readouterr()
    assert rc == 0 and "default µs" in out and "speedup" in out, err


def test_tune_library_stores_winners(tiny_mlp, cache_file):
    """compiler.tune.tune_gemms (what `cannc tune` runs): every distinct GEMM measured
    and, with min_speedup 0, its best candidate stored."""
    import time

    _, path = tiny_mlp
    sess = cannc.compile(path, shapes={"x": (16, 64)}, cores=2)
    (prog,) = sess.programs.values()
    items = tune.gemm_items(prog.spec.kernels)
    assert items and all(it["kernels"] for it in items)
    seen: list[tuple[str, bool]] = []
    res = tune.tune_gemms(prog.spec.kernels, 2, time.perf_counter() + 6, path=cache_file,
                          progress=lambda text, force: seen.append((text, force)),
                          min_speedup=0.0)
    assert [r["signature"] for r in res] == [it["signature"] for it in items]
    assert any(force and text.startswith("kernel 1/") for text, force in seen)
    done = [r for r in res if not r["skipped"]]
    assert done and all(r["gemm"] == tune.gemm_label(r["signature"]) for r in done)
    stored = [r for r in done if r["stored"]]
    assert len(tuning.entries(cache_file)) == len(stored)
    for r in stored:
        assert tuning.lookup("gemm", r["signature"]) == (r["tuning"] or {})


def test_budget_spent_before_any_candidate(tiny_mlp, cache_file):
    """A GEMM whose share of the budget is gone before its first candidate keeps the
    default and reports its time as the best (CI on a loaded Zen 3: `cannc tune --budget
    1` printed an internal error, best_us None)."""
    import time

    _, path = tiny_mlp
    sess = cannc.compile(path, shapes={"x": (16, 64)}, cores=2)
    (prog,) = sess.programs.values()
    sig = tune.gemm_items(prog.spec.kernels)[0]["signature"]
    r = tune.tune_gemm(sig, 2, time.perf_counter() - 1.0)     # the deadline has passed
    assert r["tried"] == 0 and r["tuning"] is None and r["speedup"] == 1.0
    assert r["default_us"] > 0 and r["best_us"] == r["default_us"]


def test_inspect_json_has_predictions(tiny_mlp, capsys):
    _, path = tiny_mlp
    assert main(["inspect", path, "--shape", "x=16x64", "--json", "--cores", "2"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["kernels"]
    for k in rep["kernels"]:
        assert k["predicted_us"] > 0
        assert k["tiling"]
    assert rep["predicted_us"] == pytest.approx(sum(k["predicted_us"] for k in rep["kernels"]),
                                                rel=1e-3)
    gemms = [k for k in rep["kernels"] if k["notes"].get("plan", {}).get("kind") == "gemm"]
    assert gemms and all({"MR", "NR", "KC", "MB", "NB", "pack_a", "b_mode", "tiles"}
                         <= set(k["notes"]["plan"]) for k in gemms)
    assert main(["inspect", path, "--shape", "x=16x64"]) == 0
    out = capsys.readouterr().out
    assert "pred µs" in out and "predicted:" in out


@pytest.mark.parametrize("budget", ["-1", "0", "nan", "inf", "soon"])
def test_tune_rejects_a_bad_budget(tiny_mlp, budget, capsys):
    _, path = tiny_mlp
    assert main(["tune", path, "--budget", budget]) == 2
    assert "argument --budget" in capsys.readouterr().err


@pytest.mark.parametrize("var,value", [("CANNC_ISA", "avx3"), ("CANNC_WINOGRAD", "maybe"),
                                       ("CANNC_STEM_CONV", "sometimes"),
                                       ("CANNC_DEBUG", "yes please"), ("CANNC_VERIFY", "2")])
def test_misspelt_codegen_switch_is_a_clear_error(var, value):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, **{var: value})
    r = subprocess.run([sys.executable, "-c", "import cannc"], env=env, capture_output=True,
                       text=True, cwd=root)
    assert r.returncode != 0
    assert f"CanncError: {var}='{value}': expected one of" in r.stderr


@pytest.mark.parametrize("var", ["CANNC_TUNING", "CANNC_CORE_CHOICE"])
def test_misspelt_runtime_switch_is_a_clear_error(tiny_mlp, monkeypatch, var):
    """CANNC_TUNING and CANNC_CORE_CHOICE are read at each compile: a value that is
    neither on nor off (a typo of 'off') fails the compile with a CanncError naming the
    variable, instead of leaving the switch on; on and off values in any case work."""
    m, _ = tiny_mlp
    monkeypatch.setenv(var, "of")
    with pytest.raises(CanncError, match=f"{var}='of': expected one of '1'"):
        cannc.compile(m, cores=2)
    for v in ("OFF", "0", "No", "1", "on", ""):
        monkeypatch.setenv(var, v)
        cannc.compile(m, cores=2)
    monkeypatch.setenv("CANNC_CORE_CHOICE", "False")
    assert not cannc.config.core_choice_enabled()


def test_the_gemm_tiling_function_follows_the_entries_in_effect(cache_file, monkeypatch):
    """gemm_tiling keeps its answers per GEMM and host (a model's layers repeat their
    GEMMs); an entry stored for a shape afterwards still turns it into a tuned static
    kernel (None), and another cache file without it into a dynamic one again."""
    from cannc.codegen.lower.contraction import gemm_tiling
    from cannc.ir.graph import Node
    from cannc.ir.types import TensorType

    n = Node(name="mm", op_type="MatMul", inputs=("a", "b"), outputs=("y",))
    f32 = np.dtype(np.float32)
    ts = [TensorType(f32, (1, 40, 128)), TensorType(f32, (128, 96))]
    t = gemm_tiling(n, ts, [TensorType(f32, (1, 40, 96))])
    assert t is not None and t.dims[0] == 40
    assert gemm_tiling(n, ts, [TensorType(f32, (1, 40, 96))]) is t      # kept
    tuning.store("gemm", t.notes["plan"]["signature"], {"KC": 64}, 1.0)
    assert gemm_tiling(n, ts, [TensorType(f32, (1, 40, 96))]) is None
    other = cache_file.with_name("other.json")
    monkeypatch.setenv("CANNC_TUNING_CACHE", str(other))
    again = gemm_tiling(n, ts, [TensorType(f32, (1, 40, 96))])
    assert again is not None and again.key == t.key and again.dims == t.dims
