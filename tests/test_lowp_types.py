"""float8 / float4 / e8m0 and int4 / uint4 / int2 / uint2 end to end: Cast, CastLike,
QuantizeLinear, DequantizeLinear, against onnxruntime and ONNX's reference.

onnxruntime 1.32's Python API returns float8E4M3FN/E5M2 outputs as uint8 bit patterns and
cannot return FNUZ, int4/uint4/int2/uint2 or float4 outputs at all, so those are compared
through a cast back to float32 (or int32) inside the same graph; cannc returns the
ml_dtypes arrays (same shapes; `.view(np.uint8)` gives onnxruntime's bits).

Where onnxruntime departs from the ONNX spec and its reference, cannc follows the spec and
the test says so: without saturation onnxruntime turns 480 into 448 in E4M3FN (the spec:
[x] > FLT_MAX -> NaN) and [61440, 65536) into NaN in E5M2 (the spec: Inf); onnxruntime
rounds float -> int4 half away from zero and wraps, the reference (and cannc) truncates
and gives 0 out of range (the spec: undefined out of range).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from onnx.reference.ops.op_cast import cast_to

import cannc.backend as backend
from cannc.errors import CanncError, UnsupportedOpError

R = np.random.default_rng(11)

FP8 = [T.FLOAT8E4M3FN, T.FLOAT8E4M3FNUZ, T.FLOAT8E5M2, T.FLOAT8E5M2FNUZ]

# NaN, inf, each format's max, just above it, the rounding midpoints above max, ties,
# subnormals (E4M3 2**-9, E5M2 2**-16) and their ties, values that underflow to zero
EDGE = np.array([
    0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf,
    448, 449, 464, 465, 480, 500, -464, -465,            # E4M3FN max 448
    240, 247, 248, 249, 256,                             # E4M3FNUZ max 240
    57344, 57345, 61439, 61440, 61441, 65536, 1e6, -1e6,  # E5M2 max 57344
    1.0625, 1.1875, 1.0625 + 2 ** -20, 3.5, 0.5, 1.5, 2.5,  # mantissa ties
    2 ** -6, 2 ** -7, 2 ** -8, 2 ** -9, 1.5 * 2 ** -9, 2.5 * 2 ** -9, 2 ** -10,
    0.5000001 * 2 ** -9, 2 ** -14, 2 ** -15, 2 ** -16, 1.5 * 2 ** -16, 2 ** -17,
    0.75 * 2 ** -17, 2 ** -126, 2 ** -149, 6.0, 7.0, 5.0, -5.0, 0.25, 0.75,
], np.float32)


def _x32() -> np.ndarray:
    bits = R.integers(0, 2 ** 32, 2000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([EDGE, bits.view(np.float32),
                           (R.standard_normal(500) * 300).astype(np.float32)])


def _model(nodes, inputs, outputs, inits=(), opset=21):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return m


def _vi(name, et, shape):
    return helper.make_tensor_value_info(name, et, list(shape))


def _ort(m, feeds):
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _cannc(m, feeds):
    return backend.prepare(m, cores=1).run(list(feeds.values()))


def _same(a, b):
    """Equal as floats, NaN equal to NaN, +0 equal to -0."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a == b) | (np.isnan(a) & np.isnan(b))


def _ort_deviates(to: int, sat: int, x: np.ndarray) -> np.ndarray:
    """onnxruntime's non-saturating boundary cases that contradict the spec."""
    with np.errstate(invalid="ignore"):
        a = np.abs(x.astype(np.float64))
    if sat:
        return np.zeros(x.shape, bool)
    if to == T.FLOAT8E4M3FN:
        return (a > 464) & (a < 496)       # rounds to 480, the NaN code
    if to == T.FLOAT8E5M2:
        return (a >= 61440) & (a < 65536)  # rounds to inf
    return np.zeros(x.shape, bool)


