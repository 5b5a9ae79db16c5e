"""Conv, ConvTranspose, MaxPool, AveragePool and LpPool vs onnxruntime.

Every case compiles a single-node model with cannc (2 cores, so the tile split
is exercised) and compares with onnxruntime. Weights are scaled by
1/sqrt(fan-in) so that conv sums are O(1) and rtol/atol 1e-4 is meaningful.
Kernel paths covered: direct GEMM (stride-1 "same" convs and 1x1), im2col GEMM
(strided/valid/dilated), the swapped orientation (small images, vectors along
channels), reduction blocking, runtime weights (packed per tile), depthwise and
pooling window kernels, and the fractionally strided ConvTranspose.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.codegen import conv as conv_codegen
from cannc.errors import UnsupportedOpError
from tests.helpers import assert_matches_ort, check_op, single_node_model

RNG = np.random.default_rng(2024)
TOL = dict(rtol=1e-4, atol=1e-4)


def rnd(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def conv_inputs(xs, ws, bias=True, transpose=False, group=1):
    x = rnd(*xs)
    fan_in = int(np.prod(ws[1:])) if not transpose else int(ws[0] // group * np.prod(ws[2:]))
    w = rnd(*ws, scale=1.0 / np.sqrt(fan_in))
    m = ws[1] * group if transpose else ws[0]
    return [x, w, rnd(m)] if bias else [x, w]


# ---------------------------------------------------------------------------
# Conv
# ---------------------------------------------------------------------------

# (x shape, w shape, attrs)
CONV_CASES = [
    # kernel sizes x strides (odd spatial sizes, channels not multiples of 16)
    ((1, 3, 7, 9), (5, 3, 1, 1), {}),
    ((1, 17, 11, 13), (19, 17, 1, 1), dict(strides=[2, 2])),
    ((3, 16, 9, 7), (20, 16, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((1, 10, 15, 13), (12, 10, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    ((1, 17, 11, 13), (19, 17, 5, 5), dict(pads=[2, 2, 2, 2])),
    ((1, 7, 12, 11), (9, 7, 5, 5), dict(pads=[2, 1, 0, 2], strides=[2, 2])),
    ((1, 3, 23, 21), (8, 3, 7, 7), dict(pads=[3, 3, 3, 3], strides=[2, 2])),
    ((2, 5, 13, 12), (6, 5, 7, 7), dict(pads=[3, 3, 3, 3])),
    # dilation, asymmetric / no padding, non-square kernels and strides
    ((3, 8, 12, 12), (6, 8, 3, 3), dict(dilations=[2, 2], pads=[2, 2, 2, 2])),
    ((1, 8, 14, 11), (6, 8, 3, 3), dict(dilations=[2, 1], pads=[0, 1, 2, 0])),
    ((1, 6, 10, 9), (7, 6, 3, 3), dict(pads=[0, 2, 1, 0])),
    ((1, 6, 10, 9), (7, 6, 2, 3), dict(strides=[1, 3])),
    ((1, 6, 10, 9), (7, 6, 3, 1), dict(strides=[3, 1], pads=[1, 0, 1, 0])),
    # auto_pad
    ((1, 8, 12, 11), (6, 8, 3, 3), dict(auto_pad="SAME_UPPER")),
    ((1, 8, 12, 11), (6, 8, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    ((1, 8, 12, 11), (6, 8, 4, 4), dict(auto_pad="SAME_LOWER", strides=[2, 2])),
    ((1, 8, 12, 11), (6, 8, 2, 2), dict(auto_pad="SAME_LOWER")),
    ((1, 8, 12, 11), (6, 8, 3, 3), dict(auto_pad="VALID", strides=[3, 2])),
    ((1, 8, 12, 11), (6, 8, 3, 3), dict(auto_pad="NOTSET", pads=[1, 0, 0, 1])),
    # groups
    ((1, 8, 12, 10), (6, 4, 3, 3), dict(group=2, pads=[1, 1, 1, 1])),
    ((2, 12, 9, 10), (9, 4, 3, 3), dict(group=3, strides=[2, 2])),
    ((1, 64, 10, 10), (64, 2, 3, 3), dict(group=32, pads=[1, 1, 1, 1])),
    # depthwise (multiplier 1 and 2), strides, dilations, large kernels, wide rows
    ((1, 32, 14, 14), (32, 1, 3, 3), dict(group=32, pads=[1, 1, 1, 1])),
    ((2, 16, 15, 17), (16, 1, 3, 3), dict(group=16, pads=[1, 1, 1, 1], strides=[2, 2])),
    ((1, 8, 15, 17), (16, 1, 5, 5), dict(group=8, pads=[2, 2, 2, 2])),
    ((1, 8, 30, 40), (8, 1, 3, 3), dict(group=8, pads=[0, 1, 2, 1], strides=[3, 3],
                                        dilations=[2, 1])),
    ((1, 5, 9, 300), (5, 1, 3, 3), dict(group=5, pads=[1, 1, 1, 1])),
    ((3, 7, 7, 9), (7, 1, 7, 7), dict(group=7, auto_pad="SAME_UPPER")),
    # depthwise over padded row copies (pool.PaddedRows): small images, 5x5 stride 2
    ((1, 6, 14, 14), (6, 1, 5, 5), dict(group=6, pads=[2, 2, 2, 2])),
    ((2, 4, 21, 23), (8, 1, 5, 5), dict(group=4, pads=[2, 1, 2, 3], strides=[2, 2])),
    ((1, 3, 13, 13), (3, 1, 3, 3), dict(group=3, pads=[2, 2, 2, 2], dilations=[2, 2])),
    ((1, 2, 30, 27), (2, 1, 5, 5), dict(group=2, pads=[1, 2, 3, 0], strides=[1, 2],
                                        dilations=[1, 2])),
    # stride-2 windows read by input row and column phase (pool.s2_rows): 5x5 and 3x3,
    # rows wider than one chunk of vectors (a runtime column offset; the phase vectors
    # left of it are real columns), dilation, a multiplier and odd widths
    ((1, 3, 9, 300), (3, 1, 5, 5), dict(group=3, pads=[2, 2, 2, 2], strides=[2, 2])),
    ((1, 2, 7, 290), (2, 1, 3, 3), dict(group=2, pads=[1, 1, 1, 1], strides=[1, 2])),
    ((1, 4, 17, 35), (8, 1, 3, 3), dict(group=4, pads=[2, 3, 1, 0], strides=[2, 2],
                                        dilations=[1, 2])),
    ((2, 5, 23, 45), (5, 1, 5, 5), dict(group=5, pads=[2, 1, 0, 2], strides=[2, 2])),
    # ... one vector a row more than half used (AVX-512: pool.S2_MIN_COLS), 5x5 and 7x7
    ((1, 6, 28, 28), (6, 1, 5, 5), dict(group=6, pads=[2, 2, 2, 2], strides=[2, 2])),
    ((1, 3, 31, 29), (3, 1, 7, 7), dict(group=3, pads=[3, 3, 3, 3], strides=[2, 2])),
    # depthwise on small planes, computed flat (pool.FlatPlane): 7x7 with 3x3 / 5x5 / 7x7
    # windows, multiplier 2 with dilation and asymmetric pads, taps wholly outside a 2x2
    # plane, 8 vectors of pixels (11x11)
    ((2, 24, 7, 7), (24, 1, 3, 3), dict(group=24, pads=[1, 1, 1, 1])),
    ((1, 16, 7, 7), (16, 1, 5, 5), dict(group=16, pads=[2, 2, 2, 2])),
    ((1, 8, 7, 7), (8, 1, 7, 7), dict(group=8, pads=[3, 3, 3, 3])),
    ((1, 6, 5, 6), (12, 1, 3, 3), dict(group=6, pads=[0, 1, 2, 1], dilations=[2, 1])),
    ((1, 4, 2, 2), (4, 1, 3, 3), dict(group=4, pads=[1, 1, 1, 1])),
    ((1, 4, 11, 11), (4, 1, 5, 5), dict(group=4, pads=[2, 2, 2, 2])),
    # ResNet / MobileNet-like: direct GEMM, K blocks, the swapped orientation
    ((1, 64, 28, 28), (32, 64, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((1, 96, 14, 14), (64, 96, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((1, 64, 7, 7), (48, 64, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((1, 600, 7, 7), (40, 600, 1, 1), {}),
    ((2, 24, 28, 28), (40, 24, 1, 1), {}),
    ((1, 40, 28, 28), (48, 40, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    ((1, 8, 200, 150), (3, 8, 3, 3), dict(pads=[1, 1, 1, 1])),
    # 1-D and 3-D
    ((2, 5, 20), (7, 5, 3), dict(pads=[1, 1])),
    ((1, 6, 31), (4, 6, 5), dict(strides=[2], dilations=[2])),
    ((1, 4, 5, 6, 7), (6, 4, 3, 3, 3), dict(pads=[1, 1, 1, 1, 1, 1])),
    ((1, 4, 6, 7, 8), (5, 4, 2, 3, 3), dict(strides=[2, 1, 2], pads=[0, 1, 1, 1, 0, 1])),
    ((1, 4, 5, 6, 7), (4, 1, 3, 3, 3), dict(group=4, pads=[1, 1, 1, 1, 1, 1])),
    ((2, 4, 5, 6, 7), (6, 4, 1, 3, 3), dict(pads=[0, 1, 1, 0, 1, 1])),      # direct, 3-D
    ((1, 4, 5, 6, 7), (6, 4, 3, 1, 1), dict(pads=[1, 0, 0, 1, 0, 0])),      # direct, depth taps
    ((1, 4, 5, 6, 7), (6, 4, 2, 1, 1), dict(dilations=[2, 1, 1])),          # direct, OD < D
]


def _case_id(c):
    xs, ws, at = c
    a = ",".join(f"{k}={v}" for k, v in at.items())
    return f"x{'x'.join(map(str, xs))}-w{'x'.join(map(str, ws))}-{a}"


@pytest.mark.parametrize("xs,ws,attrs", CONV_CASES, ids=[_case_id(c) for c in CONV_CASES])
def test_conv(xs, ws, attrs):
    check_op("Conv", conv_inputs(xs, ws), const_inputs=(1, 2), **TOL, **attrs)


@pytest.mark.parametrize("xs,ws,attrs", [
    ((1, 3, 7, 9), (5, 3, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((2, 8, 12, 11), (6, 8, 3, 3), dict(strides=[2, 2])),
    ((1, 16, 10, 9), (16, 1, 3, 3), dict(group=16, pads=[1, 1, 1, 1])),
])
def test_conv_no_bias(xs, ws, attrs):
    check_op("Conv", conv_inputs(xs, ws, bias=False), const_inputs=(1,), **TOL, **attrs)


@pytest.mark.parametrize("xs,ws,attrs", [
    ((2, 8, 9, 11), (10, 8, 3, 3), dict(pads=[1, 1, 1, 1])),          # direct
    ((1, 12, 13, 11), (8, 6, 3, 3), dict(group=2, strides=[2, 2])),   # im2col, groups
    ((1, 300, 7, 7), (40, 300, 3, 3), dict(pads=[1, 1, 1, 1])),       # swapped, K blocks
    ((1, 6, 9, 10), (6, 1, 3, 3), dict(group=6, pads=[1, 0, 1, 2])),  # depthwise
])
def test_conv_runtime_weights(xs, ws, attrs):
    """Weights (and bias) as graph inputs: packed per tile at run time."""
    check_op("Conv", conv_inputs(xs, ws), const_inputs=(), **TOL, **attrs)


@pytest.mark.parametrize("opset", [7, 11, 22])
def test_conv_opsets_and_kernel_shape_attr(opset):
    x, w, b = conv_inputs((1, 6, 10, 9), (7, 6, 3, 3))
    check_op("Conv", [x, w, b], const_inputs=(1, 2), opset=opset, kernel_shape=[3, 3],
             pads=[1, 1, 1, 1], **TOL)


# the same convolution through every GEMM variant (forced plans)
FORCED = [
    dict(swap=False, direct=True),
    dict(swap=False, direct=False),
    dict(swap=True),
    dict(swap=False, direct=True, KC=40),
    dict(swap=False, direct=False, KC=40, P=32),
    dict(swap=True, KC=40, MR=5),
    dict(swap=False, direct=False, MR=3, NV=1),
    dict(swap=True, MR=6, NV=4),             # the 6 x 64 tile (WIDE_TILE_EFF): 35 of 64 lanes
    dict(swap=True, MR=5, NV=4, KC=40),
    dict(swap=False, direct=True, rows_outer=True),     # micro-tiles walked row by row
    dict(swap=False, direct=False, KC=40, P=32, rows_outer=True),
]


@pytest.mark.parametrize("tuning", FORCED, ids=[",".join(f"{k}={v}" for k, v in t.items())
                                                for t in FORCED])
@pytest.mark.parametrize("const", [True, False], ids=["const-w", "runtime-w"])
def test_conv_forced_plans(monkeypatch, tuning, const):
    monkeypatch.setattr(conv_codegen, "FORCE_TUNING", tuning)
    inputs = conv_inputs((2, 20, 9, 13), (35, 20, 3, 3))
    check_op("Conv", inputs, const_inputs=(1, 2) if const else (), pads=[1, 2, 1, 0], **TOL)


# 1x1 convs in the swapped orientation: X itself as the col matrix (conv.swap_reads_x;
# where the micro-tile rows do not divide the planes, 49 pixels in rows of 5, 6 or 8, the
# last tile of a plane reads its last pixel for the rows past it), or an im2col copy; K
# blocks, NV = 1, the 6 x 64 tile
POINTWISE_SWAPPED = [
    (dict(swap=True, MR=7), True),
    (dict(swap=True, MR=7, NV=1, KC=8), True),
    (dict(swap=True, MR=7, direct=False), False),
    (dict(swap=True, MR=5), True),
    (dict(swap=True, MR=6, NV=4), True),
    (dict(swap=True, MR=8, NV=1, KC=8, P=16), True),
]


@pytest.mark.parametrize("tuning,reads_x", POINTWISE_SWAPPED,
                         ids=[",".join(f"{k}={v}" for k, v in t.items())
                              for t, _ in POINTWISE_SWAPPED])
@pytest.mark.parametrize("const", [True, False], ids=["const-w", "runtime-w"])
def test_pointwise_swapped_reads_x(monkeypatch, tuning, reads_x, const):
    g = conv_codegen.ConvGeom(N=2, C=40, M=48, G=2, isz=(1, 7, 7), osz=(1, 7, 7),
                              k=(1, 1, 1))
    p = conv_codegen.plan_conv(g, tuning=tuning)
    assert p.swap and p.direct == reads_x and (p.ws_col == p.ws_a or not reads_x)
    monkeypatch.setattr(conv_codegen, "FORCE_TUNING", tuning)
    inputs = conv_inputs((2, 40, 7, 7), (48, 20, 1, 1))
    check_op("Conv", inputs, const_inputs=(1, 2) if const else (), group=2, **TOL)


# the swapped orientation reading a KxK conv's taps from X (conv.swap_reads_x,
# _ConvGen.swap_taps): micro-tiles of MR pixels of one output row, taps whose input row
# lies in the padding skipped, columns in it read as zeros (left, right, both)
SWAP_TAPS = [
    ((2, 32, 16, 16), (32, 16, 3, 3), dict(group=2, strides=[2, 2], pads=[1, 1, 1, 1]),
     dict(swap=True, MR=8)),
    ((1, 16, 13, 15), (16, 16, 3, 3), dict(strides=[2, 2], pads=[0, 2, 1, 1]),
     dict(swap=True, MR=4)),
    ((1, 32, 7, 7), (32, 16, 3, 3), dict(group=2, pads=[2, 2, 2, 2], dilations=[2, 2]),
     dict(swap=True, MR=7)),
    ((1, 64, 10, 10), (32, 64, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1]),
     dict(swap=True, MR=5)),                     # K = 576: three reduction blocks, NV 2
    ((1, 16, 12, 12), (16, 16, 2, 2), dict(strides=[2, 2]), dict(swap=True, MR=6)),
    ((1, 16, 9, 14), (16, 16, 3, 3), dict(strides=[1, 2], pads=[1, 1, 1, 1]),
     dict(swap=True, MR=7)),
    ((1, 64, 112, 112), (64, 16, 3, 3), dict(group=4, strides=[2, 2], pads=[1, 1, 1, 1]),
     {}),                                        # RegNet's: the planner's own choice
]


@pytest.mark.parametrize("xs,ws,attrs,tuning", SWAP_TAPS,
                         ids=[_case_id(c[:3]) + "-" + ",".join(f"{k}={v}" for k, v in c[3].items())
                              for c in SWAP_TAPS])
@pytest.mark.parametrize("const", [True, False], ids=["const-w", "runtime-w"])
def test_swapped_taps_read_x(monkeypatch, xs, ws, attrs, tuning, const):
    inputs = conv_inputs(xs, ws)
    m, _ = single_node_model("Conv", inputs, const_inputs=(1, 2), **attrs)
    monkeypatch.setattr(conv_codegen, "FORCE_TUNING", tuning)
    path = cannc.compile(m, cores=2).inspect()["kernels"][0]["tiling"]
    assert path.startswith("direct-gemm-swapped"), path
    check_op("Conv", inputs, const_inputs=(1, 2) if const else (), **TOL, **attrs)


def test_conv_plan_orientation():
    """Small images use the swapped orientation; big ones read X in place."""
    g = conv_codegen.ConvGeom(N=1, C=256, M=256, G=1, isz=(1, 14, 14), osz=(1, 14, 14),
                              k=(1, 3, 3), pb=(0, 1, 1))
    assert conv_codegen.plan_conv(g).swap
    g = conv_codegen.ConvGeom(N=1, C=64, M=64, G=1, isz=(1, 56, 56), osz=(1, 56, 56),
                              k=(1, 3, 3), pb=(0, 1, 1))
    p = conv_codegen.plan_conv(g)
    assert p.direct and not p.swap and p.num_tiles >= 2


def test_pointwise_far_planes_take_short_reductions():
    """A 1x1 conv reading X in place over planes of FAR_PLANES_BYTES or more, with more
    than 2 * FAR_PLANES_KC input channels, reduces in blocks of FAR_PLANES_KC channels;
    14x14 planes and reductions of 128 keep whole blocks; a forced KC wins. The blocked
    sums (a last short block) match onnxruntime."""
    cc = conv_codegen

    def plan(C, M, H, **tun):
        g = cc.ConvGeom(N=1, C=C, M=M, G=1, isz=(1, H, H), osz=(1, H, H), k=(1, 1, 1))
        return cc.plan_conv(g, tuning=tun)

    assert 4 * 28 * 28 >= cc.FAR_PLANES_BYTES > 4 * 14 * 14
    # (64 output channels and more pack their pixel panels unless told to read X)
    for C, M, H in [(256, 64, 56), (512, 128, 28), (160, 24, 28), (256, 32, 27)]:
        p = plan(C, M, H, **({"direct": True} if M >= cc.PANELS_MIN_M else {}))
        assert p.direct and p.KC <= cc.FAR_PLANES_KC and p.nkb == -(-C // p.KC), (C, M, H, p)
    assert plan(1024, 512, 14).KC > cc.FAR_PLANES_KC
    assert plan(128, 512, 28).nkb == 1
    assert plan(256, 64, 56, KC=256).nkb == 1
    x = rnd(1, 160, 28, 28)
    w = rnd(24, 160, 1, 1, scale=160 ** -0.5)
    check_op("Conv", [x, w, rnd(24)], const_inputs=(1, 2), **TOL)


def test_two_cores_keep_to_their_own_lines_of_y():
    """A tile split that gives two cores a part of every 14x14 channel plane (784
    bytes: planes and 102-pixel blocks are not whole cache lines) has them write 2 shared
    lines a plane (shared_lines); channel blocks of whole planes share none but have
    both cores read X (split_reads). 96->576 at 14x14 (2 tiles of 102 pixels had been
    picked: 0.114 ms on 2 Sapphire Rapids cores, 0.084 with a channel half per core)
    takes whole planes; 384->64 (X 5x as big as Y) keeps pixel blocks. One core shares
    nothing. The channel halves match onnxruntime."""
    cc = conv_codegen

    def geom(C, M, H):
        return cc.ConvGeom(N=1, C=C, M=M, G=1, isz=(1, H, H), osz=(1, H, H), k=(1, 1, 1))

    g = geom(96, 576, 14)
    assert cc.shared_lines(g, 2, 102, 1, 2) == 2 * 576
    assert cc.shared_lines(g, 2, 102, 1, 1) == 0
    assert cc.shared_lines(g, 1, 198, 2, 2) == 0
    assert cc.shared_lines(geom(96, 576, 28), 2, 400, 1, 2) == 0   # 3136-byte planes
    assert cc.shared_lines(geom(96, 576, 28), 2, 398, 1, 2) == 576
    assert cc.split_reads(g, 1, 198, 2, 2) == 96 * 196 * 4
    assert cc.split_reads(g, 2, 102, 1, 2) == 0
    assert cc.split_reads(g, 2, 102, 2, 2) == 0                    # tiles 0-1 | 2-3
    p = cc.plan_conv(g)
    # (AVX2 keeps the normal orientation here: SWAP_OUT_COST_AVX2)
    assert p.swap == cc.wide_registers() and cc.shared_lines(g, p.PB, p.P, p.MB, 2) == 0, p
    g = geom(384, 64, 14)
    p = cc.plan_conv(g)
    assert cc.split_reads(g, p.PB, p.P, p.MB, 2) == 0, p
    x = rnd(1, 96, 14, 14)
    w = rnd(576, 96, 1, 1, scale=96 ** -0.5)
    check_op("Conv", [x, w, rnd(576)], const_inputs=(1, 2), **TOL)


def test_wide_tiles_on_big_planes_walk_channel_rows(monkeypatch):
    """A normal-orientation tile of at least ROWS_OUTER_MIN_CH channels, with one block
    of at most ROWS_OUTER_MAX_KC reduction rows, over planes of ROWS_OUTER_MIN_PIXELS
    or more walks its micro-tiles MR channels at a time (fewer store streams); more
    reduction rows, fewer channels or smaller planes walk pixel columns. Row-walked
    1x1 convs match onnxruntime: ragged channels and pixels, an im2col stride-2 one,
    runtime weights, and a fused Add + Relu."""
    cc = conv_codegen

    def plan(C, M, H, s=1):
        OH = (H - 1) // s + 1
        return cc.plan_conv(cc.ConvGeom(N=1, C=C, M=M, G=1, isz=(1, H, H),
                                        osz=(1, OH, OH), k=(1, 1, 1), s=(1, s, s)))

    for C, M, H, s in [(64, 256, 56, 1), (16, 96, 112, 1), (24, 144, 56, 1),
                       (32, 64, 112, 1), (32, 64, 112, 2)]:
        p = plan(C, M, H, s)
        assert not p.swap and p.rows_outer, (C, M, H, s, p)
    for C, M, H in [(256, 64, 56), (96, 576, 28), (144, 144, 28), (64, 48, 56)]:
        assert not plan(C, M, H).rows_outer, (C, M, H)
    monkeypatch.setattr(cc, "FORCE_TUNING", {"swap": False, "rows_outer": True})
    x = rnd(1, 24, 50, 50)
    w = rnd(100, 24, 1, 1, scale=24 ** -0.5)
    for const in ((1, 2), ()):
        check_op("Conv", [x, w, rnd(100)], const_inputs=const, **TOL)
    check_op("Conv", [x, w, rnd(100)], const_inputs=(1, 2), strides=[2, 2], **TOL)
    r = rnd(1, 100, 50, 50)
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"]),
         helper.make_node("Add", ["c", "r"], ["a"]), helper.make_node("Relu", ["a"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
              helper.make_tensor_value_info("r", TensorProto.FLOAT, r.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(rnd(100), "b")]),
        opset_imports=[helper.make_opsetid("", 17)])
    assert_matches_ort(m, {"x": x, "r": r}, **TOL)


def test_two_fma_pipes_weigh_micro_tile_loads(monkeypatch):
    """With two FMA pipes an MR x 16 micro-tile is load-bound (MR + 1 loads for MR FMAs)
    and the overheads cost twice the flops: 1x1 convs at 28x28 take the normal
    orientation, those at 14x14 stay swapped with 32-channel panels (NV = 1 had been
    picked for 512->128, 576->96 and 384->64; measured 12-36% slower on Sapphire
    Rapids). One pipe (Zen 4) keeps the plans measured there."""
    monkeypatch.setattr(conv_codegen, "wide_registers", lambda: True)

    def plan(c, m, hw, pipes):
        monkeypatch.setattr(conv_codegen, "fma_pipes", lambda: pipes)
        g = conv_codegen.ConvGeom(N=1, C=c, M=m, G=1, isz=(1, hw, hw), osz=(1, hw, hw),
                                  k=(1, 1, 1))
        return conv_codegen._plan_conv(g, True, 2, {})   # (not the plan cache)
    assert conv_codegen.load_balance(8, 1, 2) < 0.9 < conv_codegen.load_balance(8, 2, 2) == 1
    assert conv_codegen.load_balance(8, 1, 1) == 1
    for c, m, hw in ((512, 128, 28), (128, 512, 28), (128, 128, 28), (576, 96, 14),
                     (384, 64, 14), (1024, 256, 14)):
        assert plan(c, m, hw, 2).NV >= 2, (c, m, hw)
    for c, m in ((128, 512), (128, 128)):
        assert not plan(c, m, 28, 2).swap, (c, m)
    assert plan(512, 128, 28, 1).swap


def test_two_fma_pipes_take_6x64_tiles(monkeypatch):
    """With two FMA pipes the swapped orientation takes 6 x 64 micro-tiles, over an
    im2col copy (strided convs) or reading X itself (pointwise ones, 196 pixels: the
    last tile of a plane short); one-pipe cores keep MR x 32."""
    monkeypatch.setattr(conv_codegen, "wide_registers", lambda: True)

    def plan(c, m, hw, k, s, pipes):
        monkeypatch.setattr(conv_codegen, "fma_pipes", lambda: pipes)
        o = (hw + 2 * (k // 2) - k) // s + 1
        g = conv_codegen.ConvGeom(N=1, C=c, M=m, G=1, isz=(1, hw, hw), osz=(1, o, o),
                                  k=(1, k, k), s=(1, s, s), pb=(0, k // 2, k // 2))
        return conv_codegen._plan_conv(g, True, 2, {})   # (not the plan cache)
    for c, m, hw, k in ((128, 128, 56, 3), (256, 256, 28, 3), (512, 1024, 28, 1)):
        p = plan(c, m, hw, k, 2, 2)
        assert p.swap and not p.direct and (p.MR, p.NV) == (6, 4), (c, hw, k, p)
        p = plan(c, m, hw, k, 2, 1)
        assert p.NV <= 2, (c, hw, k, p)
    for c, m in ((1024, 256), (256, 1024)):
        p = plan(c, m, 14, 1, 1, 2)
        assert p.swap and p.direct and (p.MR, p.NV) == (6, 4), (c, m, p)
        assert plan(c, m, 14, 1, 1, 1).NV <= 2


def test_swapped_conv_prefetches_the_next_weight_panel_and_x(monkeypatch):
    """The swapped orientation reading X (a 1x1 conv) prefetches into L2 (locality 2), in
    its micro-kernel's k steps, X's planes SWAP_X_PREFETCH pixels on and, with constant
    weights, the next weight panel; weights packed per tile are not streamed. Without
    the X stream only constant weights prefetch."""
    from cannc.native.target import new_module
    g = conv_codegen.ConvGeom(N=1, C=320, M=320, G=1, isz=(1, 14, 14), osz=(1, 14, 14),
                              k=(1, 1, 1))
    plan = conv_codegen.plan_conv(g)
    assert plan.swap and plan.direct

    def l2_reads(prepacked):
        module = new_module("prefetch_test")
        conv_codegen.emit_conv(module, "k", g, plan, a_prepacked=prepacked)
        return sum(1 for ln in str(module).splitlines()
                   if '@"llvm.prefetch.p0"' in ln and ln.endswith("i32 0, i32 2, i32 1)"))

    assert conv_codegen.SWAP_X_PREFETCH > 0
    x_only = l2_reads(False)
    assert x_only > 0 and l2_reads(True) == 2 * x_only
    monkeypatch.setattr(conv_codegen, "SWAP_X_PREFETCH", 0)
    assert l2_reads(False) == 0 and l2_reads(True) == x_only


def test_small_1x1_convs_over_aliasing_planes_take_im2col(monkeypatch):
    """A 1x1 conv reading <= 24 channel planes that share a few L1 sets (112x112 and 56x56
    fp32 planes with 64 sets of 64-byte lines) copies them (im2col); wider reductions and
    planes that spread over the sets read X in place."""
    from cannc.schedule import machine
    monkeypatch.setattr(conv_codegen, "l1d_sets", lambda: (64, 64))

    def plan(c, m, hw, tuning=None):     # (not the on-disk plan cache: sets are patched)
        g = conv_codegen.ConvGeom(N=1, C=c, M=m, G=1, isz=(1, hw, hw), osz=(1, hw, hw),
                                  k=(1, 1, 1))
        return conv_codegen._plan_conv(g, True, 2, tuning or {})
    assert conv_codegen.planes_alias_in_l1(112 * 112 * 4)      # 4 of 64 sets
    assert conv_codegen.planes_alias_in_l1(56 * 56 * 4)        # 16 of 64
    assert not conv_codegen.planes_alias_in_l1(28 * 28 * 4)    # all 64
    assert not conv_codegen.planes_alias_in_l1(14 * 14 * 4)    # not whole lines
    assert not plan(16, 96, 112).direct and not plan(24, 144, 56).direct
    assert plan(32, 16, 112).direct and plan(144, 24, 56).direct
    # (64 output channels and more pack their pixel panels: ConvPlan.panels)
    assert plan(32, 64, 112).panels and plan(32, 192, 28).panels
    assert plan(16, 96, 112, {"direct": True}).direct          # an explicit choice stands
    assert machine.l1d_sets()[0] > 0


# pointwise convs in the normal orientation over packed pixel panels (ConvPlan.panels):
# ragged pixel counts (63 a plane, panels of 32 or 64), several K blocks (the last one
# short), pixel blocks shorter than a panel, rows walked outer, groups, a batch
PANELS = [
    ((2, 40, 7, 9), (70, 40, 1, 1), {}, {}),
    ((2, 40, 7, 9), (70, 40, 1, 1), {}, dict(KC=16)),
    ((1, 40, 7, 9), (70, 40, 1, 1), {}, dict(P=32, MR=8, NV=2)),
    ((1, 40, 7, 9), (70, 40, 1, 1), {}, dict(MR=6, NV=4, KC=24, rows_outer=True)),
    ((2, 40, 7, 9), (70, 20, 1, 1), dict(group=2), dict(MR=5, NV=1)),
]


@pytest.mark.parametrize("xs,ws,attrs,tuning", PANELS,
                         ids=[_case_id(c[:3]) + "-" + ",".join(f"{k}={v}" for k, v in c[3].items())
                              for c in PANELS])
@pytest.mark.parametrize("const", [True, False], ids=["const-w", "runtime-w"])
def test_pointwise_packed_panels(monkeypatch, xs, ws, attrs, tuning, const):
    monkeypatch.setattr(conv_codegen, "FORCE_TUNING", {"swap": False, "direct": False, **tuning})
    inputs = conv_inputs(xs, ws)
    m, _ = single_node_model("Conv", inputs, const_inputs=(1, 2), **attrs)
    path = cannc.compile(m, cores=2).inspect()["kernels"][0]["tiling"]
    assert path.startswith("panels-gemm"), path
    check_op("Conv", inputs, const_inputs=(1, 2) if const else (), **TOL, **attrs)


def test_pointwise_convs_of_many_channels_pack_panels(monkeypatch):
    """The planner packs pixel panels for a pointwise conv it would run in the normal
    orientation reading X where PANELS_MIN_M output channels or more share them, in the
    6 x 64 tile with two FMA pipes; fewer channels read X; an explicit choice stands;
    the swapped orientation (small planes) is left alone."""
    monkeypatch.setattr(conv_codegen, "wide_registers", lambda: True)
    cc = conv_codegen

    def plan(c, m, hw, pipes=2, **tun):
        monkeypatch.setattr(cc, "fma_pipes", lambda: pipes)
        g = cc.ConvGeom(N=1, C=c, M=m, G=1, isz=(1, hw, hw), osz=(1, hw, hw), k=(1, 1, 1))
        return cc._plan_conv(g, True, 2, tun)   # (not the plan cache)
    for c, m, hw in ((64, 256, 56), (256, 128, 56), (128, 512, 28), (144, 320, 28)):
        p = plan(c, m, hw)
        assert p.panels and not p.direct and not p.swap and (p.MR, p.NV) == (6, 4), p
        assert p.ws_col == 0 and p.ws_a >= p.KC * (-(-p.P // p.NR) * p.NR) * 4
        q = plan(c, m, hw, pipes=1)      # (one pipe: no 6 x 64 tile)
        assert q.swap or (q.panels and q.NV <= 2), q
    for c, m, hw in ((96, 24, 56), (144, 24, 56), (192, 32, 28)):
        assert plan(c, m, hw).direct and not plan(c, m, hw).panels
    assert plan(64, 256, 56, direct=True).direct
    assert plan(256, 1024, 14).swap and not plan(256, 1024, 14).panels


def test_window_plans_pad_rows_where_masks_cost_most():
    """Small images (steps mostly in the padding) and rows of 5+ taps are copied padded,
    in L1-sized row blocks; 3x3 windows over big images read X in place; stride-2
    windows read X by column phase (s2_rows), except 5x5 ones one vector wide."""
    from cannc.codegen import pool

    def plan(hw, k, s, c=64):
        o = (hw + 2 * (k // 2) - k) // s + 1
        return pool.plan_window(pool.WindowSpec(kind="dw", N=1, C=c, M=c, isz=(1, hw, hw),
                                                osz=(1, o, o), k=(1, k, k), s=(1, s, s),
                                                pb=(0, k // 2, k // 2)))
    # (AVX2 steps one padded row at a time over rows narrower than a vector)
    assert plan(14, 5, 1).padded and plan(14, 3, 1).padded
    assert pool.wide_registers() or plan(14, 3, 1).R == 1
    assert plan(28, 7, 1).padded and plan(56, 5, 1).padded
    assert not plan(56, 3, 1).padded and not plan(56, 3, 1).s2
    assert not plan(7, 5, 1).padded                 # one step per plane
    big = plan(300, 5, 1, c=2)
    assert big.padded and 0 < big.ws_bytes <= pool.PAD_BYTES and big.nrb > 1
    for hw, k in ((56, 5), (56, 3), (28, 3), (14, 3), (300, 5)):
        p = plan(hw, k, 2)
        # (AVX2 steps one vector a row, its taps by phase within lanes: see
        # test_stride2_taps_within_lanes_avx2)
        assert p.s2 and not p.padded and p.ws_bytes == 0, (hw, k)
    assert not plan(14, 5, 2).s2                    # 7 columns, 25 taps: per tap
    # 14 and 16 columns (of a vector's 16): by phase with AVX-512, padded with AVX2
    for hw, k in ((28, 5), (32, 7)):
        assert plan(hw, k, 2).s2 == pool.wide_registers(), (hw, k)
    assert not pool.plan_window(pool.WindowSpec(
        kind="dw", N=1, C=4, M=4, isz=(1, 28, 28), osz=(1, 14, 14), k=(1, 3, 3),
        s=(1, 2, 2), pb=(0, 1, 1), dts=("float16",) * 4)).s2


def test_window_plans_flat_small_planes():
    """Depthwise convs of stride 1 on planes of at most 8 vectors of pixels with rows
    narrower than a vector run flat (one masked load a tap and vector of 16 pixels); wider
    planes, strides, pools and widths that change do not."""
    from cannc.codegen import pool

    def plan(hw, k, s=1, kind="dw", w=None, pw=None):
        w = hw if w is None else w
        pw = k // 2 if pw is None else pw
        oh, ow = (hw + 2 * (k // 2) - k) // s + 1, (w + 2 * pw - k) // s + 1
        return pool.plan_window(pool.WindowSpec(kind=kind, N=1, C=8, M=8, isz=(1, hw, w),
                                                osz=(1, oh, ow), k=(1, k, k), s=(1, s, s),
                                                pb=(0, k // 2, pw)))
    for hw, k in ((7, 3), (7, 5), (7, 7), (4, 3), (11, 5)):
        p = plan(hw, k)
        assert p.flat is not None and p.V == -(-hw * hw // 16) and p.num_tiles == 8
        assert p.ws_bytes == 0
    from cannc.codegen.vec import wide_registers
    # 9 and 13 vectors: by rows with AVX-512; flat with AVX2 up to 3x3 taps
    assert (plan(12, 3).flat is None) == wide_registers()
    assert (plan(14, 3).flat is None) == wide_registers()
    assert plan(14, 5).flat is None and plan(15, 3).flat is None      # 5x5; 15 vectors
    assert plan(7, 3, s=2).flat is None and plan(7, 3, kind="max").flat is None
    assert plan(7, 3, pw=0).flat is None            # OW = 5 != W
    assert plan(4, 3, w=20).flat is None            # rows of a vector or more
    # the masks: lanes inside the plane whose tap lies inside the input
    spec = pool.WindowSpec(kind="dw", N=1, C=1, M=1, isz=(1, 7, 7), osz=(1, 7, 7),
                           k=(1, 3, 3), pb=(0, 1, 1))
    m = pool.FlatPlane.tap_mask(spec, 0, 0, 0)      # up-left tap: row 0 and column 0 out
    assert m == [0] * 8 + [0 if i % 7 == 0 else 1 for i in range(8, 16)]
    assert sum(pool.FlatPlane.tap_mask(spec, 1, 1, 3)) == 1    # pixel 48 only


def test_l1d_sets_from_sysfs(tmp_path):
    from cannc.schedule import machine
    for i, (level, kind, sets) in enumerate([(1, "Instruction", 32), (1, "Data", 64),
                                             (2, "Unified", 2048)]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        for name, val in (("level", level), ("type", kind), ("number_of_sets", sets),
                          ("coherency_line_size", 64)):
            (d / name).write_text(f"{val}\n")
    assert machine.l1d_sets.__wrapped__(str(tmp_path)) == (64, 64)
    assert machine.l1d_sets.__wrapped__(str(tmp_path / "missing")) == (64, 64)


def test_conv_unsupported_dtype():
    x = rnd(1, 2, 5, 5).astype(np.float64)
    w = rnd(3, 2, 3, 3).astype(np.float64)
    m, feeds = single_node_model("Conv", [x, w], const_inputs=(1,))
    with pytest.raises(UnsupportedOpError, match="float64"):
        cannc.compile(m, shapes={k: v.shape for k, v in feeds.items()})


# ---------------------------------------------------------------------------
# ConvTranspose
# ---------------------------------------------------------------------------

CT_CASES = [
    ((1, 4, 5, 6), (4, 3, 3, 3), {}),
    ((1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2])),
    ((2, 6, 5, 6), (6, 5, 4, 4), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], output_padding=[1, 1])),
    ((1, 4, 5, 6), (4, 2, 3, 3), dict(strides=[2, 2], group=2, pads=[1, 0, 1, 2])),
    ((1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    ((1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], auto_pad="SAME_LOWER")),
    ((1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], output_shape=[10, 12])),
    ((1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[3, 2], dilations=[2, 1])),
    ((1, 40, 7, 7), (40, 24, 2, 2), dict(strides=[2, 2])),
    ((1, 6, 5, 7), (6, 5, 4, 5), dict(strides=[4, 4], pads=[1, 2, 0, 1])),
    ((2, 64, 9, 10), (64, 20, 3, 3),
     dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])),
    ((1, 4, 9), (4, 3, 3), dict(strides=[2])),
    ((1, 3, 4, 5, 3), (3, 2, 3, 3, 3), dict(strides=[2, 2, 1], pads=[1, 1, 0, 0, 1, 1])),
]


@pytest.mark.parametrize("xs,ws,attrs", CT_CASES, ids=[_case_id(c) for c in CT_CASES])
def test_conv_transpose(xs, ws, attrs):
    inputs = conv_inputs(xs, ws, transpose=True, group=attrs.get("group", 1))
    check_op("ConvTranspose", inputs, const_inputs=(1, 2), **TOL, **attrs)


def test_conv_transpose_runtime_weights_no_bias():
    inputs = conv_inputs((2, 4, 5, 6), (4, 3, 3, 3), bias=False, transpose=True)
    check_op("ConvTranspose", inputs, const_inputs=(), strides=[2, 2], pads=[1, 1, 0, 0], **TOL)


# ---------------------------------------------------------------------------
# pools
# ---------------------------------------------------------------------------

POOL_CASES = [
    ("MaxPool", (1, 3, 9, 11), dict(kernel_shape=[3, 3])),
    ("MaxPool", (2, 5, 112, 112), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("MaxPool", (1, 3, 9, 11), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    ("MaxPool", (1, 3, 10, 11), dict(kernel_shape=[2, 3], strides=[2, 3], pads=[1, 0, 0, 1],
                                     ceil_mode=1)),
    ("MaxPool", (1, 3, 10, 11), dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[1, 1, 1, 1])),
    ("MaxPool", (1, 3, 10, 11), dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2])),
    ("MaxPool", (1, 3, 10, 11), dict(kernel_shape=[2, 2], auto_pad="SAME_LOWER")),
    ("MaxPool", (3, 4, 9, 300), dict(kernel_shape=[2, 2], strides=[1, 3])),
    ("MaxPool", (1, 3, 20), dict(kernel_shape=[3], strides=[2])),
    ("MaxPool", (1, 2, 5, 6, 7), dict(kernel_shape=[2, 2, 2], strides=[2, 2, 2])),
    ("AveragePool", (1, 3, 9, 11), dict(kernel_shape=[3, 3])),
    ("AveragePool", (1, 3, 9, 11), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    ("AveragePool", (1, 3, 9, 11), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                                        count_include_pad=1)),
    ("AveragePool", (1, 3, 9, 11), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    ("AveragePool", (1, 3, 10, 11), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1,
                                         pads=[1, 1, 1, 1], count_include_pad=1)),
    ("AveragePool", (1, 3, 10, 12), dict(kernel_shape=[3, 2], strides=[2, 3], ceil_mode=1,
                                         pads=[1, 1, 0, 1], count_include_pad=1)),
    ("AveragePool", (1, 3, 10, 11), dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER",
                                         strides=[2, 2])),
    ("AveragePool", (1, 3, 10, 11), dict(kernel_shape=[4, 4], auto_pad="SAME_LOWER",
                                         strides=[3, 3], count_include_pad=1)),
    ("AveragePool", (2, 64, 7, 7), dict(kernel_shape=[7, 7])),
    ("AveragePool", (1, 2, 6, 7, 8), dict(kernel_shape=[3, 2, 3], pads=[1, 0, 1, 1, 1, 0],
                                          count_include_pad=1)),
    ("LpPool", (1, 3, 10, 11), dict(kernel_shape=[3, 3], p=2, pads=[1, 1, 1, 1])),
    # padded row copies (pool.PaddedRows): the identity fills the padding
    ("MaxPool", (1, 3, 20, 22), dict(kernel_shape=[5, 5], strides=[2, 2], pads=[2, 2, 2, 2])),
    ("MaxPool", (1, 3, 14, 14), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    ("AveragePool", (1, 3, 20, 22), dict(kernel_shape=[5, 5], strides=[2, 2],
                                         pads=[2, 1, 1, 2])),
    ("AveragePool", (1, 3, 14, 14), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                                         count_include_pad=1)),
    ("LpPool", (1, 3, 14, 15), dict(kernel_shape=[3, 3], p=2, pads=[1, 1, 1, 1])),
    # stride-2 windows by column phase (pool.s2_rows): wide rows (runtime column chunks)
    ("MaxPool", (1, 3, 12, 301), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("AveragePool", (1, 2, 9, 70), dict(kernel_shape=[5, 3], strides=[1, 2], pads=[2, 1, 2, 1],
                                        count_include_pad=1)),
    ("LpPool", (1, 3, 10, 11), dict(kernel_shape=[2, 2], p=1, strides=[2, 2])),
    ("LpPool", (2, 3, 12), dict(kernel_shape=[4], strides=[3])),
]


def _pool_id(c):
    op, xs, at = c
    return f"{op}-{'x'.join(map(str, xs))}-" + ",".join(f"{k}={v}" for k, v in at.items())


@pytest.mark.parametrize("op,xs,attrs", POOL_CASES, ids=[_pool_id(c) for c in POOL_CASES])
def test_pool(op, xs, attrs):
    check_op(op, [rnd(*xs)], **TOL, **attrs)


# rows of 2 .. pool.UNROLL_CHUNKS column chunks take one step per chunk at constant
# columns, wider ones a runtime loop; the column edges (padding, the last chunk's lanes
# past the row) are where the two differ
WINDOW_CHUNKS = [
    ("MaxPool", (1, 2, 6, 190), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    ("MaxPool", (1, 2, 5, 1100), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    ("Conv", (1, 3, 6, 190), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=3)),
    ("Conv", (1, 2, 5, 1100), dict(kernel_shape=[3, 3], pads=[1, 2, 1, 0], group=2)),
]


def window_chunks_case(op, xs, attrs):
    """check_op of a WINDOW_CHUNKS case; asserts which column form its plan takes."""
    from cannc.codegen import pool
    C, H, W = xs[1:]
    pt, pl, pb_, pr = attrs["pads"]
    oh, ow = H + pt + pb_ - 2, W + pl + pr - 2
    plan = pool.plan_window(pool.WindowSpec(
        kind="dw" if op == "Conv" else "max", N=1, C=C, M=C, isz=(1, H, W), osz=(1, oh, ow),
        k=(1, 3, 3), pb=(0, pt, pl)))
    assert plan.chunks > 1 and not plan.s2
    wide = W > 1000
    assert (plan.chunks > pool.UNROLL_CHUNKS) == wide, (plan.chunks, W)
    if op == "Conv":
        check_op("Conv", conv_inputs(xs, (C, 1, 3, 3)), const_inputs=(1, 2), **TOL, **attrs)
    else:
        check_op(op, [rnd(*xs)], **TOL, **attrs)


@pytest.mark.parametrize("op,xs,attrs", WINDOW_CHUNKS, ids=[_pool_id(c) for c in WINDOW_CHUNKS])
def test_window_column_chunks(op, xs, attrs):
    window_chunks_case(op, xs, attrs)


@pytest.mark.parametrize("attrs", [
    dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[1, 1, 1, 1]),
    dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1,
         ceil_mode=1, strides=[2, 2]),
])
def test_average_pool_dilations_opset19(attrs):
    check_op("AveragePool", [rnd(1, 3, 10, 11)], opset=19, **TOL, **attrs)


@pytest.mark.parametrize("opset", [7, 8, 10, 12, 22])
def test_max_pool_opsets(opset):
    attrs = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    check_op("MaxPool", [rnd(2, 3, 11, 10)], opset=opset, **TOL, **attrs)


def test_max_pool_padding_is_minus_infinity():
    x = -np.abs(rnd(1, 2, 6, 7)) - 1.0   # all negative: zero padding would win
    check_op("MaxPool", [x], kernel_shape=[3, 3], pads=[1, 1, 1, 1], **TOL)


def _unsupported(op, inputs, n_outputs=1, **attrs):
    m, feeds = single_node_model(op, inputs, n_outputs, **attrs)
    with pytest.raises(UnsupportedOpError) as e:
        cannc.compile(m, shapes={k: v.shape for k, v in feeds.items()})
    return str(e.value)


@pytest.mark.parametrize("p", [3, 4])
def test_lp_pool_higher_p(p):
    check_op("LpPool", [rnd(1, 3, 7, 8)], kernel_shape=[3, 2], strides=[2, 1], p=p, rtol=1e-4,
             atol=1e-4)


def test_conv_4d_spatial_unsupported():
    msg = _unsupported("Conv", [rnd(1, 2, 3, 3, 3, 3), rnd(2, 2, 2, 2, 2, 2)])
    assert "4 spatial dimensions" in msg


# ---------------------------------------------------------------------------
# the epilogue hook (for fusion): lane i of a final vector is Y.flat[offset + i*stride]
# ---------------------------------------------------------------------------

def _run_kernel(emit, n_tiles, ws_bytes, inputs, out_shape):
    """Emit one ABI kernel with `emit(module, name)`, JIT it, run its tiles split in two
    (like two cores) and return the output."""
    import ctypes

    import llvmlite.ir as ir  # noqa: F401

    from cannc.native.target import JitLibrary, new_module, optimise_and_emit

    module = new_module("epilogue_test")
    emit(module, "k")
    lib = JitLibrary([optimise_and_emit(str(module), "k")])
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                          ctypes.c_void_p)(lib.address("k"))
    bufs = [np.ascontiguousarray(a) for a in inputs]
    out = np.full(out_shape, np.nan, np.float32)
    args = (ctypes.c_void_p * (len(bufs) + 1))(*[a.ctypes.data for a in bufs], out.ctypes.data)
    ws = np.zeros(max(ws_bytes, 64) * 2 // 4 + 16, np.float32)
    half = n_tiles // 2
    fn(ctypes.addressof(args), 0, half, ws.ctypes.data)
    fn(ctypes.addressof(args), half, n_tiles, ws.ctypes.data + max(ws_bytes, 64))
    return out



def _guarded(a: np.ndarray):
    """A copy of `a` whose last byte ends a page followed by an unreadable one: a kernel
    that reads past its end faults. Returns (array, keepalive)."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    pages = -(-a.nbytes // page) + 1
    m = mmap.mmap(-1, pages * page)
    raw = (ctypes.c_char * (pages * page)).from_buffer(m)
    guard = ctypes.addressof(raw) + (pages - 1) * page
    assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(guard), page, 0) == 0
    start = (pages - 1) * page - a.nbytes
    out = np.frombuffer(m, np.uint8, a.nbytes, start).view(a.dtype).reshape(a.shape)
    out[...] = a
    return out, (m, raw)


