"""Shape-polymorphic reductions and normalisations (codegen/ABI.md "Runtime dimensions"):
a model with symbolic batch / sequence dims is compiled once and run at other sizes
(1, odd, not a multiple of the vector width or the tile) with no code generation,
against onnxruntime."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cannc.codegen.lower import base as lowerings
from cannc.codegen.lower import lowering_for
from cannc.ir.ops import lookup
from tests.helpers import (
    assert_matches_ort,
    check_runtime_dims,
    single_node_model,
    with_dynamic_dims,
)

RNG = np.random.default_rng(4321)


def rnd(*shape, lo=None, hi=None):
    if lo is not None:
        return RNG.uniform(lo, hi, shape).astype(np.float32)
    return RNG.standard_normal(shape).astype(np.float32)


def kernel_ops(sess) -> list[list[str]]:
    return [k.op_types for spec in sess.specializations for k in spec.kernels]


def kernel_symbols(sess, ops: list[str] | None = None) -> set[str]:
    """The code of every kernel (of these ONNX ops) over the session's specialisations."""
    return {k.symbol for spec in sess.specializations for k in spec.kernels
            if ops is None or k.op_types == ops}


# (batch, seq): 1, odd, not multiples of 16 (the vector) or of the rows per tile
SIZES = [(2, 16), (1, 1), (3, 7), (5, 33), (2, 100), (1, 129)]


# -- LayerNormalization / RMSNormalization ------------------------------------------------

@pytest.mark.parametrize("hidden,bias,outs", [(64, True, 1), (37, False, 3), (768, True, 1)])
def test_layer_norm_runtime_rows(hidden, bias, outs):
    ins = [rnd(2, 16, hidden), rnd(hidden)] + ([rnd(hidden)] if bias else [])
    m, _ = single_node_model("LayerNormalization", ins, n_outputs=outs, const_inputs=[1, 2],
                             axis=-1, epsilon=1e-5)
    m = with_dynamic_dims(m, {"in0": {0: "batch", 1: "seq"}})
    sess = check_runtime_dims(m, [{"in0": rnd(b, s, hidden)} for b, s in SIZES])
    assert len(kernel_symbols(sess)) == 1


def test_layer_norm_partial_param_period():
    # scale over the last of two normalised dims: the period is static, the rows runtime
    m, _ = single_node_model("LayerNormalization", [rnd(3, 4, 24), rnd(24), rnd(24)],
                             const_inputs=[1, 2], axis=1)
    m = with_dynamic_dims(m, {"in0": {0: "batch"}})
    check_runtime_dims(m, [{"in0": rnd(b, 4, 24)} for b in (3, 1, 17)])