@pytest.mark.parametrize("sat", [1, 0])
@pytest.mark.parametrize("to", FP8, ids=lambda t: T.DataType.Name(t))
def test_cast_to_float8(to, sat):
    x32 = _x32()
    with np.errstate(over="ignore"):
        x16 = x32.astype(np.float16)
    n = len(x32)
    m = _model([helper.make_node("Cast", ["x"], ["y"], to=to, saturate=sat),
                helper.make_node("Cast", ["y"], ["z"], to=T.FLOAT),
                helper.make_node("Cast", ["h"], ["yh"], to=to, saturate=sat),
                helper.make_node("CastLike", ["yh", "x"], ["zh"])],
               [_vi("x", T.FLOAT, [n]), _vi("h", T.FLOAT16, [n])],
               [_vi("z", T.FLOAT, [n]), _vi("zh", T.FLOAT, [n]), _vi("y", to, [n])])
    z, zh, y = _cannc(m, {"x": x32, "h": x16})
    ref = cast_to(x32, to, bool(sat))
    assert y.dtype == ref.dtype and y.shape == (n,)
    np.testing.assert_array_equal(y.view(np.uint8), ref.view(np.uint8))   # bit exact
    m.graph.output.pop()                       # onnxruntime cannot return FNUZ outputs
    rz, rzh = _ort(m, {"x": x32, "h": x16})
    for got, want, src in ((z, rz, x32), (zh, rzh, x16)):
        dev = _ort_deviates(to, sat, src)
        ok = _same(got, want)
        assert ok[~dev].all(), [(src[i], want[i], got[i]) for i in np.nonzero(~ok & ~dev)[0][:5]]
        spec = cast_to(src, to, bool(sat)).astype(np.float32)
        assert _same(got[dev], spec[dev]).all()


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                  "float8_e5m2fnuz", "float4_e2m1fn", "float8_e8m0fnu",
                                  "float6_e2m3fn", "float6_e3m2fn"])
def test_cast_from_every_code(name):
    """Every code of the format to float32, float16, float64 and int32 (ml_dtypes)."""
    dt = np.dtype(getattr(ml_dtypes, name))
    codes = np.arange(1 << (8 * dt.itemsize if "float4" not in name and "float6" not in name
                            else int(name[5])), dtype=np.uint8)
    x = codes.view(dt)
    et = helper.np_dtype_to_tensor_dtype(dt)
    n = len(x)
    outs = [(T.FLOAT, np.float32), (T.FLOAT16, np.float16), (T.DOUBLE, np.float64),
            (T.INT32, np.int32), (T.BFLOAT16, ml_dtypes.bfloat16)]
    m = _model([helper.make_node("Cast", ["x"], [f"y{i}"], to=t) for i, (t, _) in enumerate(outs)],
               [_vi("x", et, [n])], [_vi(f"y{i}", t, [n]) for i, (t, _) in enumerate(outs)],
               opset=28)
    got = _cannc(m, {"x": x})
    f = x.astype(np.float32)
    for g, (_, npdt) in zip(got, outs):
        assert g.dtype == np.dtype(npdt)
        if npdt == np.int32:     # finite values only: NaN/inf to int is undefined
            fin = np.isfinite(f) & (np.abs(f) < 2 ** 31)
            np.testing.assert_array_equal(g[fin], np.trunc(f[fin]).astype(np.int32))
        else:
            with np.errstate(over="ignore"):
                assert _same(g, f.astype(npdt)).all(), name