@pytest.mark.parametrize("MR,NV", [(6, 2), (8, 1), (6, 4)])
def test_pointwise_swapped_tail_reads_no_pixel_past_x(MR, NV):
    """The swapped orientation reading X itself with MR not dividing the planes (49
    pixels): the last micro-tile's rows past the plane read its last pixel, so X may end
    where a page that cannot be read begins."""
    g = conv_codegen.ConvGeom(N=1, C=8, M=40, G=1, isz=(1, 7, 7), osz=(1, 7, 7),
                              k=(1, 1, 1), bias=True)
    plan = conv_codegen.plan_conv(g, tuning=dict(swap=True, MR=MR, NV=NV))
    assert plan.swap and plan.direct
    x, w, bias = conv_inputs((1, 8, 7, 7), (40, 8, 1, 1))
    xg, keep = _guarded(x)
    wp = conv_codegen.pack_weights(g, plan, w.reshape(40, 8, 1, 1, 1))
    got = _run_kernel(lambda mod, name: conv_codegen.emit_conv(mod, name, g, plan),
                      plan.num_tiles, plan.ws_bytes, [xg, wp, bias], (1, 40, 7, 7))
    want = np.einsum("mc,nchw->nmhw", w[:, :, 0, 0], x) + bias[None, :, None, None]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    del keep

