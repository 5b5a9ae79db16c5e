"""The error contract: bad input never crashes; it raises the right cannc exception with a
message that states the fact (key phrases pinned here)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import cannc
from cannc.native.target import ObjectCache
from tests.helpers import ort_run

ROOT = Path(__file__).resolve().parents[1]


def _model(nodes, inputs, outputs, inits=(), opsets=(("", 17),), check=True) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    m.ir_version = 9 if opsets[0][1] >= 7 else 3
    if check:
        onnx.checker.check_model(m)
    return m


def _vi(name, et=T.FLOAT, shape=None):
    return helper.make_tensor_value_info(name, et, shape)


def _linear() -> onnx.ModelProto:
    """y[batch, 8] = Relu(x[batch, 16] @ W + b) * 2: four kernels."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["h2"], name="bias"),
             helper.make_node("Relu", ["h2"], ["h3"], name="relu"),
             helper.make_node("Mul", ["h3", "two"], ["y"], name="scale")]
    return _model(nodes, [_vi("x", shape=["batch", 16])], [_vi("y", shape=["batch", 8])], inits)


@pytest.fixture(scope="module")
def linear_sess() -> cannc.Session:
    return cannc.compile(_linear(), cores=2, shapes={"x": (2, 16)})


# -- malformed models: ModelError --------------------------------------------------------------

def test_malformed_bytes():
    with pytest.raises(cannc.ModelError, match="cannot read the model"):
        cannc.compile(b"\x08\x07 this is not an onnx model \xff\xff\xff")


def test_missing_file_and_wrong_type(tmp_path):
    with pytest.raises(cannc.ModelError, match="model file not found"):
        cannc.compile(tmp_path / "nope.onnx")
    with pytest.raises(cannc.ModelError, match="expected a path, bytes or onnx.ModelProto"):
        cannc.compile(42)


def test_model_failing_the_checker():
    # a node reads a value nothing defines
    m = _model([helper.make_node("Relu", ["ghost"], ["y"], name="r")], [_vi("x", shape=[2])],
               [_vi("y", shape=[2])], check=False)
    with pytest.raises(cannc.ModelError, match="fails the ONNX checker") as e:
        cannc.compile(m)
    assert "ghost" in str(e.value)


