"""Shape-polymorphic convolutions and pools (Conv, FusedConv, MaxPool, AveragePool, LpPool):
compiled once, run at other batch sizes with no code generation (ABI.md "Runtime
dimensions"), against onnxruntime.

The kernels are planned for one image; a batch of N runs N times the tiles of one image
(the tile index carries the image), so the batch is the only runtime extent."""

from __future__ import annotations

from dataclasses import replace as dc_replace

import numpy as np
import onnx
import pytest
from helpers import check_runtime_dims, single_node_model, with_dynamic_dims
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc import config
from cannc.codegen.lower.conv import conv_geom_of, conv_tiling, pool_tiling
from cannc.ir.graph import Node
from cannc.ir.types import TensorType

R = np.random.default_rng(7)
BATCHES = [2, 1, 3, 5]          # the first compiles, the others must not
TOL = dict(rtol=1e-4, atol=1e-5)
F32 = np.dtype(np.float32)


def f32(*shape, scale=1.0):
    return (R.standard_normal(shape) * scale).astype(np.float32)


def dynamic(model: onnx.ModelProto, inputs: tuple[str, ...] = ("in0",)) -> onnx.ModelProto:
    """``model`` with a symbolic batch axis on ``inputs``; outputs keep their rank."""
    m = with_dynamic_dims(model, {name: {0: "N"} for name in inputs})
    for vi, vo in zip(m.graph.output, model.graph.output):
        sh = vi.type.tensor_type.shape
        if not sh.dim:
            for _ in vo.type.tensor_type.shape.dim:
                sh.dim.add()
    return m


def kernels_of(sess: cannc.Session, op: str) -> list:
    return [k for sp in sess.specializations for k in sp.kernels if op in k.op_types]


def assert_one_kernel_per_batch(sess: cannc.Session, op: str) -> None:
    """Every batch ran the same code, with tiles proportional to the batch."""
    ks = kernels_of(sess, op)
    assert len(ks) == len(BATCHES), [k.op_types for k in ks]
    assert len({k.symbol for k in ks}) == 1
    tiles = sorted(k.num_tiles for k in ks)
    assert tiles == [tiles[0] * b for b in sorted(BATCHES)], tiles


def conv_model(xs, ws, bias=True, const_w=True, **attrs):
    fan_in = int(np.prod(ws[1:]))
    ins = [f32(*xs), f32(*ws, scale=fan_in ** -0.5)] + ([f32(ws[0])] if bias else [])
    m, _ = single_node_model("Conv", ins, const_inputs=(1, 2) if const_w else (), **attrs)
    return m


