"""The program cache (cannc.compiler.snapshot): a compile of a model file or bytes that an
earlier process made is a hit that parses nothing and runs the same; anything that
changes the program changes its key; a damaged entry is compiled and written again."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.compiler import snapshot
from cannc.errors import CanncError, InputError, ModelError
from cannc.frontend import onnx_import
from models import zoo


@pytest.fixture
def progs(tmp_path, monkeypatch):
    """A program cache of the test's own (the object cache stays the shared one)."""
    base = tmp_path / "programs"
    # a store an earlier test left on the background writer would count in this test's
    # stats (test_hit_parses_nothing_and_runs_the_same failed now and then under xdist)
    assert snapshot.wait_stores(60)
    monkeypatch.delenv("CANNC_PROGRAM_CACHE", raising=False)
    monkeypatch.setattr(snapshot, "root", lambda: base)
    monkeypatch.setattr(snapshot, "stats", snapshot.Stats())
    # stores are written by a background thread; these tests look at the cache right
    # after a compile, so each store is waited for (test_compile_returns_before_... not)
    def store_and_wait(*a, **k):
        _store_later(*a, **k)
        assert snapshot.wait_stores(60)
    monkeypatch.setattr(snapshot, "store_later", store_and_wait)
    return base


_store_later = snapshot.store_later


def _mlp(path: Path, seed: int = 0, hidden=(64, 64)) -> Path:
    onnx.save(zoo.build("mlp", seed=seed, hidden=hidden), str(path))
    return path


def _x(batch: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 256), np.float32)}


