"""Tests for the reproducible ONNX model zoo (models/zoo.py)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models import zoo  # noqa: E402

NAMES = ["mlp", "resnet", "mobilenet", "bert", "gpt"]
TRANSFORMERS = {"bert", "gpt"}
F, I64 = TensorProto.FLOAT, TensorProto.INT64

EXPECTED_IO = {
    "mlp": ({"x": (F, ["batch", 256])}, {"logits": (F, ["batch", 10])}),
    "resnet": ({"input": (F, ["batch", 3, 64, 64])}, {"logits": (F, ["batch", 10])}),
    "mobilenet": ({"input": (F, ["batch", 3, 64, 64])}, {"logits": (F, ["batch", 10])}),
    "bert": (
        {"input_ids": (I64, ["batch", "seq"]), "attention_mask": (I64, ["batch", "seq"])},
        {"last_hidden_state": (F, ["batch", "seq", 128]), "pooler_output": (F, ["batch", 128])},
    ),
    "gpt": ({"input_ids": (I64, ["batch", "seq"])}, {"logits": (F, ["batch", "seq", 512])}),
}

REQUIRED_OPS = {
    "mlp": {"MatMul", "Add", "Div", "Erf", "Mul"},
    "resnet": {"Conv", "BatchNormalization", "Relu", "MaxPool", "Add", "GlobalAveragePool",
               "Flatten", "Gemm"},
    "mobilenet": {"Conv", "BatchNormalization", "Clip", "Add", "HardSwish", "GlobalAveragePool",
                  "Reshape", "Gemm"},
    "bert": {"Gather", "Slice", "Shape", "Unsqueeze", "Concat", "Reshape", "Transpose", "MatMul",
             "Div", "Add", "Softmax", "LayerNormalization", "ReduceMean", "Sub", "Pow", "Sqrt",
             "Erf", "Cast", "Mul", "Equal", "Where", "Gemm", "Tanh", "Expand"},
    "gpt": {"Gather", "Range", "Shape", "Unsqueeze", "Concat", "Reshape", "LayerNormalization",
            "MatMul", "Split", "Transpose", "Slice", "Where", "Softmax", "Pow", "Tanh", "Div"},
}


# ---------------------------------------------------------------- helpers


@functools.cache
def _model_bytes(name: str, **kw) -> bytes:
    return zoo.build(name, **kw).SerializeToString()


def _model(name: str, **kw) -> onnx.ModelProto:
    return onnx.load_from_string(_model_bytes(name, **kw))


@functools.cache
def _session(name: str, **kw) -> ort.InferenceSession:
    so = ort.SessionOptions()
    # Run the graph as written (no fusions), which is what a compiler consumes.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    return ort.InferenceSession(_model_bytes(name, **kw), so, providers=["CPUExecutionProvider"])


def _run(name: str, feeds: dict[str, np.ndarray], **kw) -> dict[str, np.ndarray]:
    sess = _session(name, **kw)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _shapes(name, batch, seq):
    dims = {"batch": batch, "seq": seq}
    return {k: tuple(dims.get(d, d) for d in shape)
            for k, (_, shape) in EXPECTED_IO[name][1].items()}


def _io(vis):
    return {v.name: (v.type.tensor_type.elem_type,
                     [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
            for v in vis}


# ---------------------------------------------------------------- structure


def test_registry():
    assert list(zoo.ZOO) == NAMES
    with pytest.raises(KeyError):
        zoo.build("nope")


@pytest.mark.parametrize("name", NAMES)
def test_full_checker_and_opset(name):
    m = _model(name)
    onnx.checker.check_model(m, full_check=True)
    assert [(o.domain, o.version) for o in m.opset_import] == [("", zoo.DEFAULT_OPSET)]
    assert m.ir_version == 8  # minimum IR for opset 17, for wide compatibility


@pytest.mark.parametrize("name", NAMES)
def test_io_and_dynamic_dims(name):
    m = _model(name)
    inits = {t.name for t in m.graph.initializer}
    assert not inits & {i.name for i in m.graph.input}
    assert _io(m.graph.input) == EXPECTED_IO[name][0]
    assert _io(m.graph.output) == EXPECTED_IO[name][1]


@pytest.mark.parametrize("name", NAMES)
def test_required_ops(name):
    ops = {n.op_type for n in _model(name).graph.node}
    missing = REQUIRED_OPS[name] - ops
    assert not missing, f"{name} lacks {missing}"


def test_structural_details():
    # ResNet: 7x7/s2 stem, a stride-2 block with a 1x1 projection shortcut, Gemm transB=1.
    r = _model("resnet")
    convs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
             for n in r.graph.node if n.op_type == "Conv"]
    assert (convs[0]["kernel_shape"] == [7, 7] and convs[0]["strides"] == [2, 2]
            and convs[0]["pads"] == [3] * 4)
    assert any(c["kernel_shape"] == [1, 1] and c["strides"] == [2, 2] for c in convs)
    gemm = next(n for n in r.graph.node if n.op_type == "Gemm")
    assert {a.name: onnx.helper.get_attribute_value(a) for a in gemm.attribute}["transB"] == 1

    # MobileNet: depthwise convs with strides 1 and 2; Clip min/max given as inputs.
    mb = _model("mobilenet")
    dw = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
          for n in mb.graph.node if n.op_type == "Conv"]
    dw = [c for c in dw if c["group"] > 1]
    assert {c["strides"][0] for c in dw} == {1, 2}
    assert all(len(n.input) == 3 for n in mb.graph.node if n.op_type == "Clip")

    # GPT: Split takes its sizes as an input; causal buffer is a [1,1,P,P] lower triangle.
    g = _model("gpt")
    assert all(len(n.input) == 2 for n in g.graph.node if n.op_type == "Split")
    buf = next(t for t in g.graph.initializer if t.name == "transformer.h.0.attn.bias")
    buf = onnx.numpy_helper.to_array(buf)
    assert buf.dtype == np.bool_ and buf.shape == (1, 1, 128, 128)
    assert np.array_equal(buf[0, 0], np.tril(np.ones((128, 128), bool)))


# ---------------------------------------------------------------- running


@pytest.mark.parametrize("name", NAMES)
def test_runs_with_meaningful_outputs(name):
    seqs = (5, 16) if name in TRANSFORMERS else (zoo.DEFAULT_SEQ,)
    for batch in (1, 3):
        for seq in seqs:
            feeds = zoo.example_inputs(name, batch=batch, seq=seq, seed=batch * 100 + seq)
            outs = _run(name, feeds)
            assert {k: v.shape for k, v in outs.items()} == _shapes(name, batch, seq)
            for k, y in outs.items():
                assert y.dtype == np.float32
                assert np.isfinite(y).all(), (name, k)
                assert 0.05 < float(y.std()) < 10.0, (name, k, y.std())
                assert float(np.abs(y).max()) < 100.0, (name, k)
                assert len(np.unique(y)) > y.size // 2, (name, k)  # not constant / saturated
    pooled = _run("bert", zoo.example_inputs("bert", batch=4))["pooler_output"]
    assert (np.abs(pooled) > 0.999).mean() < 0.1  # tanh not saturated


@pytest.mark.parametrize("name", NAMES)
def test_rows_are_independent(name):
    """Row 0 of a batch-3 run equals a batch-1 run on row 0 (dynamic batch is honoured)."""
    feeds = zoo.example_inputs(name, batch=3, seq=7, seed=3)
    full = _run(name, feeds)
    one = _run(name, {k: v[:1] for k, v in feeds.items()})
    for k in full:
        np.testing.assert_allclose(full[k][:1], one[k], rtol=1e-4, atol=1e-4)
    # ... and different inputs give different outputs.
    for k in full:
        assert not np.allclose(full[k][0], full[k][1], atol=1e-3)


def test_gpt_is_causal():
    feeds = zoo.example_inputs("gpt", batch=2, seq=12, seed=1)
    base = _run("gpt", feeds)["logits"]
    changed = feeds["input_ids"].copy()
    changed[:, -1] = (changed[:, -1] + 1) % 512
    out = _run("gpt", {"input_ids": changed})["logits"]
    np.testing.assert_allclose(out[:, :-1], base[:, :-1], rtol=1e-5, atol=1e-5)
    assert np.abs(out[:, -1] - base[:, -1]).max() > 1e-2


def test_bert_attention_mask_is_applied():
    ids = np.random.default_rng(0).integers(0, 1000, (2, 10)).astype(np.int64)
    mask = np.ones((2, 10), np.int64)
    mask[1, 6:] = 0
    base = _run("bert", {"input_ids": ids, "attention_mask": mask})
    ids2 = ids.copy()
    ids2[1, 6:] = (ids2[1, 6:] + 7) % 1000  # change only padded tokens
    out = _run("bert", {"input_ids": ids2, "attention_mask": mask})
    np.testing.assert_allclose(out["last_hidden_state"][:, :6], base["last_hidden_state"][:, :6],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["pooler_output"], base["pooler_output"], rtol=1e-5, atol=1e-5)
    # While unmasking them does change the result.
    full = _run("bert", {"input_ids": ids, "attention_mask": np.ones_like(mask)})
    assert np.abs(full["pooler_output"][1] - base["pooler_output"][1]).max() > 1e-3


def test_fast_at_batch_1():
    for name in NAMES:
        sess = _session(name)
        feeds = zoo.example_inputs(name, batch=1)
        sess.run(None, feeds)
        best = min(_timed(sess, feeds) for _ in range(5))
        assert best < 0.1, (name, best)


def _timed(sess, feeds):
    t = time.perf_counter()
    sess.run(None, feeds)
    return time.perf_counter() - t


# ---------------------------------------------------------------- variants / opsets


@pytest.mark.parametrize("name,kw,ops", [
    ("bert", {"decomposed_layernorm": True}, {"LayerNormalization": 0, "Where": 1}),
    ("bert", {"decomposed_layernorm": False}, {"LayerNormalization": 5, "ReduceMean": 0}),
    ("bert", {"mask_mode": "additive"}, {"Where": 0, "Equal": 0}),
    ("bert", {"mask_mode": "where"}, {"Where": 2, "Cast": 0}),
    ("bert", {"opset": 14}, {"LayerNormalization": 0}),
    ("bert", {"opset": 18}, {"LayerNormalization": 4}),
    ("gpt", {"mask_dtype": "uint8"}, {"Cast": 2}),
    ("gpt", {"decomposed_layernorm": True}, {"LayerNormalization": 0}),
    ("gpt", {"opset": 14}, {"LayerNormalization": 0}),
    ("gpt", {"opset": 18}, {"LayerNormalization": 5}),
    ("mlp", {"opset": 13}, {}),
    ("mlp", {"opset": 18}, {}),
    ("resnet", {"opset": 13}, {}),
    ("resnet", {"opset": 18}, {}),
    ("mobilenet", {"opset": 14}, {}),
    ("mobilenet", {"opset": 18}, {}),
])
def test_variants_are_equivalent(name, kw, ops):
    m = _model(name, **kw)
    onnx.checker.check_model(m, full_check=True)
    assert m.opset_import[0].version == kw.get("opset", zoo.DEFAULT_OPSET)
    counts = {op: sum(n.op_type == op for n in m.graph.node) for op in ops}
    assert counts == ops
    feeds = zoo.example_inputs(name, batch=2, seq=9, seed=4)
    ref, out = _run(name, feeds), _run(name, feeds, **kw)
    for k in ref:
        np.testing.assert_allclose(out[k], ref[k], rtol=1e-4, atol=1e-4)


def test_bad_options():
    with pytest.raises(ValueError):
        zoo.build("mobilenet", opset=13)  # HardSwish needs opset 14
    with pytest.raises(ValueError):
        zoo.build("bert", mask_mode="bogus")
    with pytest.raises(ValueError):
        zoo.build("gpt", mask_dtype="int32")
    with pytest.raises(ValueError):
        zoo.example_inputs("gpt", seq=129)


def test_size_options():
    m = zoo.build("bert", num_layers=1, hidden=64, num_heads=2, intermediate=128, vocab_size=50)
    onnx.checker.check_model(m, full_check=True)
    feeds = zoo.example_inputs(m, batch=2, seq=4)
    assert feeds["input_ids"].max() < 50
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    y = ort.InferenceSession(m.SerializeToString(), so,
                             providers=["CPUExecutionProvider"]).run(None, feeds)
    assert y[0].shape == (2, 4, 64) and y[1].shape == (2, 64)
    r = zoo.build("resnet", channels=(16, 32, 48), blocks_per_stage=2)
    onnx.checker.check_model(r, full_check=True)
    assert sum(n.op_type == "Conv" for n in r.graph.node) == 1 + 3 * 2 * 2 + 2


# ---------------------------------------------------------------- reproducibility


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_and_seeded(name):
    a = _model_bytes(name)
    assert zoo.build(name, seed=0).SerializeToString() == a
    b = _model_bytes(name, seed=1)
    assert b != a
    ma, mb = onnx.load_from_string(a), onnx.load_from_string(b)
    assert [n.op_type for n in ma.graph.node] == [n.op_type for n in mb.graph.node]
    wa = {t.name: onnx.numpy_helper.to_array(t) for t in ma.graph.initializer}
    wb = {t.name: onnx.numpy_helper.to_array(t) for t in mb.graph.initializer}
    assert wa.keys() == wb.keys()
    assert any(not np.array_equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("name", NAMES)
def test_example_inputs(name):
    m = _model(name)
    a = zoo.example_inputs(m, batch=4, seq=11, seed=7)
    b = zoo.example_inputs(name, batch=4, seq=11, seed=7)
    assert a.keys() == b.keys() == set(EXPECTED_IO[name][0])
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        want_dtype = np.int64 if EXPECTED_IO[name][0][k][0] == I64 else np.float32
        assert a[k].dtype == want_dtype and a[k].shape[0] == 4
    if "input_ids" in a:
        vocab = {"bert": 1000, "gpt": 512}[name]
        assert a["input_ids"].shape == (4, 11)
        assert 0 <= a["input_ids"].min() and a["input_ids"].max() < vocab
    if "attention_mask" in a:
        mask = a["attention_mask"]
        assert set(np.unique(mask)) <= {0, 1} and (mask.sum(axis=1) >= 1).all()
        assert mask[0].all() and not mask.all()  # row 0 full, some padding elsewhere
    assert not np.array_equal(next(iter(a.values())),
                              next(iter(zoo.example_inputs(m, batch=4, seq=11, seed=8).values())))


# ---------------------------------------------------------------- save / CLI


def test_save_is_cache_friendly(tmp_path):
    p = zoo.save("mlp", tmp_path / "out")
    assert p == tmp_path / "out" / "mlp.onnx"
    assert p.read_bytes() == _model_bytes("mlp")
    old = 1_000_000_000
    os.utime(p, (old, old))
    assert zoo.save("mlp", tmp_path / "out") == p
    assert p.stat().st_mtime == old  # unchanged content: not rewritten
    zoo.save("mlp", tmp_path / "out", seed=1)
    assert p.stat().st_mtime != old and p.read_bytes() == _model_bytes("mlp", seed=1)
    assert sorted(x.name for x in p.parent.iterdir()) == ["mlp.onnx"]  # no temp files left


def test_cli_writes_all_models(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "zoo"
    subprocess.run([sys.executable, "-m", "models.zoo", "--out", str(out)],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.onnx" for n in NAMES)
    for n in NAMES:
        assert (out / f"{n}.onnx").read_bytes() == _model_bytes(n)
    one = tmp_path / "one"
    r = subprocess.run([sys.executable, "-m", "models.zoo", "--out", str(one), "--name", "gpt"],
                       cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    assert [p.name for p in one.iterdir()] == ["gpt.onnx"] and "gpt.onnx" in r.stdout


def test_example_inputs_dim_names():
    """Exporters name the symbolic dims differently (Hugging Face exports: "b", "s");
    an unknown name is an error that names it."""
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])
    px = helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["B", 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 4])
    emb = helper.make_tensor("emb", TensorProto.FLOAT, [50, 4], np.zeros(200, np.float32))
    g = helper.make_graph([helper.make_node("Gather", ["emb", "input_ids"], ["y"])], "g",
                          [x, px], [y], [emb])
    feeds = zoo.example_inputs(helper.make_model(g), batch=3, seq=5)
    assert feeds["input_ids"].shape == (3, 5) and feeds["input_ids"].max() < 50
    assert feeds["pixels"].shape == (3, 3, 8, 8)
    bad = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "tokens"])
    g2 = helper.make_graph([helper.make_node("Gather", ["emb", "input_ids"], ["y"])], "g",
                           [bad], [y], [emb])
    with pytest.raises(ValueError, match="unknown symbolic dim 'tokens'"):
        zoo.example_inputs(helper.make_model(g2))
