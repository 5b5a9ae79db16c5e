"""cannc.ops: eager ops on NumPy arrays, compiled on first use, cached, launched directly."""

from __future__ import annotations

import math
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from helpers import in_threads

import cannc
from cannc import ops
from cannc.errors import CanncError, InputError, ShapeError
from cannc.ops import _eager

RNG = np.random.default_rng(14)


def rand(*shape: int, dtype: object = np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def _entry(op: str) -> _eager._Entry:
    return [e for k, e in _eager._CACHE.items() if k[0] == op][-1]


def test_matmul_and_elementwise_against_numpy() -> None:
    a, b = rand(3, 17, 33), rand(33, 20)
    np.testing.assert_allclose(ops.matmul(a, b), a @ b, rtol=1e-5, atol=1e-5)
    x, y = rand(4, 8), rand(8)
    np.testing.assert_allclose(ops.add(x, y), x + y, rtol=0, atol=0)
    np.testing.assert_allclose(ops.sub(x, y), x - y, rtol=0, atol=0)
    np.testing.assert_allclose(ops.mul(x, 2.5), x * np.float32(2.5), rtol=0, atol=0)
    np.testing.assert_allclose(ops.div(x, y), x / y, rtol=1e-6)
    np.testing.assert_allclose(ops.relu(x), np.maximum(x, 0), rtol=0, atol=0)
    np.testing.assert_allclose(ops.sigmoid(x), 1 / (1 + np.exp(-x)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.tanh(x), np.tanh(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ops.greater(x, y), x > y)
    np.testing.assert_allclose(ops.transpose(a, perm=(2, 0, 1)), a.transpose(2, 0, 1))
    np.testing.assert_array_equal(ops.reshape(a, (-1, 33)), a.reshape(-1, 33))
    # the eager call ran the compiled program's kernels on the caller's buffers
    assert _entry("MatMul").fast is not None


def test_softmax_layer_norm_gelu() -> None:
    x = rand(6, 50)
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(ops.softmax(x), e / e.sum(-1, keepdims=True), rtol=1e-5,
                               atol=1e-7)
    s, b = rand(50), rand(50)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(ops.layer_norm(x, s, b, epsilon=1e-5),
                               (x - mu) / np.sqrt(var + 1e-5) * s + b, rtol=1e-4, atol=1e-5)
    erf = np.vectorize(math.erf)
    np.testing.assert_allclose(ops.gelu(x), 0.5 * x * (1 + erf(x / math.sqrt(2))),
                               rtol=1e-5, atol=1e-6)
    t = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(ops.gelu(x, approximate="tanh"), t, rtol=1e-5, atol=1e-6)


def _conv_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int, pad: int) -> np.ndarray:
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    n, c, h, wd = xp.shape
    m, _, kh, kw = w.shape
    oh, ow = (h - kh) // stride + 1, (wd - kw) // stride + 1
    out = np.zeros((n, m, oh, ow), np.float64)
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
            out += np.einsum("nchw,mc->nmhw", patch, w[:, :, i, j])
    return (out + b[None, :, None, None]).astype(np.float32)


def test_attention() -> None:
    q, k, v = rand(2, 3, 8, 16), rand(2, 3, 8, 16), rand(2, 3, 8, 16)
    for causal in (0, 1):
        s = q @ k.transpose(0, 1, 3, 2) / 4.0
        if causal:
            s = s + np.triu(np.full((8, 8), -np.inf, np.float32), 1)
        e = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(ops.attention(q, k, v, is_causal=causal),
                                   e / e.sum(-1, keepdims=True) @ v, rtol=1e-5, atol=1e-5)


def test_conv_and_gemm() -> None:
    x, w, b = rand(2, 3, 11, 11), rand(8, 3, 3, 3), rand(8)
    y = ops.conv(x, w, b, strides=(2, 2), pads=(1, 1, 1, 1))
    np.testing.assert_allclose(y, _conv_ref(x, w, b, 2, 1), rtol=1e-4, atol=1e-4)
    a, bb, c = rand(5, 7), rand(9, 7), rand(9)
    np.testing.assert_allclose(ops.gemm(a, bb, c, trans_b=1, alpha=0.5),
                               0.5 * a @ bb.T + c, rtol=1e-5, atol=1e-5)


def test_second_call_is_much_faster_and_fresh() -> None:
    x, w = rand(24, 40), rand(40, 16)
    t0 = time.perf_counter()
    y1 = ops.matmul(x, w)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    y2 = ops.matmul(x, w)
    second = time.perf_counter() - t0
    assert first > 10 * second, (first, second)
    assert y1 is not y2 and not np.shares_memory(y1, y2)
    np.testing.assert_array_equal(y1, y2)
    # inputs are read in place, never written; a strided view is made contiguous
    xc = x.copy()
    ops.matmul(x, w)
    np.testing.assert_array_equal(x, xc)
    xt = rand(40, 24).T
    np.testing.assert_allclose(ops.matmul(xt, w), xt @ w, rtol=1e-5, atol=1e-5)


def test_benchmark_helper() -> None:
    x = rand(16, 16)
    r = ops.benchmark(ops.relu, x, warmup=5, runs=50)
    assert r.runs == 50 and 0 < r.p10 <= r.median <= r.p90
    assert ops.benchmark(np.negative, x, warmup=0).runs >= 10
    with pytest.raises(CanncError, match="runs"):
        ops.benchmark(ops.relu, x, runs=0)


def test_auto_mixed_precision_seed_example() -> None:
    x, w = rand(32, 64), rand(64, 48)
    scale, bias = rand(48), rand(48)
    with ops.auto_mixed_precision(dtype="bf16"):
        y = ops.matmul(x, w, output_dtype="float32")   # kept at full precision
        z = ops.layer_norm(y, scale, bias, epsilon=1e-5)
        yb = ops.matmul(x, w)                          # a contraction narrows
        zb = ops.layer_norm(yb, scale, bias, epsilon=1e-5)   # a normalisation stays fp32
        exact = ops.matmul(x, w, precision="fp32")
        assert ops.current_precision() == "bf16"
    assert ops.current_precision() == "fp32"
    assert y.dtype == np.float32 and z.dtype == np.float32
    assert yb.dtype == ml_dtypes.bfloat16 and zb.dtype == np.float32
    ref = x.astype(np.float64) @ w
    # products in bf16, sums in float32: close to, but not, the float32 result
    xb = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    wb = w.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_allclose(y, xb @ wb, rtol=1e-4, atol=1e-3)
    assert np.abs(y - ref).max() > 1e-4
    np.testing.assert_allclose(exact, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(yb.astype(np.float32), y, rtol=1e-2, atol=1e-2)
    mu, var = y.mean(-1, keepdims=True), y.var(-1, keepdims=True)
    np.testing.assert_allclose(z, (y - mu) / np.sqrt(var + 1e-5) * scale + bias, rtol=1e-4,
                               atol=1e-4)
    with ops.auto_mixed_precision(dtype="bf16"):
        sm = ops.softmax(yb)                        # DENY: a bf16 input is widened
        rb = ops.relu(yb)                           # FOLLOW: bf16 in, bf16 out
        rf = ops.relu(y)
    assert sm.dtype == np.float32 and rb.dtype == ml_dtypes.bfloat16 and rf.dtype == np.float32
    yf = yb.astype(np.float32)
    e = np.exp(yf - yf.max(-1, keepdims=True))
    np.testing.assert_allclose(sm, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(rb.astype(np.float32), np.maximum(yf, 0))
    with ops.auto_mixed_precision(dtype="bf16"), ops.auto_mixed_precision(enabled=False):
        assert ops.matmul(x, w).dtype == np.float32


def test_errors_name_op_and_argument() -> None:
    x, w = rand(4, 8), rand(8, 3)
    with pytest.raises(ShapeError, match=r"cannc\.ops\.matmul.*a: float32\[4, 8\], "
                                         r"b: float32\[4, 8\]"):
        ops.matmul(x, x)
    with pytest.raises(InputError, match="'a' .*float32.* and 'b' .*float64"):
        ops.matmul(x, w.astype(np.float64))
    with pytest.raises(InputError, match="argument 'a' has dtype int8"):
        ops.matmul(x.astype(np.int8), w.astype(np.int8))
    with pytest.raises(InputError, match="argument 'b' is not an array"):
        ops.matmul(x, "w")
    with pytest.raises(CanncError, match="unknown attribute 'axes'.*softmax takes: axis"):
        ops.call("Softmax", x, axes=1)
    with pytest.raises(CanncError, match="cannc.ops.softmax: unknown attribute 'axes'"):
        ops.softmax(x, axes=1)
    with pytest.raises(CanncError, match="unknown attribute 'alpha'; matmul takes no attr"):
        ops.matmul(x, w, alpha=2.0)
    with pytest.raises(CanncError, match="no op com.example::Nope is registered"):
        ops.call("Nope", x, domain="com.example")
    with pytest.raises(CanncError, match="output_dtype 'nope'"):
        ops.matmul(x, w, output_dtype="nope")
    with pytest.raises(CanncError, match="cannc.ops.matmul: unknown precision 'fp8'"):
        ops.matmul(x, w, precision="fp8")
    with pytest.raises(InputError, match="missing input"):
        ops.call("MatMul", x)
    with pytest.raises(InputError, match="argument 'x' has non-native byte order"):
        ops.relu(x.astype(">f4"))
    # a list is a runtime array (float64 here), never silently narrowed
    with pytest.raises(InputError, match="'b' .*float64"):
        ops.matmul(x, [[1.0]] * 8)
    np.testing.assert_allclose(ops.matmul(x.astype(np.float64), [[1.0]] * 8),
                               x.sum(1, keepdims=True), rtol=1e-6)


def test_call_generic_and_multiple_outputs() -> None:
    x = rand(6, 10)
    np.testing.assert_allclose(ops.call("ReduceSum", x, np.array([1]), keepdims=0),
                               x.sum(1), rtol=1e-5, atol=1e-5)
    a, b = ops.call("Split", x, axis=1, num_outputs=2)
    np.testing.assert_array_equal(a, x[:, :5])
    np.testing.assert_array_equal(b, x[:, 5:])
    np.testing.assert_array_equal(ops.call("Cast", x, to=np.float16), x.astype(np.float16))


def test_cache_is_thread_safe() -> None:
    before = ops.cache_info()["compiles"]
    # a small launch runs on the calling core, a big one on every AI Core
    shapes = [(5, 96), (160, 96)]
    w = rand(96, 128)
    start = threading.Barrier(4)

    def work(seed: int) -> None:
        r = np.random.default_rng(seed)
        start.wait()
        for i in range(30):
            x = r.standard_normal(shapes[i % 2]).astype(np.float32) + 1000.0
            y = ops.matmul(x, w)
            np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=0.05)

    in_threads(work, 4)
    assert ops.cache_info()["compiles"] - before == 2     # one compile per signature
    launches = [e.fast for k, e in _eager._CACHE.items()
                if k[0] == "MatMul" and k[3][1] == (w.dtype, w.shape)]
    assert sorted(f.ncores for f in launches) == [1, cannc.session.shared_device().cores]


def test_exported_from_package() -> None:
    assert cannc.ops is ops and callable(cannc.ops.call)