def test_cast_double_and_int_sources_round_once():
    """float64 -> float8 rounds once (a tie in float32 is not one in float64), and
    wide integers convert like ml_dtypes does from the exact value."""
    d = np.array([1.0625 + 2 ** -40, 1.0625 - 2 ** -40, 464 + 2 ** -30, 2 ** -9 * (1.5 + 2 ** -40),
                  -(1.1875 + 2 ** -45), 1e300, -1e300, 1e-300], np.float64)
    ints = np.array([0, 1, -1, 17, 448, 465, 100000, -(2 ** 31), 2 ** 31 - 1], np.int32)
    to = T.FLOAT8E4M3FN
    m = _model([helper.make_node("Cast", ["d"], ["yd"], to=to, saturate=0),
                helper.make_node("Cast", ["i"], ["yi"], to=T.FLOAT8E5M2)],
               [_vi("d", T.DOUBLE, d.shape), _vi("i", T.INT32, ints.shape)],
               [_vi("yd", to, d.shape), _vi("yi", T.FLOAT8E5M2, ints.shape)])
    yd, yi = _cannc(m, {"d": d, "i": ints})
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(yd.view(np.uint8),
                                      d.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    np.testing.assert_array_equal(yi.view(np.uint8),
                                  cast_to(ints.astype(np.float64), T.FLOAT8E5M2, True)
                                  .view(np.uint8))


@pytest.mark.parametrize("mode", ["up", "down", "nearest"])
def test_cast_e8m0_float4_float6(mode):
    x = np.abs(_x32())
    n = len(x)
    m = _model([helper.make_node("Cast", ["x"], ["e"], to=T.FLOAT8E8M0, round_mode=mode),
                helper.make_node("Cast", ["x"], ["en"], to=T.FLOAT8E8M0, round_mode=mode,
                                 saturate=0),
                helper.make_node("Cast", ["x"], ["f4"], to=T.FLOAT4E2M1),
                helper.make_node("Cast", ["nx"], ["f4n"], to=T.FLOAT4E2M1),
                helper.make_node("Cast", ["nx"], ["f6a"], to=T.FLOAT6E2M3),
                helper.make_node("Cast", ["x"], ["f6b"], to=T.FLOAT6E3M2)],
               [_vi("x", T.FLOAT, [n]), _vi("nx", T.FLOAT, [n])],
               [_vi("e", T.FLOAT8E8M0, [n]), _vi("en", T.FLOAT8E8M0, [n]),
                _vi("f4", T.FLOAT4E2M1, [n]), _vi("f4n", T.FLOAT4E2M1, [n]),
                _vi("f6a", T.FLOAT6E2M3, [n]), _vi("f6b", T.FLOAT6E3M2, [n])], opset=28)
    e, en, f4, f4n, f6a, f6b = _cannc(m, {"x": x, "nx": -x})
    for got, want in ((e, cast_to(x, T.FLOAT8E8M0, True, mode)),
                      (en, cast_to(x, T.FLOAT8E8M0, False, mode)),
                      (f4, cast_to(x, T.FLOAT4E2M1, True)),
                      (f4n, cast_to(-x, T.FLOAT4E2M1, True)),
                      (f6a, cast_to(-x, T.FLOAT6E2M3, True)),
                      (f6b, cast_to(x, T.FLOAT6E3M2, True))):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


SUBBYTE = [(T.INT4, -8, 7, 21), (T.UINT4, 0, 15, 21), (T.INT2, -2, 1, 25), (T.UINT2, 0, 3, 25)]


@pytest.mark.parametrize("to,lo,hi,opset", SUBBYTE, ids=lambda v: str(v))
def test_cast_subbyte_int(to, lo, hi, opset):
    ints = np.arange(-300, 300, dtype=np.int32)
    fin = np.arange(lo, hi + 1, dtype=np.float32)
    frac = np.array([lo - 0.5, lo - 1, hi + 0.5, hi + 1, 0.5, -0.5, 1.5, hi - 0.5, 100.0,
                     np.nan, np.inf, -np.inf], np.float32)
    f = np.concatenate([fin, frac])
    m = _model([helper.make_node("Cast", ["i"], ["qi"], to=to),
                helper.make_node("Cast", ["qi"], ["ri"], to=T.INT32),
                helper.make_node("Cast", ["f"], ["qf"], to=to),
                helper.make_node("Cast", ["qf"], ["rf"], to=T.FLOAT),
                helper.make_node("Cast", ["qf"], ["r8"], to=T.INT8)],
               [_vi("i", T.INT32, ints.shape), _vi("f", T.FLOAT, f.shape)],
               [_vi("ri", T.INT32, ints.shape), _vi("rf", T.FLOAT, f.shape),
                _vi("r8", T.INT8, f.shape), _vi("qf", to, f.shape)], opset=opset)
    ri, rf, r8, qf = _cannc(m, {"i": ints, "f": f})
    ndt = helper.tensor_dtype_to_np_dtype(to)
    assert qf.dtype == ndt and qf.shape == f.shape
    # int -> subbyte: the low bits, reinterpreted (like onnxruntime and ml_dtypes)
    m.graph.output.pop()
    o_ri, o_rf, o_r8 = _ort(m, {"i": ints, "f": f})
    np.testing.assert_array_equal(ri, o_ri)
    # integral in-range floats agree with onnxruntime; the rest follow the reference
    k = len(fin)
    np.testing.assert_array_equal(rf[:k], o_rf[:k])
    np.testing.assert_array_equal(r8[:k], o_r8[:k])
    with np.errstate(invalid="ignore"):
        ref = f.astype(ndt)
    np.testing.assert_array_equal(qf.view(np.uint8), ref.view(np.uint8))
    np.testing.assert_array_equal(rf, ref.astype(np.float32))


@pytest.mark.parametrize("layout", ["tensor", "axis", "block"])
@pytest.mark.parametrize("qt,zpv", [(T.INT4, 1), (T.UINT4, 3), (T.INT2, -1), (T.UINT2, 1),
                                    (T.FLOAT8E4M3FN, 0), (T.FLOAT8E5M2, 0)],
                         ids=lambda v: str(v))
def test_quantize_dequantize(qt, zpv, layout):
    x = (R.standard_normal((4, 8)) * 5).astype(np.float32)
    x.flat[:10] = [np.nan, np.inf, -np.inf, 1e6, 2.5, -2.5, 0.35, -0.35, 500, -70000]
    if layout == "tensor":
        s, zshape, attrs = np.array(0.7, np.float32), [], {}
    elif layout == "axis":
        s, zshape, attrs = np.array([0.5, 1, 2, 0.25], np.float32), [4], {"axis": 0}
    else:
        s = (np.abs(R.standard_normal((4, 2))) + 0.2).astype(np.float32)
        zshape, attrs = [4, 2], {"axis": 1, "block_size": 4}
    ndt = helper.tensor_dtype_to_np_dtype(qt)
    zp = np.full(zshape, zpv, np.float32).astype(ndt)
    opset = 25 if qt in (T.INT2, T.UINT2) else 21
    inits = [numpy_helper.from_array(s, "s"), numpy_helper.from_array(zp, "zp")]
    m = _model([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], **attrs),
                helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], **attrs)],
               [_vi("x", T.FLOAT, x.shape)], [_vi("y", T.FLOAT, x.shape)], inits, opset)
    (got,) = _cannc(m, {"x": x})
    try:
        (want,) = _ort(m, {"x": x})
    except Exception as e:         # e.g. int2 QuantizeLinear not in onnxruntime 1.32
        pytest.skip(f"onnxruntime: {str(e)[:80]}")
    assert _same(got, want).all(), [(x.flat[i], want.flat[i], got.flat[i])
                                    for i in np.nonzero(~_same(got, want).ravel())[0][:5]]