# (x shape at batch 2, w shape, attrs)
CONV_CASES = {
    "3x3-pad1-direct": ((2, 16, 9, 7), (20, 16, 3, 3), dict(pads=[1, 1, 1, 1])),
    "3x3-pad1-wide": ((2, 8, 20, 40), (12, 8, 3, 3), dict(pads=[1, 1, 1, 1])),
    "7x7-stride2-im2col": ((2, 3, 23, 21), (8, 3, 7, 7), dict(pads=[3, 3, 3, 3], strides=[2, 2])),
    "1x1": ((2, 24, 14, 14), (40, 24, 1, 1), {}),
    "1x1-stride2": ((2, 17, 11, 13), (19, 17, 1, 1), dict(strides=[2, 2])),
    "grouped": ((2, 12, 9, 10), (9, 4, 3, 3), dict(group=3, strides=[2, 2])),
    "grouped-same": ((2, 8, 12, 10), (6, 4, 3, 3), dict(group=2, pads=[1, 1, 1, 1])),
    "depthwise": ((2, 32, 14, 14), (32, 1, 3, 3), dict(group=32, pads=[1, 1, 1, 1])),
    "depthwise-stride2-mult2": ((2, 8, 15, 17), (16, 1, 3, 3),
                                dict(group=8, pads=[1, 1, 1, 1], strides=[2, 2])),
    "swapped-kblocks": ((2, 300, 7, 7), (40, 300, 3, 3), dict(pads=[1, 1, 1, 1])),
    "dilated": ((2, 8, 12, 12), (6, 8, 3, 3), dict(dilations=[2, 2], pads=[2, 2, 2, 2])),
    "same-upper": ((2, 8, 12, 11), (6, 8, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    "1d": ((2, 5, 20), (7, 5, 3), dict(pads=[1, 1])),
    "3d": ((2, 4, 5, 6, 7), (6, 4, 3, 3, 3), dict(pads=[1, 1, 1, 1, 1, 1])),
}


@pytest.mark.parametrize("name", list(CONV_CASES))
def test_conv(name):
    xs, ws, attrs = CONV_CASES[name]
    m = dynamic(conv_model(xs, ws, **attrs))
    sess = check_runtime_dims(m, [{"in0": f32(b, *xs[1:])} for b in BATCHES], **TOL)
    assert_one_kernel_per_batch(sess, "Conv")


@pytest.mark.parametrize("name", ["3x3-pad1-direct", "7x7-stride2-im2col", "swapped-kblocks",
                                  "depthwise"])
def test_conv_runtime_weights(name):
    """Weights and bias as graph inputs (static shapes): packed per tile at run time, in
    the same tile grid as prepacked weights."""
    xs, ws, attrs = CONV_CASES[name]
    m = dynamic(conv_model(xs, ws, const_w=False, **attrs))
    w, bias = f32(*ws, scale=int(np.prod(ws[1:])) ** -0.5), f32(ws[0])
    sess = check_runtime_dims(m, [{"in0": f32(b, *xs[1:]), "in1": w, "in2": bias}
                                  for b in BATCHES], **TOL)
    assert_one_kernel_per_batch(sess, "Conv")


def test_conv_no_bias():
    xs, ws, attrs = CONV_CASES["grouped-same"]
    m = dynamic(conv_model(xs, ws, bias=False, **attrs))
    check_runtime_dims(m, [{"in0": f32(b, *xs[1:])} for b in BATCHES], **TOL)


def test_conv_tiling_key_excludes_batch():
    """The key is one image's geometry and plan; a batch scales the tiles only."""
    node = Node(name="c", op_type="Conv", inputs=("x", "w", "b"), outputs=("y",),
                attrs={"pads": [1, 1, 1, 1], "dilations": [2, 2]}, opset=17)   # not Winograd

    def tiling(n, hw=28):
        ins = [TensorType(F32, (n, 64, hw + 2, hw + 2)), TensorType(F32, (32, 64, 3, 3)),
               TensorType(F32, (32,))]
        return conv_tiling(node, ins, [TensorType(F32, (n, 32, hw, hw))])

    t1, t8 = tiling(1), tiling(8)
    assert t1.key == t8.key and t1.dims == t8.dims == ()
    assert t8.num_tiles == 8 * t1.num_tiles >= 2 * 8
    assert t8.flops == 8 * t1.flops and t1.workspace_bytes == t8.workspace_bytes
    assert tiling(1, hw=14).key != t1.key

    pnode = Node(name="p", op_type="MaxPool", inputs=("x",), outputs=("y",),
                 attrs={"kernel_shape": [3, 3], "strides": [2, 2]}, opset=17)
    p1, p6 = (pool_tiling(pnode, [TensorType(F32, (n, 5, 15, 15))],
                          [TensorType(F32, (n, 5, 7, 7))]) for n in (1, 6))
    assert p1.key == p6.key and p6.num_tiles == 6 * p1.num_tiles


# -- Winograd (forced): chosen and planned on one image, so it serves every batch too ----------

# (x shape at batch 2, w shape, attrs, FORCE_TUNING)
WINO_CASES = {
    "gather": ((2, 20, 9, 13), (35, 20, 3, 3), dict(pads=[1, 2, 1, 0]), {}),
    "rows": ((2, 16, 12, 40), (24, 16, 3, 3), dict(pads=[1, 1, 1, 1]), {}),
    # several tile blocks (the last one partial), channel blocks and reduction blocks
    "blocks-gather": ((2, 20, 11, 9), (70, 20, 3, 3), dict(pads=[1, 1, 1, 1]),
                      dict(PT=16, CH=32, CB=7, MR=6)),
    "blocks-rows": ((2, 20, 21, 34), (40, 20, 3, 3), dict(pads=[1, 2, 1, 0]),
                    dict(PT=40, CH=32, CB=16)),
}


@pytest.fixture
def winograd_forced(monkeypatch):
    """CANNC_WINOGRAD=force (in the lowering memo's salt: no kernel of another mode is
    reused)."""
    monkeypatch.setattr(config, "WINOGRAD", "force")


@pytest.mark.parametrize("name", list(WINO_CASES))
def test_conv_winograd(winograd_forced, monkeypatch, name):
    from cannc.codegen import winograd as wg

    xs, ws, attrs, tuning = WINO_CASES[name]
    monkeypatch.setattr(wg, "FORCE_TUNING", tuning)
    m = dynamic(conv_model(xs, ws, **attrs))
    sess = check_runtime_dims(m, [{"in0": f32(b, *xs[1:])} for b in BATCHES], **TOL)
    assert_one_kernel_per_batch(sess, "Conv")
    ks = kernels_of(sess, "Conv")
    assert all(k.notes["path"].startswith("winograd F(2,3)") for k in ks), ks[0].notes
    if tuning:
        assert f"PT{tuning['PT']}x" in ks[0].notes["path"]
    # the GEMM flops of the transformed convolution scale with the batch, as the tiles
    assert len({k.notes["gemm_flops"] / k.num_tiles for k in ks}) == 1


def test_conv_winograd_runtime_weights(winograd_forced):
    """Weights as a graph input under a Winograd key (the tiling function cannot tell):
    the implicit GEMM, run in the Winograd kernel's tile grid."""
    xs, ws, attrs, _ = WINO_CASES["gather"]
    m = dynamic(conv_model(xs, ws, const_w=False, **attrs))
    w, bias = f32(*ws, scale=int(np.prod(ws[1:])) ** -0.5), f32(ws[0])
    sess = check_runtime_dims(m, [{"in0": f32(b, *xs[1:]), "in1": w, "in2": bias}
                                  for b in BATCHES], **TOL)
    assert_one_kernel_per_batch(sess, "Conv")
    path = kernels_of(sess, "Conv")[0].notes["path"]
    assert "gemm" in path and "tiles/image" in path and not path.startswith("winograd")


def test_fused_conv_winograd(winograd_forced):
    """Conv + BN + residual Add + ReLU in one Winograd FusedConv kernel at every batch (the
    epilogue's 'full' operand is indexed by the flat output offset, image included)."""
    C = 24
    inits = {"w": f32(C, C, 3, 3, scale=(9 * C) ** -0.5), "cb": f32(C), **_bn("bn", C)}
    nodes = [helper.make_node("Conv", ["x", "w", "cb"], ["c"], pads=[1, 1, 1, 1]),
             _bn_node("bn", "c", "n"),
             helper.make_node("Add", ["n", "x"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    m = _model(nodes, [_vi("x", ["N", C, 10, 19])], [_vi("y", ["N", C, 10, 19])], inits)
    sess = check_runtime_dims(m, [{"x": f32(b, C, 10, 19)} for b in BATCHES], **TOL)
    ks = kernels_of(sess, "Conv")
    assert len(ks) == len(BATCHES) and len({k.symbol for k in ks}) == 1
    assert "Add" in ks[0].op_types and ks[0].notes["path"].startswith("winograd")


def test_conv_winograd_tiling_key_excludes_batch(winograd_forced):
    """The Winograd plan is one image's: the same key at every batch, N x its tiles."""
    from cannc.codegen import winograd as wg

    node = Node(name="c", op_type="Conv", inputs=("x", "w", "b"), outputs=("y",),
                attrs={"pads": [1, 1, 1, 1]}, opset=17)

    def tiling(n, hw=14):
        ins = [TensorType(F32, (n, 64, hw, hw)), TensorType(F32, (64, 64, 3, 3)),
               TensorType(F32, (64,))]
        return conv_tiling(node, ins, [TensorType(F32, (n, 64, hw, hw))])

    t1, t8 = tiling(1), tiling(8)
    assert t1.key[:2] == ("conv", "winograd") and t1.key == t8.key and t8.dims == ()
    wplan = t1.key[3][0]
    assert t1.num_tiles == wplan.tiles_per_image and t8.num_tiles == 8 * t1.num_tiles
    assert t8.notes["gemm_flops"] == 8 * t1.notes["gemm_flops"]
    assert t1.workspace_bytes == t8.workspace_bytes >= wplan.ws_bytes
    assert tiling(1, hw=28).key != t1.key
    # the selection (and plan) is the one image's at any batch
    geom = conv_geom_of(node, [TensorType(F32, (8, 64, 14, 14)), TensorType(F32, (64, 64, 3, 3)),
                               TensorType(F32, (64,))], [TensorType(F32, (8, 64, 14, 14))])[0]
    for n in (1, 3, 8):
        p = wg.choose(dc_replace(geom, N=n), "auto")
        assert (p is None) == (wg.choose(dc_replace(geom, N=1), "auto") is None)
        if p is not None:
            assert dc_replace(p, num_tiles=0) == dc_replace(wplan, num_tiles=0)


# -- Conv + epilogue (FusedConv) ----------------------------------------------------------


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _model(nodes, inputs, outputs, inits):
    g = helper.make_graph(nodes, "dyn_conv", inputs, outputs,
                          initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = min(m.ir_version, 9)
    return m


def _bn(prefix, c):
    return {f"{prefix}_s": (1 + 0.1 * f32(c)), f"{prefix}_b": 0.1 * f32(c),
            f"{prefix}_m": 0.1 * f32(c), f"{prefix}_v": (1 + 0.2 * np.abs(f32(c)))}


def _bn_node(prefix, x, y):
    return helper.make_node("BatchNormalization", [x, f"{prefix}_s", f"{prefix}_b",
                                                   f"{prefix}_m", f"{prefix}_v"], [y])


@pytest.mark.parametrize("act", ["Relu", "Clip"])
def test_fused_conv_bn_act_residual(act):
    """Conv + BatchNormalization (folded) + residual Add ('full' operand: one offset per
    image) + ReLU / ReLU6 in one FusedConv kernel."""
    C = 16
    inits = {"w": f32(C, C, 3, 3, scale=(9 * C) ** -0.5), "cb": f32(C), **_bn("bn", C),
             "lo": np.array(0.0, np.float32), "hi": np.array(1.5, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w", "cb"], ["c"], pads=[1, 1, 1, 1]),
             _bn_node("bn", "c", "n"),
             helper.make_node("Add", ["n", "x"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"]) if act == "Relu" else
             helper.make_node("Clip", ["a", "lo", "hi"], ["y"])]
    m = _model(nodes, [_vi("x", ["N", C, 10, 9])], [_vi("y", ["N", C, 10, 9])], inits)
    sess = check_runtime_dims(m, [{"x": f32(b, C, 10, 9)} for b in BATCHES], **TOL)
    ks = [k for sp in sess.specializations for k in sp.kernels]
    assert all(len(sp.kernels) == 1 for sp in sess.specializations), [k.op_types for k in ks]
    assert len({k.symbol for k in ks}) == 1 and "Add" in ks[0].op_types


def test_residual_conv_tiles_few_channel_rows():
    """A 1x1 conv whose epilogue reads a residual of the output's shape: tiles of at most
    RESIDUAL_ROWS channel rows and long pixel runs (the output and the residual are CH
    streams each), the X block a tile re-reads within half of L2; without the read the
    plan is the geometry's own. Compiled through FusedConv: the kernel's plan is the
    residual one, and it matches onnxruntime at every batch."""
    from cannc.codegen import conv as cc
    from cannc.schedule.machine import l2_bytes

    C, M, H, W = 32, 96, 20, 20
    geom = cc.ConvGeom(N=1, C=64, M=256, G=1, isz=(1, 56, 56), osz=(1, 56, 56),
                       k=(1, 1, 1), bias=True)
    # (reading X in place: the planner's own choice packs pixel panels, ConvPlan.panels)
    assert cc.plan_conv(geom, tuning={}, reads=1).panels
    plain = cc.plan_conv(geom, tuning={"direct": True})
    res = cc.plan_conv(geom, tuning={"direct": True}, reads=1)
    assert plain.direct and not plain.swap and plain.CH > cc.RESIDUAL_ROWS, plain
    assert res.direct and not res.swap and res.CH <= cc.RESIDUAL_ROWS, res
    assert plain.P < res.P and 4 * geom.K * res.P <= l2_bytes() // 2, (plain, res)

    inits = {"w": f32(M, C, 1, 1, scale=C ** -0.5), "cb": f32(M)}
    nodes = [helper.make_node("Conv", ["x", "w", "cb"], ["c"]),
             helper.make_node("Add", ["c", "res"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    m = _model(nodes, [_vi("x", ["N", C, H, W]), _vi("res", ["N", M, H, W])],
               [_vi("y", ["N", M, H, W])], inits)
    feeds = [{"x": f32(b, C, H, W), "res": f32(b, M, H, W)} for b in BATCHES]
    sess = check_runtime_dims(m, feeds, **TOL)
    ks = kernels_of(sess, "Conv")
    assert len({k.symbol for k in ks}) == 1 and "Add" in ks[0].op_types
    want = cc.plan_conv(cc.ConvGeom(N=1, C=C, M=M, G=1, isz=(1, H, W), osz=(1, H, W),
                                    k=(1, 1, 1), bias=True), tuning={}, reads=1)
    # (96 channels pack panels: a tile's rows share its packed block, not few rows a tile)
    assert (want.panels or want.CH <= cc.RESIDUAL_ROWS) and \
        f"CH{want.CH}x{want.MB}" in ks[0].notes["path"], ks[0].notes["path"]


def test_fused_conv_operand_patterns():
    """Epilogue operands indexed per channel (a [1, M, 1, 1] runtime input), per element
    (a residual input) and a runtime scalar, on the swapped orientation (lanes along
    channels, so operand lanes are OHW apart)."""
    C, M, H, W = 64, 48, 7, 7
    inits = {"w": f32(M, C, 3, 3, scale=(9 * C) ** -0.5), "cb": f32(M)}
    nodes = [helper.make_node("Conv", ["x", "w", "cb"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c", "scale"], ["s"]),
             helper.make_node("Add", ["s", "res"], ["a"]),
             helper.make_node("Sub", ["a", "k"], ["y"])]
    m = _model(nodes, [_vi("x", ["N", C, H, W]), _vi("scale", [1, M, 1, 1]),
                       _vi("res", ["N", M, H, W]), _vi("k", [])],
               [_vi("y", ["N", M, H, W])], inits)
    scale, k = f32(1, M, 1, 1), np.array(0.25, np.float32)
    feeds = [{"x": f32(b, C, H, W), "scale": scale, "res": f32(b, M, H, W), "k": k}
             for b in BATCHES]
    sess = check_runtime_dims(m, feeds, **TOL)
    ks = kernels_of(sess, "Conv")
    assert len({k.symbol for k in ks}) == 1 and {"Mul", "Add", "Sub"} <= set(ks[0].op_types)


def test_fused_depthwise_clip():
    """MobileNet's depthwise Conv + BN + ReLU6 (the window kernel with an epilogue)."""
    C = 24
    inits = {"w": f32(C, 1, 3, 3, scale=1 / 3), **_bn("bn", C),
             "lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], group=C, pads=[1, 1, 1, 1],
                              strides=[2, 2]),
             _bn_node("bn", "c", "n"),
             helper.make_node("Clip", ["n", "lo", "hi"], ["y"])]
    m = _model(nodes, [_vi("x", ["N", C, 13, 14])], [_vi("y", ["N", C, 7, 7])], inits)
    sess = check_runtime_dims(m, [{"x": 3 * f32(b, C, 13, 14)} for b in BATCHES], **TOL)
    ks = kernels_of(sess, "Conv")
    assert len({k.symbol for k in ks}) == 1 and "depthwise" in ks[0].notes["path"]


# -- pools ----------------------------------------------------------------------------------

POOL_CASES = {
    "max-3x3-s2-pad1": ("MaxPool", (2, 5, 22, 22), dict(kernel_shape=[3, 3], strides=[2, 2],
                                                         pads=[1, 1, 1, 1])),
    "max-ceil": ("MaxPool", (2, 3, 9, 11), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    "max-wide": ("MaxPool", (2, 4, 9, 300), dict(kernel_shape=[2, 2], strides=[1, 3])),
    "max-3d": ("MaxPool", (2, 2, 5, 6, 7), dict(kernel_shape=[2, 2, 2], strides=[2, 2, 2])),
    "avg-pad": ("AveragePool", (2, 3, 9, 11), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    "avg-include-pad-ceil": ("AveragePool", (2, 3, 10, 11),
                             dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1,
                                  pads=[1, 1, 1, 1], count_include_pad=1)),
    "avg-7x7-global-like": ("AveragePool", (2, 64, 7, 7), dict(kernel_shape=[7, 7])),
    "avg-1d": ("AveragePool", (2, 3, 20), dict(kernel_shape=[4], strides=[3])),
    "lp-p2": ("LpPool", (2, 3, 10, 11), dict(kernel_shape=[3, 3], p=2, pads=[1, 1, 1, 1])),
}


@pytest.mark.parametrize("name", list(POOL_CASES))
def test_pool(name):
    op, xs, attrs = POOL_CASES[name]
    m, _ = single_node_model(op, [f32(*xs)], **attrs)
    sess = check_runtime_dims(dynamic(m), [{"in0": f32(b, *xs[1:])} for b in BATCHES],
                              rtol=1e-4, atol=1e-5)
    assert_one_kernel_per_batch(sess, op)


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("xs", [(2, 16, 7, 7), (2, 5, 3, 4, 6), (2, 40, 9)], ids=["2d", "3d", "1d"])
def test_global_pool(op, xs):
    m, _ = single_node_model(op, [f32(*xs)])
    sess = check_runtime_dims(dynamic(m), [{"in0": f32(b, *xs[1:])} for b in BATCHES], **TOL)
    assert len({k.symbol for k in kernels_of(sess, op)}) == 1


# -- a small ResNet ---------------------------------------------------------------------------


def tiny_resnet(head: bool = False, classes: int = 10) -> onnx.ModelProto:
    """Stem (7x7/2 conv + BN + ReLU + 3x3/2 max pool), a basic block and a stride-2 basic
    block with a 1x1 projection, as torchvision's ResNet; with ``head``, its global
    average pool, Flatten and the classifier (Gemm) too."""
    inits: dict[str, np.ndarray] = {}
    nodes = []

    def conv_bn(x, cin, cout, k, stride, name, relu=True):
        inits[f"{name}_w"] = f32(cout, cin, k, k, scale=(2.0 / (cin * k * k)) ** 0.5)
        inits.update(_bn(f"{name}_bn", cout))
        p = (k - 1) // 2
        nodes.append(helper.make_node("Conv", [x, f"{name}_w"], [f"{name}_c"], kernel_shape=[k, k],
                                      strides=[stride] * 2, pads=[p] * 4))
        nodes.append(_bn_node(f"{name}_bn", f"{name}_c", f"{name}_n"))
        if not relu:
            return f"{name}_n"
        nodes.append(helper.make_node("Relu", [f"{name}_n"], [f"{name}_r"]))
        return f"{name}_r"

    def block(x, cin, cout, stride, name):
        h = conv_bn(x, cin, cout, 3, stride, f"{name}a")
        h = conv_bn(h, cout, cout, 3, 1, f"{name}b", relu=False)
        sc = conv_bn(x, cin, cout, 1, stride, f"{name}d", relu=False) if stride > 1 else x
        nodes.append(helper.make_node("Add", [h, sc], [f"{name}_sum"]))
        nodes.append(helper.make_node("Relu", [f"{name}_sum"], [f"{name}_out"]))
        return f"{name}_out"

    h = conv_bn("x", 3, 8, 7, 2, "stem")
    nodes.append(helper.make_node("MaxPool", [h], ["pool"], kernel_shape=[3, 3], strides=[2, 2],
                                  pads=[1, 1, 1, 1]))
    h = block("pool", 8, 8, 1, "l1")
    h = block(h, 8, 16, 2, "l2")
    if not head:
        return _model(nodes, [_vi("x", ["N", 3, 32, 32])], [_vi(h, ["N", 16, 4, 4])], inits)
    inits["fc_w"] = f32(classes, 16, scale=0.25)
    inits["fc_b"] = f32(classes)
    nodes += [helper.make_node("GlobalAveragePool", [h], ["gap"]),
              helper.make_node("Flatten", ["gap"], ["flat"], axis=1),
              helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1)]
    return _model(nodes, [_vi("x", ["N", 3, 32, 32])], [_vi("logits", ["N", classes])], inits)


def test_tiny_resnet():
    m = tiny_resnet()
    sess = check_runtime_dims(m, [{"x": f32(b, 3, 32, 32)} for b in BATCHES], **TOL)
    convs = kernels_of(sess, "Conv")
    assert len({k.symbol for k in convs}) == len(convs) // len(BATCHES) >= 5
    assert len({k.symbol for k in kernels_of(sess, "MaxPool")}) == 1


@pytest.mark.parametrize("mode", ["auto", "force"])
def test_tiny_resnet_classifier(monkeypatch, mode):
    """The whole network, global average pool and classifier included, compiles once and
    runs at every batch; forced, its 3x3 stride-1 convs take the Winograd path."""
    monkeypatch.setattr(config, "WINOGRAD", mode)
    m = tiny_resnet(head=True)
    sess = check_runtime_dims(m, [{"x": f32(b, 3, 32, 32)} for b in BATCHES], **TOL)
    assert len({k.symbol for k in kernels_of(sess, "GlobalAveragePool")}) == 1
    paths = {k.notes["path"] for k in kernels_of(sess, "Conv")}
    assert any(p.startswith("winograd") for p in paths) == (mode == "force"), paths
