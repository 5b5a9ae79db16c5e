"""Reduced-precision fused attention (codegen/attention.py): bfloat16 / float16 Q, K, V,
masks and outputs converted on load / store, `precision` "bf16" (vdpbf16ps where the CPU
has avx512bf16, else widened to float32) and "fp16" (float32 FMA), against a float64
reference computed from the SAME rounded inputs.

Tolerances. Without rounding inside the kernel (dot 'f32': narrow inputs widened exactly)
the float32 kernel's rtol 1e-4 / atol 1e-5 holds. With dot 'bf16' Q K^T is exact products
of the rounded inputs with float32 accumulation (errors ~1e-6 relative), but P is rounded
to bf16 after the exp, as flash-attention kernels do: every weight gets a relative error
|e| <= 2^-9 and the row sum l adds the rounded weights, so the output stays a convex
combination of V's rows, off the exact one by at most sum_j |w_j (e_j - mean e)| |v_j - o|
<= 2^-8 (1 + 2^-8) * span_j(v) per output column (span: max - min of the column over the
keys). That bound (x 1.05 for the float32 parts) is the atol used; a narrow output adds
one ulp of its type (rtol 2^-7 bf16, 2^-10 fp16).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.abspath(os.path.dirname(os.path.dirname(__file__))))

from llvmlite import ir

from cannc.codegen.amx import amx_usable
from cannc.codegen.attention import (
    attention_num_tiles,
    attention_plan,
    attention_precision_note,
    attention_tiling,
    attention_workspace_bytes,
    emit_attention,
)
from cannc.ir.attnspec import AttnSpec
from cannc.native.target import host, jit_kernel
from tests.helpers import aligned, run_splits

BF16 = np.dtype(ml_dtypes.bfloat16)
NP = {"float32": np.dtype(np.float32), "bfloat16": BF16, "float16": np.dtype(np.float16)}
HAS_BF16 = host().has("avx512bf16")
SENT = -12345.5
OUT_RTOL = {"float32": 0.0, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


def _round(x, dt):
    return np.asarray(x, np.float32).astype(NP[dt]).astype(np.float64)


def _extent(shape, strides) -> int:
    return 1 + sum((n - 1) * st for n, st in zip(shape, strides))


def _index(shape, strides) -> np.ndarray:
    """Element offsets of a strided 4-D view."""
    return sum(np.arange(n).reshape([-1 if a == i else 1 for a in range(4)]) * st
               for i, (n, st) in enumerate(zip(shape, strides)))


class Case:
    """Operands of the spec's dtypes in buffers laid out by its strides (any layout), the
    reference, a runner."""

    def __init__(self, spec: AttnSpec, seed=0, mask_fn=None):
        s = self.spec = spec
        rng = np.random.default_rng(seed)
        self.bufs, self.vals = {}, {}
        for nm, dt, shape, st in (("q", s.dtypes[0], (s.B, s.H, s.Sq, s.D), s.q_strides),
                                  ("k", s.dtypes[1], (s.B, s.H, s.Sk, s.D), s.k_strides),
                                  ("v", s.dtypes[2], (s.B, s.H, s.Sk, s.Dv), s.v_strides)):
            n = _extent(shape, st)
            buf = aligned(n, dtype=NP[dt])
            buf[...] = rng.standard_normal(n).astype(NP[dt])
            self.bufs[nm] = buf
            self.vals[nm] = buf.astype(np.float64)[_index(shape, st)]
        self.mask = None
        if s.mask != "none":
            shape = (s.B, s.H, s.Sq, s.Sk)
            n = _extent(shape, s.mask_strides)
            mdt = np.bool_ if s.mask_dtype == "bool" else NP[s.mask_dtype]
            m = aligned(n, dtype=mdt)
            if mask_fn is not None:
                m[...] = mask_fn(rng, n)
            elif s.mask == "add":
                m[...] = rng.standard_normal(n).astype(mdt)
            else:
                m[...] = rng.random(n) < 0.7
            self.bufs["mask"] = m
            mv = m[_index(shape, s.mask_strides)]
            if s.mask == "where":
                mv = mv.copy()
                mv[..., 0] = True
                m[_index(shape, s.mask_strides)[..., 0]] = True
            self.mask = mv.astype(np.float64) if s.mask == "add" else mv.astype(bool)

    def reference(self, prec_inputs: str | None):
        """float64 attention of the inputs (rounded to bf16 first for prec_inputs)."""
        s = self.spec
        q, k, v = (self.vals[n] if prec_inputs is None else _round(self.vals[n], prec_inputs)
                   for n in "qkv")
        raw = np.einsum("bhid,bhjd->bhij", q, k) * float(np.float32(s.scale))
        if s.mask == "add":
            raw = raw + self.mask
        elif s.mask == "where":
            raw = np.where(self.mask, raw, -np.inf)
        if s.causal:
            i = np.arange(s.Sq)[:, None]
            j = np.arange(s.Sk)[None, :]
            raw = np.where(j > i + (s.Sk - s.Sq), -np.inf, raw)
        with np.errstate(invalid="ignore"):
            e = np.exp(raw - raw.max(-1, keepdims=True))
            p = e / e.sum(-1, keepdims=True)      # rows without a key: NaN, as numpy
        span = (v.max(2) - v.min(2))[:, :, None, :]
        return p @ v, span

    def run(self, tuning=None, form=False):
        s = self.spec
        o_np = NP[s.dtypes[3]]
        oshape = (s.B, s.H, s.Sq, s.Dv)
        oidx = _index(oshape, s.o_strides)
        O = aligned(_extent(oshape, s.o_strides) + 32, dtype=o_np)   # + 16 guards each side
        O[...] = o_np.type(SENT)
        ptrs = [self.bufs[n].ctypes.data for n in ("q", "k", "v")]
        if s.mask != "none":
            ptrs.append(self.bufs["mask"].ctypes.data)
        ptrs.append(O.ctypes.data + 16 * O.itemsize)
        module = ir.Module()
        if form:
            til = attention_tiling(s, tuning)
            emit_attention(module, "attn", til.form, tuning=tuning)
            argv = (ctypes.c_int64 * (len(ptrs) + len(til.dims)))(*ptrs, *til.dims)
            tiles, wsb = til.num_tiles, til.workspace_bytes
        else:
            emit_attention(module, "attn", s, tuning=tuning)
            argv = (ctypes.c_void_p * len(ptrs))(*ptrs)
            tiles = attention_num_tiles(s, tuning)
            wsb = attention_workspace_bytes(s, tuning)
        kernel = jit_kernel(module, "attn", 0)
        run_splits(kernel, argv, tiles, wsb, ws_fill=np.nan)
        untouched = np.ones(O.size, bool)
        untouched[16 + oidx.reshape(-1)] = False
        assert np.all(O[untouched] == o_np.type(SENT)), "wrote outside O"
        return O[16 + oidx].astype(np.float64)

    def check(self, tuning=None, form=False):
        s = self.spec
        dot = attention_plan(s, tuning).dot
        got = self.run(tuning, form)
        ref, span = self.reference("bfloat16" if dot in ("bf16", "amx") else None)
        rt = OUT_RTOL[s.dtypes[3]]
        if dot in ("bf16", "amx"):
            atol = 1.05 * 2.0 ** -8 * (1 + 2.0 ** -8) * span + 1e-6
        else:
            atol = 1e-5 + 1e-4 * np.abs(ref)
        assert np.array_equal(np.isnan(got), np.isnan(ref)), "NaN rows differ"
        got, ref = np.nan_to_num(got), np.nan_to_num(ref)
        err = np.abs(got - ref)
        bad = err > atol + rt * np.abs(ref)
        assert not bad.any(), (f"{bad.sum()} of {bad.size} outside; max err {err.max():.3g}, "
                               f"dot {dot}")
        return got, ref


def spec(B, H, Sq, Sk, D, Dv=None, dtypes=("bfloat16",) * 4, precision="bf16", **kw):
    """Dense operands; O rows padded by 16 guard elements (Case.run checks them)."""
    Dv = D if Dv is None else Dv
    d = AttnSpec.dense(B, H, Sq, Sk, D, Dv, dtypes=tuple(dtypes), precision=precision, **kw)
    W = Dv + 16
    return dataclasses.replace(d, o_strides=(H * Sq * W, Sq * W, W, 1))


BF = ("bfloat16",) * 4
F16 = ("float16",) * 4
# vdpbf16ps (where the CPU has it), and widened to float32 FMA
DOTS = [pytest.param({"dot": "bf16"}, id="dp", marks=pytest.mark.skipif(
            not HAS_BF16, reason="no avx512bf16")),
        pytest.param({"dot": "f32"}, id="wide")]

SHAPES = [(1, 2, 7, 7, 16, 16), (2, 1, 37, 53, 64, 64), (1, 1, 20, 150, 33, 17),
          (1, 3, 70, 29, 80, 80)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tuning", DOTS)
def test_bf16_qkv(shape, tuning):
    Case(spec(*shape, dtypes=BF)).check(tuning)


def test_bf16_host_default():
    Case(spec(1, 2, 20, 40, 64, dtypes=BF)).check()


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_fp16_qkv(shape):
    s = spec(*shape, dtypes=F16, precision="fp16")
    assert attention_plan(s).dot == "f32"
    Case(s).check()
    assert attention_precision_note(s).startswith("fp16 storage, fp32 FMA")


@pytest.mark.parametrize("odt", ["float32", "bfloat16"])
@pytest.mark.parametrize("tuning", DOTS)
def test_fp32_inputs_with_bf16_precision(odt, tuning):
    """cannc_precision on float32 operands: converted to bf16 on load, any output dtype."""
    s = spec(2, 2, 33, 70, 64, 48, dtypes=("float32",) * 3 + (odt,))
    Case(s, seed=3).check(tuning)


def test_mixed_operand_dtypes():
    s = spec(1, 2, 19, 41, 32, dtypes=("float32", "bfloat16", "float32", "float16"))
    Case(s, seed=4).check()


@pytest.mark.parametrize("mdt", ["bool", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("tuning", DOTS)
def test_masks(mdt, tuning):
    mode = "where" if mdt == "bool" else "add"
    s = spec(2, 2, 24, 45, 64, mask=mode, mask_dtype=mdt, mask_strides=(2 * 24 * 45, 24 * 45,
                                                                         45, 1),
             fill=float("-inf"))
    Case(s, seed=5).check(tuning)


@pytest.mark.parametrize("tuning", DOTS)
@pytest.mark.parametrize("Sq,Sk", [(40, 40), (9, 100), (12, 5)])
def test_causal(tuning, Sq, Sk):
    s = spec(1, 2, Sq, Sk, 64, causal=True)
    Case(s, seed=6).check(tuning)


@pytest.mark.parametrize("shape", [(1, 2, 37, 53, 64, 64), (2, 1, 5, 300, 33, 40)])
@pytest.mark.parametrize("tuning", DOTS)
def test_shape_polymorphic_form(shape, tuning):
    B, H, Sq, Sk = shape[:4]
    Case(spec(*shape, mask="add", mask_dtype="bfloat16",
              mask_strides=(H * Sq * Sk, Sq * Sk, Sk, 1))).check(tuning, form=True)


@pytest.mark.parametrize("tuning", DOTS)
@pytest.mark.parametrize("dts", [BF, ("float32",) * 4])
@pytest.mark.parametrize("shape", [(1, 2, 37, 53, 64, 64), (2, 1, 20, 140, 33, 24)])
def test_k_stored_transposed(tuning, dts, shape):
    """K as [B, H, D, Sk] (key stride 1), as BERT exports it."""
    s = spec(*shape, dtypes=dts, k_transposed=True)
    assert s.k_strides[2] == 1
    assert attention_plan(s, tuning).dot == tuning["dot"]
    Case(s, seed=9).check(tuning)
    Case(s, seed=9).check(tuning, form=True)


@pytest.mark.parametrize("dts", [BF, F16])
def test_odd_layouts(dts):
    """Strided operands the widened path reads with gathers and writes with scatters:
    Q, V and O with a non-unit d stride, K with neither stride 1, a mask with key stride
    > 1 (d-major buffers; O [B, H, Dv, Sq])."""
    B, H, Sq, Sk, D, Dv = 1, 2, 19, 37, 24, 20
    s = AttnSpec(B, H, Sq, Sk, D, Dv, q_strides=(H * D * Sq, D * Sq, 1, Sq),
                 k_strides=(H * Sk * D * 2, Sk * D * 2, 2, 2 * Sk),
                 v_strides=(H * Dv * Sk, Dv * Sk, 1, Sk),
                 o_strides=(H * Dv * Sq, Dv * Sq, 1, Sq), scale=0.2, mask="add",
                 mask_dtype=dts[0], mask_strides=(0, 0, 1, Sq),
                 dtypes=dts, precision="bf16" if dts == BF else "fp16")
    assert attention_plan(s).dot == "f32" and attention_plan(s).v_mode == "pack"
    Case(s, seed=10).check()


@pytest.mark.parametrize("tuning", DOTS)
def test_long_keys_block_scope(tuning):
    """K^T of a head past the whole-head packing size: packed per key block."""
    s = spec(1, 1, 20, 2100, 64)
    assert attention_plan(s, tuning).scope == "block"
    Case(s, seed=7).check(tuning)


@pytest.mark.skipif(not HAS_BF16, reason="no avx512bf16")
def test_bf16_dot_products_round_p():
    """With avx512bf16 the kernel multiplies in bf16 (P rounded): not the exact fp32
    result of the same inputs, though within the P-rounding bound above."""
    s = spec(1, 1, 32, 256, 64, dtypes=("float32",) * 4)
    c = Case(s, seed=8)
    dp = {"dot": "bf16"}
    assert attention_plan(s, dp).dot == "bf16"
    assert attention_precision_note(s, dp).startswith("bf16 avx512_bf16")
    # the default: vdpbf16ps unless the CPU has AMX (there it is slower than fp32 FMA)
    # (and AMX tiles where they are usable: tests/test_attention_amx.py)
    assert attention_plan(s).dot == ("amx" if amx_usable() is None else
                                     "f32" if host().has("amx-bf16") else "bf16")
    got, ref = c.check(dp)
    assert np.abs(got - ref).max() > 1e-6
    exact, _ = c.reference(None)
    wide = c.run({"dot": "f32"})
    np.testing.assert_allclose(wide, exact, rtol=1e-4, atol=1e-5)


def test_precision_notes_and_bad_specs():
    assert attention_precision_note(spec(1, 1, 4, 4, 8, dtypes=("float32",) * 4,
                                         precision="fp32")) == "fp32"
    note = attention_precision_note(spec(1, 1, 4, 4, 8), {"dot": "f32"})
    assert note.startswith("bf16 widened to fp32")
    with pytest.raises(ValueError, match="dtypes"):
        spec(1, 1, 4, 4, 8, dtypes=("float64",) * 4)
    with pytest.raises(ValueError, match="precision"):
        spec(1, 1, 4, 4, 8, precision="int8")
    with pytest.raises(ValueError, match="k_mode 'direct'"):
        attention_plan(spec(1, 1, 4, 4, 8), {"k_mode": "direct", "dot": "f32"})


# ---------------------------------------------------------------------------
# compiled models: the ONNX Attention op and the fused pattern, typed bf16 / fp16
# ---------------------------------------------------------------------------

import onnx  # noqa: E402
from onnx import helper  # noqa: E402

import cannc  # noqa: E402
from cannc.ir.types import NP_TO_ONNX  # noqa: E402


def _attention_model(ins: dict, **attrs):
    names = [n for n in ("Q", "K", "V", "attn_mask") if n in ins]
    node = helper.make_node("Attention", names, ["Y"], **attrs)
    q = ins["Q"]
    B, H, Sq, _ = q.shape
    Dv = ins["V"].shape[3]
    g = helper.make_graph(
        [node], "a",
        [helper.make_tensor_value_info(n, NP_TO_ONNX[ins[n].dtype], ins[n].shape)
         for n in names],
        [helper.make_tensor_value_info("Y", NP_TO_ONNX[q.dtype], (B, H, Sq, Dv))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    m.ir_version = 10
    return m


def _compile(m, feeds):
    sess = cannc.compile(m, cores=2, shapes={k: v.shape for k, v in feeds.items()})
    ks = [k for s in sess.specializations for k in s.kernels]
    return sess, ks


def _ref(q, k, v, scale, bias=None, causal=False):
    """float64 attention; causal as ONNX Attention without a past: key j <= query i."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    if bias is not None:
        s = s + bias
    if causal:
        i, j = np.arange(s.shape[2])[:, None], np.arange(s.shape[3])[None, :]
        s = np.where(j > i, -np.inf, s)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v, (v.max(2) - v.min(2))[:, :, None, :]