def test_decomposed_layer_norm_runtime_rows():
    """ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add (older exporters) fuses into
    LayerNormalization, which then runs at every size from one kernel."""
    h = 48
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", h])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", h])
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
             numpy_helper.from_array(rnd(h), "gamma"), numpy_helper.from_array(rnd(h), "beta")]
    nodes = [helper.make_node("ReduceMean", ["x"], ["mu"], axes=[-1]),
             helper.make_node("Sub", ["x", "mu"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"]),
             helper.make_node("Mul", ["n", "gamma"], ["g"]),
             helper.make_node("Add", ["g", "beta"], ["y"])]
    m = helper.make_model(helper.make_graph(nodes, "ln", [x], [y], initializer=inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    sess = check_runtime_dims(m, [{"x": rnd(b, s, h)} for b, s in SIZES], rtol=1e-4, atol=1e-4)
    assert kernel_ops(sess)[0] == ["ReduceMean", "Sub", "Pow", "ReduceMean", "Add", "Sqrt",
                                   "Div", "Mul", "Add"]


def test_rms_norm_runtime_rows():
    m, _ = single_node_model("RMSNormalization", [rnd(2, 5, 40), rnd(40)], opset=23,
                             const_inputs=[1], axis=-1)
    m = with_dynamic_dims(m, {"in0": {0: "batch", 1: "seq"}})
    check_runtime_dims(m, [{"in0": rnd(b, s, 40)} for b, s in SIZES[:4]])


# -- Softmax family -----------------------------------------------------------------------

@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
def test_softmax_runtime_rows_and_length(op):
    """Attention-score shape [batch, heads, seq, seq]: rows and the reduced length (the
    sequence) are both runtime."""
    m, _ = single_node_model(op, [rnd(2, 3, 16, 16)], opset=13, axis=-1)
    m = with_dynamic_dims(m, {"in0": {0: "batch", 2: "seq", 3: "seq"}})
    sess = check_runtime_dims(m, [{"in0": rnd(b, 3, s, s)} for b, s in SIZES])
    assert len(kernel_symbols(sess)) == 1


def test_softmax_opset11_coerced_2d():
    # opset < 13, axis=1: the input is [batch, prod(rest)], both extents runtime
    m, _ = single_node_model("Softmax", [rnd(2, 3, 5)], opset=11, axis=1)
    m = with_dynamic_dims(m, {"in0": {0: "batch", 2: "seq"}})
    check_runtime_dims(m, [{"in0": rnd(b, 3, s)} for b, s in SIZES])


def test_logsoftmax_extreme_values():
    m, _ = single_node_model("LogSoftmax", [rnd(2, 20)], opset=13, axis=-1)
    m = with_dynamic_dims(m, {"in0": {0: "batch", 1: "seq"}})
    feeds = []
    for b, s in [(2, 20), (3, 41), (1, 5)]:
        x = rnd(b, s) * 30
        x[0, 0] = 80.0
        feeds.append({"in0": x})
    check_runtime_dims(m, feeds)


def _masked_softmax_model(op: str, mask_shape: list, scale: float = 0.125) -> onnx.ModelProto:
    """op(x * scale + mask) over the last axis of x [batch, 4, seq, seq]: the Mul and Add
    become the prologue of one FusedSoftmax."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, "seq", "seq"])
    mk = helper.make_tensor_value_info("mask", TensorProto.FLOAT, mask_shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, "seq", "seq"])
    sc = numpy_helper.from_array(np.array(scale, np.float32), "scale")
    nodes = [helper.make_node("Mul", ["x", "scale"], ["xs"]),
             helper.make_node("Add", ["xs", "mask"], ["xm"]),
             helper.make_node(op, ["xm"], ["y"], axis=-1)]
    m = helper.make_model(helper.make_graph(nodes, "sm", [x, mk], [y], initializer=[sc]),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def _mask(shape: list, b: int, s: int) -> np.ndarray:
    concrete = [b if d == "batch" else s if d == "seq" else d for d in shape]
    return np.where(RNG.uniform(size=concrete) < 0.3, -1e4, 0.0).astype(np.float32)


# mask broadcast patterns: padding [B,1,1,S], per-query [B,1,S,1] (one value per row),
# causal [S,S], per-key [S]
MASKS = [["batch", 1, 1, "seq"], ["batch", 1, "seq", 1], ["seq", "seq"], ["seq"]]


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("mask", range(len(MASKS)))
def test_fused_softmax_runtime_dims(op, mask):
    shape = MASKS[mask]
    m = _masked_softmax_model(op, shape)
    # seq >= 2: at seq 1 the fusion rule keeps the Softmax apart (a different graph)
    sizes = [(2, 16), (1, 2), (3, 7), (5, 33), (2, 100)]
    sess = check_runtime_dims(m, [{"x": rnd(b, 4, s, s), "mask": _mask(shape, b, s)}
                                  for b, s in sizes])
    # one specialisation per size (plus the compile-time default one, at seq 1)
    assert kernel_ops(sess).count(["Mul", "Add", op]) == len(sizes), kernel_ops(sess)
    assert len(kernel_symbols(sess, ["Mul", "Add", op])) == 1


# -- Reduce* ------------------------------------------------------------------------------

# (op, opset, axes attribute, keepdims, input dims made symbolic): trailing axes (row
# mode), all axes, kept and reduced groups alternating
REDUCES = [
    ("ReduceSum", 11, [-1], 1, {0: "batch", 1: "seq"}),
    ("ReduceMean", 13, [2], 0, {0: "batch", 1: "seq"}),
    ("ReduceMax", 13, [1, 2], 1, {0: "batch", 1: "seq"}),
    ("ReduceMin", 13, None, 0, {0: "batch", 1: "seq"}),
    ("ReduceL2", 13, [1, 2], 0, {0: "batch", 1: "seq"}),
    ("ReduceLogSumExp", 13, [-1], 1, {0: "batch", 2: "hidden"}),
    ("ReduceSumSquare", 13, [0, 2], 1, {0: "batch", 1: "seq"}),
    ("ReduceProd", 13, [-1], 0, {0: "batch", 2: "hidden"}),
    # column mode (the last axis kept): mean pooling over the sequence, a batch sum
    ("ReduceMean", 13, [1], 0, {0: "batch", 1: "seq"}),
    ("ReduceSum", 11, [0], 1, {0: "batch", 2: "hidden"}),
    ("ReduceMax", 13, [0, 1], 0, {0: "batch", 1: "seq", 2: "hidden"}),
    ("ReduceLogSumExp", 13, [1], 1, {1: "seq", 2: "hidden"}),
]


@pytest.mark.parametrize("case", range(len(REDUCES)))
def test_reduce_runtime_dims(case):
    op, opset, axes, keepdims, dims = REDUCES[case]
    kw = {} if axes is None else {"axes": axes}
    lo, hi = (0.9, 1.1) if op == "ReduceProd" else (None, None)
    m, _ = single_node_model(op, [rnd(2, 16, 24, lo=lo, hi=hi)], opset=opset,
                             keepdims=keepdims, **kw)
    m = with_dynamic_dims(m, {"in0": dims})
    feeds = []
    for b, s in SIZES:
        shape = [b if dims.get(0) else 2, s if dims.get(1) else 16,
                 3 * s + 1 if dims.get(2) else 24]
        feeds.append({"in0": rnd(*shape, lo=lo, hi=hi)})
    sess = check_runtime_dims(m, feeds)
    assert len(kernel_symbols(sess)) == 1


# the axes as a constant input (ReduceSum from opset 13, the others from 18: what current
# exporters write): the tiling function reads its value, one kernel serves every shape
AXES_INPUT = [
    ("ReduceSum", 13, [1], 0, {0: "batch", 1: "seq"}),       # mean pooling's sum
    ("ReduceMean", 18, [-1], 1, {0: "batch", 1: "seq"}),     # a decomposed RMSNorm's
    ("ReduceMax", 18, [0, 1], 0, {0: "batch", 1: "seq", 2: "hidden"}),
    ("ReduceL2", 18, [2, 0], 1, {0: "batch", 2: "hidden"}),  # unsorted, kept dims
]


@pytest.mark.parametrize("case", range(len(AXES_INPUT)))
def test_reduce_axes_input_runtime_dims(case):
    op, opset, axes, keepdims, dims = AXES_INPUT[case]
    m, _ = single_node_model(op, [rnd(2, 16, 24), np.array(axes, np.int64)], opset=opset,
                             const_inputs=[1], keepdims=keepdims)
    m = with_dynamic_dims(m, {"in0": dims})
    feeds = [{"in0": rnd(b if dims.get(0) else 2, s if dims.get(1) else 16,
                         3 * s + 1 if dims.get(2) else 24)} for b, s in SIZES]
    sess = check_runtime_dims(m, feeds)
    assert len(kernel_symbols(sess)) == 1
    assert all(k.shape_polymorphic for spec in sess.specializations for k in spec.kernels)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_column_mode_runtime_dims(op):
    """Softmax over a middle axis (opset 13): vectors along the kept last axis, whose
    runtime length spans several blocks and a masked tail."""
    m, _ = single_node_model(op, [rnd(2, 5, 300)], opset=13, axis=1)
    m = with_dynamic_dims(m, {"in0": {0: "batch", 1: "seq", 2: "hidden"}})
    sizes = [(2, 5, 300), (1, 1, 1), (3, 7, 17), (1, 33, 513), (4, 2, 256)]
    check_runtime_dims(m, [{"in0": rnd(*sz)} for sz in sizes])


def test_reduce_int_mean_runtime_length():
    m, _ = single_node_model("ReduceMean", [RNG.integers(-50, 50, (2, 9)).astype(np.int32)],
                             opset=13, axes=[-1], keepdims=0)
    m = with_dynamic_dims(m, {"in0": {0: "batch", 1: "seq"}})
    check_runtime_dims(m, [{"in0": RNG.integers(-50, 50, (b, s)).astype(np.int32)}
                           for b, s in SIZES])


# -- InstanceNormalization / GroupNormalization -----------------------------------------

def test_instance_norm_runtime_batch():
    m, _ = single_node_model("InstanceNormalization", [rnd(2, 6, 5, 7), rnd(6), rnd(6)],
                             const_inputs=[1, 2], epsilon=1e-5)
    m = with_dynamic_dims(m, {"in0": {0: "batch"}})
    check_runtime_dims(m, [{"in0": rnd(b, 6, 5, 7)} for b in (2, 1, 3, 9)])


@pytest.mark.parametrize("opset", [18, 21])
def test_group_norm_runtime_batch(opset):
    c, g = 8, 4
    n = g if opset == 18 else c
    m, _ = single_node_model("GroupNormalization", [rnd(2, c, 3, 5), rnd(n), rnd(n)],
                             opset=opset, const_inputs=[1, 2], output_dtypes=[np.float32],
                             num_groups=g, epsilon=1e-5)
    out = m.graph.output[0].type.tensor_type
    if not out.HasField("shape"):
        for d in (2, c, 3, 5):
            out.shape.dim.add().dim_value = d
    m = with_dynamic_dims(m, {"in0": {0: "batch"}})
    check_runtime_dims(m, [{"in0": rnd(b, c, 3, 5)} for b in (2, 1, 5)])


# -- BatchNormalization (inference: a broadcasting map) -------------------------------------

@pytest.mark.parametrize("const", [True, False])
@pytest.mark.parametrize("opset", [7, 15])
def test_batch_norm_runtime_dims(const, opset):
    c = 5
    params = [rnd(c), rnd(c), rnd(c), rnd(c, lo=0.5, hi=2.0)]
    m, _ = single_node_model("BatchNormalization", [rnd(2, c, 3, 7)] + params, opset=opset,
                             const_inputs=[1, 2, 3, 4] if const else [])
    m = with_dynamic_dims(m, {"in0": {0: "batch", 2: "h", 3: "w"}})
    feeds = [{"in0": rnd(b, c, h, w)} for b, h, w in [(2, 3, 7), (1, 1, 1), (3, 9, 17)]]
    if not const:
        feeds = [dict(f, **{f"in{i}": p for i, p in enumerate(params, 1)}) for f in feeds]
    check_runtime_dims(m, feeds)


# -- the static path (no Tiling) still works --------------------------------------------------

@pytest.mark.parametrize("op,inputs,attrs", [
    ("LayerNormalization", [rnd(3, 5, 40), rnd(40), rnd(40)], {"axis": -1}),
    ("Softmax", [rnd(3, 4, 37)], {"axis": -1}),
    ("ReduceMean", [rnd(3, 4, 37)], {"axes": [-1]}),
])
def test_static_path_without_tiling(monkeypatch, op, inputs, attrs):
    # the op's registered lowering, without its host tiling function
    monkeypatch.setitem(lowerings._LOWERINGS, ("", op),
                        dataclasses.replace(lowering_for(lookup(op)), tiling=None))
    opset = 13 if op == "ReduceMean" else 17
    m, feeds = single_node_model(op, inputs, opset=opset,
                                 const_inputs=[1, 2] if len(inputs) > 1 else [], **attrs)
    assert_matches_ort(m, feeds)


def test_static_path_fused_softmax(monkeypatch):
    monkeypatch.setitem(lowerings._LOWERINGS, ("cannc", "FusedSoftmax"), dataclasses.replace(
        lowering_for(lookup("FusedSoftmax", "cannc")), tiling=None))
    m = _masked_softmax_model("Softmax", ["batch", 1, 1, "seq"])
    b, s = 3, 19
    assert_matches_ort(m, {"x": rnd(b, 4, s, s), "mask": _mask(["batch", 1, 1, "seq"], b, s)})
