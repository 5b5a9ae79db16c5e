"""Large model files: the weights are viewed in the file's bytes, not parsed out of them
(cannc.frontend.wire.strip_raw_data, onnx_import.load_model). The model imported so is
the model: same results as onnxruntime, the whole ModelProto back for save, and every
tensor the viewer does not take (other types, wrong sizes, damaged files) goes the
usual way, with the usual errors."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.errors import ModelError
from cannc.frontend import onnx_import, wire

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def small_limits(monkeypatch):
    """Let test-sized files (a few MB) take the viewed path."""
    monkeypatch.setattr(onnx_import, "LAZY_MIN_FILE", 1 << 16)
    monkeypatch.setattr(onnx_import, "SKELETON_BYTES", 1 << 16)
    monkeypatch.setattr(onnx_import, "EXACT_CHECK_BYTES", 1 << 12)


def _mlp(path, dims=(96, 512, 384, 10), extra=(), seed=0):
    rng = np.random.default_rng(seed)
    inits, nodes, x = [], [], "x"
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        w = rng.standard_normal((a, b)).astype(np.float32) * 0.1
        bias = rng.standard_normal(b).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(bias, f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"])]
        x = f"y{i}"
        if i < len(dims) - 2:
            nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
            x = f"r{i}"
    for t, node in extra:
        inits.append(t)
        nodes.append(node)
    g = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", dims[0]])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", dims[-1]])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(m, str(path))
    return path


def _x(n=96):
    return {"x": np.random.default_rng(1).standard_normal((4, n)).astype(np.float32)}


def test_viewed_weights_are_the_model(small_limits, tmp_path):
    path = _mlp(tmp_path / "m.onnx")
    loaded = onnx_import.load_model(path)
    assert loaded.weights, "the weights were parsed, not viewed"
    names = [loaded.proto.graph.initializer[i].name for i in loaded.weights]
    assert set(names) >= {"w0", "w1"}
    ref = onnx.load(str(path))
    for i, a in loaded.weights.items():
        want = numpy_helper.to_array(ref.graph.initializer[i])
        assert a.dtype == want.dtype and np.array_equal(a, want)
        assert not loaded.proto.graph.initializer[i].HasField("raw_data")
    # the whole model back: byte for byte what parsing gives
    assert loaded.complete().SerializeToString() == ref.SerializeToString()
    sess = cannc.compile(str(path), cores=2)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, _x())
    np.testing.assert_allclose(sess.run(None, _x())[0], want[0], rtol=1e-4, atol=1e-5)


def test_save_after_a_viewed_import_writes_the_whole_model(small_limits, tmp_path):
    path = _mlp(tmp_path / "m.onnx")
    sess = cannc.compile(str(path), cores=2)
    out = sess.run(None, _x())[0]
    sess.save(tmp_path / "m.cnc")
    back = cannc.load(tmp_path / "m.cnc")
    np.testing.assert_array_equal(back.run(None, _x())[0], out)
    # and a new shape after the load (the saved model's weights are all there)
    x8 = {"x": np.random.default_rng(2).standard_normal((8, 96)).astype(np.float32)}
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(back.run(None, x8)[0], ref.run(None, x8)[0],
                               rtol=1e-4, atol=1e-5)


def test_tensors_the_viewer_does_not_take_go_the_usual_way(small_limits, tmp_path):
    # a big bfloat16 initializer (not a plain numpy layout) is parsed as before
    bf = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32)
    t = helper.make_tensor("bf", TensorProto.BFLOAT16, bf.shape,
                           (bf.view(np.uint32) >> 16).astype(np.uint16).tobytes(), raw=True)
    cast = helper.make_node("Cast", ["bf"], ["bf32"], to=TensorProto.FLOAT)
    path = _mlp(tmp_path / "m.onnx", extra=[(t, cast)])
    loaded = onnx_import.load_model(path)
    bf_index = [t.name for t in loaded.proto.graph.initializer].index("bf")
    assert bf_index not in loaded.weights
    assert loaded.proto.graph.initializer[bf_index].raw_data == t.raw_data
    g, _ = onnx_import.import_model(loaded)
    assert g.constants["bf"].shape == (64, 512)


def test_a_weight_of_the_wrong_size_is_the_usual_error(small_limits, tmp_path):
    w = numpy_helper.from_array(np.zeros((512, 384), np.float32), "w1")
    w.dims[0] = 500                                     # 500x384 declared, 512x384 held
    m = onnx.load(str(_mlp(tmp_path / "ok.onnx")))
    m.graph.initializer[2].CopyFrom(w)
    bad = tmp_path / "bad.onnx"
    onnx.save(m, str(bad))
    assert 2 not in onnx_import.load_model(bad).weights
    with pytest.raises(ModelError):
        cannc.compile(str(bad))


@pytest.mark.parametrize("cut", [0.5, 0.999])
def test_a_truncated_file_is_a_model_error(small_limits, tmp_path, cut):
    path = _mlp(tmp_path / "m.onnx")
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * cut)])
    with pytest.raises(ModelError):
        cannc.compile(str(path))


def test_small_files_are_parsed(tmp_path):
    path = _mlp(tmp_path / "m.onnx")       # ~1 MB, under the real limits
    assert onnx_import.load_model(path).weights == {}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.booleans()), min_size=0, max_size=6),
       st.integers(0, 200))
def test_strip_raw_data_agrees_with_protobuf(tensors, min_bytes):
    inits = []
    for i, (n, raw) in enumerate(tensors):
        a = np.arange(n, dtype=np.float32)
        t = numpy_helper.from_array(a, f"t{i}")
        if not raw:
            t = helper.make_tensor(f"t{i}", TensorProto.FLOAT, [n], a.tolist())
        inits.append(t)
    g = helper.make_graph([], "g", [], [], inits)
    m = helper.make_model(g, producer_name="p", doc_string="d" * 5)
    b = m.SerializeToString()
    reduced, spans = wire.strip_raw_data(b, min_bytes)
    got = onnx.ModelProto()
    got.ParseFromString(reduced)
    want = onnx.ModelProto()
    want.CopyFrom(m)
    for i, t in enumerate(want.graph.initializer):
        if t.HasField("raw_data") and len(t.raw_data) >= min_bytes:
            assert i in spans and b[slice(*spans[i])] == t.raw_data
            t.ClearField("raw_data")
        else:
            assert i not in spans
    assert got == want


def test_strip_raw_data_refuses_what_is_not_a_model():
    with pytest.raises(ValueError):
        wire.strip_raw_data(b"\x3a\xff\xff\xff\xff\x0f", 0)      # a field longer than the bytes


def test_model_file_is_read_into_small_pages(small_limits, tmp_path):
    """The file's bytes go to memory advised against huge pages (VmFlags "nh"): they are
    read once, and a first touch of huge pages can cost several times more."""
    import os

    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc/self/smaps")
    from tests.runtime.test_memory import _vma_of

    loaded = onnx_import.load_model(str(_mlp(tmp_path / "m.onnx")))
    assert loaded.weights
    w = next(iter(loaded.weights.values()))
    vma = _vma_of(w.ctypes.data)
    assert vma is not None and "nh" in vma[1]
    assert all(v.base is not None for v in loaded.weights.values())   # views, not copies