def _close(got, ref, span, out_dt, note):
    """The P-rounding bound (module docstring) when the note says vdpbf16ps, else fp32."""
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all() and np.isfinite(ref).all()
    lowp = "avx512_bf16" in note or "AMX" in note
    atol = 1.05 * 2.0 ** -8 * span + 1e-6 if lowp else 1e-5 + 1e-4 * abs(ref)
    err = np.abs(got - ref) - atol - OUT_RTOL[np.dtype(out_dt).name] * np.abs(ref)
    assert err.max() <= 0, f"max excess {err.max():.3g} ({note})"


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("mask", ["float", "bool_causal"])
def test_onnx_attention_narrow_without_casts(dt, mask):
    rng = np.random.default_rng(11)
    npdt = NP[dt]
    ins = {n: rng.standard_normal(s).astype(npdt) for n, s in
           (("Q", (2, 3, 20, 32)), ("K", (2, 3, 30, 32)), ("V", (2, 3, 30, 24)))}
    attrs = {}
    bias = None
    if mask == "float":
        ins["attn_mask"] = rng.standard_normal((20, 30)).astype(npdt)
        bias = ins["attn_mask"].astype(np.float64)
    else:
        keep = rng.random((20, 30)) < 0.8
        keep[:, 0] = True
        keep[3] = False          # a row without any key: zeros (the guard)
        ins["attn_mask"] = keep
        bias = np.where(keep, 0.0, -np.inf)
        attrs["is_causal"] = 1
    sess, ks = _compile(_attention_model(ins, **attrs), ins)
    assert not any("Cast" in k.op_types for k in ks), [k.op_types for k in ks]
    (note,) = [k.notes["precision"] for k in ks if "precision" in k.notes]
    assert ("bf16" if dt == "bfloat16" else "fp16") in note
    (y,) = sess.run(None, ins)
    assert y.dtype == npdt
    half = float(np.asarray(np.sqrt(1 / np.sqrt(32))).astype(npdt).astype(np.float64))
    with np.errstate(invalid="ignore"):
        ref, span = _ref(ins["Q"], ins["K"], ins["V"], half * half, bias,
                         causal=mask == "bool_causal")
    if mask != "float":
        assert np.isnan(ref[:, :, 3]).all() and np.all(y[:, :, 3] == 0)
        ref[:, :, 3] = 0.0       # ONNX: a row without an allowed key is 0
    _close(y, ref, span, npdt, note)


