"""MaxPool's Indices output (opset 8+): int64 flat indices into X of each window's max,
row-major or (storage_order=1) spatially column-major, with pads, strides, dilations,
ceil_mode and auto_pad, vs onnxruntime; and the NumPy reference the folder uses."""

from __future__ import annotations

import numpy as np
import pytest

from cannc.ir.graph import Node
from cannc.ir.ops.conv import maxpool_reference
from tests.helpers import check_op, ort_run, single_node_model

RNG = np.random.default_rng(8)

CASES = [
    ((2, 3, 9, 11), dict(kernel_shape=[3, 3])),
    ((1, 2, 10, 11), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 2, 9, 11), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    ((1, 2, 10, 11), dict(kernel_shape=[2, 3], strides=[2, 3], pads=[1, 0, 0, 1], ceil_mode=1)),
    ((1, 2, 10, 11), dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 2, 10, 11), dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2])),
    ((1, 2, 10, 11), dict(kernel_shape=[2, 2], auto_pad="SAME_LOWER")),
    ((2, 3, 20), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    ((1, 2, 5, 6, 7), dict(kernel_shape=[2, 2, 2], strides=[2, 1, 2], pads=[0, 1, 0, 1, 0, 1])),
]


def _x(shape, ties: bool) -> np.ndarray:
    x = RNG.standard_normal(shape).astype(np.float32)
    return np.round(x) if ties else x     # rounded: ties, the first index wins


@pytest.mark.parametrize("order", [0, 1])
@pytest.mark.parametrize("shape,attrs", CASES)
def test_indices_match_ort(shape, attrs, order):
    opset = 12 if "dilations" in attrs or "ceil_mode" in attrs else 8
    x = _x(shape, ties=order == 1)
    check_op("MaxPool", [x], n_outputs=2, opset=opset, storage_order=order, **attrs)


def test_indices_float16():
    check_op("MaxPool", [_x((1, 3, 8, 9), True).astype(np.float16)], n_outputs=2, opset=12,
             kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 0, 0])


@pytest.mark.parametrize("order", [0, 1])
@pytest.mark.parametrize("shape,attrs", CASES)
def test_reference_matches_ort(shape, attrs, order):
    x = _x(shape, ties=True)
    m, feeds = single_node_model("MaxPool", [x], n_outputs=2, opset=12, storage_order=order,
                                 **attrs)
    want = ort_run(m, feeds)
    node = Node("p", "MaxPool", ("x",), ("y", "i"), attrs=dict(attrs, storage_order=order),
                opset=12)
    got = maxpool_reference(node, [x])
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
