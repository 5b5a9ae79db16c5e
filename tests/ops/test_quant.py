"""Quantisation ops (ops/quant.py): cannc against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_op

R = np.random.default_rng(7)


@pytest.mark.parametrize("zdt", [np.uint8, np.int8, np.uint16, np.int16])
def test_quantize_per_tensor(zdt):
    x = (R.standard_normal((3, 37)) * 40).astype(np.float32)
    x[0, :4] = [0.5, 1.5, -0.5, 2.5]           # ties round to even
    check_op("QuantizeLinear", [x, np.float32(0.37), np.array(3, zdt)], opset=21)


def test_quantize_per_axis_and_blocked():
    x = (R.standard_normal((2, 3, 4, 5)) * 10).astype(np.float32)
    s = np.array([0.1, 0.2, 0.3], np.float32)
    z = np.array([0, 10, 250], np.uint8)
    check_op("QuantizeLinear", [x, s, z], opset=21, axis=1)
    sb = (R.random((2, 3, 2, 5)) + 0.05).astype(np.float32)
    zb = R.integers(-5, 5, (2, 3, 2, 5)).astype(np.int8)
    check_op("QuantizeLinear", [x, sb, zb], opset=21, axis=2, block_size=2)


def test_quantize_float16_input():
    x = (R.standard_normal((4, 33)) * 9).astype(np.float16)
    check_op("QuantizeLinear", [x, np.float16(0.25), np.uint8(128)], opset=21)


@pytest.mark.parametrize("xdt", [np.uint8, np.int8, np.int32])
def test_dequantize(xdt):
    info = np.iinfo(xdt)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    x = R.integers(lo, hi, (5, 41)).astype(xdt)
    zp = None if xdt == np.int32 else np.array(3, xdt)
    check_op("DequantizeLinear", [x, np.float32(0.05), zp], opset=21)
    s = (R.random(41) + 0.1).astype(np.float32)
    zpa = None if xdt == np.int32 else R.integers(0, 9, 41).astype(xdt)
    check_op("DequantizeLinear", [x, s, zpa], opset=21, axis=1)


def test_dynamic_quantize():
    for x in ((R.standard_normal((7, 13)) * 3).astype(np.float32),
              np.abs(R.standard_normal(50)).astype(np.float32) + 1.0,
              -np.abs(R.standard_normal(50)).astype(np.float32)):
        check_op("DynamicQuantizeLinear", [x], n_outputs=3, opset=11)


@pytest.mark.parametrize("adt,bdt", [(np.uint8, np.uint8), (np.int8, np.int8),
                                     (np.uint8, np.int8)])
def test_matmul_integer(adt, bdt):
    a = R.integers(0 if adt == np.uint8 else -100, 100, (2, 5, 19)).astype(adt)
    b = R.integers(0 if bdt == np.uint8 else -100, 100, (19, 35)).astype(bdt)
    check_op("MatMulInteger", [a, b, np.array(3, adt), np.array(1, bdt)], opset=10)
    zb = R.integers(0, 5, 35).astype(bdt)     # per-column zero point of B
    check_op("MatMulInteger", [a, b, None, zb], opset=10)


@pytest.mark.parametrize("dt", [np.uint8, np.int8])
def test_qlinear_matmul(dt):
    lo = 0 if dt == np.uint8 else -128
    a = R.integers(lo, lo + 255, (3, 4, 21)).astype(dt)
    b = R.integers(lo, lo + 255, (21, 18)).astype(dt)
    check_op("QLinearMatMul", [a, np.float32(0.02), np.array(lo + 100, dt), b,
                               np.float32(0.01), np.array(lo + 120, dt), np.float32(0.3),
                               np.array(lo + 110, dt)], opset=10)
