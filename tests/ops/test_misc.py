"""TopK, Einsum, CumProd, LRN, RotaryEmbedding (ops/misc.py) and the other ops added for
ONNX conformance (elementwise, MatMul dtypes, EyeLike, BitCast): cannc against
onnxruntime, or against onnx.reference where onnxruntime lacks the op."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import check_op, single_node_model
from onnx.reference import ReferenceEvaluator

import cannc

R = np.random.default_rng(5)


def f32(*shape, scale=1.0):
    return (R.standard_normal(shape) * scale).astype(np.float32)


def check_ref(op, inputs, opset, n_outputs=1, rtol=1e-5, atol=1e-6, **attrs):
    """cannc against the ONNX reference implementation (ops onnxruntime lacks)."""
    m, feeds = single_node_model(op, inputs, n_outputs, opset, **attrs)
    exp = ReferenceEvaluator(m).run(None, feeds)
    got = cannc.compile(m, shapes={k: v.shape for k, v in feeds.items()}).run(None, feeds)
    for g, e in zip(got, exp):
        e = np.asarray(e)
        assert g.dtype == e.dtype and g.shape == e.shape
        if e.dtype.kind == "f" or e.dtype.name == "bfloat16":
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol, atol)
        else:
            np.testing.assert_array_equal(g, e)


# -- TopK ----------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("largest", [0, 1])
@pytest.mark.parametrize("dt", [np.float32, np.int64])
def test_topk(axis, largest, dt):
    x = R.integers(-20, 20, (6, 9, 11)).astype(dt)        # many ties: lower index first
    check_op("TopK", [x, np.array([4], np.int64)], n_outputs=2, const_inputs=[1], axis=axis,
             largest=largest, opset=11)


def test_topk_k_equals_dim():
    check_op("TopK", [f32(3, 5), np.array([5], np.int64)], n_outputs=2, const_inputs=[1],
             opset=11)


# -- Einsum ---------------------------------------------------------------------------
@pytest.mark.parametrize("eq,shapes", [
    ("ij,jk->ik", [(5, 7), (7, 3)]),
    ("bij,bjk->bik", [(2, 5, 7), (2, 7, 3)]),
    ("ii->i", [(6, 6)]),
    ("...ii->...i", [(3, 5, 5)]),
    ("ij->", [(4, 9)]),
    ("i,i", [(7,), (7,)]),
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 8), (2, 3, 5, 8)]),
    ("ij,kj", [(3, 4), (5, 4)]),
    ("...j,j->...", [(2, 3, 4), (4,)]),
])
def test_einsum(eq, shapes):
    check_op("Einsum", [f32(*s) for s in shapes], equation=eq, opset=12)


def test_einsum_int():
    a = R.integers(-5, 5, (3, 4)).astype(np.int64)
    b = R.integers(-5, 5, (4, 2)).astype(np.int64)
    check_op("Einsum", [a, b], equation="ij,jk->ik", opset=12)


# -- CumProd (opset 26: not in onnxruntime) --------------------------------------------
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_cumprod(exclusive, reverse, axis):
    x = (R.random((3, 4, 5)) + 0.5).astype(np.float32)
    m, feeds = single_node_model("CumProd", [x, np.array(axis, np.int64)], opset=26,
                                 const_inputs=[1], exclusive=exclusive, reverse=reverse)
    exp = ReferenceEvaluator(m).run(None, feeds)[0]
    got = cannc.compile(m).run(None, feeds)[0]
    np.testing.assert_allclose(got, exp, rtol=1e-5)


# -- LRN --------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 3, 5])
def test_lrn(size):
    check_op("LRN", [f32(2, 7, 5, 6)], size=size, alpha=2e-3, beta=0.6, bias=1.5)


def test_lrn_even_size():
    """onnxruntime only takes odd sizes (and onnx.reference loops over the batch instead
    of the channels): against the spec's formula, window [c - 1, c + 2] for size 4."""
    x = f32(2, 7, 5, 6)
    m, feeds = single_node_model("LRN", [x], opset=13, size=4, alpha=2e-3, beta=0.6, bias=1.5)
    got = cannc.compile(m).run(None, feeds)[0]
    sq = np.zeros_like(x, dtype=np.float64)
    for c in range(7):
        sq[:, c] = (x[:, max(0, c - 1):min(7, c + 3)].astype(np.float64) ** 2).sum(1)
    np.testing.assert_allclose(got, x / (1.5 + 2e-3 / 4 * sq) ** 0.6, rtol=1e-5)


# -- RotaryEmbedding --------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rot", [0, 4])
def test_rotary_embedding(interleaved, rot):
    x = f32(2, 3, 5, 8)
    half = (rot or 8) // 2
    cos, sin = f32(20, half), f32(20, half)
    pos = R.integers(0, 20, (2, 5)).astype(np.int64)
    check_ref("RotaryEmbedding", [x, cos, sin, pos], 23, interleaved=interleaved,
              rotary_embedding_dim=rot)