def _sdpa_model(dt, B=1, H=2, S=40, D=32):
    """MatMul(Q, K^T) * scale + mask -> Softmax -> MatMul(V), typed dt (a narrow export)."""
    T = NP_TO_ONNX[NP[dt]]
    scale = onnx.numpy_helper.from_array(np.array(1 / np.sqrt(D), NP[dt]), "scale")
    nodes = [helper.make_node("Transpose", ["K"], ["Kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["Q", "Kt"], ["s0"]),
             helper.make_node("Mul", ["s0", "scale"], ["s1"]),
             helper.make_node("Add", ["s1", "M"], ["s2"]),
             helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "V"], ["Y"])]
    g = helper.make_graph(nodes, "sdpa", [
        helper.make_tensor_value_info("Q", T, (B, H, S, D)),
        helper.make_tensor_value_info("K", T, (B, H, S, D)),
        helper.make_tensor_value_info("V", T, (B, H, S, D)),
        helper.make_tensor_value_info("M", T, (B, 1, 1, S))],
        [helper.make_tensor_value_info("Y", T, (B, H, S, D))], initializer=[scale])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m, float(onnx.numpy_helper.to_array(scale).astype(np.float64))


def _sdpa_feeds(dt, B=1, H=2, S=40, D=32, seed=12):
    rng = np.random.default_rng(seed)
    f = {n: rng.standard_normal((B, H, S, D)).astype(NP[dt]) for n in "QKV"}
    m = np.zeros((B, 1, 1, S), NP[dt])
    m[..., -7:] = -10000
    f["M"] = m
    return f


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
def test_fused_attention_narrow_graph(dt):
    m, scale = _sdpa_model(dt)
    feeds = _sdpa_feeds(dt)
    sess, ks = _compile(m, feeds)
    (k,) = ks                       # one FusedAttention kernel, no Casts
    assert "attention" in k.notes and "Softmax" in k.op_types, k.notes
    note = k.notes["precision"]
    (y,) = sess.run(None, feeds)
    assert y.dtype == NP[dt]
    ref, span = _ref(feeds["Q"], feeds["K"], feeds["V"], float(np.float32(scale)),
                     feeds["M"].astype(np.float64))
    _close(y, ref, span, NP[dt], note)


