"""Conv, depthwise and pooling kernels generated for AVX2, run on an AVX-512 host.

The AVX2 kernels differ from the AVX-512 ones in more than width: micro-tiles sized
for 16 ymm registers, masks wider than 256 bits split, a masked store that takes a
plain store when its mask is all true, and the direct conv's k loop versioned per tap
(plain loads ANDed with the mask when the tap's addresses lie inside X's block --
interior tiles -- masked loads at the block's edges). A session on an AVX-512 machine
would never run that code: here the host target's features are restricted as
``CANNC_ISA=avx2`` does (the object cache is keyed by them) and a cross-section of the
conv and pool cases is compared with onnxruntime. On an AVX2-only host test_conv.py
already runs these kernels, so this module skips.
"""

from __future__ import annotations

import pytest

from tests.helpers import check_op, restrict_host_to_avx2
from tests.ops.test_conv import (
    CONV_CASES,
    POOL_CASES,
    SWAP_TAPS,
    TOL,
    WINDOW_CHUNKS,
    _case_id,
    _pool_id,
    conv_inputs,
    rnd,
    window_chunks_case,
)


@pytest.fixture(autouse=True)
def avx2_host(monkeypatch):
    restrict_host_to_avx2(monkeypatch)


# direct convs whose taps cross X's edges at every border (pads on all sides, rows
# that are not a multiple of the 16-pixel vector), an im2col and a swapped one, the
# depthwise window kernels, 1-D and 3-D
AVX2_CONV = [c for i, c in enumerate(CONV_CASES) if i % 3 == 0] + [
    ((1, 16, 19, 21), (24, 16, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((2, 8, 33, 17), (12, 8, 5, 5), dict(pads=[2, 2, 2, 2])),
    ((1, 32, 14, 14), (32, 1, 3, 3), dict(group=32, pads=[1, 1, 1, 1])),
    # stride 2 by column phase (pool.s2_rows): the even/odd splits and lane rotations
    ((1, 3, 9, 300), (3, 1, 5, 5), dict(group=3, pads=[2, 2, 2, 2], strides=[2, 2])),
    ((2, 5, 23, 45), (5, 1, 3, 3), dict(group=5, pads=[1, 0, 2, 1], strides=[2, 2])),
]


@pytest.mark.parametrize("xs,ws,attrs", AVX2_CONV, ids=[_case_id(c) for c in AVX2_CONV])
def test_conv_avx2(xs, ws, attrs):
    check_op("Conv", conv_inputs(xs, ws), const_inputs=(1, 2), **TOL, **attrs)


@pytest.mark.parametrize("xs,ws,attrs", [
    ((2, 8, 9, 11), (10, 8, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((1, 6, 9, 10), (6, 1, 3, 3), dict(group=6, pads=[1, 0, 1, 2])),
])
def test_conv_runtime_weights_avx2(xs, ws, attrs):
    check_op("Conv", conv_inputs(xs, ws), const_inputs=(), **TOL, **attrs)


AVX2_POOL = [c for i, c in enumerate(POOL_CASES) if i % 2 == 0]


@pytest.mark.parametrize("op,xs,attrs", AVX2_POOL, ids=[_pool_id(c) for c in AVX2_POOL])
def test_pool_avx2(op, xs, attrs):
    check_op(op, [rnd(*xs)], **TOL, **attrs)


@pytest.mark.parametrize("op,xs,attrs", WINDOW_CHUNKS, ids=[_pool_id(c) for c in WINDOW_CHUNKS])
def test_window_column_chunks_avx2(op, xs, attrs):
    window_chunks_case(op, xs, attrs)


def _dw_plan(xs, ws, attrs):
    """pool.plan_window of the depthwise Conv of input shape xs, weights ws, ONNX attrs."""
    from cannc.codegen import pool
    s = attrs.get("strides", [1, 1])[0]
    p = attrs["pads"]
    o = [(xs[2 + i] + p[i] + p[i + 2] - ws[2 + i]) // s + 1 for i in (0, 1)]
    return pool.plan_window(pool.WindowSpec(
        kind="dw", N=1, C=xs[1], M=ws[0], isz=(1,) + xs[2:], osz=(1, *o), k=(1,) + ws[2:],
        s=(1, s, s), pb=(0, p[0], p[1])))


# depthwise convs on small planes computed flat (pool.FlatPlane: masked loads split into
# ymm halves), and 1x1 convs whose swapped micro-kernel reads X itself (MR 4 divides
# 14x14's 196 pixels; AVX2 micro-tiles are 6, 5 or 4 pixels)
# (3x3 windows on planes of up to 13 vectors: 14x14, and 12x12 with a multiplier of 2 and
# pads on one side of the rows)
@pytest.mark.parametrize("xs,ws,attrs", [
    ((2, 24, 7, 7), (24, 1, 5, 5), dict(group=24, pads=[2, 2, 2, 2])),
    ((1, 6, 4, 4), (12, 1, 3, 3), dict(group=6, pads=[1, 1, 1, 1])),
    ((2, 20, 14, 14), (20, 1, 3, 3), dict(group=20, pads=[1, 1, 1, 1])),
    ((1, 6, 12, 12), (12, 1, 3, 3), dict(group=6, pads=[0, 1, 2, 1])),
])
def test_flat_depthwise_avx2(xs, ws, attrs):
    assert _dw_plan(xs, ws, attrs).flat is not None
    check_op("Conv", conv_inputs(xs, ws), const_inputs=(1, 2), **TOL, **attrs)


@pytest.mark.parametrize("const", [True, False], ids=["const-w", "runtime-w"])
def test_pointwise_swapped_reads_x_avx2(monkeypatch, const):
    from cannc.codegen import conv as conv_codegen
    tuning = dict(swap=True, MR=4)
    g = conv_codegen.ConvGeom(N=2, C=40, M=24, G=1, isz=(1, 14, 14), osz=(1, 14, 14),
                              k=(1, 1, 1))
    assert conv_codegen.plan_conv(g, tuning=tuning).direct
    monkeypatch.setattr(conv_codegen, "FORCE_TUNING", tuning)
    check_op("Conv", conv_inputs((2, 40, 14, 14), (24, 40, 1, 1)),
             const_inputs=(1, 2) if const else (), **TOL)


# the swapped orientation reading KxK taps from X (conv.swap_reads_x) with AVX2's
# micro-tiles of 6, 5 or 4 pixels: padding rows skipped, padding columns read as zeros
AVX2_SWAP_TAPS = [(xs, ws, at, t) for xs, ws, at, t in SWAP_TAPS if t.get("MR") in (4, 5, 6)]


@pytest.mark.parametrize("xs,ws,attrs,tuning", AVX2_SWAP_TAPS,
                         ids=[_case_id(c[:3]) for c in AVX2_SWAP_TAPS])
def test_swapped_taps_read_x_avx2(monkeypatch, xs, ws, attrs, tuning):
    from cannc.codegen import conv as conv_codegen
    monkeypatch.setattr(conv_codegen, "FORCE_TUNING", tuning)
    check_op("Conv", conv_inputs(xs, ws), const_inputs=(1, 2), **TOL, **attrs)


@pytest.mark.parametrize("xs,ws,attrs", [
    ((1, 16, 40, 30), (16, 16, 1, 1), {}),                          # tiles of 6 + 6 + 4
    ((2, 8, 13, 11), (22, 8, 3, 3), dict(pads=[1, 1, 1, 1])),        # 6 x 3 + 4
    ((1, 12, 9, 9), (7, 12, 1, 1), {}),                              # 4 + 3
])
def test_residual_add_on_short_channel_tiles_avx2(xs, ws, attrs):
    """Conv + Add fused (the residual read in the epilogue) where the last tile of
    channels has fewer rows than the micro-kernel: those rows skip the epilogue and the
    store on AVX2 (conv._NormalIO.store_final)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    import cannc
    from tests.helpers import check_session, model_of

    rng = np.random.default_rng(sum(xs) + sum(ws))
    x = rng.standard_normal(xs).astype(np.float32)
    w = (rng.standard_normal(ws) * 0.2).astype(np.float32)
    bias = rng.standard_normal(ws[0]).astype(np.float32)
    pads = attrs.get("pads", [0, 0, 0, 0])
    ys = [xs[0], ws[0], xs[2] + pads[0] + pads[2] - ws[2] + 1,
          xs[3] + pads[1] + pads[3] - ws[3] + 1]
    model = model_of(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], **attrs),
         helper.make_node("Add", ["c", "r"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xs)),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, ys)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ys)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "b")])
    feeds = {"x": x, "r": rng.standard_normal(ys).astype(np.float32)}
    sess = cannc.compile(model, cores=2, shapes={k: v.shape for k, v in feeds.items()})
    (path,) = [k.notes["path"] for s in sess.specializations for k in s.kernels
               if "path" in k.notes]
    mr = int(path.split(" MR")[1].split()[0])
    assert "swapped" not in path and ws[0] % mr, path      # channels in rows, a short tile
    check_session(sess, model, feeds)


@pytest.mark.parametrize("xs,ws,attrs", [
    ((1, 6, 17, 40), (6, 1, 5, 5), dict(group=6, pads=[2, 2, 2, 2])),
    ((1, 5, 30, 56), (5, 1, 5, 5), dict(group=5, pads=[2, 2, 2, 2], strides=[2, 2])),
    ((2, 3, 13, 56), (3, 1, 3, 3), dict(group=3, pads=[1, 1, 1, 1])),
])
def test_depthwise_one_vector_a_row_avx2(xs, ws, attrs):
    """AVX2 depthwise steps of one vector a row and up to 3 rows (pool.plan_window)."""
    plan = _dw_plan(xs, ws, attrs)
    assert plan.flat is None and plan.V == 1 and plan.R > 1 and plan.chunks > 1
    check_op("Conv", conv_inputs(xs, ws), const_inputs=(1, 2), **TOL, **attrs)


@pytest.mark.parametrize("direct", [True, False], ids=["reads-x", "im2col"])
def test_swapped_reduction_blocks_fit_half_of_l1_avx2(monkeypatch, direct):
    """AVX2's swapped micro-tiles reduce in blocks whose weight panel and lines of X fill
    half of L1 (conv.swap_kc_avx2: 128 rows on 32 KiB): a 7x7 1x1 conv of 300 input
    channels takes 3 blocks, their partial sums carried through the workspace."""
    from cannc.codegen import conv as conv_codegen
    monkeypatch.setattr(conv_codegen, "l1d_bytes", lambda: 32 << 10)
    assert conv_codegen.swap_kc_avx2(16) == 128
    monkeypatch.setattr(conv_codegen, "l1d_bytes", lambda: 48 << 10)
    assert conv_codegen.swap_kc_avx2(16) == 192
    monkeypatch.setattr(conv_codegen, "l1d_bytes", lambda: 32 << 10)
    tuning = dict(swap=True, MR=6, direct=direct)
    g = conv_codegen.ConvGeom(N=1, C=300, M=40, G=1, isz=(1, 7, 7), osz=(1, 7, 7),
                              k=(1, 1, 1))
    plan = conv_codegen.plan_conv(g, tuning=tuning)
    assert plan.swap and plan.direct == direct and plan.KC == 100 and plan.nkb == 3, plan
    monkeypatch.setattr(conv_codegen, "FORCE_TUNING", tuning)
    check_op("Conv", conv_inputs((1, 300, 7, 7), (40, 300, 1, 1)), const_inputs=(1, 2), **TOL)


@pytest.mark.parametrize("xs,ws,attrs,padded", [
    ((1, 6, 15, 15), (6, 1, 3, 3), dict(group=6, pads=[1, 1, 1, 1]), True),  # (14x14: flat)
    ((2, 6, 13, 15), (6, 1, 3, 3), dict(group=6, pads=[0, 1, 2, 0]), True),
    ((1, 5, 14, 14), (5, 1, 5, 5), dict(group=5, pads=[2, 2, 2, 2], strides=[2, 2]), True),
    ((1, 7, 14, 13), (7, 1, 3, 3), dict(group=7, pads=[1, 1, 1, 1], strides=[2, 2]), False),
])
def test_depthwise_narrow_rows_one_row_a_step_avx2(xs, ws, attrs, padded):
    """AVX2 depthwise convs over input rows narrower than a vector step one output row
    at a time (pool.plan_window): 3x3 at stride 1 from padded rows, stride 2 as its plan
    reads them (5x5 padded, 3x3 by column phase)."""
    plan = _dw_plan(xs, ws, attrs)
    assert plan.R == 1 and plan.V == 1 and plan.padded == padded, plan
    check_op("Conv", conv_inputs(xs, ws), const_inputs=(1, 2), **TOL, **attrs)


@pytest.mark.parametrize("op,xs,ws,attrs,s2", [
    ("Conv", (1, 6, 60, 70), (6, 1, 3, 3), dict(group=6, pads=[1, 1, 1, 1], strides=[2, 2]),
     True),
    ("Conv", (2, 4, 33, 47), (8, 1, 3, 3), dict(group=4, pads=[0, 1, 2, 0], strides=[2, 2]),
     True),
    ("Conv", (1, 5, 40, 75), (5, 1, 5, 5), dict(group=5, pads=[2, 2, 2, 2], strides=[2, 2]),
     True),
    ("Conv", (1, 5, 30, 30), (5, 1, 5, 5), dict(group=5, pads=[2, 2, 2, 2], strides=[2, 2]),
     False),                                           # one vector a row: padded rows
    ("MaxPool", (1, 3, 41, 67), None, dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                                          strides=[2, 2]), True),
    ("AveragePool", (1, 3, 40, 66), None, dict(kernel_shape=[3, 3], pads=[0, 1, 1, 0],
                                              strides=[2, 2]), True),
])
def test_stride2_taps_within_lanes_avx2(op, xs, ws, attrs, s2):
    """AVX2 stride-2 windows by column phase take each tap's phase within 128-bit lanes
    from a pair of vectors loaded at its own offset (pool.taps_in_lane), their sums in
    pool.PHASE_ORDER until the store; one vector a row (pool.plan_window), 5x5 windows so
    where a row is wider than a vector."""
    from cannc.codegen import pool
    if op == "Conv":
        plan = _dw_plan(xs, ws, attrs)
        inputs, const = conv_inputs(xs, ws), (1, 2)
    else:
        k, p, s = attrs["kernel_shape"], attrs["pads"], attrs["strides"]
        o = [(xs[2 + i] + p[i] + p[i + 2] - k[i]) // s[i] + 1 for i in (0, 1)]
        plan = pool.plan_window(pool.WindowSpec(
            kind="max" if op == "MaxPool" else "avg", N=1, C=xs[1], M=xs[1],
            isz=(1,) + xs[2:], osz=(1, *o), k=(1, *k), s=(1, *s), pb=(0, p[0], p[1]),
            count_rows=(1.0,) * o[0], count_cols=(1.0,) * o[1]))
        inputs, const = [rnd(*xs)], ()
    assert plan.V == 1 and plan.s2 == s2 and plan.padded != s2, plan
    check_op(op, inputs, const_inputs=const, **TOL, **attrs)


def test_silu_fused_late_avx2():
    """Conv + SiLU chains as EfficientNet has them (a 1x1 expansion, a depthwise 3x3 and a
    stride-2 depthwise 5x5, each followed by x * sigmoid(x)): the SiLU fused into each
    conv and applied in a pass of its own after the sums (conv.costly_epilogue)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    import cannc
    from tests.helpers import check_session, model_of

    rng = np.random.default_rng(7)
    nodes, inits, cur = [], [], "x"
    for i, (cout, k, s, g) in enumerate([(24, 1, 1, 1), (24, 3, 1, 24), (24, 5, 2, 24)]):
        cin = 8 if i == 0 else 24
        w = (rng.standard_normal((cout, cin // g, k, k)) / np.sqrt(cin // g * k * k))
        inits += [numpy_helper.from_array(w.astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("Conv", [cur, f"w{i}", f"b{i}"], [f"c{i}"], group=g,
                                   strides=[s, s], pads=[k // 2] * 4),
                  helper.make_node("Sigmoid", [f"c{i}"], [f"s{i}"]),
                  helper.make_node("Mul", [f"c{i}", f"s{i}"], [f"y{i}"])]
        cur = f"y{i}"
    model = model_of(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                           [1, 8, 37, 45])],
                     [helper.make_tensor_value_info(cur, TensorProto.FLOAT, None)], inits)
    feeds = {"x": rng.standard_normal((1, 8, 37, 45)).astype(np.float32)}
    sess = cannc.compile(model, cores=2)
    fused = [k for s in sess.specializations for k in s.kernels
             if k.op_types[:1] == ["Conv"] and "Sigmoid" in k.op_types]
    assert len(fused) == 3, [k.op_types for s in sess.specializations for k in s.kernels]
    check_session(sess, model, feeds)


@pytest.mark.parametrize("op,xs,ws,attrs", [
    ("Conv", (1, 8, 28, 30), (8, 1, 3, 3), dict(group=8, pads=[1, 1, 1, 1])),    # tail 14
    ("Conv", (2, 5, 20, 20), (5, 1, 3, 3), dict(group=5, pads=[1, 1, 1, 1])),    # tail 4
    ("Conv", (1, 6, 30, 30), (6, 1, 5, 5), dict(group=6, pads=[2, 2, 2, 2])),    # padded rows
    ("Conv", (1, 6, 56, 56), (6, 1, 5, 5), dict(group=6, pads=[2, 2, 2, 2],
                                               strides=[2, 2])),                 # column phases
    ("Conv", (1, 4, 45, 99), (4, 1, 3, 3), dict(group=4, pads=[1, 0, 1, 2],
                                               strides=[2, 2])),                 # column phases
    ("AveragePool", (1, 3, 28, 28), None, dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    ("MaxPool", (1, 3, 21, 27), None, dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
])
def test_overlapped_last_chunk_avx2(op, xs, ws, attrs):
    """Rows of several chunks whose last chunk ends inside a ymm half: it starts at
    OW - 16*V, computing some of the chunk before's columns again (pool.overlap_last_chunk)."""
    from cannc.codegen import pool
    if op == "Conv":
        plan = _dw_plan(xs, ws, attrs)
        s = attrs.get("strides", [1, 1])[0]
        spec_ow = (xs[3] + attrs["pads"][1] + attrs["pads"][3] - ws[3]) // s + 1
        inputs, const = conv_inputs(xs, ws), (1, 2)
    else:
        kind = "avg" if op == "AveragePool" else "max"
        k, p = attrs["kernel_shape"], attrs["pads"]
        o = [(xs[2 + i] + p[i] + p[i + 2] - k[i]) + 1 for i in (0, 1)]
        plan = pool.plan_window(pool.WindowSpec(kind=kind, N=1, C=xs[1], M=xs[1],
                                                isz=(1,) + xs[2:], osz=(1, *o), k=(1, *k),
                                                pb=(0, p[0], p[1])))
        spec_ow = o[1]
        inputs, const = [rnd(*xs)], ()
    assert plan.flat is None and plan.chunks > 1
    assert (spec_ow - (plan.chunks - 1) * plan.V * 16) % 8, (spec_ow, plan)
    check_op(op, inputs, const_inputs=const, **TOL, **attrs)
