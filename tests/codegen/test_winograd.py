"""The Winograd Conv path (codegen/winograd.py) against onnxruntime, and its selection.

Every compile here uses a fresh lowering memo (CANNC_CACHE_DIR -> tmp_path): the memo
is keyed by the node, not by ``config.WINOGRAD``, so a kernel lowered under one mode
must not be reused under another. Most cases force the path (``config.WINOGRAD =
"force"``) and assert that the kernel really took it.
"""

from __future__ import annotations

import ctypes
import importlib
from fractions import Fraction

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc import config
from cannc.codegen import winograd as wg
from cannc.codegen.conv import ConvGeom, Slots
from cannc.native.target import jit_kernel, new_module
from tests.helpers import aligned, ort_run, restrict_host_to_avx2, run_splits, single_node_model

RNG = np.random.default_rng(7)
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch, tmp_path):
    monkeypatch.setenv("CANNC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(config, "WINOGRAD", "force")


def conv_inputs(xs, ws, bias=True, relu=False):
    x = RNG.standard_normal(xs).astype(np.float32)
    if relu:
        x = np.maximum(x, 0)
    w = (RNG.standard_normal(ws) * np.sqrt(2.0 / np.prod(ws[1:]))).astype(np.float32)  # He init
    return [x, w, RNG.standard_normal(ws[0]).astype(np.float32)] if bias else [x, w]


def kernel_notes(sess) -> list[dict]:
    return [k.notes for s in sess.specializations for k in s.kernels]


def conv_path(sess) -> str:
    (n,) = [n for n in kernel_notes(sess) if "path" in n]
    return n["path"]


def compare(model, feeds, tol=TOL):
    """Compile (2 cores), run, compare with onnxruntime; returns the session."""
    exp = ort_run(model, feeds)
    sess = cannc.compile(model, cores=2, shapes={k: v.shape for k, v in feeds.items()})
    for got, e in zip(sess.run(None, feeds), exp):
        assert got.shape == e.shape and got.dtype == e.dtype
        np.testing.assert_allclose(got, e, **tol)
    return sess


def run_conv(inputs, tol=TOL, **attrs):
    m, feeds = single_node_model("Conv", inputs, const_inputs=tuple(range(1, len(inputs))),
                                 **attrs)
    return compare(m, feeds, tol)


# ---------------------------------------------------------------------------
# transform matrices
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("m", [2, 4])
def test_matrices_compute_a_correlation(m):
    AT, G, BT = wg.matrices(m)
    d = [Fraction(int(v)) for v in RNG.integers(-9, 9, m + 2)]
    g = [Fraction(int(v)) for v in RNG.integers(-9, 9, 3)]
    gg = [sum(G[j][k] * g[k] for k in range(3)) for j in range(m + 2)]
    dd = [sum(BT[j][i] * d[i] for i in range(m + 2)) for j in range(m + 2)]
    y = [sum(AT[i][j] * gg[j] * dd[j] for j in range(m + 2)) for i in range(m)]
    assert y == [sum(d[i + k] * g[k] for k in range(3)) for i in range(m)]


# ---------------------------------------------------------------------------
# cannc vs onnxruntime, path forced
# ---------------------------------------------------------------------------

CASES = [
    # odd H/W (not multiples of the 2x2 tile), C/M not multiples of 16
    ((1, 5, 9, 7), (7, 5, 3, 3), dict(pads=[1, 1, 1, 1]), True),
    ((3, 20, 9, 13), (35, 20, 3, 3), dict(pads=[1, 2, 1, 0]), True),       # asymmetric pads
    ((1, 17, 10, 11), (40, 17, 3, 3), {}, True),                          # no padding
    ((3, 3, 5, 5), (9, 3, 3, 3), dict(pads=[0, 1, 2, 0]), False),         # no bias
    ((1, 33, 23, 37), (19, 33, 3, 3), dict(auto_pad="SAME_UPPER"), True),  # rows path, TW >= 8
    ((2, 24, 31, 18), (48, 24, 3, 3), dict(pads=[1, 1, 1, 1]), True),
    ((1, 8, 3, 40), (16, 8, 3, 3), dict(pads=[1, 0, 1, 0]), True),        # a single tile row
]


@pytest.mark.parametrize("xs,ws,attrs,bias", CASES,
                         ids=[f"x{'x'.join(map(str, c[0]))}-m{c[1][0]}-{c[2]}" for c in CASES])
def test_winograd_matches_ort(xs, ws, attrs, bias):
    sess = run_conv(conv_inputs(xs, ws, bias), **attrs)
    assert conv_path(sess).startswith("winograd F(2,3)")


FORCED = [
    dict(CB=7, PT=16, MR=6),     # several reduction blocks; tile blocks cutting tile rows
    dict(CH=32, PT=24, MR=7),    # several channel blocks (input transform per block)
    dict(NV=1, MR=8, PT=8),      # 16-channel panels, more Winograd tiles than one block
    dict(CB=16, CH=64, PT=40),
    dict(CH=16, PT=16),          # below one 32-channel panel: rounded up to a panel
]


@pytest.mark.parametrize("tuning", FORCED, ids=[",".join(f"{k}={v}" for k, v in t.items())
                                                for t in FORCED])
@pytest.mark.parametrize("xs,isa", [((2, 20, 9, 13), "host"), ((1, 20, 21, 34), "host"),
                                    ((1, 20, 21, 34), "avx2")],
                         ids=["gather", "rows", "rows-avx2"])
def test_winograd_forced_plans(monkeypatch, tuning, xs, isa):
    if isa == "avx2":
        restrict_host_to_avx2(monkeypatch)
    monkeypatch.setattr(wg, "FORCE_TUNING", tuning)
    sess = run_conv(conv_inputs(xs, (70, 20, 3, 3)), pads=[1, 2, 1, 0])
    path = conv_path(sess)
    assert path.startswith("winograd") and f"PT{tuning['PT']}x" in path


@pytest.mark.parametrize("act", ["normal", "relu"])
@pytest.mark.parametrize("N,C,H", [(1, 64, 28), (3, 128, 14), (2, 512, 7)])
def test_winograd_resnet_accuracy(N, C, H, act):
    """Realistic data (He-init weights, N(0,1) or post-ReLU activations) at the
    tolerance of the conv tests."""
    sess = run_conv(conv_inputs((N, C, H, H), (C, C, 3, 3), relu=act == "relu"),
                    pads=[1, 1, 1, 1])
    assert conv_path(sess).startswith("winograd F(2,3)")


def test_winograd_f43_experimental(monkeypatch):
    """F(4,3) (gather input transform) is not selected (accuracy, see the module doc)
    but computes the convolution: checked at a tolerance it meets."""
    monkeypatch.setattr(wg, "FORCE_TUNING", dict(m=4))
    sess = run_conv(conv_inputs((2, 12, 11, 9), (20, 12, 3, 3)), tol=dict(rtol=1e-3, atol=1e-4),
                    pads=[1, 1, 0, 1])
    assert conv_path(sess).startswith("winograd F(4,3)")


# ---------------------------------------------------------------------------
# fused epilogue: Conv + Mul (per channel) + Add (residual) + Relu / Clip
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("act", ["relu", "clip"])
def test_winograd_fused_epilogue(act):
    N, C, M, H, W = 2, 20, 36, 15, 13
    x, w, cb = conv_inputs((N, C, H, W), (M, C, 3, 3))
    F = TensorProto.FLOAT
    nodes = [helper.make_node("Conv", ["x", "w", "cb"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c", "cs"], ["s"]),
             helper.make_node("Add", ["s", "r"], ["a"])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(cb, "cb"),
             numpy_helper.from_array(RNG.standard_normal((M, 1, 1)).astype(np.float32), "cs")]
    if act == "relu":
        nodes.append(helper.make_node("Relu", ["a"], ["y"]))
    else:
        nodes.append(helper.make_node("Clip", ["a", "lo", "hi"], ["y"]))
        inits += [numpy_helper.from_array(np.float32(-0.5), "lo"),
                  numpy_helper.from_array(np.float32(1.0), "hi")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [N, C, H, W]),
                                       helper.make_tensor_value_info("r", F, [N, M, H, W])],
                          [helper.make_tensor_value_info("y", F, [N, M, H, W])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": x, "r": RNG.standard_normal((N, M, H, W)).astype(np.float32)}
    sess = compare(model, feeds)
    (notes,) = [n for n in kernel_notes(sess) if "path" in n]
    assert notes["path"].startswith("winograd") and "Add" in notes.get("epilogue", "")


def test_winograd_epilogue_offsets():
    """The epilogue sees lane i as Y.flat[offset + i*stride] (stride 1: F(2,3) stores
    along pixels): an epilogue adding that index reveals where each lane is stored."""
    from tests.ops.test_conv import _index_epilogue

    x, w, bias = conv_inputs((2, 12, 9, 11), (40, 12, 3, 3))
    g = ConvGeom(N=2, C=12, M=40, G=1, isz=(1, 9, 11), osz=(1, 9, 11), k=(1, 3, 3), pb=(0, 1, 1),
                 bias=True)
    plan = wg.plan_winograd(g, tuning=dict(PT=16, CH=32))
    got = _run(g, plan, [x, wg.pack_winograd_weights(g, plan, w), bias], epilogue=_index_epilogue)
    m, feeds = single_node_model("Conv", [x, w, bias], const_inputs=(1, 2), pads=[1, 1, 1, 1])
    ref = ort_run(m, feeds)[0]
    np.testing.assert_allclose(got, ref + np.arange(ref.size).reshape(ref.shape), rtol=1e-4,
                               atol=1e-3)


def _run(g, plan, inputs, epilogue=None, splits=None):
    mod = new_module("wino_test")
    slots = Slots(x=0, w=1, b=2 if g.bias else -1, y=len(inputs))
    wg.emit_winograd(mod, "k", g, plan, slots, epilogue=epilogue)
    fn = jit_kernel(mod, "k")
    bufs = [aligned(a.shape) for a in inputs]
    for b_, a in zip(bufs, inputs):
        b_[...] = a
    y = aligned((g.N, g.M) + g.osz[1:])
    y[...] = np.nan
    argv = (ctypes.c_void_p * (len(bufs) + 1))(*[a.ctypes.data for a in bufs], y.ctypes.data)
    run_splits(fn, ctypes.addressof(argv), plan.num_tiles, plan.ws_bytes, splits=splits)
    return y


@pytest.mark.parametrize("isa", ["host", "avx2"])
def test_winograd_tile_ranges_and_workspace(monkeypatch, isa):
    """Any split of [0, num_tiles) gives the same result; nothing is written outside the
    workspace (guards) and every output element is written (Y starts as NaN). Under AVX2
    the input transform writes whole vectors past short segments (inside V's rows)."""
    if isa == "avx2":
        restrict_host_to_avx2(monkeypatch)
    x, w, bias = conv_inputs((2, 21, 12, 19), (37, 21, 3, 3))
    g = ConvGeom(N=2, C=21, M=37, G=1, isz=(1, 12, 19), osz=(1, 12, 19), k=(1, 3, 3),
                 pb=(0, 1, 1), bias=True)
    plan = wg.plan_winograd(g, tuning=dict(PT=24, CH=32, CB=8, MR=6))
    assert plan.num_tiles >= 6 and plan.nkb > 1 and plan.MB > 1
    wp = wg.pack_winograd_weights(g, plan, w)
    T = plan.num_tiles
    a = _run(g, plan, [x, wp, bias])
    b = _run(g, plan, [x, wp, bias], splits=[0, 1, 2, T - 3, T])
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
    m, feeds = single_node_model("Conv", [x, w, bias], const_inputs=(1, 2), pads=[1, 1, 1, 1])
    np.testing.assert_allclose(a, ort_run(m, feeds)[0], **TOL)


def test_avx2_reduction_blocks_fit_half_of_l1(monkeypatch):
    """AVX2 plans reduce in blocks of at most conv.swap_kc_avx2 channels (128 on a
    32 KiB L1), as the swapped conv does; AVX-512 keeps blocks of 256."""
    from cannc.codegen import conv as conv_codegen
    g = ConvGeom(N=1, C=256, M=256, G=1, isz=(1, 14, 14), osz=(1, 14, 14), k=(1, 3, 3),
                 pb=(0, 1, 1))
    if wg.wide_registers():
        assert wg._plan_winograd(g, 2, {}).CB == 256
    restrict_host_to_avx2(monkeypatch)
    monkeypatch.setattr(conv_codegen, "l1d_bytes", lambda: 32 << 10)
    p = wg._plan_winograd(g, 2, {})
    assert (p.CB, p.nkb) == (128, 2), p


# ---------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------

def _compile_conv(xs, ws, **attrs):
    m, feeds = single_node_model("Conv", conv_inputs(xs, ws), const_inputs=(1, 2), **attrs)
    return cannc.compile(m, cores=2, shapes={k: v.shape for k, v in feeds.items()})


def test_selection_takes_winograd_for_resnet_layer(monkeypatch):
    monkeypatch.setattr(config, "WINOGRAD", "auto")
    sess = _compile_conv((1, 64, 56, 56), (64, 64, 3, 3), pads=[1, 1, 1, 1])
    (k,) = [k for s in sess.specializations for k in s.kernels]
    assert k.notes["path"].startswith("winograd F(2,3)")
    # GFLOP/s stay comparable: flops are the direct convolution's, the GEMMs do fewer
    assert k.flops == 2 * 64 * 56 * 56 * 64 * 9
    assert k.notes["gemm_flops"] == 2 * 16 * 28 * 28 * 64 * 64


def _sapphire_rapids_memory(monkeypatch, mem_gbps=13.5):
    """The peaks and L2 of the Sapphire Rapids guest whose figures chose the rule."""
    monkeypatch.setattr(wg, "peaks", lambda: {"fp32_gflops_per_core": 200.0,
                                              "mem_gbps": mem_gbps})
    monkeypatch.setattr(wg, "l2_bytes", lambda: 2 << 20)


def test_selection_weighs_the_weights_memory_time(monkeypatch):
    """Winograd's weights are 16/9 of the direct ones and stream once a call: at 7x7 with
    512 channels (9.4 MB direct) one image does too few flops to pay for them, a batch
    of 8 does; 256 channels at 14x14 keep Winograd at batch 1; with a fast memory (or
    weights that stay in L2) the flops alone decide, as before."""
    _sapphire_rapids_memory(monkeypatch)

    def geom(c, hw):
        return ConvGeom(N=1, C=c, M=c, G=1, isz=(1, hw, hw), osz=(1, hw, hw), k=(1, 3, 3),
                        pb=(0, 1, 1), bias=True)
    assert wg.choose(geom(512, 7), batch=1) is None
    assert wg.choose(geom(512, 7), batch=8) is not None
    assert wg.choose(geom(256, 14), batch=1) is not None
    assert wg.choose(geom(128, 28), batch=1) is not None
    _sapphire_rapids_memory(monkeypatch, mem_gbps=1e4)
    assert wg.choose(geom(512, 7), batch=1) is not None


def test_one_session_runs_batch_1_direct_and_batch_8_winograd(monkeypatch):
    """The choice is made per batch in conv_tiling: a model of any batch runs the implicit
    GEMM at batch 1 and Winograd at batch 8 (two kernels, each with its own packed
    weights), both matching onnxruntime."""
    monkeypatch.setattr(config, "WINOGRAD", "auto")
    _sapphire_rapids_memory(monkeypatch)
    x1, w, b = conv_inputs((1, 512, 7, 7), (512, 512, 3, 3))
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 512, 7, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = cannc.compile(model, cores=2)
    x8 = RNG.standard_normal((8, 512, 7, 7)).astype(np.float32)
    for x in (x1, x8):
        got = sess.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, ort_run(model, {"x": x})[0], **TOL)
    paths = {s.kernels[0].notes["path"].split()[0] for s in sess.specializations}
    assert paths == {"direct-gemm-swapped", "winograd"} or \
        paths == {"im2col-gemm-swapped", "winograd"}, paths


@pytest.mark.parametrize("mode", ["auto", "force"])
@pytest.mark.parametrize("xs,ws,attrs", [
    ((1, 64, 56, 56), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    ((1, 64, 56, 56), (64, 32, 3, 3), dict(pads=[1, 1, 1, 1], group=2)),
    ((1, 64, 56, 56), (64, 64, 3, 3), dict(pads=[2, 2, 2, 2], dilations=[2, 2])),
    ((1, 64, 56, 56), (64, 64, 5, 5), dict(pads=[2, 2, 2, 2])),
], ids=["stride2", "groups", "dilation", "5x5"])
def test_selection_skips_ineligible(monkeypatch, mode, xs, ws, attrs):
    monkeypatch.setattr(config, "WINOGRAD", mode)
    assert not conv_path(_compile_conv(xs, ws, **attrs)).startswith("winograd")


def test_selection_off_and_small(monkeypatch):
    monkeypatch.setattr(config, "WINOGRAD", "off")
    assert not conv_path(_compile_conv((1, 64, 56, 56), (64, 64, 3, 3),
                                       pads=[1, 1, 1, 1])).startswith("winograd")
    monkeypatch.setattr(config, "WINOGRAD", "auto")   # too small to pay for the transforms
    assert not conv_path(_compile_conv((1, 4, 8, 8), (4, 4, 3, 3),
                                       pads=[1, 1, 1, 1])).startswith("winograd")


def test_runtime_weights_do_not_use_winograd():
    m, feeds = single_node_model("Conv", conv_inputs((1, 16, 12, 12), (16, 16, 3, 3)),
                                 const_inputs=(2,), pads=[1, 1, 1, 1])
    sess = cannc.compile(m, cores=2, shapes={k: v.shape for k, v in feeds.items()})
    assert not conv_path(sess).startswith("winograd")


@pytest.mark.parametrize("value,mode", [("0", "off"), ("off", "off"), ("", "auto"), ("1", "auto"),
                                        ("force", "force")])
def test_env_switch(monkeypatch, value, mode):
    monkeypatch.setenv("CANNC_WINOGRAD", value)
    try:
        importlib.reload(config)
        assert config.WINOGRAD == mode
    finally:
        monkeypatch.delenv("CANNC_WINOGRAD")
        importlib.reload(config)
