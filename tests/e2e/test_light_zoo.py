"""The ONNX model zoo's real graphs at opsets 7-9 that the onnx package ships
(`onnx/backend/test/data/light/`: AlexNet, DenseNet-121, Inception v1/v2, ResNet-50,
ShuffleNet, SqueezeNet, VGG-19, ZFNet-512), compiled by cannc against onnxruntime.

The shipped graphs replace every weight by a ConstantOfShape of one value, so their
outputs barely depend on the input (the shipped expected outputs are weak). Each model
is therefore checked twice: as shipped (the fold of those ConstantOfShape nodes, the
fill kernel of the ones too large to fold, Dropout with its mask declared, Unsqueeze-1)
and with random weights of the same shapes (He-scaled, batch-norm statistics near the
identity), its pre-softmax logits exposed as a second graph output. Comparison: float32
rtol 1e-4, atol 1e-5 relative to the output's magnitude (deep nets accumulate in another
order than onnxruntime).
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import assert_matches_ort, ort_run, single_node_model, with_dynamic_dims
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.compiler.report import support_report

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
MODELS = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
          "shufflenet", "squeezenet", "vgg19", "zfnet512"]
# random weights above this many elements stay the shipped ConstantOfShape (VGG-19's and
# ZFNet's first fully connected weight: 100M / 75M elements, the fill kernel's case)
RANDOM_LIMIT = 1 << 24


def _load(name: str) -> onnx.ModelProto:
    return onnx.load(os.path.join(LIGHT, f"light_{name}.onnx"))


def _feeds(model: onnx.ModelProto, seed: int = 0, batch: int | None = None) -> dict:
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape = [d.dim_value if d.HasField("dim_value") else batch
                 for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _ort(model: onnx.ModelProto, feeds: dict) -> list:
    """onnxruntime without graph optimisations (it would fold the 100M-element
    ConstantOfShape weights at session creation, seconds for nothing)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _compare(got: list, expected: list, names: list[str]) -> None:
    for g, e, name in zip(got, expected, names):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        scale = max(1.0, float(np.abs(e).max()))
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


def _roles(model: onnx.ModelProto) -> dict[str, tuple[str, int]]:
    """value -> (op type, input index) of its first consumer, through Unsqueeze."""
    roles: dict[str, tuple[str, int]] = {}
    for n in model.graph.node:
        for i, v in enumerate(n.input):
            roles.setdefault(v, (n.op_type, i))
    for n in model.graph.node:
        if n.op_type == "Unsqueeze" and n.output[0] in roles:
            roles[n.input[0]] = roles[n.output[0]]
    return roles


def _random_weight(shape: tuple[int, ...], role: tuple[str, int],
                   rng: np.random.Generator) -> np.ndarray:
    op, i = role
    if len(shape) >= 2:                      # Conv / Gemm weight: He-scaled
        w = rng.standard_normal(shape, dtype=np.float32)
        return w * np.float32(np.sqrt(2.0 / np.prod(shape[1:])))
    if (op, i) in (("BatchNormalization", 1), ("BatchNormalization", 4), ("Mul", 1)):
        return rng.uniform(0.5, 1.0, shape)  # scale, variance
    return rng.normal(0.0, 0.1, shape)       # biases, means


