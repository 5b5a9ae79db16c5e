"""The ONNX Attention op (ir/ops/attention_op.py + the legalize_attention pass): cannc
against onnxruntime's CPU Attention (opset 23/24), or against onnx.reference where
onnxruntime rejects the case (masks narrower than the keys, float16/bfloat16,
opset-25 sliding windows)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from helpers import ort_run
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import cannc
from cannc.errors import UnsupportedOpError
from cannc.ir.types import NP_TO_ONNX

R = np.random.default_rng(23)
INPUTS = ["Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen"]
OUTPUTS = ["Y", "present_key", "present_value", "qk_matmul_output"]


def f32(*shape, scale=1.0):
    return (R.standard_normal(shape) * scale).astype(np.float32)


def model(inputs: dict, n_out: int = 1, opset: int = 23, const: tuple = (),
          out_shapes: dict | None = None, **attrs):
    """One Attention node; inputs by name (absent ones omitted); `const` names become
    initializers; `out_shapes` gives output shapes ONNX cannot infer. Returns (model,
    feeds)."""
    names, gin, inits, feeds = [], [], [], {}
    for nm in INPUTS:
        a = inputs.get(nm)
        if a is None:
            names.append("")
            continue
        names.append(nm)
        if nm in const:
            inits.append(onnx.numpy_helper.from_array(a, nm))
        else:
            gin.append(helper.make_tensor_value_info(nm, NP_TO_ONNX[a.dtype], a.shape))
            feeds[nm] = a
    while names and not names[-1]:
        names.pop()
    outs = OUTPUTS[:n_out]
    if n_out == 4 and inputs.get("past_key") is None:
        outs = ["Y", "", "", "qk_matmul_output"]
    node = helper.make_node("Attention", names, outs, **attrs)
    et = NP_TO_ONNX[inputs["Q"].dtype]
    out_shapes = out_shapes or {}
    g = helper.make_graph([node], "attention", gin,
                          [helper.make_tensor_value_info(o, et, out_shapes.get(o))
                           for o in outs if o],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    m = onnx.shape_inference.infer_shapes(m)
    inferred = {v.name: v for v in m.graph.value_info}
    for vi in m.graph.output:
        if vi.name in inferred:
            vi.CopyFrom(inferred[vi.name])
    return m, feeds


def run_cannc(m, feeds, cores=2):
    sess = cannc.compile(m, cores=cores, shapes={k: v.shape for k, v in feeds.items()})
    return sess, sess.run(None, feeds)


def compare(got, exp, rtol, atol):
    assert len(got) == len(exp)
    for g, e in zip(got, exp):
        e = np.asarray(e)
        assert g.dtype == e.dtype, (g.dtype, e.dtype)
        assert g.shape == e.shape, (g.shape, e.shape)
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol,
                                   atol=atol)


def check(inputs, n_out=1, opset=23, ref="ort", cores=2, rtol=1e-4, atol=1e-5, const=(),
          out_shapes=None, **attrs):
    """Compile + run with cannc, compare with onnxruntime or onnx.reference; returns
    the session."""
    m, feeds = model(inputs, n_out, opset, const, out_shapes, **attrs)
    if ref == "ort":
        exp = ort_run(m, feeds)
    else:
        exp = ReferenceEvaluator(m).run(None, feeds)
    sess, got = run_cannc(m, feeds, cores)
    compare(got, exp, rtol, atol)
    return sess


def notes(sess) -> str:
    ks = [k for s in sess.specializations for k in s.kernels if "attention" in k.notes]
    assert len(ks) == 1
    return ks[0].notes["attention"]


# -- plain attention, 4-D and 3-D ----------------------------------------------------------
@pytest.mark.parametrize("B,H,Sq,Sk,D,Dv", [
    (2, 3, 4, 6, 8, 8), (1, 2, 37, 53, 24, 40), (2, 4, 1, 77, 64, 64), (1, 1, 130, 70, 17, 5),
])
def test_4d(B, H, Sq, Sk, D, Dv):
    s = check({"Q": f32(B, H, Sq, D), "K": f32(B, H, Sk, D), "V": f32(B, H, Sk, Dv)})
    assert "direct" in notes(s) and "guard" not in notes(s)


def test_scale():
    check({"Q": f32(2, 3, 9, 16), "K": f32(2, 3, 11, 16), "V": f32(2, 3, 11, 16)}, scale=0.3)


@pytest.mark.parametrize("hq,hkv", [(3, 3), (6, 2), (4, 1)])
def test_3d_heads(hq, hkv):
    D, Dv = 8, 12
    check({"Q": f32(2, 5, hq * D), "K": f32(2, 7, hkv * D), "V": f32(2, 7, hkv * Dv)},
          q_num_heads=hq, kv_num_heads=hkv)


@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 1)])
def test_4d_gqa(hq, hkv):
    check({"Q": f32(2, hq, 6, 16), "K": f32(2, hkv, 10, 16), "V": f32(2, hkv, 10, 16)})


@pytest.mark.parametrize("cores", [1, 3])
def test_tiles_split_heads(cores):
    # few heads, many query blocks: one head's blocks spread over the cores
    check({"Q": f32(1, 2, 200, 32), "K": f32(1, 2, 150, 32), "V": f32(1, 2, 150, 32)},
          cores=cores)


# -- causal --------------------------------------------------------------------------------
@pytest.mark.parametrize("Sq,Sk", [(6, 6), (4, 9), (40, 100), (9, 4), (70, 33)])
def test_causal(Sq, Sk):
    # no past: top-left alignment (query i sees keys j <= i), also when Sq > Sk
    s = check({"Q": f32(2, 3, Sq, 16), "K": f32(2, 3, Sk, 16), "V": f32(2, 3, Sk, 16)},
              is_causal=1)
    assert ("bias" in notes(s)) == (Sk < Sq)


def test_causal_3d_gqa():
    check({"Q": f32(2, 5, 6 * 8), "K": f32(2, 7, 2 * 8), "V": f32(2, 7, 2 * 8)},
          is_causal=1, q_num_heads=6, kv_num_heads=2)


# -- masks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 7), (1, 7), (3, 5, 7), (2, 1, 5, 7), (2, 3, 5, 7),
                                   (2, 1, 1, 7), (1, 3, 1, 7), (7,)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_broadcast(shape, kind):
    if kind == "bool":
        mask = R.random(shape) > 0.3
    else:
        mask = f32(*shape)
        mask[R.random(shape) < 0.2] = -np.inf
    # onnxruntime takes 2-D..4-D masks with all Sq rows; the others against the reference
    ort_ok = len(shape) >= 2 and shape[-2] == 5
    s = check({"Q": f32(2, 3, 5, 8), "K": f32(2, 3, 7, 8), "V": f32(2, 3, 7, 8),
               "attn_mask": mask}, ref="ort" if ort_ok else "reference")
    assert "guard" in notes(s)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("causal", [0, 1])
def test_fully_masked_rows_are_zero(kind, causal):
    mask = R.random((2, 1, 6, 9)) > 0.4
    mask[0, 0, 2] = False
    mask[1, 0, 5] = False
    mask[1, 0, 0, 1:] = True        # row 0 sees key 0 only under causal: masked here
    mask[1, 0, 0, 0] = False
    if kind == "float":
        mask = np.where(mask, f32(2, 1, 6, 9), -np.inf).astype(np.float32)
    m, feeds = model({"Q": f32(2, 4, 6, 8), "K": f32(2, 4, 9, 8), "V": f32(2, 4, 9, 8),
                      "attn_mask": mask}, is_causal=causal)
    _, (y,) = run_cannc(m, feeds)
    compare([y], ort_run(m, feeds), 1e-4, 1e-5)
    assert np.all(y[0, :, 2] == 0) and np.all(y[1, :, 5] == 0)
    assert np.all(y[1, :, 0] == 0) == bool(causal)
    assert np.isfinite(y).all()


def test_causal_and_mask_3d_gqa():
    mask = R.random((9, 9)) > 0.5
    check({"Q": f32(2, 9, 4 * 8), "K": f32(2, 9, 2 * 8), "V": f32(2, 9, 2 * 8),
           "attn_mask": mask}, is_causal=1, q_num_heads=4, kv_num_heads=2)


def test_mask_narrower_than_keys():
    # keys past the mask's width are masked (the reference pads the mask with -inf)
    check({"Q": f32(2, 3, 4, 8), "K": f32(2, 3, 6, 8), "V": f32(2, 3, 6, 8),
           "attn_mask": f32(2, 3, 4, 4)}, ref="reference")
    check({"Q": f32(2, 3, 4, 8), "K": f32(2, 3, 6, 8), "V": f32(2, 3, 6, 8),
           "attn_mask": R.random((4, 5)) > 0.2}, ref="reference", is_causal=1)


def test_constant_mask():
    # a constant mask without empty rows needs no guard: the fine tiling is kept
    mask = np.triu(np.full((16, 16), -np.inf, np.float32), 1)
    s = check({"Q": f32(1, 2, 16, 8), "K": f32(1, 2, 16, 8), "V": f32(1, 2, 16, 8),
               "attn_mask": mask}, const=("attn_mask",))
    assert "guard" not in notes(s)
    mask[3] = -np.inf
    s = check({"Q": f32(1, 2, 16, 8), "K": f32(1, 2, 16, 8), "V": f32(1, 2, 16, 8),
               "attn_mask": mask}, const=("attn_mask",))
    assert "guard" in notes(s)


# -- KV cache ------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("mask", [False, True])
def test_past_present_4d(causal, mask):
    B, Hq, Hkv, Sq, S, P, D, Dv = 2, 6, 3, 4, 4, 5, 8, 10
    ins = {"Q": f32(B, Hq, Sq, D), "K": f32(B, Hkv, S, D), "V": f32(B, Hkv, S, Dv),
           "past_key": f32(B, Hkv, P, D), "past_value": f32(B, Hkv, P, Dv)}
    if mask:
        ins["attn_mask"] = f32(B, 1, Sq, P + S)
    check(ins, n_out=3, is_causal=causal)


@pytest.mark.parametrize("causal", [0, 1])
def test_past_present_3d(causal):
    B, Hq, Hkv, Sq, P, D = 2, 4, 2, 1, 7, 16
    check({"Q": f32(B, Sq, Hq * D), "K": f32(B, Sq, Hkv * D), "V": f32(B, Sq, Hkv * D),
           "attn_mask": R.random((Sq, P + Sq)) > 0.3,
           "past_key": f32(B, Hkv, P, D), "past_value": f32(B, Hkv, P, D)},
          n_out=3, is_causal=causal, q_num_heads=Hq, kv_num_heads=Hkv)


def test_past_without_present_outputs():
    # (onnxruntime insists on present_key when past_key is given)
    B, H, Sq, P, D = 1, 2, 3, 6, 8
    check({"Q": f32(B, H, Sq, D), "K": f32(B, H, Sq, D), "V": f32(B, H, Sq, D),
           "past_key": f32(B, H, P, D), "past_value": f32(B, H, P, D)}, is_causal=1,
          ref="reference")


@pytest.mark.parametrize("rank", [3, 4])
def test_present_without_past(rank):
    # the first step of a generation: present_* are K / V in [B, kv_heads, S, d]
    B, Hq, Hkv, S, D = 2, 4, 2, 5, 8
    if rank == 4:
        ins, attrs = {"Q": f32(B, Hq, S, D), "K": f32(B, Hkv, S, D), "V": f32(B, Hkv, S, D)}, {}
    else:
        ins = {"Q": f32(B, S, Hq * D), "K": f32(B, S, Hkv * D), "V": f32(B, S, Hkv * D)}
        attrs = {"q_num_heads": Hq, "kv_num_heads": Hkv}
    # (ONNX's shape inference leaves present_* without a past unshaped)
    shapes = {"Y": None, "present_key": (B, Hkv, S, D), "present_value": (B, Hkv, S, D)}
    check(ins, n_out=3, is_causal=1, ref="reference", out_shapes=shapes, **attrs)


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_gqa_decode_merged(rank, mask):
    # one query per head: the 4 query heads of a KV head run as 4 rows of one kernel call
    B, Hq, Hkv, P, D = 2, 8, 2, 37, 16
    if rank == 4:
        ins = {"Q": f32(B, Hq, 1, D), "K": f32(B, Hkv, 1, D), "V": f32(B, Hkv, 1, D)}
        attrs = {}
    else:
        ins = {"Q": f32(B, 1, Hq * D), "K": f32(B, 1, Hkv * D), "V": f32(B, 1, Hkv * D)}
        attrs = {"q_num_heads": Hq, "kv_num_heads": Hkv}
    ins.update(past_key=f32(B, Hkv, P, D), past_value=f32(B, Hkv, P, D))
    if mask == "bool":
        ins["attn_mask"] = R.random((B, Hq, 1, P + 1)) > 0.3
        ins["attn_mask"][1, 5] = False        # a fully masked head
    elif mask == "float":
        ins["attn_mask"] = f32(B, 1, 1, P + 1)
    s = check(ins, n_out=3, is_causal=1, **attrs)
    assert "merged-gqa" in notes(s)


# -- nonpad_kv_seqlen (opset 24) and the bias path --------------------------------------------
@pytest.mark.parametrize("causal", [0, 1])
def test_nonpad(causal):
    B, Hq, Hkv, Sq, L, D = 3, 4, 2, 3, 10, 8
    ins = {"Q": f32(B, Hq, Sq, D), "K": f32(B, Hkv, L, D), "V": f32(B, Hkv, L, D),
           "nonpad_kv_seqlen": np.array([10, 4, 7], np.int64)}
    s = check(ins, opset=24, is_causal=causal)
    assert "bias" in notes(s)


def test_nonpad_with_mask_chunked():
    # a bias of 300 x 1000 floats is built in chunks of query rows (plus a tail chunk)
    B, H, Sq, L, D = 2, 2, 300, 1000, 16
    mask = R.random((B, 1, Sq, L)) > 0.1
    mask[1, 0, 7] = False
    s = check({"Q": f32(B, H, Sq, D), "K": f32(B, H, L, D), "V": f32(B, H, L, D),
               "attn_mask": mask, "nonpad_kv_seqlen": np.array([1000, 613], np.int64)},
              opset=24, is_causal=1, cores=3)
    assert "bias" in notes(s)


def test_causal_kv_shorter_than_queries_with_past():
    # offset = past: keys j <= i + P; K has fewer new keys than queries (bias path)
    B, H, Sq, S, P, D = 1, 2, 6, 2, 3, 8
    check({"Q": f32(B, H, Sq, D), "K": f32(B, H, S, D), "V": f32(B, H, S, D),
           "past_key": f32(B, H, P, D), "past_value": f32(B, H, P, D)},
          n_out=3, is_causal=1, ref="reference")


# -- float16 / bfloat16, sliding window --------------------------------------------------------
@pytest.mark.parametrize("dt", [np.float16, ml_dtypes.bfloat16])
def test_low_precision(dt):
    tol = 2e-3 if dt == np.float16 else 2 ** -6
    ins = {"Q": f32(2, 4, 5, 8).astype(dt), "K": f32(2, 2, 6, 8).astype(dt),
           "V": f32(2, 2, 6, 8).astype(dt), "attn_mask": f32(5, 9).astype(dt),
           "past_key": f32(2, 2, 3, 8).astype(dt), "past_value": f32(2, 2, 3, 8).astype(dt)}
    check(ins, n_out=3, is_causal=1, ref="reference", rtol=tol, atol=tol)


@pytest.mark.parametrize("left,right,causal", [(2, -1, 1), (1, 2, 0), (0, 0, 0), (3, -1, 0)])
def test_sliding_window(left, right, causal):
    check({"Q": f32(2, 3, 7, 8), "K": f32(2, 3, 9, 8), "V": f32(2, 3, 9, 8)}, opset=25,
          ref="reference", is_causal=causal, left_window_size=left, right_window_size=right)


# -- what the kernel lacks ---------------------------------------------------------------------
@pytest.mark.parametrize("attrs,n_out,why", [
    ({"softcap": 2.0}, 1, "softcap"),
    ({}, 4, "qk_matmul_output"),
    ({"qk_matmul_output_mode": 3}, 4, "qk_matmul_output"),
])
def test_unsupported(attrs, n_out, why):
    # (with past, so that no two outputs are empty: the IR verifier rejects a node with two
    # '' outputs before any Attention code runs)
    m, feeds = model({"Q": f32(1, 2, 3, 8), "K": f32(1, 2, 3, 8), "V": f32(1, 2, 3, 8),
                      "past_key": f32(1, 2, 2, 8), "past_value": f32(1, 2, 2, 8)},
                     n_out, **attrs)
    with pytest.raises(UnsupportedOpError, match=why):
        run_cannc(m, feeds)


def test_o0_pipeline():
    m, feeds = model({"Q": f32(1, 2, 3, 8), "K": f32(1, 2, 3, 8), "V": f32(1, 2, 3, 8),
                      "past_key": f32(1, 2, 4, 8), "past_value": f32(1, 2, 4, 8)}, 3,
                     is_causal=1)
    sess = cannc.compile(m, cores=1, pipeline="O0",
                         shapes={k: v.shape for k, v in feeds.items()})
    compare(sess.run(None, feeds), ort_run(m, feeds), 1e-4, 1e-5)
    assert TensorProto.FLOAT == 1
