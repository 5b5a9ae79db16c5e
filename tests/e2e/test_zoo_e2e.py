"""Every zoo model, compiled by cannc, against onnxruntime at several sizes."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ort_run

import cannc
from models import zoo

CASES = [
    ("mlp", {}, [dict(batch=1), dict(batch=8)]),
    ("resnet", {}, [dict(batch=1), dict(batch=2)]),
    ("mobilenet", {}, [dict(batch=1), dict(batch=2)]),
    ("bert", {}, [dict(batch=1, seq=16), dict(batch=2, seq=7)]),
    ("gpt", {}, [dict(batch=1, seq=16), dict(batch=2, seq=5)]),
]


def _compare(model, sess, feeds, rtol=1e-4, atol=1e-4):
    expected = ort_run(model, feeds)
    got = sess.run(None, feeds)
    for g, e, o in zip(got, expected, sess.get_outputs()):
        assert g.shape == e.shape and g.dtype == e.dtype, o.name
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=o.name)


@pytest.mark.parametrize("name,opts,sizes", CASES, ids=[c[0] for c in CASES])
def test_zoo_model_matches_onnxruntime(name, opts, sizes):
    model = zoo.build(name, **opts)
    sess = cannc.compile(model, cores=2)
    for s in sizes:
        _compare(model, sess, zoo.example_inputs(model, **s))
    # one specialisation per distinct input shape, each compiled once
    n = len(sess.programs)
    sess.run(None, zoo.example_inputs(model, **sizes[0]))
    assert len(sess.programs) == n


@pytest.mark.parametrize("name,opset", [("bert", 14), ("bert", 18), ("gpt", 14), ("mlp", 13),
                                        ("mobilenet", 14), ("resnet", 13)])
def test_zoo_other_opsets(name, opset):
    model = zoo.build(name, opset=opset)
    sess = cannc.compile(model, cores=1)
    _compare(model, sess, zoo.example_inputs(model, batch=2))


def test_bert_variants():
    for kw in (dict(decomposed_layernorm=True), dict(mask_mode="where")):
        model = zoo.build("bert", **kw)
        sess = cannc.compile(model, cores=2)
        _compare(model, sess, zoo.example_inputs(model, batch=2, seq=9))


def test_value_specialisation_of_shape_inputs():
    """A Reshape whose target shape is a runtime input: the session specialises on it."""
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["r"]),
         helper.make_node("Relu", ["r"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
              helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m = onnx.shape_inference.infer_shapes(m)
    sess = cannc.compile(m, cores=1)
    x = np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)
    for shp in ([3, 4], [12, 1], [3, 4]):
        (y,) = sess.run(None, {"x": x, "shape": np.array(shp, np.int64)})
        np.testing.assert_array_equal(y, np.maximum(x, 0).reshape(shp))
    assert len(sess.programs) == 2


def test_external_data_model_from_path(tmp_path):
    import onnx

    ref = zoo.build("mlp")
    m = zoo.build("mlp")
    onnx.save_model(m, str(tmp_path / "mlp.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=1024)
    assert (tmp_path / "weights.bin").stat().st_size > (tmp_path / "mlp.onnx").stat().st_size
    sess = cannc.compile(str(tmp_path / "mlp.onnx"), cores=1)
    _compare(ref, sess, zoo.example_inputs(ref, batch=3))
    sess.save(tmp_path / "mlp.cnc")
    _compare(ref, cannc.load(tmp_path / "mlp.cnc"), zoo.example_inputs(ref, batch=3))


@pytest.mark.parametrize("name", ["mlp", "bert", "resnet"])
def test_empty_batch_gives_empty_outputs(name):
    """A batch of 0 carries no data: everything folds, no kernel runs, shapes match ORT."""
    model = zoo.build(name)
    sess = cannc.compile(model, cores=1)
    feeds = {k: v[:0] for k, v in zoo.example_inputs(model, batch=2).items()}
    for g, e in zip(sess.run(None, feeds), ort_run(model, feeds)):
        assert g.shape == e.shape and g.dtype == e.dtype and g.size == 0


def _resize_head(by: str):
    """x -> Conv -> Resize back to x's height and width, as torchvision's LR-ASPP and
    DeepLabV3 heads export it: the sizes are Concat(Shape(conv)[:2], Shape(x)[2:]);
    or (``by='scales'``) a constant 2x upsampling."""
    from onnx import TensorProto, helper
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 3, 3],
                           rng.standard_normal(108).astype(np.float32))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1])]
    inits = [w]
    if by == "sizes":
        nodes += [helper.make_node("Shape", ["c"], ["sc"]),
                  helper.make_node("Slice", ["sc", "s0", "s2"], ["nc"]),
                  helper.make_node("Shape", ["x"], ["sx"]),
                  helper.make_node("Slice", ["sx", "s2", "s4"], ["hw"]),
                  helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
                  helper.make_node("Resize", ["c", "", "", "sizes"], ["y"], mode="linear")]
        inits += [helper.make_tensor(n, TensorProto.INT64, [1], [v])
                  for n, v in (("s0", 0), ("s2", 2), ("s4", 4))]
    else:
        nodes += [helper.make_node("Resize", ["c", "", "scales"], ["y"], mode="nearest")]
        inits += [helper.make_tensor("scales", TensorProto.FLOAT, [4], [1, 1, 2, 2])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["batch", 3, 8, 8])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("by", ["sizes", "scales"])
def test_empty_batch_through_resize(by):
    """ONNX's shape inference leaves a Resize's output dim unset where it is 0 (sizes
    computed from the Shape of an empty batch): cannc said 'depends on data' where
    onnxruntime returns an empty output (LR-ASPP, DeepLabV3 at batch 0)."""
    model = _resize_head(by)
    sess = cannc.compile(model, cores=1)
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    for feeds in ({"x": x[:0]}, {"x": x}):
        (got,), (want,) = sess.run(None, feeds), ort_run(model, feeds)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
