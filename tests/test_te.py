"""cannc.te constructs against NumPy (each runs as a compiled kernel, eagerly)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cannc
from cannc import te

np_erf = np.vectorize(math.erf)

rng = np.random.default_rng(7)
X = rng.standard_normal((3, 20)).astype(np.float32)
P = (np.abs(X) + 0.5).astype(np.float32)

ELEMENTWISE = [
    ("arith", lambda x: (x + 1.0) * 2.0 - x / 3.0, lambda x: (x + 1) * 2 - x / 3, X),
    ("rev", lambda x: 1.0 - 2.0 / (x * x + 1.0), lambda x: 1 - 2 / (x * x + 1), X),
    ("exp", te.exp, np.exp, X), ("log", te.log, np.log, P), ("tanh", te.tanh, np.tanh, X),
    ("erf", te.erf, np_erf, X), ("sqrt", te.sqrt, np.sqrt, P),
    ("sigmoid", te.sigmoid, lambda x: 1 / (1 + np.exp(-x)), X), ("abs", te.abs, np.abs, X),
    ("where", lambda x: te.where(x > 0, x, 0.1 * x), lambda x: np.where(x > 0, x, 0.1 * x), X),
    ("minmax", lambda x: te.maximum(te.minimum(x, 0.5), -0.5), lambda x: np.clip(x, -.5, .5), X),
    ("cast", lambda x: te.cast(te.cast(x * 4.0, "int32"), "float32"),
     lambda x: (x * 4).astype(np.int32).astype(np.float32), X),
]


@pytest.mark.parametrize("name,body,ref,x", ELEMENTWISE, ids=[c[0] for c in ELEMENTWISE])
def test_elementwise(name, body, ref, x):
    op = cannc.custom_op(f"TeEw_{name}", domain="com.te.test")(lambda x: body(x))
    np.testing.assert_allclose(op(x), ref(x.astype(np.float64)), rtol=2e-5, atol=2e-6)


def test_broadcast_two_inputs():
    op = cannc.custom_op("TeBcast", domain="com.te.test")(lambda a, b: a * b + 1.0)
    b = rng.standard_normal((20,)).astype(np.float32)
    np.testing.assert_allclose(op(X, b), X * b + 1, rtol=1e-6)


def test_compute_index_arithmetic_and_gathers():
    def body(x):
        n = x.shape[1]
        return te.compute((x.shape[0], n), lambda i, j: x[i, (n - 1 - j)] * 2.0
                          + x[(i + 1) % x.shape[0], (j * 3) % n] + x[i, j // 2])

    op = cannc.custom_op("TeIdx", domain="com.te.test")(body)
    n = X.shape[1]
    j = np.arange(n)
    ref = X[:, n - 1 - j] * 2 + np.roll(X, -1, axis=0)[:, (j * 3) % n] + X[:, j // 2]
    np.testing.assert_allclose(op(X), ref, rtol=1e-6)


def test_reductions_sum_max_softmax():
    def softmax(x):
        m = te.max(x, axis=1)
        e = te.compute(x.shape, lambda i, j: te.exp(x[i, j] - m[i]))
        s = te.sum(e, axis=1)
        return te.compute(x.shape, lambda i, j: e[i, j] / s[i])

    op = cannc.custom_op("TeSoftmax", domain="com.te.test")(softmax)
    ex = np.exp(X - X.max(1, keepdims=True))
    np.testing.assert_allclose(op(X), ex / ex.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    tot = cannc.custom_op("TeSumAll", domain="com.te.test")(lambda x: te.sum(x, axis=0))
    np.testing.assert_allclose(tot(X), X.sum(0), rtol=1e-5, atol=1e-5)


def test_reduce_axis_matmul():
    def mm(a, b):
        k = te.reduce_axis(a.shape[1])
        return te.compute((a.shape[0], b.shape[1]),
                          lambda i, j: te.sum(a[i, k] * b[k, j], axis=k))

    op = cannc.custom_op("TeMM", domain="com.te.test")(mm)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    b = rng.standard_normal((7, 19)).astype(np.float32)
    np.testing.assert_allclose(op(a, b), a @ b, rtol=1e-5, atol=1e-5)


def test_floor_semantics_of_negative_index_math():
    def body(x):
        n = x.shape[0]
        return te.compute(x.shape, lambda i: x[(i - 3) % n] + te.cast((i - 3) // 2, "float32"))

    op = cannc.custom_op("TeFloor", domain="com.te.test")(body)
    x = np.arange(10, dtype=np.float32)
    i = np.arange(10)
    np.testing.assert_allclose(op(x), x[(i - 3) % 10] + (i - 3) // 2)


def test_trace_errors():
    with pytest.raises(te.TraceError, match="use //"):
        te.compute((4,), lambda i: i / 2)
    x = te.placeholder((4, 8))
    with pytest.raises(te.TraceError, match="has 2 axes"):
        x[0]
    with pytest.raises(te.TraceError, match="do not broadcast"):
        x + te.placeholder((3,), index=1)
