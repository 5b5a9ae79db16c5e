"""Reduced-precision convolution and pooling (bfloat16 / float16 operands, float32
accumulation): cannc against a float32 reference computed from the SAME rounded inputs
(onnxruntime's float32 Conv / pools on the narrow values widened), the tolerance from
the reduction length plus one ulp of the narrow output."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import cannc
from cannc.codegen.lower import conv as lconv
from cannc.ir.types import NP_TO_ONNX
from tests.helpers import model_of, ort_run, single_node_model

BF16 = ml_dtypes.bfloat16
ULP = {BF16: 2.0 ** -8, np.float16: 2.0 ** -11, np.float32: 0.0}


def _model(nodes, ins, outs, inits=()):
    """model_of with the outputs' shapes from ONNX's shape inference (for the checker)."""
    m = onnx.shape_inference.infer_shapes(model_of(nodes, ins, outs, inits, opset=22))
    for vi in m.graph.output:
        for v in m.graph.value_info:
            if v.name == vi.name:
                vi.CopyFrom(v)
    return m


def _rand(shape, dt, rng, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dt)


def _check(got, want, K, out_dt, absref):
    """|got - want| <= 1e-5*sqrt(K) * sum|x||w| + one ulp of the output type."""
    got = np.asarray(got).astype(np.float32)
    tol = 1e-5 * np.sqrt(K) * absref + ULP[out_dt] * np.abs(want) + 1e-6
    bad = np.abs(got - want) > tol
    assert not bad.any(), (f"{bad.sum()} of {bad.size} off; max err "
                           f"{np.abs(got - want).max()}, max tol {tol.max()}")


def _conv_ref(ins32, const, **attrs):
    m, f = single_node_model("Conv", ins32, const_inputs=const, **attrs)
    return ort_run(m, f)[0]


def _abs_ref(ins32, const, **attrs):
    """sum |x||w| per output (for the tolerance): the conv of |x| and |w|, no bias."""
    return _conv_ref([np.abs(ins32[0]), np.abs(ins32[1])], (1,) if 1 in const else (), **attrs)


def _skip_without_dp(mode):
    if mode == "dp" and not cannc.native.target.host().has("avx512bf16"):
        pytest.skip("no avx512_bf16")


def _run_conv(dt, xs, ws, *, bias=True, const_w=True, x_dt=None, y_dt=None, prec=None,
              mode=None, rng=None, **attrs):
    _skip_without_dp(mode)
    rng = rng or np.random.default_rng(0)
    x_dt = x_dt or dt
    y_dt = y_dt or dt
    x = _rand(xs, dt, rng).astype(x_dt)                 # values representable in dt
    w = _rand(ws, dt, rng, 1.0 / np.sqrt(np.prod(ws[1:])))
    ins = [x, w] + ([_rand(ws[0], dt, rng)] if bias else [])
    const = (1, 2) if const_w else ()
    if prec:
        attrs["cannc_precision"] = prec
    names = [f"in{i}" for i in range(len(ins))]
    node = helper.make_node("Conv", names, ["out0"], **attrs)
    inits = [numpy_helper.from_array(a, n) for i, (a, n) in enumerate(zip(ins, names))
             if i in const]
    gin = [helper.make_tensor_value_info(n, NP_TO_ONNX[a.dtype], a.shape)
           for i, (a, n) in enumerate(zip(ins, names)) if i not in const]
    out = helper.make_tensor_value_info("out0", NP_TO_ONNX[np.dtype(y_dt)], None)
    m = _model([node], gin, [out], inits)
    feeds = {n: a for i, (a, n) in enumerate(zip(ins, names)) if i not in const}
    old = lconv.FORCE_LOWP_MODE
    lconv.FORCE_LOWP_MODE = mode
    try:
        sess = cannc.compile(m, cores=2)
    finally:
        lconv.FORCE_LOWP_MODE = old
    got = sess.run(None, feeds)[0]
    assert got.dtype == np.dtype(y_dt)
    plain = {k: v for k, v in attrs.items() if k != "cannc_precision"}
    ins32 = [a.astype(np.float32) for a in ins]
    want = _conv_ref(ins32, const, **plain)
    assert got.shape == want.shape
    K = int(np.prod(ws[1:]))
    _check(got, want, K, y_dt, _abs_ref(ins32, const, **plain))
    return sess


def _notes(sess):
    return [k.notes for s in sess.specializations for k in s.kernels]


CASES = [
    ((1, 16, 10, 12), (24, 16, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((2, 7, 9, 9), (10, 7, 3, 3), dict(strides=[2, 2])),                    # odd C, batch 2
    ((1, 8, 11, 13), (16, 4, 1, 1), dict(group=2)),                         # groups, 1x1
    ((1, 5, 17, 19), (9, 5, 3, 3), dict(strides=[3, 2], pads=[2, 1, 0, 1],  # gathers
                                        dilations=[1, 2])),
    ((1, 3, 23, 23), (8, 3, 7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3])),  # stem
    ((1, 12, 40), (6, 12, 5), dict(pads=[2, 2])),                           # 1-D
    ((1, 6, 9, 9), (6, 1, 3, 3), dict(group=6, pads=[1, 1, 1, 1])),          # depthwise
]


@pytest.mark.parametrize("mode", ["dp", "f32"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_bf16_conv(case, mode):
    xs, ws, attrs = CASES[case]
    if mode == "dp" and not cannc.native.target.host().has("avx512bf16"):
        pytest.skip("no avx512_bf16")
    _run_conv(BF16, xs, ws, mode=mode, **attrs)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fp16_conv(case):
    xs, ws, attrs = CASES[case]
    _run_conv(np.float16, xs, ws, **attrs)


def test_fp16_conv_matches_onnxruntime():
    """onnxruntime runs float16 Conv itself (fp32 accumulation)."""
    rng = np.random.default_rng(3)
    x = _rand((1, 16, 14, 14), np.float16, rng)
    w = _rand((32, 16, 3, 3), np.float16, rng, 0.1)
    m, f = single_node_model("Conv", [x, w], const_inputs=(1,), pads=[1, 1, 1, 1])
    got = cannc.compile(m, cores=2).run(None, f)[0]
    want = ort_run(m, f)[0]
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                               rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("mode", ["dp", "f32"])
def test_runtime_weights_and_narrow_bias(mode):
    _run_conv(BF16, (1, 9, 8, 10), (12, 9, 3, 3), const_w=False, mode=mode, pads=[1, 1, 1, 1])
    _run_conv(np.float16, (1, 9, 8, 10), (12, 9, 3, 3), const_w=False, pads=[0, 1, 0, 1])


def _with_precision(m, prec, **opts):
    """A session whose Conv nodes carry attrs["cannc_precision"] (as the mixed-precision
    pass sets it on float32 graphs; ONNX has no such attribute, so it is set on the
    imported graph before the first compile)."""
    sess = cannc.compile(m, eager=False, **opts)
    convs = [n for n in sess.graph.nodes() if n.op_type == "Conv"]
    assert convs
    for n in convs:
        n.attrs["cannc_precision"] = prec
    return sess


@pytest.mark.parametrize("mode", ["dp", "f32"])
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
@pytest.mark.parametrize("case", [0, 1, 3])
def test_fp32_graph_with_cannc_precision(prec, case, mode):
    """fp32 X (rounded while packing), fp32 constant W (rounded at compile time), fp32
    bias and output: products of the rounded values, fp32 accumulation."""
    xs, ws, attrs = CASES[case]
    dt = BF16 if prec == "bf16" else np.float16
    rng = np.random.default_rng(case)
    x = rng.standard_normal(xs).astype(np.float32)
    w = (rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))).astype(np.float32)
    bias = rng.standard_normal(ws[0]).astype(np.float32)
    m, feeds = single_node_model("Conv", [x, w, bias], const_inputs=(1, 2), **attrs)
    _skip_without_dp(mode)
    old = lconv.FORCE_LOWP_MODE
    lconv.FORCE_LOWP_MODE = mode
    try:
        sess = _with_precision(m, prec, cores=2)
        got = sess.run(None, feeds)[0]
    finally:
        lconv.FORCE_LOWP_MODE = old
    assert got.dtype == np.float32
    r = [x.astype(dt).astype(np.float32), w.astype(dt).astype(np.float32), bias]
    want = _conv_ref(r, (1, 2), **attrs)
    _check(got, want, int(np.prod(ws[1:])), np.float32, _abs_ref(r, (1, 2), **attrs))
    # not the fp32 result: the inputs were rounded (the differences are far above fp32's)
    exact = _conv_ref([x, w, bias], (1, 2), **attrs)
    assert np.abs(got - exact).max() > 1e-4
    note = [n.get("precision", "") for n in _notes(sess)]
    assert note and note[0].startswith(prec), note


def _epilogue_model(dt, residual: bool):
    rng = np.random.default_rng(7)
    C, M, H = 16, 16, 10
    x = _rand((1, C, H, H), dt, rng)
    w = _rand((M, C, 3, 3), dt, rng, 0.1)
    b = _rand((M,), dt, rng)
    r = _rand((1, M, H, H), dt, rng)
    et = NP_TO_ONNX[np.dtype(dt)]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1])]
    last = "c"
    if residual:
        nodes.append(helper.make_node("Add", ["c", "r"], ["s"]))
        last = "s"
    nodes.append(helper.make_node("Relu", [last], ["y"]))
    ins = [helper.make_tensor_value_info("x", et, x.shape)]
    feeds = {"x": x}
    if residual:
        ins.append(helper.make_tensor_value_info("r", et, r.shape))
        feeds["r"] = r
    m = _model(nodes, ins, [helper.make_tensor_value_info("y", et, None)],
               [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    conv = _conv_ref([x.astype(np.float32), w.astype(np.float32), b.astype(np.float32)],
                     (1, 2), pads=[1, 1, 1, 1])
    want = np.maximum(conv + (r.astype(np.float32) if residual else 0), 0)
    absref = _abs_ref([x.astype(np.float32), w.astype(np.float32)], (1,), pads=[1, 1, 1, 1])
    return m, feeds, want, absref, C * 9


@pytest.mark.parametrize("dt", [BF16, np.float16])
@pytest.mark.parametrize("residual", [False, True])
def test_fused_epilogue(dt, residual):
    m, feeds, want, absref, K = _epilogue_model(dt, residual)
    sess = cannc.compile(m, cores=2)
    got = sess.run(None, feeds)[0]
    assert got.dtype == np.dtype(dt)
    notes = _notes(sess)
    assert len(notes) == 1 and notes[0].get("epilogue"), notes   # one fused kernel
    # the epilogue runs in float32 and rounds once: one more ulp for the residual add
    _check(got, want, K, dt, absref + ULP[dt] * np.abs(want))


def _pool_model(op, x, **attrs):
    return _model([helper.make_node(op, ["x"], ["y"], **attrs)],
                  [helper.make_tensor_value_info("x", NP_TO_ONNX[x.dtype], x.shape)],
                  [helper.make_tensor_value_info("y", NP_TO_ONNX[x.dtype], None)])


POOLS = [
    ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("MaxPool", dict(kernel_shape=[2, 2])),
    ("AveragePool", dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    ("AveragePool", dict(kernel_shape=[3, 3], strides=[3, 3], count_include_pad=1,
                         pads=[1, 1, 1, 1])),
    ("LpPool", dict(kernel_shape=[2, 2], p=2)),
    ("GlobalAveragePool", {}),
    ("GlobalMaxPool", {}),
]


@pytest.mark.parametrize("dt", [BF16, np.float16])
@pytest.mark.parametrize("case", range(len(POOLS)))
def test_pools(case, dt):
    op, attrs = POOLS[case]
    rng = np.random.default_rng(case)
    x = _rand((2, 5, 13, 11), dt, rng)
    m = _pool_model(op, x, **attrs)
    got = cannc.compile(m, cores=2).run(None, {"x": x})[0]
    assert got.dtype == np.dtype(dt)
    want = ort_run(_pool_model(op, x.astype(np.float32), **attrs),
                   {"x": x.astype(np.float32)})[0]
    if op == "MaxPool" or op == "GlobalMaxPool":
        np.testing.assert_array_equal(got.astype(np.float32), want)
    else:   # float32 sum, one rounding
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=ULP[dt], atol=1e-6)


def test_precision_note_and_default_fp32_unchanged():
    sess = _run_conv(BF16, (1, 8, 8, 8), (8, 8, 3, 3), pads=[1, 1, 1, 1])
    assert any(n.get("precision", "").startswith("bf16") for n in _notes(sess))
    s32 = _run_conv(np.float32, (1, 8, 8, 8), (8, 8, 3, 3), pads=[1, 1, 1, 1])
    assert not any("lowp" in n.get("path", "") for n in _notes(s32))