def _index_epilogue(b, val, offset, stride, mask):
    """val + (offset + i*stride) as float: reveals where each lane is stored."""
    import llvmlite.ir as ir

    from cannc.codegen.conv import VF, VI

    v16 = ir.VectorType(ir.IntType(64), 16)
    off = b.insert_element(ir.Constant(v16, ir.Undefined), offset, ir.Constant(ir.IntType(32), 0))
    off = b.shuffle_vector(off, ir.Constant(v16, ir.Undefined), ir.Constant(VI, None))
    idx = b.add(off, ir.Constant(v16, [i * stride for i in range(16)]))
    return b.fadd(val, b.sitofp(idx, VF))


@pytest.mark.parametrize("tuning",
                         [dict(swap=False), dict(swap=True), dict(swap=False, direct=False),
                          dict(swap=True, MR=6, NV=4)],
                         ids=["normal", "swapped", "im2col", "swapped-6x64"])
def test_conv_epilogue_offsets(tuning):
    x, w, bias = conv_inputs((2, 12, 9, 10), (40, 12, 3, 3))
    m, feeds = single_node_model("Conv", [x, w, bias], const_inputs=(1, 2), pads=[1, 1, 1, 1])
    from tests.helpers import ort_run
    ref = ort_run(m, feeds)[0]
    g = conv_codegen.ConvGeom(N=2, C=12, M=40, G=1, isz=(1, 9, 10), osz=(1, 9, 10), k=(1, 3, 3),
                              pb=(0, 1, 1), bias=True)
    plan = conv_codegen.plan_conv(g, tuning=tuning)
    wp = conv_codegen.pack_weights(g, plan, w.reshape(40, 12, 1, 3, 3))
    got = _run_kernel(lambda mod, name: conv_codegen.emit_conv(mod, name, g, plan,
                                                               epilogue=_index_epilogue),
                      plan.num_tiles, plan.ws_bytes, [x, wp, bias], ref.shape)
    want = ref + np.arange(ref.size, dtype=np.float32).reshape(ref.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_window_and_convtranspose_epilogue_offsets():
    from cannc.codegen import pool as pool_codegen
    from tests.helpers import ort_run

    x = rnd(2, 3, 9, 11)
    m, feeds = single_node_model("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2])
    ref = ort_run(m, feeds)[0]
    spec = pool_codegen.WindowSpec(kind="max", N=2, C=3, M=3, isz=(1, 9, 11), osz=(1, 4, 5),
                                   k=(1, 3, 3), s=(1, 2, 2))
    plan = pool_codegen.plan_window(spec)
    got = _run_kernel(lambda mod, name: pool_codegen.emit_window(mod, name, spec, plan,
                                                                 epilogue=_index_epilogue),
                      plan.num_tiles, plan.ws_bytes, [x], ref.shape)
    np.testing.assert_allclose(got, ref + np.arange(ref.size).reshape(ref.shape), rtol=1e-5)

    x, w, bias = conv_inputs((1, 4, 5, 6), (4, 3, 3, 3), transpose=True)
    m, feeds = single_node_model("ConvTranspose", [x, w, bias], const_inputs=(1, 2), strides=[2, 2])
    ref = ort_run(m, feeds)[0]
    tg = conv_codegen.ConvTGeom(N=1, C=4, M=3, G=1, isz=(1, 5, 6), osz=(1, 11, 13), k=(1, 3, 3),
                                s=(1, 2, 2), d=(1, 1, 1), pb=(0, 0, 0), bias=True)
    tplan = conv_codegen.plan_convtranspose(tg)
    wp = conv_codegen.pack_convtranspose_weights(tg, tplan, w)
    got = _run_kernel(lambda mod, name: conv_codegen.emit_convtranspose(mod, name, tg, tplan,
                                                                        epilogue=_index_epilogue),
                      tplan.num_tiles, tplan.ws_bytes, [x, wp, bias], ref.shape)
    np.testing.assert_allclose(got, ref + np.arange(ref.size).reshape(ref.shape), rtol=1e-4,
                               atol=1e-3)


# ---------------------------------------------------------------------------
# costly epilogues applied in a pass of their own (conv.costly_epilogue): AVX2 code
# ---------------------------------------------------------------------------

@pytest.fixture
def avx2_code(monkeypatch):
    """AVX2 kernels: the host's own on an AVX2 machine, else the host restricted to AVX2."""
    from cannc.native import target
    from tests.helpers import restrict_host_to_avx2
    h = target.host()
    if h.has("avx512f"):
        restrict_host_to_avx2(monkeypatch)
    elif not (h.has("avx2") and h.has("fma")):
        pytest.skip("the host lacks AVX2/FMA")


def _costly_index_epilogue(b, val, offset, stride, mask):
    return _index_epilogue(b, val, offset, stride, mask)


_costly_index_epilogue.cost = conv_codegen.LATE_EPILOGUE_FLOPS


def _late_kernel(emit, n_tiles, ws_bytes, inputs, out_shape):
    """_run_kernel's output and whether the kernel has the late epilogue pass."""
    text = []

    def emit_and_keep(module, name):
        emit(module, name)
        text.append(str(module))

    out = _run_kernel(emit_and_keep, n_tiles, ws_bytes, inputs, out_shape)
    return out, '"late' in text[0] or "late." in text[0]


@pytest.mark.parametrize("xs,ws,attrs", [
    ((2, 6, 19, 21), (6, 1, 3, 3), dict(pads=[1, 1, 1, 1])),                 # in place
    ((1, 5, 17, 40), (5, 1, 5, 5), dict(pads=[2, 2, 2, 2])),                 # padded rows
    ((1, 4, 23, 45), (4, 1, 3, 3), dict(pads=[1, 0, 2, 1], strides=[2, 2])),  # column phases
    ((1, 3, 60, 60), (3, 1, 3, 3), dict(pads=[1, 1, 1, 1])),                 # row blocks
])
def test_depthwise_late_epilogue_offsets(avx2_code, xs, ws, attrs):
    """A depthwise kernel whose epilogue is costly stores its sums and then applies the
    epilogue to each row block it wrote (pool.late_epilogue): every element once, at its
    own flat offset (a vector's tail under a mask)."""
    from cannc.codegen import pool as pool_codegen
    from tests.helpers import ort_run
    C = xs[1]
    x, w, bias = conv_inputs(xs, ws)
    m, feeds = single_node_model("Conv", [x, w, bias], const_inputs=(1, 2), group=C, **attrs)
    ref = ort_run(m, feeds)[0]
    s, p = attrs.get("strides", [1, 1])[0], attrs["pads"]
    spec = pool_codegen.WindowSpec(kind="dw", N=xs[0], C=C, M=C, isz=(1,) + xs[2:],
                                   osz=(1,) + ref.shape[2:], k=(1,) + ws[2:], s=(1, s, s),
                                   pb=(0, p[0], p[1]), bias=True)
    plan = pool_codegen.plan_window(spec)
    assert plan.flat is None and pool_codegen.late_epilogue(spec, _costly_index_epilogue)
    got, late = _late_kernel(
        lambda mod, name: pool_codegen.emit_window(mod, name, spec, plan,
                                                   slots=conv_codegen.Slots(),
                                                   epilogue=_costly_index_epilogue),
        plan.num_tiles, plan.ws_bytes, [x, w.reshape(C, -1), bias], ref.shape)
    assert late
    np.testing.assert_allclose(got, ref + np.arange(ref.size).reshape(ref.shape),
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("k,tuning", [(3, dict(swap=False)), (3, dict(swap=False, direct=False)),
                                      (3, dict(swap=False, KC=45)),
                                      (1, dict(swap=False, direct=False))],
                         ids=["direct", "im2col", "k-blocks", "panels"])
def test_conv_late_epilogue_offsets(avx2_code, k, tuning):
    """The same for an implicit-GEMM conv with channels as rows (conv.late_epilogue): the
    pass over each tile after its last K block."""
    C = 24 if k == 1 else 12
    x, w, bias = conv_inputs((2, C, 9, 10), (40, C, k, k))
    pad = k // 2
    m, feeds = single_node_model("Conv", [x, w, bias], const_inputs=(1, 2), pads=[pad] * 4)
    from tests.helpers import ort_run
    ref = ort_run(m, feeds)[0]
    g = conv_codegen.ConvGeom(N=2, C=C, M=40, G=1, isz=(1, 9, 10), osz=(1, 9, 10),
                              k=(1, k, k), pb=(0, pad, pad), bias=True)
    plan = conv_codegen.plan_conv(g, tuning=tuning)
    assert not plan.swap and conv_codegen.late_epilogue(plan, _costly_index_epilogue)
    assert plan.nkb > 1 if "KC" in tuning else plan.panels == (k == 1)
    wp = conv_codegen.pack_weights(g, plan, w.reshape(40, C, 1, k, k))
    got, late = _late_kernel(
        lambda mod, name: conv_codegen.emit_conv(mod, name, g, plan,
                                                 epilogue=_costly_index_epilogue),
        plan.num_tiles, plan.ws_bytes, [x, wp, bias], ref.shape)
    assert late
    np.testing.assert_allclose(got, ref + np.arange(ref.size, dtype=np.float32).reshape(
        ref.shape), rtol=1e-4, atol=1e-3)


def test_cheap_or_avx512_epilogues_stay_in_the_store(monkeypatch):
    """A cheap epilogue (a Relu: 1 flop) is applied as the sums are stored; so is every
    epilogue with AVX-512's 32 registers."""
    from cannc.codegen import vec
    plan = conv_codegen.plan_conv(conv_codegen.ConvGeom(
        N=1, C=12, M=40, G=1, isz=(1, 9, 10), osz=(1, 9, 10), k=(1, 3, 3), pb=(0, 1, 1)),
        tuning=dict(swap=False))

    def cheap(b, val, offset, stride, mask):
        return val

    cheap.cost = 1
    for wide in (False, True):
        monkeypatch.setattr(conv_codegen, "wide_registers", lambda wide=wide: wide)
        monkeypatch.setattr(vec, "wide_registers", lambda wide=wide: wide)
        assert not conv_codegen.late_epilogue(plan, cheap)
        assert conv_codegen.late_epilogue(plan, _costly_index_epilogue) == (not wide)
    assert not conv_codegen.late_epilogue(plan, None)