def test_graph_output_of_unknown_rank_runs_like_onnxruntime():
    """An output declared as a tensor without a shape (the checker wants the field;
    onnxruntime runs such models): its shape comes from inference."""
    g = helper.make_graph(
        [helper.make_node("Gather", ["x", "i"], ["y"], axis=1),
         helper.make_node("Relu", ["y"], ["z"])], "g",
        [helper.make_tensor_value_info("x", T.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("z", T.FLOAT, None)],
        [numpy_helper.from_array(np.array([0, 5, 1], np.int64), "i")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    got = cannc.compile(m).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, ort_run(m, {"x": x})[0])
    assert got.shape == (4, 3)


def test_old_opset():
    m = _model([helper.make_node("Relu", ["x"], ["y"], name="r")], [_vi("x", shape=[2])],
               [_vi("y", shape=[2])], opsets=(("", 6),), check=False)
    with pytest.raises(cannc.ModelError, match=r"opset 6 is older than the oldest supported \(7\)"):
        cannc.compile(m)


def test_non_tensor_input():
    seq = helper.make_tensor_sequence_value_info("s", T.FLOAT, [2])
    m = _model([helper.make_node("SequenceLength", ["s"], ["n"], name="len")], [seq],
               [_vi("n", T.INT64, [])])
    with pytest.raises(cannc.ModelError, match="'s' is not a tensor"):
        cannc.compile(m)


def test_inconsistent_static_shapes_name_the_node():
    w = numpy_helper.from_array(np.ones((32, 4), np.float32), "W")
    m = _model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm_3")],
               [_vi("x", shape=[2, 16])], [_vi("y", shape=[2, 4])], [w])
    with pytest.raises(cannc.ShapeError, match="MatMul at node 'mm_3'"):
        cannc.compile(m)


# -- unsupported ops: all of them, with node, domain and opset ----------------------------------

def test_unsupported_ops_are_all_listed():
    nodes = [helper.make_node("Det", ["x"], ["d1"], name="det_first"),
             helper.make_node("Relu", ["x"], ["r"], name="fine"),
             helper.make_node("Det", ["r"], ["d2"], name="det_second"),
             helper.make_node("Add", ["d1", "d2"], ["y"], name="sum")]
    m = _model(nodes, [_vi("x", shape=[3, 3])], [_vi("y", shape=[])])
    with pytest.raises(cannc.UnsupportedOpError) as e:
        cannc.compile(m)
    assert [(n[0], n[1], n[2] or "ai.onnx", n[3]) for n in e.value.nodes] == \
        [("det_first", "Det", "ai.onnx", 17), ("det_second", "Det", "ai.onnx", 17)]
    msg = str(e.value)
    assert msg.startswith("2 node(s) cannot be compiled")
    assert "node 'det_first': Det (domain 'ai.onnx', opset 17)" in msg
    assert "node 'det_second'" in msg and "supported ops: `cannc ops`" in msg


def test_unsupported_custom_domain_ops_are_all_listed():
    nodes = [helper.make_node("Det", ["x"], ["d"], name="det0"),
             helper.make_node("Fancy", ["x"], ["f1"], name="fancy_a", domain="com.acme"),
             helper.make_node("Fancy", ["f1"], ["f2"], name="fancy_b", domain="com.acme")]
    m = _model(nodes, [_vi("x", shape=[3, 3])], [_vi("d", shape=[]), _vi("f2", shape=[3, 3])],
               opsets=(("", 17), ("com.acme", 2)))
    with pytest.raises(cannc.UnsupportedOpError) as e:
        cannc.compile(m)
    assert {n[0] for n in e.value.nodes} == {"det0", "fancy_a", "fancy_b"}
    assert "domain 'com.acme', opset 2" in str(e.value)


# -- run-time inputs and outputs: InputError ------------------------------------------------------

def _two_inputs_sess() -> cannc.Session:
    m = _model([helper.make_node("Add", ["a", "b"], ["y"], name="add")],
               [_vi("a", shape=["batch", 4]), _vi("b", shape=["batch", 4])],
               [_vi("y", shape=["batch", 4])])
    return cannc.compile(m, cores=1, shapes={"a": (2, 4), "b": (2, 4)})


def test_input_names(linear_sess):
    x = np.zeros((2, 16), np.float32)
    with pytest.raises(cannc.InputError, match=r"unknown input name\(s\) \['z'\]"):
        linear_sess.run(None, {"x": x, "z": x})
    with pytest.raises(cannc.InputError, match=r"missing input\(s\) \['x'\]"):
        linear_sess.run(None, {})
    with pytest.raises(cannc.InputError, match="must be a dict"):
        linear_sess.run(None, [x])


def test_input_dtype_rank_and_fixed_dim(linear_sess):
    with pytest.raises(cannc.InputError, match=r"input 'x' has dtype float64, expected float32"):
        linear_sess.run(None, {"x": np.zeros((2, 16))})
    with pytest.raises(cannc.InputError, match=r"input 'x' has rank 1 .* expected rank 2"):
        linear_sess.run(None, {"x": np.zeros(16, np.float32)})
    with pytest.raises(cannc.InputError, match=r"dimension 1 must be 16"):
        linear_sess.run(None, {"x": np.zeros((2, 15), np.float32)})


def test_inconsistent_symbolic_dims():
    sess = _two_inputs_sess()
    a, b = np.ones((2, 4), np.float32), np.ones((3, 4), np.float32)
    with pytest.raises(cannc.InputError,
                       match=r"dimension 'batch' is 2 in input 'a' but 3 in input 'b'"):
        sess.run(None, {"a": a, "b": b})
    np.testing.assert_array_equal(sess.run(None, {"a": a, "b": a})[0], a + a)


def test_unknown_output_names_and_shapes(linear_sess):
    x = np.zeros((2, 16), np.float32)
    with pytest.raises(cannc.InputError, match=r"unknown output name\(s\) \['nope'\]"):
        linear_sess.run(["nope"], {"x": x})
    assert linear_sess.run(["y"], {"x": x})[0].shape == (2, 8)
    with pytest.raises(cannc.InputError, match=r"shapes given for unknown inputs \['q'\]"):
        cannc.compile(_linear(), shapes={"q": (1, 16)})


# -- damaged object cache: rebuilt, counted, still correct --------------------------------------

def test_damaged_object_cache_is_rebuilt(tmp_path):
    m = _linear()
    x = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)
    c1 = ObjectCache(tmp_path)
    # unfused, so that there are several kernels to damage in different ways
    cannc.compile(m, cores=2, shapes={"x": (2, 16)}, cache=c1, fusion=False)
    files = sorted(tmp_path.rglob("*.o"))
    assert c1.misses == len(files) == 4
    files[0].write_bytes(b"")                             # emptied
    files[1].write_bytes(files[1].read_bytes()[:40])      # truncated
    data = bytearray(files[2].read_bytes())               # payload bit flip: checksum fails
    data[-100] ^= 0xFF
    files[2].write_bytes(bytes(data))
    files[3].write_bytes(b"\x7fELF" + b"\0" * 200)        # not our format at all

    c2 = ObjectCache(tmp_path)
    sess = cannc.compile(m, cores=2, shapes={"x": (2, 16)}, cache=c2, fusion=False)
    assert c2.rebuilt_damaged == 4 and c2.misses == 4 and c2.hits == 0
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(m, {"x": x})[0],
                               rtol=1e-4, atol=1e-5)
    c3 = ObjectCache(tmp_path)                            # the rebuilt entries are good again
    cannc.compile(m, cores=1, shapes={"x": (2, 16)}, cache=c3, fusion=False)
    assert (c3.hits, c3.misses, c3.rebuilt_damaged) == (4, 0, 0)


