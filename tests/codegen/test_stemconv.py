"""The stem conv kernel (codegen/stemconv.py) against onnxruntime.

Strided convs over few input channels read X in place from column-phase rows: the
cases cross X's edges on every side (pads, widths that are no multiple of the stride
or of 16), leave a short channel group (M no multiple of MR) and a short last vector,
run several images (the tile index carries the image), runtime weights, fused
epilogues, and a 2-core split of the row blocks; the plan checks pin what the kernel
relies on.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc import config
from cannc.codegen import stemconv
from cannc.codegen.conv import ConvGeom
from tests.helpers import assert_matches_ort, restrict_host_to_avx2, single_node_model

RNG = np.random.default_rng(7)


def rnd(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def geom(C=3, M=32, H=224, W=224, k=3, s=2, p=1, G=1, d=1):
    OH, OW = (H + 2 * p - d * (k - 1) - 1) // s + 1, (W + 2 * p - d * (k - 1) - 1) // s + 1
    return ConvGeom(N=1, C=C, M=M, G=G, isz=(1, H, W), osz=(1, OH, OW), k=(1, k, k),
                    s=(1, s, s), d=(1, d, d), pb=(0, p, p))


def test_eligible():
    assert stemconv.eligible(geom())                        # MobileNet's 3x3/2
    assert stemconv.eligible(geom(M=64, k=7, p=3))          # ResNet's 7x7/2
    assert stemconv.eligible(geom(M=96, k=4, s=4, p=0))     # ConvNeXt's 4x4/4 patches
    assert not stemconv.eligible(geom(C=16))                # many input channels: GEMM
    assert not stemconv.eligible(geom(s=1))                 # stride 1: the direct GEMM
    assert not stemconv.eligible(geom(s=3))
    assert not stemconv.eligible(geom(k=1, p=0))            # kernel narrower than stride
    assert not stemconv.eligible(geom(M=4))
    assert not stemconv.eligible(geom(H=20, W=20))          # rows of less than a vector
    assert not stemconv.eligible(geom(d=2))
    assert not stemconv.eligible(geom(k=16, s=16, p=0))     # ViT's patches: 256 taps
    assert stemconv.choose(geom(), "off") is None
    assert stemconv.choose(geom(H=40, W=40, M=8), "auto") is None   # too small to matter
    assert stemconv.choose(geom(H=40, W=40, M=8), "force") is not None


def test_plan():
    g = geom(M=64, k=7, p=3)                         # 112 x 112 output
    p = stemconv.plan_stem(g, {})
    assert p.RB * p.R >= 112 > (p.RB - 1) * p.R
    assert p.SR == (p.R - 1) * 2 + 7
    # a slab row holds every pixel a tap of any column block reads
    assert p.LP % 16 == 0 and p.LP >= 112 + 3
    assert p.ws_bytes >= 4 * 3 * p.SR * 2 * p.LP
    assert p.num_tiles == p.RB
    assert stemconv.plan_stem(dataclasses.replace(g, N=5), {}).num_tiles == 5 * p.RB
    q = stemconv.plan_stem(g, {"MR": 3, "NV": 2, "R": 5})
    assert (q.MR, q.NV, q.R, q.RB) == (3, 2, 5, 23)


# (x shape, w shape, attrs)
CASES = [
    ((1, 3, 64, 64), (32, 3, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    ((2, 3, 61, 75), (24, 3, 7, 7), dict(pads=[3, 3, 3, 3], strides=[2, 2])),
    ((1, 3, 48, 76), (18, 3, 4, 4), dict(strides=[4, 4])),
    ((1, 1, 40, 70), (10, 1, 3, 3), dict(pads=[0, 1, 2, 0], strides=[2, 2])),
    ((1, 4, 33, 97), (9, 4, 5, 3), dict(pads=[2, 1, 2, 1], strides=[1, 2])),
    ((1, 2, 30, 131), (16, 2, 3, 5), dict(pads=[1, 2, 0, 2], strides=[3, 2])),
    ((3, 3, 35, 69), (8, 3, 3, 3), dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    ((1, 3, 21, 300), (12, 3, 6, 6), dict(pads=[2, 3, 2, 1], strides=[4, 4])),
    ((1, 3, 67, 71), (16, 3, 11, 11), dict(pads=[2, 2, 2, 2], strides=[4, 4])),  # AlexNet's
]


def _id(c):
    xs, ws, a = c
    return "x" + "x".join(map(str, xs)) + "-w" + "x".join(map(str, ws)) + "-s" + \
        "x".join(map(str, a.get("strides", [1, 1])))


def _inputs(xs, ws, bias=True):
    fan_in = int(np.prod(ws[1:]))
    x, w = rnd(*xs), rnd(*ws, scale=1.0 / np.sqrt(fan_in))
    return [x, w, rnd(ws[0])] if bias else [x, w]


def _stem_kernels(sess):
    return [k for sp in sess.specializations for k in sp.kernels
            if k.notes.get("path", "").startswith("stem-direct")]


@pytest.fixture
def forced(monkeypatch):
    """Every eligible conv takes the stem path, whatever its size."""
    monkeypatch.setattr(config, "STEM_CONV", "force")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
@pytest.mark.parametrize("bias", [True, False])
def test_stem_conv(forced, case, bias):
    xs, ws, attrs = case
    m, feeds = single_node_model("Conv", _inputs(xs, ws, bias), const_inputs=(1, 2), **attrs)
    assert_matches_ort(m, feeds, rtol=1e-4, atol=1e-5)
    sess = cannc.compile(m, cores=2)
    assert _stem_kernels(sess), "the conv did not take the stem path"


@pytest.mark.parametrize("case", CASES[:3], ids=[_id(c) for c in CASES[:3]])
def test_stem_conv_runtime_weights(forced, case):
    xs, ws, attrs = case
    m, feeds = single_node_model("Conv", _inputs(xs, ws), const_inputs=(), **attrs)
    assert_matches_ort(m, feeds, rtol=1e-4, atol=1e-5, cores=1)


@pytest.mark.parametrize("tuning", [{"MR": 3, "NV": 1, "R": 1}, {"MR": 5, "NV": 3, "R": 3},
                                    {"MR": 8, "NV": 2, "R": 8}])
def test_stem_conv_tunings(forced, monkeypatch, tuning):
    """Other micro-tiles and row blocks: short channel groups (M % MR), column blocks
    of one vector, a last row block of fewer rows."""
    monkeypatch.setattr(stemconv, "FORCE_TUNING", tuning)
    for xs, ws, attrs in (CASES[1], CASES[5]):
        m, feeds = single_node_model("Conv", _inputs(xs, ws), const_inputs=(1, 2), **attrs)
        assert_matches_ort(m, feeds, rtol=1e-4, atol=1e-5)


def test_stem_conv_fused_epilogue_dynamic_batch(forced):
    """Conv + Clip (MobileNet's stem, fused) with a batch dimension left open: the
    kernel of one image's plan runs every batch size."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 50, 66])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 20, 25, 33])
    w = rnd(20, 3, 3, 3, scale=0.2)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(rnd(20), "b"),
             numpy_helper.from_array(np.float32(0.0), "lo"),
             numpy_helper.from_array(np.float32(6.0), "hi")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1],
                              strides=[2, 2]),
             helper.make_node("Clip", ["c", "lo", "hi"], ["y"])]
    m = helper.make_model(helper.make_graph(nodes, "stem", [x], [y], inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.checker.check_model(m)
    sess = cannc.compile(m, cores=2)
    from tests.helpers import ort_run
    for n in (1, 3):
        feeds = {"x": rnd(n, 3, 50, 66, scale=3.0)}
        np.testing.assert_allclose(sess.run(None, feeds)[0], ort_run(m, feeds)[0],
                                   rtol=1e-4, atol=1e-5)
    ks = _stem_kernels(sess)
    assert ks and all("Clip" in k.op_types for k in ks)
    assert len({k.symbol for k in ks}) == 1     # one kernel for every batch


def test_stem_conv_avx2(forced, monkeypatch):
    """AVX2's 2 x 3 micro-tiles: rows of 2-5 vectors (blocks of 3 and the rest, a
    masked last vector), 1-2 channels past the last whole tile."""
    restrict_host_to_avx2(monkeypatch)
    g = ConvGeom(N=1, C=3, M=64, G=1, isz=(1, 224, 224), osz=(1, 112, 112), k=(1, 7, 7),
                 s=(1, 2, 2), pb=(0, 3, 3))
    p = stemconv.plan_stem(g, {})
    assert (p.MR, p.NV) == (2, 3), p
    for xs, ws, attrs in CASES[:3] + [CASES[5], CASES[7]]:
        m, feeds = single_node_model("Conv", _inputs(xs, ws), const_inputs=(1, 2), **attrs)
        assert_matches_ort(m, feeds, rtol=1e-4, atol=1e-5)


def test_stem_conv_off(monkeypatch):
    """CANNC_STEM_CONV=0: the implicit GEMM, same results."""
    monkeypatch.setattr(config, "STEM_CONV", "off")
    xs, ws, attrs = CASES[1]
    m, feeds = single_node_model("Conv", _inputs(xs, ws), const_inputs=(1, 2), **attrs)
    assert_matches_ort(m, feeds, rtol=1e-4, atol=1e-5)
    assert not _stem_kernels(cannc.compile(m, cores=2))
