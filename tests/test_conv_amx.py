"""bf16 convolution on AMX tiles (cannc/codegen/amx_conv.py): whole sessions through the
Conv lowering (both modes, direct and im2col, forced), and the emitted kernel alone over
a NaN-filled workspace split like two cores. References: float32 convolutions of the
SAME bf16-rounded inputs (tests/test_conv_lowp.py's helpers), the tolerance from the
reduction length plus one ulp of a bf16 output. Skipped, with the reason, where
`amx_usable()` says AMX cannot run here."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

import cannc
from cannc.codegen import amx_conv
from cannc.codegen.amx import amx_usable
from cannc.codegen.conv import ConvGeom, LowpTypes, Slots, cdiv
from cannc.codegen.lower import conv as lconv
from cannc.native import target
from tests.helpers import aligned, run_splits
from tests.test_conv_lowp import (
    _abs_ref,
    _check,
    _conv_ref,
    _epilogue_model,
    _notes,
    _run_conv,
    _with_precision,
)

BF16 = ml_dtypes.bfloat16
_WHY = amx_usable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"AMX not usable: {_WHY}")

# (X shape, W shape, attrs, direct possible)
CASES = [
    ((1, 16, 10, 12), (24, 16, 3, 3), dict(pads=[1, 1, 1, 1]), True),     # M < 32
    ((2, 7, 9, 9), (10, 7, 3, 3), dict(strides=[2, 2]), True),            # odd C, batch 2
    ((1, 7, 9, 11), (10, 7, 3, 3), dict(pads=[0, 1, 2, 1]), True),        # odd C, pads
    ((1, 8, 11, 13), (16, 4, 1, 1), dict(group=2), True),                 # groups, 1x1
    ((1, 5, 17, 19), (9, 5, 3, 3), dict(pads=[2, 1, 0, 1], dilations=[1, 2]), True),
    ((1, 5, 17, 19), (9, 5, 3, 3), dict(strides=[3, 2], pads=[2, 1, 0, 1],
                                        dilations=[1, 2]), False),        # gathers
    ((1, 3, 23, 23), (8, 3, 7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3]), True),  # stem
    ((1, 12, 40), (6, 12, 5), dict(pads=[2, 2]), True),                   # 1-D
    ((1, 40, 9, 7), (70, 40, 3, 3), dict(pads=[1, 1, 1, 1]), True),       # 3 panels, K 360
    ((1, 33, 7, 9), (48, 33, 1, 1), {}, True),                            # 1x1 stride 1
    ((1, 3, 2, 4, 5), (4, 3, 2, 3, 3), dict(pads=[1, 1, 1, 1, 1, 1]), False),  # 3-D
    ((1, 6, 10, 13), (8, 6, 1, 1), dict(strides=[2, 2]), True),           # 1x1 stride 2
    ((1, 5, 11, 12), (7, 5, 3, 2), dict(strides=[1, 2], pads=[1, 0, 1, 1]), True),  # phases
]


def _modes(case):
    return ["amx-direct", "amx-im2col"] if CASES[case][3] else ["amx-im2col"]


@pytest.mark.parametrize("case,mode", [(c, m) for c in range(len(CASES)) for m in _modes(c)])
def test_bf16_conv(case, mode):
    xs, ws, attrs, _ = CASES[case]
    sess = _run_conv(BF16, xs, ws, mode=mode, **attrs)
    notes = _notes(sess)
    assert notes[0]["precision"] == "bf16 AMX", notes
    assert notes[0]["path"].startswith("amx-conv " + mode[4:]), notes


def _cast_model(x_dt, y_dt, rng):
    """x (x_dt) -> Conv -> [Cast] -> y (y_dt): a bf16 x: a bf16 Conv and a Cast to fp32;
    an fp32 x: an fp32 Conv (given cannc_precision, as the mixed-precision pass does) and
    a Cast to bf16. The fusion rule precision_casts folds the Cast into the conv."""
    from onnx import TensorProto, helper, numpy_helper

    from tests.test_conv_lowp import _model
    x = rng.standard_normal((1, 9, 8, 10)).astype(np.float32).astype(BF16).astype(x_dt)
    w = (rng.standard_normal((20, 9, 3, 3)) / 9).astype(BF16)
    b = rng.standard_normal(20).astype(BF16)
    et = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(BF16): TensorProto.BFLOAT16}
    if np.dtype(x_dt) != np.dtype(BF16):
        w, b = w.astype(np.float32), b.astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1])]
    out = "c"
    if np.dtype(y_dt) != np.dtype(x_dt):
        nodes.append(helper.make_node("Cast", ["c"], ["y"], to=et[np.dtype(y_dt)]))
        out = "y"
    m = _model(nodes, [helper.make_tensor_value_info("x", et[np.dtype(x_dt)], x.shape)],
               [helper.make_tensor_value_info(out, et[np.dtype(y_dt)], None)],
               [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    r = [x.astype(np.float32), w.astype(np.float32), b.astype(np.float32)]
    return m, {"x": x}, r


@pytest.mark.parametrize("x_dt,y_dt", [(np.float32, BF16), (BF16, np.float32)])
@pytest.mark.parametrize("mode", ["amx-direct", "amx-im2col"])
def test_mixed_operand_dtypes(x_dt, y_dt, mode, monkeypatch):
    """X fp32 (rounded while the col buffer / X copy is built) or bf16, Y fp32 or bf16
    (rounded on store); one kernel."""
    monkeypatch.setattr(lconv, "FORCE_LOWP_MODE", mode)
    m, feeds, r = _cast_model(x_dt, y_dt, np.random.default_rng(1))
    if np.dtype(x_dt) == np.float32:
        sess = _with_precision(m, "bf16", cores=2)
    else:
        sess = cannc.compile(m, cores=2)
    got = sess.run(None, feeds)[0]
    assert got.dtype == np.dtype(y_dt)
    notes = _notes(sess)
    assert len(notes) == 1 and notes[0]["precision"] == "bf16 AMX", notes
    want = _conv_ref(r, (1, 2), pads=[1, 1, 1, 1])
    _check(got, want, 81, y_dt, _abs_ref(r, (1, 2), pads=[1, 1, 1, 1]))


def test_no_bias_and_runtime_weights():
    _run_conv(BF16, (1, 6, 8, 8), (12, 6, 3, 3), bias=False, mode="amx", pads=[1, 1, 1, 1])
    # runtime weights: the vector kernel in the AMX kernel's tile grid
    sess = _run_conv(BF16, (2, 9, 8, 10), (12, 9, 3, 3), const_w=False, mode="amx",
                     pads=[1, 1, 1, 1])
    assert "tiles/image" in _notes(sess)[0]["path"], _notes(sess)


@pytest.mark.parametrize("residual", [False, True])
def test_fused_epilogue_chosen_by_default(residual):
    """FusedConv (bias, residual add, Relu in fp32, one rounding): AMX is the default
    bf16 conv where it is usable."""
    m, feeds, want, absref, K = _epilogue_model(BF16, residual)
    sess = cannc.compile(m, cores=2)
    got = sess.run(None, feeds)[0]
    assert got.dtype == np.dtype(BF16)
    notes = _notes(sess)
    assert len(notes) == 1 and notes[0].get("epilogue"), notes
    assert notes[0]["precision"] == "bf16 AMX", notes
    _check(got, want, K, BF16, absref + 2.0 ** -8 * np.abs(want))


@pytest.mark.parametrize("case", [0, 6])
def test_fp32_graph_with_cannc_precision(case):
    xs, ws, attrs, _ = CASES[case]
    rng = np.random.default_rng(case)
    x = rng.standard_normal(xs).astype(np.float32)
    w = (rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:]))).astype(np.float32)
    bias = rng.standard_normal(ws[0]).astype(np.float32)
    from tests.helpers import single_node_model
    m, feeds = single_node_model("Conv", [x, w, bias], const_inputs=(1, 2), **attrs)
    sess = _with_precision(m, "bf16", cores=2)
    got = sess.run(None, feeds)[0]
    assert got.dtype == np.float32
    r = [x.astype(BF16).astype(np.float32), w.astype(BF16).astype(np.float32), bias]
    want = _conv_ref(r, (1, 2), **attrs)
    _check(got, want, int(np.prod(ws[1:])), np.float32, _abs_ref(r, (1, 2), **attrs))
    assert np.abs(got - _conv_ref([x, w, bias], (1, 2), **attrs)).max() > 1e-4
    assert _notes(sess)[0]["precision"] == "bf16 AMX"


# (X width, Inf column): an even column, the element past tap 6 of output column
# (col - 4) / 2: 2 (near the left edge: the bounds-masked path), 18 (the 16 output
# columns from 16 read inside the row: the unmasked path)
@pytest.mark.parametrize("width,col", [(17, 8), (70, 40)])
def test_stem_kwpairs_and_inf_past_odd_kw(width, col):
    """A 7x7 stride-2 conv on 3 channels pairs taps (kw, kw+1): 84 units, not 98. An Inf
    in X reaches exactly the outputs whose window holds it (the element past the odd
    last tap pair is masked, not multiplied by a zero weight)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 3, 15, width)).astype(BF16).astype(np.float32)
    x[0, 1, 6, col] = np.inf
    w = (rng.standard_normal((8, 3, 7, 7)) / 12).astype(BF16).astype(np.float32)
    from tests.helpers import single_node_model
    attrs = dict(strides=[2, 2], pads=[3, 3, 3, 3])
    m, feeds = single_node_model("Conv", [x, w], const_inputs=(1,), **attrs)
    lconv.FORCE_LOWP_MODE = "amx"
    try:
        sess = _with_precision(m, "bf16", cores=2)
        got = sess.run(None, feeds)[0]
    finally:
        lconv.FORCE_LOWP_MODE = None
    assert "kwpairs" in _notes(sess)[0]["path"], _notes(sess)
    want = _conv_ref([x, w], (1,), **attrs)
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    assert np.isfinite(want).sum() > want.size // 2 and not np.isfinite(want).all()
    fin = np.isfinite(want)
    absref = _abs_ref([np.where(np.isfinite(x), x, 0), w], (1,), **attrs)
    _check(got[fin], want[fin], 147, np.float32, absref[fin])