# -- damaged .cnc artifacts: CacheError ------------------------------------------------------------

@pytest.fixture(scope="module")
def artifact(tmp_path_factory, linear_sess) -> bytes:
    p = tmp_path_factory.mktemp("cnc") / "linear.cnc"
    linear_sess.save(p)
    return p.read_bytes()


def _rezip(artifact: bytes, replace: dict[str, bytes | None], compress: bool = True) -> bytes:
    out = io.BytesIO()
    mode = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(io.BytesIO(artifact)) as zi, zipfile.ZipFile(out, "w", mode) as zo:
        for name in zi.namelist():
            data = replace.get(name, zi.read(name))
            if data is not None:
                zo.writestr(name, data)
    return out.getvalue()


def test_artifact_roundtrip(tmp_path, artifact, linear_sess):
    p = tmp_path / "ok.cnc"
    p.write_bytes(artifact)
    x = np.ones((2, 16), np.float32)
    loaded = cannc.load(p, cores=1)
    np.testing.assert_array_equal(loaded.run(None, {"x": x})[0], linear_sess.run(None, {"x": x})[0])


def _stored_model_flip(a: bytes) -> bytes:
    b = bytearray(_rezip(a, {}, compress=False))
    b[200] ^= 0xFF      # inside model.onnx: its xxh3 checksum catches it (load maps the
    return bytes(b)     # stored member rather than reading it, so zip's CRC-32 is not read)


def _model_local_header(a: bytes, what: str) -> bytes:
    """The artifact with model.onnx's local zip header damaged (load maps the member from
    where that header says its data starts)."""
    h = zipfile.ZipFile(io.BytesIO(a)).getinfo("model.onnx").header_offset
    b = bytearray(a)
    if what == "signature":
        b[h:h + 4] = b"PK\x00\x00"
    else:                                  # a name and extra field running past the end
        b[h + 26:h + 30] = b"\xff\xff\xff\xff"
    return bytes(b)