def test_quantize_float8_saturate_off_and_int4_graph_io():
    """QuantizeLinear's saturate=0 (overflow to NaN/inf) and sub-byte graph inputs and
    outputs: cannc returns ml_dtypes arrays of the declared type and shape."""
    x = np.array([1.0, 500.0, -500.0, 70000.0, np.nan], np.float32)
    q4 = np.array([[-8, 7, 0], [1, -1, 3]], np.float32).astype(ml_dtypes.int4)
    m = _model([helper.make_node("QuantizeLinear", ["x", "s"], ["y"], saturate=0,
                                 output_dtype=T.FLOAT8E4M3FN),
                helper.make_node("QuantizeLinear", ["x", "s"], ["y5"], saturate=0,
                                 output_dtype=T.FLOAT8E5M2),
                helper.make_node("Identity", ["q"], ["q_out"]),
                helper.make_node("DequantizeLinear", ["q", "s"], ["dq"])],
               [_vi("x", T.FLOAT, x.shape), _vi("q", T.INT4, q4.shape)],
               [_vi("y", T.FLOAT8E4M3FN, x.shape), _vi("y5", T.FLOAT8E5M2, x.shape),
                _vi("q_out", T.INT4, q4.shape), _vi("dq", T.FLOAT, q4.shape)],
               [numpy_helper.from_array(np.array(1.0, np.float32), "s")])
    y, y5, q_out, dq = _cannc(m, {"x": x, "q": q4})
    np.testing.assert_array_equal(y.view(np.uint8), cast_to(x, T.FLOAT8E4M3FN, False)
                                  .view(np.uint8))
    np.testing.assert_array_equal(y5.view(np.uint8), cast_to(x, T.FLOAT8E5M2, False)
                                  .view(np.uint8))
    assert q_out.dtype == np.dtype(ml_dtypes.int4) and q_out.shape == q4.shape
    np.testing.assert_array_equal(q_out.astype(np.int8), q4.astype(np.int8))
    np.testing.assert_array_equal(dq, q4.astype(np.float32))