def _ort(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def _no_parse(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was parsed on a program-cache hit")
    # (the session imports them from the frontend when it needs them)
    monkeypatch.setattr(onnx_import, "load_model", refuse)
    monkeypatch.setattr(onnx_import, "import_model", refuse)


def test_hit_parses_nothing_and_runs_the_same(progs, tmp_path, monkeypatch):
    path = _mlp(tmp_path / "m.onnx")
    feeds = _x()
    first = cannc.compile(str(path), cores=2).run(None, feeds)
    # the given shapes' program, and under their full shapes the ones that ran
    assert snapshot.stats.stored == 3 and snapshot.stats.hits == 0
    blobs = list((progs / "blobs").glob("*.w"))
    assert blobs, "the weights were not stored"
    misses = snapshot.stats.misses
    with monkeypatch.context() as m:
        _no_parse(m)
        sess = cannc.compile(path, cores=2)          # a PathLike hits the same entry
        again = sess.run(None, feeds)
        assert sess._graph is None
        assert [i.name for i in sess.get_inputs()] == ["x"]
        assert [o.name for o in sess.get_outputs()] == ["logits"]
    assert snapshot.stats.hits == 2 and snapshot.stats.misses == misses
    np.testing.assert_array_equal(again[0], first[0])
    np.testing.assert_allclose(again[0], _ort(path, feeds)[0], rtol=1e-4, atol=1e-5)
    # the hit's weights are accounted as device weights
    assert sess.device.mem_info().get("weights_bytes", 0) > 0


def test_hit_checks_inputs_as_a_fresh_session_does(progs, tmp_path):
    path = _mlp(tmp_path / "m.onnx")
    cannc.compile(str(path), cores=2)
    sess = cannc.compile(str(path), cores=2)
    assert snapshot.stats.hits == 1
    with pytest.raises(InputError):
        sess.run(None, {"y": _x()["x"]})
    with pytest.raises(InputError):
        sess.run(None, {"x": np.zeros((2, 255), np.float32)})


def test_bytes_models_are_cached(progs, tmp_path):
    data = zoo.build("mlp", seed=3, hidden=(32,)).SerializeToString()
    feeds = _x()
    a = cannc.compile(data, cores=2).run(None, feeds)
    misses = snapshot.stats.misses
    b = cannc.compile(data, cores=2).run(None, feeds)
    assert snapshot.stats.hits == 2 and snapshot.stats.misses == misses
    np.testing.assert_array_equal(a[0], b[0])


def test_a_modelproto_is_not_cached(progs):
    cannc.compile(zoo.build("mlp", hidden=(32,)), cores=2)
    assert snapshot.stats.stored == 0 and not progs.exists()


def test_a_changed_model_file_misses(progs, tmp_path):
    path = _mlp(tmp_path / "m.onnx", seed=0)
    feeds = _x()
    cannc.compile(str(path), cores=2).run(None, feeds)
    _mlp(path, seed=1)                              # same path, other weights
    got = cannc.compile(str(path), cores=2).run(None, feeds)
    assert snapshot.stats.hits == 0
    np.testing.assert_allclose(got[0], _ort(path, feeds)[0], rtol=1e-4, atol=1e-5)


def test_options_and_shapes_are_part_of_the_key(progs, tmp_path):
    path = str(_mlp(tmp_path / "m.onnx"))
    cannc.compile(path, cores=2)
    for kw in ({"cores": 1}, {"fusion": False}, {"shapes": {"x": (4, 256)}},
               {"pass_options": {"infer_and_fold": {"limit_elems": 1 << 10}}},
               {"pipeline": "O0"}):
        before = snapshot.stats.hits
        cannc.compile(path, **({"cores": 2} | kw))
        assert snapshot.stats.hits == before, kw
    cannc.compile(path, cores=2, shapes={"x": (4, 256)})
    assert snapshot.stats.hits >= 1


def test_other_shapes_after_a_hit(progs, tmp_path, monkeypatch):
    """A shape the entry was not made for compiles from the model (parsed then); a
    shape an earlier process ran is a hit of its own."""
    path = _mlp(tmp_path / "m.onnx")
    s1 = cannc.compile(str(path), cores=2)
    s1.run(None, _x(batch=5))                       # stored under its shapes too
    with monkeypatch.context() as m:
        _no_parse(m)
        s2 = cannc.compile(str(path), cores=2)
        out5 = s2.run(None, _x(batch=5))
        assert s2._graph is None
    np.testing.assert_allclose(out5[0], _ort(path, _x(batch=5))[0], rtol=1e-4, atol=1e-5)
    out7 = s2.run(None, _x(batch=7))                # parses the model now
    assert s2._graph is not None
    np.testing.assert_allclose(out7[0], _ort(path, _x(batch=7))[0], rtol=1e-4, atol=1e-5)
    rep = s2.inspect({"x": (3, 256)})
    assert rep["kernels"]
    # the hit's program reports as the program it was
    def kernels(sess):
        rep = sess.inspect({"x": (5, 256)}, without_fusion=False)
        return [(k["symbol"], k["nodes"], k["tiling"]) for k in rep["kernels"]], rep["memory"]
    assert kernels(s2) == kernels(s1)


def test_a_model_changed_after_a_hit_is_not_compiled_for_new_shapes(progs, tmp_path):
    path = _mlp(tmp_path / "m.onnx")
    cannc.compile(str(path), cores=2)
    sess = cannc.compile(str(path), cores=2)
    assert snapshot.stats.hits == 1
    _mlp(path, seed=9)
    np.testing.assert_equal(sess.run(None, _x(batch=1))[0].shape, (1, 10))  # its program
    with pytest.raises(ModelError, match="changed"):
        sess.run(None, _x(batch=3))


def test_save_after_a_hit(progs, tmp_path):
    path = _mlp(tmp_path / "m.onnx")
    cannc.compile(str(path), cores=2)
    sess = cannc.compile(str(path), cores=2)
    assert snapshot.stats.hits == 1
    sess.save(tmp_path / "m.cnc")
    loaded = cannc.load(tmp_path / "m.cnc")
    feeds = _x(batch=1)
    np.testing.assert_array_equal(loaded.run(None, feeds)[0], sess.run(None, feeds)[0])


def test_an_artifact_loads_without_parsing_even_the_first_time(progs, tmp_path, monkeypatch):
    """Saving a .cnc leaves the session's programs in the program cache under the entries
    a load of that artifact looks up (`cannc compile -o x.cnc`, then `cannc run x.cnc`):
    its first load already parses nothing and runs no pass, nor does any later one."""
    path = _mlp(tmp_path / "m.onnx")
    sess = cannc.compile(str(path), cores=2, shapes={"x": (3, 256)})
    sess.run(None, _x(batch=5))
    stored = snapshot.stats.stored
    sess.save(tmp_path / "m.cnc")
    assert snapshot.stats.stored == stored + 3     # both shapes; the first also as given
    hits = snapshot.stats.hits
    with monkeypatch.context() as m:
        _no_parse(m)
        first = cannc.load(tmp_path / "m.cnc", cores=2)
        again = cannc.load(tmp_path / "m.cnc", cores=2)
        assert first._graph is None and again._graph is None
        # load maps the stored model rather than reading it, and unmaps it before it returns
        assert str(tmp_path / "m.cnc") not in Path("/proc/self/maps").read_text()
        for b in (3, 5):
            want = sess.run(None, _x(batch=b))[0]
            np.testing.assert_array_equal(first.run(None, _x(batch=b))[0], want)
            np.testing.assert_array_equal(again.run(None, _x(batch=b))[0], want)
    assert snapshot.stats.hits == hits + 4 and snapshot.stats.stored == stored + 3
    np.testing.assert_allclose(again.run(None, _x(batch=3))[0], _ort(path, _x(batch=3))[0],
                               rtol=1e-4, atol=1e-5)


def test_an_artifact_of_other_options_than_a_load_gives_compiles_at_its_first_load(
        progs, tmp_path, monkeypatch):
    """A session whose programs a load would not make (here: compiled without fusion,
    which the artifact does not record) leaves none for the load: the first load
    compiles (with the artifact's objects) and stores its own, the second hits them."""
    path = _mlp(tmp_path / "m.onnx")
    sess = cannc.compile(str(path), cores=2, shapes={"x": (3, 256)}, fusion=False)
    stored = snapshot.stats.stored
    sess.save(tmp_path / "m.cnc")
    assert snapshot.stats.stored == stored
    first = cannc.load(tmp_path / "m.cnc", cores=2)
    assert first._graph is not None                     # parsed (from a copy) and compiled
    assert str(tmp_path / "m.cnc") not in Path("/proc/self/maps").read_text()
    assert snapshot.stats.stored == stored + 2          # under its shapes, and as given
    with monkeypatch.context() as m:
        _no_parse(m)
        again = cannc.load(tmp_path / "m.cnc", cores=2)
        np.testing.assert_array_equal(again.run(None, _x(batch=3))[0],
                                      first.run(None, _x(batch=3))[0])
    np.testing.assert_allclose(first.run(None, _x(batch=3))[0], _ort(path, _x(batch=3))[0],
                               rtol=1e-4, atol=1e-5)


def test_a_loaded_artifact_reads_its_model_again_rather_than_keeping_it(progs, tmp_path):
    """A session loaded from a .cnc file does not hold the model's bytes (as big as its
    weights); it reads them again from the artifact for a shape it has no program for,
    and says so clearly when the artifact has changed or gone."""
    path = _mlp(tmp_path / "m.onnx")
    cannc.compile(str(path), cores=2, shapes={"x": (3, 256)}).save(tmp_path / "m.cnc")
    cannc.load(tmp_path / "m.cnc", cores=2)
    sess = cannc.load(tmp_path / "m.cnc", cores=2)               # a hit
    assert sess._graph is None and sess._model_ref is None
    np.testing.assert_allclose(sess.run(None, _x(batch=7))[0], _ort(path, _x(batch=7))[0],
                               rtol=1e-4, atol=1e-5)               # read again, compiled
    changed = cannc.load(tmp_path / "m.cnc", cores=2)
    _mlp(tmp_path / "other.onnx", seed=1)
    cannc.compile(str(tmp_path / "other.onnx"), cores=2,
                  shapes={"x": (3, 256)}).save(tmp_path / "m.cnc")
    with pytest.raises(ModelError, match="changed after this session was created"):
        changed.run(None, _x(batch=9))
    cannc.load(tmp_path / "m.cnc", cores=2)
    gone = cannc.load(tmp_path / "m.cnc", cores=2)               # a hit again
    assert gone._graph is None
    (tmp_path / "m.cnc").unlink()
    with pytest.raises(ModelError, match="can no longer be read"):
        gone.run(None, _x(batch=11))


def test_cannc_run_of_an_artifact_loaded_before_parses_nothing(progs, tmp_path, monkeypatch,
                                                              capsys):
    """`cannc run model.cnc` makes its inputs from the session's inputs and outputs (not
    from the model's graph), so a run served by the program cache parses nothing."""
    from cannc.cli import main
    path = _mlp(tmp_path / "m.onnx")
    cannc.compile(str(path), cores=2, shapes={"x": (3, 256)}).save(tmp_path / "m.cnc")
    cannc.load(tmp_path / "m.cnc", cores=2)        # the first load stores the program
    with monkeypatch.context() as m:
        _no_parse(m)
        assert main(["run", str(tmp_path / "m.cnc"), "--cores", "2",
                     "--shape", "x=3x256"]) == 0
    assert "logits  float32[3, 10]" in capsys.readouterr().out


def _entry_files(progs: Path) -> tuple[list[Path], list[Path]]:
    metas = sorted(progs.glob("*/meta"))
    blobs = sorted((progs / "blobs").glob("*.w"))
    return metas, blobs


def test_damaged_meta_is_compiled_again(progs, tmp_path):
    path = _mlp(tmp_path / "m.onnx")
    feeds = _x()
    want = cannc.compile(str(path), cores=2).run(None, feeds)
    metas, _ = _entry_files(progs)
    for meta in metas:
        raw = bytearray(meta.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        meta.write_bytes(bytes(raw))
    sess = cannc.compile(str(path), cores=2)
    assert snapshot.stats.hits == 0 and snapshot.stats.damaged >= 1
    np.testing.assert_array_equal(sess.run(None, feeds)[0], want[0])
    cannc.compile(str(path), cores=2)                # written again: a hit now
    assert snapshot.stats.hits >= 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_weights_are_compiled_again(progs, tmp_path, damage):
    path = _mlp(tmp_path / "m.onnx")
    feeds = _x()
    want = cannc.compile(str(path), cores=2).run(None, feeds)
    _, blobs = _entry_files(progs)
    big = max(blobs, key=lambda p: p.stat().st_size)
    if damage == "flip":
        raw = bytearray(big.read_bytes())
        raw[100] ^= 0x01
        big.write_bytes(bytes(raw))
    elif damage == "truncate":
        with open(big, "r+b") as f:
            f.truncate(big.stat().st_size // 2)
    else:
        big.unlink()
    snapshot._blobs.clear()
    snapshot._arrays.clear()
    sess = cannc.compile(str(path), cores=2)
    assert snapshot.stats.hits == 0 and snapshot.stats.damaged >= 1
    got = sess.run(None, feeds)
    np.testing.assert_array_equal(got[0], want[0])
    assert big.exists() and big.stat().st_size > 0    # stored again
    snapshot._blobs.clear()
    snapshot._arrays.clear()
    hits = snapshot.stats.hits
    cannc.compile(str(path), cores=2)
    assert snapshot.stats.hits == hits + 1


def test_eviction_keeps_the_cache_within_its_budget(progs, tmp_path, monkeypatch):
    a = str(_mlp(tmp_path / "a.onnx", seed=1, hidden=(128, 128)))
    b = str(_mlp(tmp_path / "b.onnx", seed=2, hidden=(128, 128)))
    cannc.compile(a, cores=2, eager=True)
    one = sum(f.stat().st_size for f in progs.rglob("*") if f.is_file())
    monkeypatch.setenv("CANNC_PROGRAM_CACHE", str(int(one * 1.5)))
    monkeypatch.setattr(snapshot, "BLOB_GRACE_S", -1.0)
    cannc.compile(b, cores=2, eager=True)
    assert snapshot.stats.evicted >= 1
    total = sum(f.stat().st_size for f in progs.rglob("*") if f.is_file())
    assert total <= one * 1.5
    before = snapshot.stats.hits
    cannc.compile(b, cores=2)                        # the newest stays
    assert snapshot.stats.hits == before + 1
    cannc.compile(a, cores=2)                        # the oldest went
    assert snapshot.stats.hits == before + 1


def test_budget_values(monkeypatch):
    for v, want in (("", snapshot.DEFAULT_BUDGET), ("0", 0), ("off", 0), ("512", 512),
                    ("2K", 2048), ("1.5M", 3 << 19), ("8G", 8 << 30)):
        monkeypatch.setenv("CANNC_PROGRAM_CACHE", v)
        assert snapshot.budget() == want, v
    monkeypatch.setenv("CANNC_PROGRAM_CACHE", "lots")
    with pytest.raises(CanncError, match="CANNC_PROGRAM_CACHE"):
        snapshot.budget()


def test_disabled_by_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CANNC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CANNC_PROGRAM_CACHE", "0")
    monkeypatch.setattr(snapshot, "stats", snapshot.Stats())
    assert snapshot.root() is None
    path = str(_mlp(tmp_path / "m.onnx", hidden=(32,)))
    cannc.compile(path, cores=1)
    cannc.compile(path, cores=1)
    assert snapshot.stats == snapshot.Stats()
    assert not (tmp_path / "cache" / "programs").exists()


def _external_model(tmp_path: Path, w: np.ndarray) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])
    model = helper.make_model(
        helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "ext", [x], [y],
                          [numpy_helper.from_array(w, "w")]),
        opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "ext.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="ext.data",
              size_threshold=0)
    return path


def test_external_data_is_part_of_the_digest(progs, tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    path = _external_model(tmp_path, w)
    assert snapshot.external_locations(path.read_bytes()) == ["ext.data"]
    d1 = snapshot.model_digest(str(path))
    feeds = {"x": rng.standard_normal((2, 64)).astype(np.float32)}
    cannc.compile(str(path), cores=2).run(None, feeds)
    data = tmp_path / "ext.data"
    data.write_bytes((2 * w).tobytes())             # same model file, other weights
    assert snapshot.model_digest(str(path)) != d1
    got = cannc.compile(str(path), cores=2).run(None, feeds)
    assert snapshot.stats.hits == 0
    np.testing.assert_allclose(got[0], feeds["x"] @ (2 * w), rtol=1e-4, atol=1e-4)


def test_wire_reader_agrees_with_onnx(tmp_path):
    rng = np.random.default_rng(1)
    path = _external_model(tmp_path, rng.standard_normal((64, 64)).astype(np.float32))
    raw = path.read_bytes()
    assert snapshot.external_locations(raw) == snapshot._external_locations_parsed(path)
    plain = zoo.build("mlp", hidden=(32,)).SerializeToString()
    assert snapshot.external_locations(plain) == []
    # bytes that are no protobuf: None, and the digest of such a file is still a digest
    assert snapshot.external_locations(b"\xff\xff\xff") is None
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff\xff\xff not a model")
    assert snapshot.model_digest(str(junk)) is None
    assert snapshot.model_digest(str(tmp_path / "missing.onnx")) is None
    assert snapshot.model_digest(onnx.ModelProto()) is None


def test_unreadable_model_is_still_reported_by_the_compile(progs, tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff\xff\xff not a model")
    with pytest.raises(CanncError):
        cannc.compile(str(junk), cores=1)
    with pytest.raises(CanncError):
        cannc.compile(str(tmp_path / "missing.onnx"), cores=1)
    assert snapshot.stats.stored == 0


def test_another_process_hits(progs, tmp_path):
    """The point of it all: a second process compiles nothing, and parses nothing: it does
    not even import onnx (with ml_dtypes 0.7, ~0.6 s of a ~0.9 s `import cannc`), nor
    networkx (~0.1 s; the programs' graphs unpickle without it). (Both are fresh
    processes: this one may have registered custom ops, which are part of the key.)"""
    import subprocess
    import sys
    path = _mlp(tmp_path / "m.onnx")
    feeds = _x()
    np.save(tmp_path / "x.npy", feeds["x"])
    code = f"""
import sys, numpy as np, cannc
from cannc.compiler import snapshot
from pathlib import Path
assert "onnx" not in sys.modules and "ml_dtypes" not in sys.modules, \
    "import cannc imported onnx/ml_dtypes (~0.6 s): import them where they are used"
assert "networkx" not in sys.modules, "import cannc imported networkx (~0.1 s)"
assert "cannc.codegen.lower" not in sys.modules, "import cannc imported the code generators"
snapshot.root = lambda: Path({str(progs)!r})
sess = cannc.compile({str(path)!r}, cores=2)
x = np.load({str(tmp_path / 'x.npy')!r})
np.save({str(tmp_path)!r} + "/" + sys.argv[1] + ".npy", sess.run(None, {{"x": x}})[0])
want = (0, 3) if sys.argv[1] == "cold" else (2, 0)
assert (snapshot.stats.hits, snapshot.stats.misses) == want, snapshot.stats
if sys.argv[1] == "warm":
    assert "onnx" not in sys.modules and "ml_dtypes" not in sys.modules, \
        "a program-cache hit imported onnx/ml_dtypes (the model parsed?)"
    assert "networkx" not in sys.modules, "a program-cache hit imported networkx"
    assert "cannc.codegen.lower" not in sys.modules, \
        "a program-cache hit imported the code generators"
"""
    for which in ("cold", "warm"):
        r = subprocess.run([sys.executable, "-c", code, which], capture_output=True,
                           text=True, env={**os.environ}, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    warm = np.load(tmp_path / "warm.npy")
    np.testing.assert_array_equal(warm, np.load(tmp_path / "cold.npy"))
    np.testing.assert_allclose(warm, _ort(path, feeds)[0], rtol=1e-4, atol=1e-5)


def test_the_salt_takes_the_switches_of_generators_not_imported_at_their_values():
    """memo.salt() reads the codegen switches (FORCE_TUNING, ...) of the modules imported
    and takes memo.SWITCHES' values for the others (a cache hit imports none of them):
    those must be what the modules start with, or a hit would never find the programs a
    compile stored."""
    import importlib

    from cannc.codegen import memo
    for module, attr, default in memo.SWITCHES:
        m = importlib.import_module(f"cannc.codegen.{module}")
        assert getattr(m, attr) == default, f"{module}.{attr}"


def test_compile_returns_before_its_program_is_written(progs, tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot, "store_later", _store_later)
    gate = threading.Event()
    real_store = snapshot.store

    def gated(*a, **k):
        assert gate.wait(30)
        return real_store(*a, **k)
    monkeypatch.setattr(snapshot, "store", gated)
    path = _mlp(tmp_path / "m.onnx")
    sess = cannc.compile(str(path), cores=2)        # the writer waits at the gate
    assert snapshot.stats.stored == 0 and not list(progs.glob("*/meta"))
    ref = sess.run(None, _x())[0]
    # a lookup of an entry being written waits for it (and then hits)
    threading.Timer(0.3, gate.set).start()
    again = cannc.compile(str(path), cores=2)
    assert snapshot.stats.stored >= 1 and snapshot.stats.hits == 1
    np.testing.assert_array_equal(again.run(None, _x())[0], ref)
    assert snapshot.wait_stores(30)


def test_a_failing_store_is_counted_and_the_session_runs(progs, tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot, "store_later", _store_later)

    def broken(*a, **k):
        raise RuntimeError("cannot pickle this")
    monkeypatch.setattr(snapshot, "store", broken)
    path = _mlp(tmp_path / "m.onnx")
    sess = cannc.compile(str(path), cores=2)
    assert snapshot.wait_stores(30)
    assert snapshot.stats.store_errors >= 1
    assert "cannot pickle this" in snapshot.stats.last_store_error
    np.testing.assert_allclose(sess.run(None, _x())[0], _ort(path, _x())[0],
                               rtol=1e-4, atol=1e-5)


def test_the_writer_runs_at_the_lowest_priority(progs, tmp_path, monkeypatch):
    """The background writer gives way to the AI cores (nice 19, its thread's own)."""
    import os

    monkeypatch.setattr(snapshot, "store_later", _store_later)
    seen = []
    real_store = snapshot.store

    def spy(*a, **k):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_store(*a, **k)
    monkeypatch.setattr(snapshot, "store", spy)
    path = _mlp(tmp_path / "m.onnx")
    sess = cannc.compile(str(path), cores=2)
    assert snapshot.wait_stores(30)
    assert seen and all(p == 19 for p in seen)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19  # (not this one)
    np.testing.assert_allclose(sess.run(None, _x())[0], _ort(path, _x())[0],
                               rtol=1e-4, atol=1e-5)