@pytest.mark.parametrize("damage, phrase", [
    (lambda a: a[: len(a) // 2], "not a valid cannc artifact"),
    (lambda a: b"", "not a valid cannc artifact"),
    (lambda a: b"PK\x03\x04" + bytes(range(256)) * 4, "not a valid cannc artifact"),
    (lambda a: _rezip(a, {"manifest.json": None}), "not a valid cannc artifact"),
    (lambda a: _rezip(a, {"manifest.json": b"{not json"}), "not a valid cannc artifact"),
    (lambda a: _rezip(a, {"manifest.json": b'{"format": "zip"}'}), "is not a cannc artifact"),
    (lambda a: _rezip(a, {"model.onnx": None}), "not a valid cannc artifact"),
    (_stored_model_flip, r"the embedded model is damaged \(checksum mismatch\)"),
    (lambda a: _model_local_header(a, "signature"), "damaged zip"),
    (lambda a: _model_local_header(a, "extra"), "damaged zip"),
], ids=["truncated", "empty", "junk", "no-manifest", "bad-json", "wrong-format", "no-model",
        "bit-flip", "model-header", "model-extra-field"])
def test_damaged_artifact(tmp_path, artifact, damage, phrase):
    p = tmp_path / "damaged.cnc"
    p.write_bytes(damage(artifact))
    with pytest.raises(cannc.CacheError, match=phrase):
        cannc.load(p)
    assert str(p) not in Path("/proc/self/maps").read_text(), "load left the file mapped"


@pytest.mark.parametrize("damage", [
    lambda a: a[:100] + bytes(b ^ 0x5A for b in a[100:164]) + a[164:],
    lambda a: _rezip(a, {"manifest.json": b"[1, 2]"}),
], ids=["deflate-stream", "manifest-not-object"])
def test_damaged_artifact_core_gaps(tmp_path, artifact, damage):
    p = tmp_path / "damaged.cnc"
    p.write_bytes(damage(artifact))
    try:
        cannc.load(p)
    except cannc.CacheError:
        return
    except Exception as e:  # anything else is the bug
        raise AssertionError(f"{type(e).__name__}: {e}") from e
    raise AssertionError("a damaged artifact loaded")


def test_garbage_objects_in_artifact_do_not_crash(tmp_path, artifact):
    manifest = json.loads(zipfile.ZipFile(io.BytesIO(artifact)).read("manifest.json"))
    bad = _rezip(artifact, {f"objects/{k}.o": b"\x7fELF\x02\x01\x01" + b"\xab" * 64
                            for k in manifest["objects"]})
    p = tmp_path / "garbage.cnc"
    p.write_bytes(bad)
    code = textwrap.dedent(f"""
        import cannc
        try:
            cannc.load({str(p)!r})
        except cannc.CacheError:
            raise SystemExit(0)
        raise SystemExit(1)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=120)
    assert r.returncode == 0, f"exit code {r.returncode}: {r.stderr.decode()[-500:]}"


# -- compile options -----------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{"cores": 0}, {"pipeline": "O9"},
                                     {"shapes": {"x": (2, 16, 1)}}, {"inflight": 0},
                                     {"fusion": {"nonsense": True}}],
                         ids=["cores=0", "pipeline=O9", "shape-rank", "inflight=0",
                              "fusion-rule"])
def test_bad_compile_options(options):
    m = _model([helper.make_node("Relu", ["x"], ["y"], name="r")], [_vi("x", shape=["n", 16])],
               [_vi("y", shape=["n", 16])])
    try:
        cannc.compile(m, **options)
    except cannc.CanncError:
        return
    except Exception as e:
        raise AssertionError(f"{type(e).__name__}: {e}") from e
    raise AssertionError(f"{options} accepted")


def test_unresolvable_symbol_is_an_error_not_a_crash():
    """Generated code can need a runtime-library symbol the process lacks (LLVM lowers
    some conversions to compiler-rt calls, e.g. __truncdfhf2, which only some processes
    have): loading must fail with a CompileError, not abort inside MCJIT."""
    import llvmlite.ir as ir

    from cannc.native.target import JitLibrary, elf_symbols, new_module, optimise_and_emit

    m = new_module("t")
    f = ir.Function(m, ir.FunctionType(ir.DoubleType(), [ir.DoubleType()]), "calls_missing")
    ext = ir.Function(m, ir.FunctionType(ir.DoubleType(), [ir.DoubleType()]),
                      "__cannc_no_such_symbol")
    b = ir.IRBuilder(f.append_basic_block())
    b.ret(b.call(ext, [f.args[0]]))
    obj = optimise_and_emit(str(m), "t")
    defined, undefined = elf_symbols(obj)
    assert "calls_missing" in defined and "__cannc_no_such_symbol" in undefined
    with pytest.raises(cannc.CompileError, match="__cannc_no_such_symbol"):
        JitLibrary([obj])