def test_unsupported_lowp_is_a_clear_error():
    """An op without low-precision support names the node and the element type (cannc
    compiles on the first run, when the shapes are known)."""
    x = np.zeros((2, 3), ml_dtypes.float8_e4m3fn)
    m = _model([helper.make_node("Transpose", ["a"], ["y"], name="tr_f8")],
               [_vi("a", T.FLOAT8E4M3FN, x.shape)], [_vi("y", T.FLOAT8E4M3FN, x.shape[::-1])])
    with pytest.raises(UnsupportedOpError, match="tr_f8.*float8_e4m3fn"):
        _cannc(m, {"a": x})
    m = _model([helper.make_node("QuantizeLinear", ["x", "s"], ["y"], name="q_e8m0",
                                 output_dtype=T.FLOAT8E8M0)],
               [_vi("x", T.FLOAT, [4])], [_vi("y", T.FLOAT8E8M0, [4])],
               [numpy_helper.from_array(np.array(1.0, np.float32), "s")], opset=25)
    with pytest.raises(CanncError, match="q_e8m0.*(FLOAT8E8M0|float8e8m0|float8_e8m0)"):
        _cannc(m, {"x": np.ones(4, np.float32)})


@pytest.mark.parametrize("qt", [T.INT4, T.UINT4, T.INT2, T.FLOAT8E4M3FN], ids=lambda t: str(t))
def test_packed_initializer_dequantize_matmul(qt):
    """Weights as packed int4/uint4/int2 (two or four per byte in the TensorProto) or float8
    initializers, blocked DequantizeLinear, MatMul: like onnxruntime without its graph
    optimisations (which fuse DQ+MatMul into MatMulNBits and quantise the activations)."""
    K, N, B = 64, 24, 16
    ndt = helper.tensor_dtype_to_np_dtype(qt)
    lo, hi = {T.INT4: (-8, 7), T.UINT4: (0, 15), T.INT2: (-2, 1)}.get(qt, (-20, 20))
    w = R.integers(lo, hi + 1, (K, N)).astype(np.float32).astype(ndt)
    s = (R.random((K // B, N)) * 0.1 + 0.01).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(s, "s")]
    ins = ["w", "s"]
    if qt != T.FLOAT8E4M3FN:
        inits.append(numpy_helper.from_array(np.ones((K // B, N), np.float32).astype(ndt), "z"))
        ins.append("z")
    m = _model([helper.make_node("DequantizeLinear", ins, ["wf"], axis=0, block_size=B),
                helper.make_node("MatMul", ["x", "wf"], ["y"])],
               [_vi("x", T.FLOAT, [3, K])], [_vi("y", T.FLOAT, [3, N])], inits,
               25 if qt == T.INT2 else 21)
    x = R.standard_normal((3, K)).astype(np.float32)
    (got,) = _cannc(m, {"x": x})
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    (want,) = ort.InferenceSession(m.SerializeToString(), so,
                                   providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qt", [T.FLOAT4E2M1, T.FLOAT6E2M3, T.FLOAT6E3M2, T.FLOAT8E4M3FNUZ,
                                T.FLOAT8E5M2FNUZ], ids=lambda t: str(t))
def test_quantize_dequantize_small_floats_vs_reference(qt):
    """Formats onnxruntime has no (De)QuantizeLinear for: ONNX's reference, zero points
    included (float4/float6 add theirs, float6 subtracts it again)."""
    from onnx.reference import ReferenceEvaluator
    x = (R.standard_normal((4, 8)) * 4).astype(np.float32)
    x.flat[:6] = [np.nan, np.inf, -np.inf, 1e6, 0.3, -0.3]
    ndt = helper.tensor_dtype_to_np_dtype(qt)
    s = np.array([0.5, 1, 2, 0.25], np.float32)
    zp = np.array([0, 1, 0, -1], np.float32).astype(ndt)
    if qt in (T.FLOAT8E4M3FNUZ, T.FLOAT8E5M2FNUZ):
        zp = np.zeros(4, ndt)
    inits = [numpy_helper.from_array(s, "s"), numpy_helper.from_array(zp, "zp")]
    m = _model([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], axis=0),
                helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], axis=0)],
               [_vi("x", T.FLOAT, x.shape)], [_vi("y", T.FLOAT, x.shape), _vi("q", qt, x.shape)],
               inits, 28)
    y, q = _cannc(m, {"x": x})
    ry, rq = ReferenceEvaluator(m).run(None, {"x": x})
    np.testing.assert_array_equal(q.view(np.uint8), rq.view(np.uint8))
    assert _same(y, ry).all()