def randomised(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """The graph with random weights (ConstantOfShape weights and float initializers), its
    Softmax's input (the logits) as a second output."""
    rng = np.random.default_rng(seed)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    roles = _roles(m)
    shapes = {t.name: tuple(int(d) for d in numpy_helper.to_array(t))
              for t in g.initializer if t.data_type == TensorProto.INT64}
    new, keep = {}, []
    for n in g.node:
        shape = shapes.get(n.input[0]) if n.op_type == "ConstantOfShape" else None
        if shape is not None and np.prod(shape) <= RANDOM_LIMIT:
            new[n.output[0]] = _random_weight(shape, roles.get(n.output[0], ("", 0)), rng)
        else:
            keep.append(n)
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT and t.name in roles and len(t.dims) == 1:
            new[t.name] = _random_weight(tuple(t.dims), roles[t.name], rng)
    inits = [t for t in g.initializer if t.name not in new]
    inits += [numpy_helper.from_array(a.astype(np.float32), k) for k, a in new.items()]
    del g.node[:]
    g.node.extend(keep)
    del g.initializer[:]
    g.initializer.extend(inits)
    listed = {vi.name for vi in g.input}
    for k, a in new.items():          # IR 3: initializers are listed as graph inputs too
        if k not in listed:
            g.input.append(helper.make_tensor_value_info(k, TensorProto.FLOAT, list(a.shape)))
    inferred = onnx.shape_inference.infer_shapes(m)
    types = {vi.name: vi for vi in inferred.graph.value_info}
    for n in g.node:
        if n.op_type == "Softmax" and n.input[0] in types:
            g.output.append(types[n.input[0]])
    return m


def _check_supported(model: onnx.ModelProto) -> None:
    rep = support_report(model)
    bad = [(r.name, r.op, r.reason) for r in rep.nodes if r.status == "unsupported"]
    assert rep.supported and not bad, bad


@pytest.mark.parametrize("name", MODELS)
def test_light_model_as_shipped(name):
    model = _load(name)
    _check_supported(model)
    sess = cannc.compile(model, cores=2)
    feeds = _feeds(model)
    _compare(sess.run(None, feeds), _ort(model, feeds),
             [o.name for o in sess.get_outputs()])


@pytest.mark.parametrize("name", MODELS)
def test_light_model_random_weights(name):
    model = randomised(_load(name))
    sess = cannc.compile(model, cores=2)
    feeds = _feeds(model, seed=1)
    got, expected = sess.run(None, feeds), _ort(model, feeds)
    assert len(got) == len(model.graph.output)      # (with the logits, where a Softmax is)
    assert float(np.std(expected[-1])) > 1e-3, "the logits barely depend on the input"
    _compare(got, expected, [o.name for o in sess.get_outputs()])


def test_squeezenet_any_batch():
    """A fully convolutional graph with a symbolic batch: Softmax-1 on [N, 1000, 1, 1]
    normalises each sample's flattened [1000, 1, 1] (the 2-D coercion of opsets < 13)."""
    model = randomised(_load("squeezenet"))
    model = with_dynamic_dims(model, {"data_0": {0: "N"}})
    sess = cannc.compile(model, cores=2)
    for batch in (2, 1):
        feeds = _feeds(model, seed=batch, batch=batch)
        _compare(sess.run(None, feeds), _ort(model, feeds),
                 [o.name for o in sess.get_outputs()])


# --- the old-opset semantics these graphs rely on, node by node --------------------------

_rng = np.random.default_rng(7)


def _f(*shape: int) -> np.ndarray:
    return _rng.standard_normal(shape).astype(np.float32)


def _mask_model(opset: int) -> tuple[onnx.ModelProto, dict]:
    mask_type = TensorProto.FLOAT if opset < 10 else TensorProto.BOOL
    attrs = {"ratio": 0.25} if opset < 12 else {}
    shape = [2, 3, 4]
    g = helper.make_graph(
        [helper.make_node("Dropout", ["x"], ["y", "mask"], **attrs)], "dropout",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("mask", mask_type, shape)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 7
    return m, {"x": _f(*shape)}


@pytest.mark.parametrize("opset", [7, 9, 10, 12, 13])
def test_dropout_mask_is_a_constant(opset):
    """Inference Dropout with its mask declared (and a graph output): the data passes
    through, the mask is a constant of onnxruntime's dtype and values for that opset
    (the input's type before 10, bool after; zeros before 12, ones from 12)."""
    m, feeds = _mask_model(opset)
    got = assert_matches_ort(m, feeds, cores=1)
    assert got[1].dtype == (np.float32 if opset < 10 else np.bool_)


@pytest.mark.parametrize("dtype,value", [(np.float32, 0.02), (np.int64, 7), (np.bool_, True),
                                         (np.float16, 1.5)])
def test_constant_of_shape_too_large_to_fold_is_a_fill_kernel(dtype, value):
    shape = np.array([3, 1000, 7], np.int64)
    vt = numpy_helper.from_array(np.array([value], dtype))
    g = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["s"], ["c"], value=vt),
         helper.make_node("Identity", ["x"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("c", vt.data_type, [3, 1000, 7]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(shape, "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)])
    m.ir_version = 7
    sess = cannc.compile(m, cores=2, pass_options={"infer_and_fold": {"limit_elems": 1000}})
    (prog,) = sess.programs.values()
    assert [k.op_types for k in prog.spec.kernels].count(["ConstantOfShape"]) == 1
    (c,) = sess.run(["c"], {"x": np.zeros(1, np.float32)})
    assert c.dtype == dtype and c.shape == (3, 1000, 7)
    assert (c == np.array(value, dtype)).all()


# (op, inputs, attributes): every input constant, so the constant folder computes the node
FOLDED = [
    ("Unsqueeze", [_f(3, 4)], dict(opset=9, axes=[0, 3])),
    ("Squeeze", [_f(3, 1, 4)], dict(opset=9, axes=[1])),
    ("Softmax", [_f(2, 3, 4)], dict(opset=9, axis=1)),
    ("LogSoftmax", [_f(2, 3, 4)], dict(opset=9, axis=0)),
    ("Hardmax", [_f(2, 3, 4)], dict(opset=11, axis=1)),
    ("Softmax", [_f(2, 3, 4)], dict(opset=13, axis=1)),
    ("BatchNormalization", [_f(2, 3, 4, 5), _f(3), _f(3), _f(3), np.abs(_f(3)) + .5],
     dict(opset=7, epsilon=1e-3)),
    ("BatchNormalization", [_f(2, 3, 4), _f(3, 4), _f(3, 4), _f(3, 4), np.abs(_f(3, 4)) + .5],
     dict(opset=7, spatial=0)),
    ("LRN", [_f(1, 7, 2, 3)], dict(opset=9, size=5, alpha=1e-2, beta=0.75, bias=2.0)),
    ("Upsample", [_f(1, 2, 3, 4)], dict(opset=7, scales=[1.0, 1.0, 2.0, 3.0])),
    ("Upsample", [_f(1, 2, 3, 4)], dict(opset=7, scales=[1.0, 1.0, 2.0, 1.5], mode="linear")),
    ("Gemm", [_f(3, 4), _f(5, 4), _f(5)], dict(opset=7, transB=1)),
    ("Sum", [_f(2, 3), _f(3), _f(2, 1), _f(1, 3)], dict(opset=8)),
    ("Dropout", [_f(2, 3)], dict(opset=7, ratio=0.5)),
]


@pytest.mark.parametrize("op,inputs,attrs", FOLDED,
                         ids=[f"{o}-{a['opset']}-{i}" for i, (o, _, a) in enumerate(FOLDED)])
def test_constant_folding_reads_the_nodes_opset(op, inputs, attrs):
    """The constant folder evaluates each node at its own opset (a bare node given to
    onnx.reference is read at the newest: Unsqueeze-1's `axes` attribute fails, Softmax-1
    normalises one axis instead of the flattened trailing dims)."""
    attrs = dict(attrs)
    m, feeds = single_node_model(op, inputs, opset=attrs.pop("opset"),
                                 const_inputs=range(len(inputs)), **attrs)
    assert not feeds
    sess = cannc.compile(m, cores=1)
    got = sess.run(None, {})
    assert all(not p.spec.kernels for p in sess.programs.values())   # folded: no kernel
    _compare(got, ort_run(m, {}), [o.name for o in sess.get_outputs()])
