"""NaN in max-type ops: NaN propagates (IEEE maximum/minimum, numpy's max/argmax).

ONNX does not define NaN for these ops. Measured on onnxruntime 1.32 (CPU):
Max/Min propagate NaN wherever it sits (cannc matches ORT); ReduceMax/ReduceMin give
NaN only when the NaN is a group's first element, MaxPool/GlobalMaxPool only when it
is the last one of the window, ArgMax/ArgMin return a NaN's index only when it is the
first element: position-dependent, so there cannc follows numpy (NaN propagates; the
arg-reductions give the index of the first NaN, of the last with select_last_index).
"""

from __future__ import annotations

import numpy as np
import pytest

import cannc
from tests.helpers import check_op, single_node_model

RNG = np.random.default_rng(15)


def run1(op: str, x: np.ndarray, opset: int = 17, **attrs) -> np.ndarray:
    m, feeds = single_node_model(op, [x], opset=opset, **attrs)
    sess = cannc.compile(m, cores=2, shapes={k: v.shape for k, v in feeds.items()})
    return sess.run(None, feeds)[0]


def with_nans(shape, where) -> np.ndarray:
    x = RNG.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[list(where)] = np.nan
    return x


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_elementwise_max_min_match_ort(op):
    x = with_nans((67,), range(0, 67, 5))
    y = with_nans((67,), range(3, 67, 7))
    check_op(op, [x, y])


def test_reduce_max_min_propagate():
    # NaN first, middle and last in a row; rows of 37 (scalar tail) and 1000 (vectors)
    for n in (37, 1000):
        x = RNG.standard_normal((4, n)).astype(np.float32)
        x[0, 0] = x[1, n // 2] = x[2, n - 1] = np.nan
        for op, ref in (("ReduceMax", np.max), ("ReduceMin", np.min)):
            got = run1(op, x, opset=13, axes=[1], keepdims=0)
            np.testing.assert_array_equal(got, ref(x, axis=1), err_msg=f"{op} n={n}")


def test_max_pools_propagate():
    x = RNG.standard_normal((1, 3, 9, 40)).astype(np.float32)
    x[0, 0, 0, 0] = x[0, 1, 4, 20] = x[0, 2, 8, 39] = np.nan
    got = run1("GlobalMaxPool", x)
    np.testing.assert_array_equal(got.ravel(), np.max(x, axis=(2, 3)).ravel())
    # 3x3 windows, stride 2, padded: a window holding a NaN anywhere is NaN, others exact
    got = run1("MaxPool", x, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    oh, ow = got.shape[2:]
    want = np.empty_like(got)
    for i in range(oh):
        for j in range(ow):
            want[..., i, j] = np.max(xp[..., 2 * i:2 * i + 3, 2 * j:2 * j + 3], axis=(2, 3))
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got).sum() == np.isnan(want).sum() > 0


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_reductions_take_the_first_nan(op):
    x = RNG.standard_normal((5, 300)).astype(np.float32)
    x[0, 0] = x[1, 150] = x[2, 299] = np.nan
    x[3, 17] = x[3, 250] = np.nan          # two NaNs: the first (the last with select_last)
    ref = np.argmax if op == "ArgMax" else np.argmin
    got = run1(op, x, axis=1, keepdims=0)
    np.testing.assert_array_equal(got, ref(x, axis=1))
    got = run1(op, x, axis=1, keepdims=0, select_last_index=1)
    want = ref(x, axis=1)
    want[3] = 250
    np.testing.assert_array_equal(got, want)
    # no NaN: unchanged (ties and all) against onnxruntime
    check_op(op, [np.round(RNG.standard_normal((5, 300))).astype(np.float32)], axis=1)
