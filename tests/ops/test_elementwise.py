"""Elementwise and broadcasting ops: cannc against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_op

R = np.random.default_rng(0)


def f32(*shape, scale=1.0):
    return (R.standard_normal(shape) * scale).astype(np.float32)


SHAPES = [((3, 37), (3, 37)), ((2, 1, 5), (4, 1)), ((1000,), ()), ((2, 3, 4, 5), (3, 1, 5)),
          ((70, 33), (33,))]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min"])
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_binary_float_broadcasting(op, shapes):
    a, b = f32(*shapes[0]), f32(*shapes[1])
    if op == "Div":
        b = np.where(np.abs(b) < 0.1, 0.5, b).astype(np.float32)
    check_op(op, [a, b])


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int8, np.uint8, np.float64])
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min"])
def test_binary_other_dtypes(op, dtype):
    a = R.integers(-50, 50, (4, 33)).astype(dtype)
    b = R.integers(1, 9, (33,)).astype(dtype)
    if np.dtype(dtype).kind == "u":
        a = np.abs(a).astype(dtype)
    check_op(op, [a, b])


@pytest.mark.parametrize("op", ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_comparisons(op, dtype):
    a = R.integers(-3, 3, (5, 20)).astype(dtype)
    b = R.integers(-3, 3, (20,)).astype(dtype)
    check_op(op, [a, b])


def test_logic_and_where():
    a = R.random((4, 40)) > 0.5
    b = R.random((40,)) > 0.5
    for op in ("And", "Or", "Xor"):
        check_op(op, [a, b])
    check_op("Not", [a])
    check_op("Where", [a, f32(4, 40), f32(1, 40)])
    check_op("Where", [a, np.int64(3) * np.ones((1,), np.int64), R.integers(0, 9, (4, 40))])


UNARY = {
    "Relu": {}, "Neg": {}, "Abs": {}, "Sqrt": {"positive": True}, "Reciprocal": {"nonzero": True},
    "Exp": {}, "Log": {"positive": True}, "Erf": {}, "Tanh": {}, "Sigmoid": {},
    "Floor": {}, "Ceil": {}, "Round": {}, "Sign": {}, "Softplus": {}, "Sin": {}, "Cos": {},
    "LeakyRelu": {"attrs": {"alpha": 0.1}}, "Elu": {"attrs": {"alpha": 0.7}}, "Selu": {},
    "Celu": {"attrs": {"alpha": 1.3}}, "ThresholdedRelu": {"attrs": {"alpha": 0.4}},
    "HardSigmoid": {"attrs": {"alpha": 0.3, "beta": 0.4}}, "HardSwish": {}, "Mish": {},
}


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_float(op):
    spec = UNARY[op]
    x = f32(7, 45, scale=3.0)
    if spec.get("positive"):
        x = np.abs(x) + 0.01
    if spec.get("nonzero"):
        x = np.where(np.abs(x) < 0.1, 0.3, x).astype(np.float32)
    opset = 18 if op in ("Mish", "HardSwish") else 17
    check_op(op, [x], opset=opset, atol=1e-5, rtol=1e-4, **spec.get("attrs", {}))


def test_gelu_both_forms():
    x = f32(5, 50, scale=3.0)
    check_op("Gelu", [x], opset=20)
    check_op("Gelu", [x], opset=20, approximate="tanh")


def test_pow():
    x = np.abs(f32(4, 30)) + 0.1
    check_op("Pow", [x, np.float32(2.0)], const_inputs=[1])
    check_op("Pow", [x, np.float32(3.0)], const_inputs=[1])
    check_op("Pow", [x, f32(30)])
    neg = f32(4, 30)
    check_op("Pow", [neg, np.array([3.0], np.float32)])


def test_clip_versions():
    x = f32(6, 50, scale=2)
    check_op("Clip", [x], opset=10, min=-0.5, max=0.7)
    check_op("Clip", [x, np.float32(-0.5), np.float32(0.5)], opset=13, const_inputs=[1, 2])
    check_op("Clip", [x, None, np.float32(0.5)], opset=13)
    check_op("Clip", [x], opset=13)


def test_variadic():
    check_op("Sum", [f32(3, 4), f32(4), f32(3, 1)])
    check_op("Mean", [f32(3, 4), f32(4)])
    check_op("Max", [f32(3, 4), f32(4), f32(3, 1)])


@pytest.mark.parametrize("to,src", [(1, np.int64), (7, np.float32), (9, np.float32),
                                    (1, np.bool_), (6, np.float64), (11, np.float32),
                                    (10, np.float32), (2, np.int32), (1, np.float16)])
def test_cast(to, src):
    x = (R.standard_normal((3, 40)) * 50).astype(src)
    check_op("Cast", [x], to=to)


def test_mod():
    a = R.integers(-20, 20, (50,)).astype(np.int64)
    b = R.integers(1, 7, (50,)).astype(np.int64) * np.where(R.random(50) > 0.5, 1, -1)
    check_op("Mod", [a, b])
    check_op("Mod", [a, b], fmod=1)
    check_op("Mod", [f32(50) * 5, np.float32(1.5) * np.ones(50, np.float32)], fmod=1)


def test_large_tensor_uses_many_tiles():
    x = f32(3, 50000)
    check_op("Relu", [x], cores=2)
    check_op("Add", [x, f32(50000)], cores=2)