def test_fused_attention_cannc_precision_attribute(monkeypatch):
    """float32 graph, FusedAttention carrying cannc_precision='bf16' (what the
    mixed-precision pass sets): Q, K, V converted on load, fp32 output."""
    from cannc.compiler import pipeline
    from cannc.passes.manager import _PASSES, graph_pass

    name = "_test_attention_bf16"
    if name not in _PASSES:
        @graph_pass(name)
        def _mark(graph, ctx):
            changed = False
            for n in list(graph.nodes()):
                if n.op_type == "FusedAttention" and "cannc_precision" not in n.attrs:
                    graph.replace_node(n.name, n.replace(
                        attrs={**n.attrs, "cannc_precision": "bf16"}))
                    changed = True
            return changed
    monkeypatch.setitem(pipeline.PIPELINES, "O1", pipeline.PIPELINES["O1"] + [name])
    m, scale = _sdpa_model("float32")
    feeds = _sdpa_feeds("float32")
    sess, ks = _compile(m, feeds)
    (k,) = ks
    note = k.notes["precision"]
    assert note.startswith("bf16"), note
    (y,) = sess.run(None, feeds)
    assert y.dtype == np.float32
    rnd = "avx512_bf16" in note
    q, kk, v = (_round(feeds[n], "bfloat16") if rnd else feeds[n] for n in "QKV")
    ref, span = _ref(q, kk, v, float(np.float32(scale)), feeds["M"].astype(np.float64))
    _close(y, ref, span, np.float32, note)


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
def test_onnx_attention_narrow_3d_sliding_window(dt):
    """The general path (the bias built in the workspace: sliding window), 3-D operands
    [B, S, heads * d], GQA: narrow pointers and a narrow float mask read there too."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(13)
    npdt = NP[dt]
    ins = {"Q": rng.standard_normal((2, 9, 4 * 16)).astype(npdt),
           "K": rng.standard_normal((2, 11, 2 * 16)).astype(npdt),
           "V": rng.standard_normal((2, 11, 2 * 8)).astype(npdt),
           "attn_mask": rng.standard_normal((9, 11)).astype(npdt)}
    names = list(ins)
    node = helper.make_node("Attention", names, ["Y"], q_num_heads=4, kv_num_heads=2,
                            is_causal=1, left_window_size=3)
    T = NP_TO_ONNX[npdt]
    g = helper.make_graph([node], "a", [helper.make_tensor_value_info(n, T, ins[n].shape)
                                        for n in names],
                          [helper.make_tensor_value_info("Y", T, (2, 9, 4 * 8))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 25)])
    m.ir_version = 10
    sess, ks = _compile(m, ins)
    assert not any("Cast" in k.op_types for k in ks)
    (att,) = [k.notes["attention"] for k in ks if "attention" in k.notes]
    assert "bias" in att, att
    (y,) = sess.run(None, ins)
    (exp,) = ReferenceEvaluator(m).run(None, ins)
    assert y.dtype == npdt
    # the reference rounds scores and weights to the narrow type; cannc's softmax is fp32
    tol = 2e-3 if dt == "float16" else 2 ** -6
    np.testing.assert_allclose(y.astype(np.float64), exp.astype(np.float64), rtol=tol,
                               atol=tol)
