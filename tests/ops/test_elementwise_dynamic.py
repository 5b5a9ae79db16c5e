"""Shape-polymorphic maps: compiled once, run at other batch sizes and sequence
lengths with no code generation (ABI.md "Runtime dimensions"), against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_runtime_dims, model_of, ort_run, single_node_model, with_dynamic_dims
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.codegen.elementwise import map_layout
from cannc.compiler import codegen_counts

R = np.random.default_rng(7)
# batch, seq: 1, odd sizes, sizes that are not multiples of the vector width or of a tile
SIZES = [(2, 5), (1, 7), (3, 1), (1, 1), (5, 33), (4, 1029)]


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


dynamic = with_dynamic_dims


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


@pytest.mark.parametrize("op", ["Add", "Mul", "Sub", "Div"])
def test_row_broadcast(op):
    H = 33
    m, _ = single_node_model(op, [f32(2, 5, H), f32(H)])
    m = dynamic(m, {"in0": {0: "batch", 1: "seq"}})
    bias = f32(H) + 3.0
    check_runtime_dims(m, [{"in0": f32(b, s, H), "in1": bias} for b, s in SIZES])


def test_same_shape_unary_and_binary_chain():
    """x*y -> Gelu -> + residual, scalar constant: one FusedMap over [B, S, H]."""
    H = 40
    nodes = [helper.make_node("Mul", ["x", "y"], ["m"]),
             helper.make_node("Gelu", ["m"], ["g"], domain=""),
             helper.make_node("Mul", ["g", "half"], ["h"]),
             helper.make_node("Add", ["h", "bias"], ["a"]),
             helper.make_node("Add", ["a", "x"], ["out"])]
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "half"),
             numpy_helper.from_array(f32(H), "bias")]
    m = model_of(nodes, [vi("x", TensorProto.FLOAT, ["batch", "seq", H]),
                         vi("y", TensorProto.FLOAT, ["batch", "seq", H])],
                 [vi("out", TensorProto.FLOAT, [None, None, H])], inits)
    m.opset_import[0].version = 20  # Gelu
    check_runtime_dims(m, [{"x": f32(b, s, H), "y": f32(b, s, H)} for b, s in SIZES])


def test_column_broadcast_and_scalar_constant():
    """[B, S, H] * [B, S, 1] + scalar constant (a LayerNorm-like tail)."""
    H = 20
    nodes = [helper.make_node("Mul", ["x", "r"], ["m"]),
             helper.make_node("Add", ["m", "c"], ["out"])]
    m = model_of(nodes, [vi("x", TensorProto.FLOAT, ["batch", "seq", H]),
                         vi("r", TensorProto.FLOAT, ["batch", "seq", 1])],
                 [vi("out", TensorProto.FLOAT, [None, None, H])],
                 [numpy_helper.from_array(np.array([0.25], np.float32), "c")])
    check_runtime_dims(m, [{"x": f32(b, s, H), "r": f32(b, s, 1)} for b, s in SIZES])


def test_attention_mask_pattern():
    """scores [B, NH, S, S] + mask [B, 1, 1, S]: a rank-3 broadcast pattern."""
    NH = 3
    m, _ = single_node_model("Add", [f32(2, NH, 5, 5), f32(2, 1, 1, 5)])
    m = dynamic(m, {"in0": {0: "batch", 2: "seq", 3: "seq"}, "in1": {0: "batch", 3: "seq"}})
    sizes = [(2, 5), (1, 7), (3, 17), (1, 2), (2, 40)]
    check_runtime_dims(m, [{"in0": f32(b, NH, s, s), "in1": f32(b, 1, 1, s)}
                           for b, s in sizes])


@pytest.mark.parametrize("op,dtype", [("Cast", np.int64), ("Equal", np.int32),
                                      ("Where", np.bool_), ("Relu", np.float64)])
def test_other_dtypes(op, dtype):
    def data(b, s):
        if dtype == np.bool_:
            return [R.random((b, s)) > 0.5, f32(b, s), np.array([0.5], np.float32)]
        if op == "Equal":
            return [R.integers(-2, 2, (b, s)).astype(dtype), np.array([1], dtype)]
        if op == "Cast":
            return [R.integers(-99, 99, (b, s)).astype(dtype)]
        return [R.standard_normal((b, s)).astype(dtype)]

    attrs = {"to": TensorProto.FLOAT} if op == "Cast" else {}
    m, _ = single_node_model(op, data(2, 5), **attrs)
    m = dynamic(m, {"in0": {0: "batch", 1: "seq"}} | (
        {"in1": {0: "batch", 1: "seq"}} if op == "Where" else {}))
    feeds = []
    for b, s in SIZES:
        d = data(b, s)
        feeds.append({f"in{i}": a for i, a in enumerate(d)})
    check_runtime_dims(m, feeds)


def test_layout_key_ignores_batch_of_one():
    """The tiling key is the broadcast pattern: a batch (or seq) of 1 on an operand that
    carries the axis keeps it; a broadcast operand's 1 against a runtime 1 does not."""
    lay = lambda shapes, out: map_layout(shapes, out)[0]
    assert lay([(1, 7, 33), (33,)], (1, 7, 33)) == lay([(4, 9, 33), (33,)], (4, 9, 33))
    assert lay([(1, 1, 33), (33,)], (1, 1, 33)) == lay([(4, 9, 33), (33,)], (4, 9, 33))
    assert map_layout([(4, 9, 33), (33,)], (4, 9, 33))[1] == (36, 33)
    # [1, S, H] position table added to [B, S, H]: at B == 1 nothing is broadcast
    assert lay([(1, 7, 8), (1, 7, 8)], (1, 7, 8)) != lay([(3, 7, 8), (1, 7, 8)], (3, 7, 8))
    assert map_layout([(3, 0, 2)], (3, 0, 2)) is None


def test_pattern_change_at_one_is_a_variant():
    """A runtime extent of 1 against an operand that is broadcast on that axis changes the
    pattern: another kernel (the lowering memo may already hold it), and both are right;
    other batch sizes reuse the first kernel."""
    m, _ = single_node_model("Add", [f32(3, 7, 8), f32(1, 7, 8)])
    m = dynamic(m, {"in0": {0: "batch"}})
    sess = cannc.compile(m, cores=2)
    pos = f32(1, 7, 8)
    for b in (3, 1, 2):
        feeds = {"in0": f32(b, 7, 8), "in1": pos}
        before = codegen_counts()
        got = sess.run(None, feeds)[0]
        after = codegen_counts()
        np.testing.assert_allclose(got, ort_run(m, feeds)[0], rtol=1e-4, atol=1e-5)
        if b == 2:
            assert after == before, "batch 2 reuses batch 3's kernel"