def test_rotary_embedding_3d_no_ids():
    x = f32(2, 5, 24)
    check_ref("RotaryEmbedding", [x, f32(2, 5, 3), f32(2, 5, 3)], 23, num_heads=4)


# -- new elementwise ops -----------------------------------------------------------------
@pytest.mark.parametrize("op", ["Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh",
                                "Acosh", "Atanh", "Softsign"])
def test_unary_math(op):
    x = R.uniform(-0.95, 0.95, (5, 37)).astype(np.float32)
    if op == "Acosh":
        x = (np.abs(x) * 20 + 1).astype(np.float32)
    check_op(op, [x], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dt", [np.float32, np.int32, np.int8])
def test_shrink(dt):
    x = R.integers(-9, 9, (4, 40)).astype(dt)
    check_op("Shrink", [x], lambd=1.5, bias=2.0 if dt == np.float32 else 2.0)


def test_prelu():
    check_op("PRelu", [f32(2, 3, 4, 5), f32(3, 1, 1)])
    check_op("PRelu", [f32(6, 40), f32(40)])


def test_isinf():
    x = np.array([[np.inf, -np.inf, 1.0, np.nan, 0.0, -2.0] * 7], np.float32)
    for pos, neg in ((1, 1), (1, 0), (0, 1)):
        check_op("IsInf", [x], detect_positive=pos, detect_negative=neg, opset=10)


@pytest.mark.parametrize("dt", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bitshift(dt, direction):
    bits = np.dtype(dt).itemsize * 8
    x = R.integers(0, 200, (3, 33)).astype(dt)
    y = R.integers(0, bits - 1, (33,)).astype(dt)
    check_op("BitShift", [x, y], direction=direction, opset=11)


@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
@pytest.mark.parametrize("dt", [np.int32, np.uint8, np.int64])
def test_bitwise(op, dt):
    a = R.integers(0, 120, (4, 35)).astype(dt)
    b = R.integers(0, 120, (35,)).astype(dt)
    check_op(op, [a, b], opset=18)
    check_op("BitwiseNot", [a], opset=18)


@pytest.mark.parametrize("dt", [np.float64, np.float16, np.int32, np.int64])
def test_matmul_dtypes(dt):
    for sa, sb in [((3, 4), (4, 37)), ((2, 3, 17), (17, 35)), ((3, 1, 3, 4), (1, 2, 4, 2)),
                   ((4,), (2, 4, 1)), ((1, 2, 4, 3), (3,)), ((0, 3), (3, 4))]:
        a = (R.standard_normal(sa) * 3).astype(dt)
        b = (R.standard_normal(sb) * 3).astype(dt)
        check_op("MatMul", [a, b], rtol=1e-2 if dt == np.float16 else 1e-5)


def test_matmul_float32_empty_k():
    check_op("MatMul", [f32(3, 0), f32(0, 5)])


def test_bfloat16_maps_and_matmul():
    """bfloat16 (no onnxruntime kernels for most ops): against float32 math rounded."""
    bf = ml_dtypes.bfloat16
    x = R.standard_normal((5, 33)).astype(bf)
    y = R.standard_normal((33, 7)).astype(bf)
    for op, ins, ref in (("Add", [x, x], lambda: x.astype(np.float32) * 2),
                         ("MatMul", [x, y], lambda: x.astype(np.float32) @ y.astype(np.float32)),
                         ("Relu", [x], lambda: np.maximum(x.astype(np.float32), 0))):
        m, feeds = single_node_model(op, ins, opset=18)
        got = cannc.compile(m).run(None, feeds)[0]
        assert got.dtype == bf
        np.testing.assert_allclose(got.astype(np.float32), ref().astype(bf).astype(np.float32),
                                   rtol=1e-2, atol=1e-2)


def test_cast_double_to_half_rounds_once():
    """Against NumPy's correctly rounded conversion: values just off float16 ties, where
    a double rounding through float32 (what onnxruntime does) goes the wrong way."""
    x = np.array([1 + 2 ** -11 + 2 ** -40, 1 + 2 ** -11 - 2 ** -40, 65519.99, 65520.0, 7e-8,
                  -3.3e-5, 1e6, np.nan, -np.inf, 2 ** -25 + 2 ** -50] * 3, np.float64)
    m, feeds = single_node_model("Cast", [x], opset=19, to=10)
    got = cannc.compile(m).run(None, feeds)[0]
    np.testing.assert_array_equal(got, x.astype(np.float16))


def test_eyelike():
    check_op("EyeLike", [np.zeros((5, 7), np.int32)], k=2)
    check_op("EyeLike", [np.zeros((60, 70), np.float32)], k=-3, dtype=11)


def test_bitcast():
    x = f32(3, 5)
    m, feeds = single_node_model("BitCast", [x], opset=26, to=6)
    got = cannc.compile(m).run(None, feeds)[0]
    np.testing.assert_array_equal(got, x.view(np.int32))