def test_cost_model_picks_direct_for_resnet_3x3():
    g = ConvGeom(N=1, C=64, M=64, G=1, isz=(1, 56, 56), osz=(1, 56, 56), k=(1, 3, 3),
                 pb=(0, 1, 1), bias=True)
    p = amx_conv.plan_amx_conv(g)
    assert p.direct and p.cb_outer and p.kchunks == 2 and p.kb == 18   # a chunk per block
    s2 = ConvGeom(N=1, C=64, M=128, G=1, isz=(1, 56, 56), osz=(1, 28, 28), k=(1, 3, 3),
                  s=(1, 2, 2), pb=(0, 1, 1), bias=True)
    assert amx_conv.plan_amx_conv(s2).direct     # stride 2: four phases of X
    s2_14 = ConvGeom(N=1, C=256, M=512, G=1, isz=(1, 14, 14), osz=(1, 7, 7), k=(1, 3, 3),
                     s=(1, 2, 2), pb=(0, 1, 1), bias=True)
    assert not amx_conv.plan_amx_conv(s2_14).direct   # 49 pixels: a small col buffer
    t16 = LowpTypes(x="float16", w="float16", b="float16", y="float16", prec="fp16")
    assert amx_conv.amx_conv_supports(g, t16)


@pytest.mark.parametrize("direct,stride,cb_outer", [(True, 1, False), (True, 1, True),
                                                     (False, 1, False), (True, 2, False),
                                                     (True, 2, True)])
