"""Cache integrity (issue 15 item 8): damaged entries of every store — the object cache,
the lowering memo, the tuning cache, .cnc artifacts — are detected and rebuilt, ignored
or rejected with a CacheError, never used and never a raw exception; and two processes
compiling the same model into one cache directory at once leave it intact."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import xxhash

import cannc
from cannc.codegen import memo as memo_mod
from cannc.codegen.memo import MemoEntry
from cannc.native.target import ObjectCache, read_checksummed, write_checksummed
from cannc.schedule import tuning
from tests.helpers import ort_run
from tests.test_errors import _linear, _rezip

ROOT = Path(__file__).resolve().parents[1]
X = np.random.default_rng(5).standard_normal((2, 16)).astype(np.float32)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache directory for objects and the lowering memo, read from disk."""
    monkeypatch.setenv("CANNC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(memo_mod, "_memos", {})
    return tmp_path


def _compile(root: Path) -> cannc.Session:
    memo_mod._memos.clear()            # every compile reads the memo from disk
    return cannc.compile(_linear(), cores=1, shapes={"x": (2, 16)}, cache=ObjectCache(root),
                         fusion=False)


def _check(sess: cannc.Session) -> None:
    np.testing.assert_allclose(sess.run(None, {"x": X})[0], ort_run(_linear(), {"x": X})[0],
                               rtol=1e-4, atol=1e-5)


def _memo_files(root: Path) -> list[Path]:
    return sorted((root / "lower").rglob("*.pkl"))


def _damages():
    good = MemoEntry("cannc_k_x", "0" * 64, (), {}, 1, 0, True, 1)
    bad_types = MemoEntry(None, 5, ("a",), [], -1, 0, "yes", 1)   # type: ignore[arg-type]
    return [
        ("empty", lambda p: p.write_bytes(b"")),
        ("truncated", lambda p: p.write_bytes(p.read_bytes()[:30])),
        ("bit-flip", lambda p: p.write_bytes(_flip(p.read_bytes(), -5))),
        ("other-magic", lambda p: p.write_bytes(b"CNCOBJ1\n" + p.read_bytes()[9:])),
        ("not-a-pickle", lambda p: write_checksummed(p, memo_mod._MAGIC, b"junk" * 10)),
        ("wrong-object", lambda p: write_checksummed(p, memo_mod._MAGIC,
                                                     pickle.dumps({"symbol": "x"}))),
        ("wrong-types", lambda p: write_checksummed(p, memo_mod._MAGIC,
                                                    pickle.dumps(bad_types))),
        ("dangling-object", lambda p: write_checksummed(p, memo_mod._MAGIC,
                                                        pickle.dumps(good))),
    ]


def _flip(b: bytes, i: int) -> bytes:
    a = bytearray(b)
    a[i] ^= 0x41
    return bytes(a)


def test_damaged_lowering_memo_entries_are_lowered_again(cache_dir):
    _check(_compile(cache_dir))
    files = _memo_files(cache_dir)
    assert len(files) >= 3
    damages = _damages()
    for i, p in enumerate(files):
        damages[i % len(damages)][1](p)
    _check(_compile(cache_dir))           # every damaged entry: lowered again, correct
    # ... and rewritten: every entry reads back as a well-formed MemoEntry
    for p in _memo_files(cache_dir):
        e = pickle.loads(read_checksummed(p, memo_mod._MAGIC))
        assert memo_mod._well_formed(e), p
    c = ObjectCache(cache_dir)
    memo_mod._memos.clear()
    _check(cannc.compile(_linear(), cores=1, shapes={"x": (2, 16)}, cache=c, fusion=False))
    assert c.misses == 0 and c.rebuilt_damaged == 0


@pytest.mark.parametrize("name", [d[0] for d in _damages()])
def test_each_memo_damage_reads_as_missing(cache_dir, name):
    _compile(cache_dir)
    p = _memo_files(cache_dir)[0]
    dict(_damages())[name](p)
    memo = memo_mod.LoweringMemo(cache_dir)
    e = memo.get(p.stem)
    assert e is None or (name == "dangling-object" and e.object_key == "0" * 64)


def test_memo_entry_whose_object_is_gone_compiles_again(cache_dir):
    _compile(cache_dir)
    for p in cache_dir.rglob("*.o"):
        p.unlink()
    c = ObjectCache(cache_dir)
    memo_mod._memos.clear()
    sess = cannc.compile(_linear(), cores=1, shapes={"x": (2, 16)}, cache=c, fusion=False)
    _check(sess)
    assert c.misses == 4


# -- the tuning cache -------------------------------------------------------------------------

def test_damaged_tuning_cache_bytes_never_raise(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("CANNC_TUNING_CACHE", str(path))
    sig = {"M": 2, "N": 8, "K": 16}
    tuning.store("gemm", sig, {"KC": 64}, 1.0)
    good = path.read_bytes()
    variants = [good[:n] for n in range(0, len(good), max(len(good) // 12, 1))]
    variants += [_flip(good, i) for i in range(0, len(good), max(len(good) // 12, 1))]
    variants += [b"\xff\xfe\x00garbage", b"[]", b'{"format": "cannc-tuning"}', b"null"]
    for v in variants:
        path.write_bytes(v)
        os.utime(path, ns=(len(v), len(v) + hash(v) % 1000))   # a new (mtime, size) stamp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = tuning.lookup("gemm", sig)
            tuning.fingerprint()
        assert got is None or got == {"KC": 64}


@pytest.mark.parametrize("tun", [{"KC": "x"}, {"grid": None}, {"KC": -64}, {"MR": 10 ** 9},
                                 {"grid": [0, 0]}, {"KC": 1.5}, {"unknown_field": 1}])
def test_nonsense_tuning_entries_are_ignored(tmp_path, monkeypatch, tun):
    from cannc.codegen.gemm import GemmSpec
    from cannc.codegen.plans import gemm_tuning
    monkeypatch.setenv("CANNC_TUNING_CACHE", str(tmp_path / "t.json"))
    spec = GemmSpec(64, 96, 128, b_prepacked=True)
    tuning.store("gemm", tuning.gemm_signature(spec, True), tun, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = gemm_tuning(spec, epilogue=True)
    assert got is None or got == tun


# -- .cnc artifacts: a sweep of truncations and bit flips ------------------------------------

@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> bytes:
    p = tmp_path_factory.mktemp("cnc") / "m.cnc"
    cannc.compile(_linear(), cores=1, shapes={"x": (2, 16)}).save(p)
    return p.read_bytes()


def test_artifact_damage_sweep(tmp_path, artifact):
    """Every truncation and bit flip: a CacheError, or (a flip in bytes nothing reads) an
    artifact that loads and answers correctly."""
    n = len(artifact)
    step = max(n // 24, 1)
    variants = [artifact[:k] for k in range(0, n, step)]
    variants += [_flip(artifact, i) for i in range(0, n, step)]
    loaded = 0
    for i, v in enumerate(variants):
        p = tmp_path / f"v{i}.cnc"
        p.write_bytes(v)
        try:
            sess = cannc.load(p, cores=1)
        except cannc.CacheError:
            continue
        _check(sess)
        loaded += 1
    assert loaded < len(variants) // 2


def test_artifact_with_a_swapped_model_is_rejected(tmp_path, artifact):
    other = _linear()
    other.graph.node[2].op_type = "Sigmoid"          # a different, valid model
    p = tmp_path / "swapped.cnc"
    p.write_bytes(_rezip(artifact, {"model.onnx": other.SerializeToString()}))
    with pytest.raises(cannc.CacheError, match="embedded model is damaged"):
        cannc.load(p)


def test_artifact_with_consistent_but_malformed_objects_is_rejected(tmp_path, artifact):
    """Objects replaced by junk *and* their checksums updated (a hand-edit, a writer bug):
    refused before they reach MCJIT, which would crash on them."""
    man = json.loads(zipfile.ZipFile(io.BytesIO(artifact)).read("manifest.json"))
    junk = b"\x7fELF\x02\x01\x01" + b"\xab" * 64
    man["xxh3_128"] = {k: xxhash.xxh3_128(junk).hexdigest() for k in man["objects"]}
    rep = {f"objects/{k}.o": junk for k in man["objects"]}
    rep["manifest.json"] = json.dumps(man).encode()
    p = tmp_path / "junk.cnc"
    p.write_bytes(_rezip(artifact, rep))
    with pytest.raises(cannc.CacheError, match="malformed ELF"):
        cannc.load(p)


def test_artifact_model_is_stored_and_every_member_checksummed(artifact):
    """The model is stored, not deflated (its float weights hardly shrink, and inflating
    them took ~2 s of every BERT-base-sized load); the objects are deflated; the manifest
    checksums each member and names the inputs its specialisations list shapes of."""
    z = zipfile.ZipFile(io.BytesIO(artifact))
    assert z.getinfo("model.onnx").compress_type == zipfile.ZIP_STORED
    objs = [n for n in z.namelist() if n.startswith("objects/")]
    assert objs and all(z.getinfo(n).compress_type == zipfile.ZIP_DEFLATED for n in objs)
    man = json.loads(z.read("manifest.json"))
    assert man["version"] == 2 and man["inputs"] == ["x"]
    assert man["model_xxh3_128"] == xxhash.xxh3_128(z.read("model.onnx")).hexdigest()
    assert man["xxh3_128"] == {k: xxhash.xxh3_128(z.read(f"objects/{k}.o")).hexdigest()
                               for k in man["objects"]}


def _as_version_1(artifact: bytes, objects: dict[str, bytes] | None = None) -> bytes:
    """The artifact as version 1 wrote it: sha256 checksums, everything deflated, no
    input names."""
    import hashlib
    z = zipfile.ZipFile(io.BytesIO(artifact))
    man = json.loads(z.read("manifest.json"))
    man.update(version=1, model_sha256=hashlib.sha256(z.read("model.onnx")).hexdigest(),
               sha256={k: hashlib.sha256(z.read(f"objects/{k}.o")).hexdigest()
                       for k in man["objects"]})
    for k in ("inputs", "model_xxh3_128", "xxh3_128"):
        del man[k]
    return _rezip(artifact, {"manifest.json": json.dumps(man).encode(), **(objects or {})})


def test_a_version_1_artifact_loads_and_its_checksums_still_count(tmp_path, artifact):
    p = tmp_path / "v1.cnc"
    p.write_bytes(_as_version_1(artifact))
    _check(cannc.load(p, cores=1))
    man = json.loads(zipfile.ZipFile(io.BytesIO(artifact)).read("manifest.json"))
    k = man["objects"][0]
    obj = zipfile.ZipFile(io.BytesIO(artifact)).read(f"objects/{k}.o")
    p.write_bytes(_as_version_1(artifact, {f"objects/{k}.o": _flip(obj, len(obj) // 2)}))
    with pytest.raises(cannc.CacheError, match="checksum mismatch"):
        cannc.load(p, cores=1)


@pytest.mark.parametrize("edit", [{"pipeline": "O9"}, {"specializations": [[[2, 16, 3]]]},
                                  {"specializations": [[[-2, 16]]]}, {"objects": {"a": 1}},
                                  {"specializations": [[[2, 17]]]}])
def test_artifact_with_a_bad_manifest_field(tmp_path, artifact, edit):
    man = json.loads(zipfile.ZipFile(io.BytesIO(artifact)).read("manifest.json"))
    man.update(edit)
    p = tmp_path / "bad.cnc"
    p.write_bytes(_rezip(artifact, {"manifest.json": json.dumps(man).encode()}))
    with pytest.raises(cannc.CacheError):
        cannc.load(p)


# -- two processes, one cache directory --------------------------------------------------------

def test_two_processes_compiling_into_one_cache_dir(tmp_path):
    code = textwrap.dedent("""
        import sys, numpy as np, cannc
        from tests.test_errors import _linear
        from tests.helpers import ort_run
        x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
        s = cannc.compile(_linear(), cores=1, shapes={"x": (3, 16)}, fusion=False)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], ort_run(_linear(), {"x": x})[0],
                                   rtol=1e-4, atol=1e-5)
        from cannc.native.target import default_cache
        c = default_cache()
        print(c.hits, c.misses, c.rebuilt_damaged)
    """)
    env = {**os.environ, "CANNC_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()[-800:]
    assert not list(tmp_path.rglob("*.tmp*")), "a temporary file was left behind"
    third = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                           capture_output=True, timeout=180)
    assert third.returncode == 0, third.stderr.decode()[-800:]
    hits, misses, damaged = map(int, third.stdout.split()[-3:])
    assert misses == 0 and damaged == 0 and hits >= 4


def test_evicted_library_object_lowers_the_kernel_again(cache_dir):
    """A memo entry whose kernel calls library modules (a GEMM's shared strip kernels)
    is used only while their objects are in the cache too: with one evicted, the kernel
    is lowered again and the library module compiled again."""
    from onnx import TensorProto, helper, numpy_helper

    from cannc.compiler import codegen_counts
    from tests.helpers import model_of

    w = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    m = model_of([helper.make_node("MatMul", ["x", "w"], ["y"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", 64])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                 [numpy_helper.from_array(w, "w")])
    x = np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32)

    def compile_and_check():
        memo_mod._memos.clear()
        sess = cannc.compile(m, cores=1, shapes={"x": x.shape}, cache=ObjectCache(cache_dir))
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ w, rtol=1e-4, atol=1e-5)
        return sess

    needs = {n for k in compile_and_check().specializations[0].kernels for n in k.needs}
    assert needs and all(sym.startswith("cannc_lib_") for sym, _ in needs)
    lowerings = codegen_counts()[0]
    compile_and_check()                                  # all from the memo and the cache
    assert codegen_counts()[0] == lowerings
    for _, key in needs:
        (cache_dir / key[:2] / f"{key}.o").unlink()
    sess = compile_and_check()
    assert codegen_counts()[0] > lowerings
    assert {n for k in sess.specializations[0].kernels for n in k.needs} == needs