@pytest.mark.parametrize("chunk", [None, 2])
def test_kernel_nan_workspace_and_k_chunks(direct, stride, cb_outer, chunk, monkeypatch):
    """The kernel alone: a NaN-filled workspace (the K padding rows must be zeroed, the
    pixel columns past the image must not leak; stride 2: the direct mode's phases),
    tiles split over two cores, and the K-chunked micro-kernel (C tiles carried through
    the scratch); the direct mode's K steps in either order (K chunks per channel block with
    (channel block, tap))."""
    if chunk:
        monkeypatch.setattr(amx_conv, "KSTEPS_L1", chunk)
    monkeypatch.setattr(amx_conv, "CB_OUTER_MIN_NCB", 1 if cb_outer else 1 << 20)
    monkeypatch.setattr(amx_conv, "CB_CHUNK_MIN_P", 0)   # (channel block, tap): chunked
    oh, ow = (9, 11) if stride == 1 else (5, 6)
    g = ConvGeom(N=2, C=37, M=40, G=1, isz=(1, 9, 11), osz=(1, oh, ow), k=(1, 3, 3),
                 s=(1, stride, stride), pb=(0, 1, 1), bias=True)
    t = LowpTypes(x="float32", w="float32", b="float32", y="float32", prec="bf16")
    p = amx_conv.plan_amx_conv(g, direct=direct)
    assert p.kb > 2 and p.direct == direct and p.cb_outer == cb_outer
    assert not direct or p.CU // 16 == 2     # two channel blocks: the K orders differ
    assert p.kchunks == (cdiv(p.kb, chunk) if chunk else 2 if cb_outer else 1)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 37, 9, 11)).astype(np.float32)
    w = (rng.standard_normal((40, 37, 3, 3)) / 18).astype(np.float32)
    bias = rng.standard_normal(40).astype(np.float32)
    m = target.new_module("amxconv_test")
    amx_conv.emit_amx_conv(m, "k", g, p, t, Slots(x=0, w=1, b=2, y=3))
    fn = target.jit_kernel(m, "k", 2)
    packed = amx_conv.pack_amx_conv_weights(g, p, w)
    bufs = [aligned(a.size) for a in (x, packed, bias)] + [aligned(2 * 40 * oh * ow)]
    for buf, a in zip(bufs, (x, packed, bias)):
        buf[:] = a.reshape(-1)
    argv = (ctypes.c_void_p * 4)(*[b.ctypes.data for b in bufs])
    run_splits(fn, argv, p.num_tiles, p.ws_bytes, ws_fill=np.nan)
    got = bufs[3].reshape(2, 40, oh, ow)
    r = [x.astype(BF16).astype(np.float32), w.astype(BF16).astype(np.float32), bias]
    attrs = dict(pads=[1, 1, 1, 1], strides=[stride, stride])
    want = _conv_ref(r, (1, 2), **attrs)
    _check(got, want, 37 * 9, np.float32, _abs_ref(r, (1, 2), **attrs))


def test_force_mode_restored():
    assert lconv.FORCE_LOWP_MODE is None
