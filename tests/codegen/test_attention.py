"""Tests of the fused attention kernel generator (cannc/codegen/attention.py).

Every kernel is JIT-compiled for the host CPU through the compiler's own
pipeline (cannc.native.target.jit_kernel) and called through ctypes with the
tile range split like two cores would (plus empty ranges), then compared with
a float64 numpy reference of the unfused graph (matmul, scale, mask, causal,
softmax, matmul) at rtol 1e-4 / atol 1e-5.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from llvmlite import ir

from cannc.codegen.attention import (
    RT_DIMS,
    attention_num_tiles,
    attention_plan,
    attention_tiling,
    attention_workspace_bytes,
    emit_attention,
)
from cannc.ir.attnspec import AttnSpec, dense_strides
from cannc.native.target import jit_kernel
from tests.helpers import aligned, run_concurrently, run_splits, tile_ranges

SENTINEL = np.float32(-12345.5)
F32_LOWEST = float(np.finfo(np.float32).min)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def extent(shape, strides) -> int:
    return 1 + sum((n - 1) * st for n, st in zip(shape, strides))


def view(buf, shape, strides):
    return np.lib.stride_tricks.as_strided(
        buf, shape=shape, strides=[st * buf.itemsize for st in strides], writeable=False
    )


def reference(spec: AttnSpec, q, k, v, mask):
    """float64 numpy of the unfused graph."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    raw = np.einsum("bhid,bhjd->bhij", q, k)
    scale = float(np.float32(spec.scale))
    fill = float(np.float32(spec.fill))
    with np.errstate(invalid="ignore", over="ignore"):
        if spec.mask == "add":
            mk = mask.astype(np.float64)
            s = raw * scale + mk if spec.score_bias_after_scale else (raw + mk) * scale
            # the float32 graph rounds the masked scores to float32: with a
            # -10000 mask they only carry ~1e-3 absolute precision (ulp of 1e4)
            s = s.astype(np.float32).astype(np.float64)
        elif spec.mask == "where":
            keep = mask != 0
            s = (
                np.where(keep, raw * scale, fill)
                if spec.score_bias_after_scale
                else np.where(keep, raw, fill) * scale
            )
        else:
            s = raw * scale
        s = np.broadcast_to(s, (spec.B, spec.H, spec.Sq, spec.Sk)).copy()
        if spec.causal:
            i = np.arange(spec.Sq)[:, None]
            j = np.arange(spec.Sk)[None, :]
            s[..., j > i + (spec.Sk - spec.Sq)] = -np.inf
        m = s.max(-1, keepdims=True)
        e = np.exp(s - m)
        p = e / e.sum(-1, keepdims=True)
        if spec.zero_nan_rows:      # torch's export: Where(IsNaN(p), 0, p)
            p = np.where(np.isnan(p), 0.0, p)
        return p @ v


class Case:
    """Buffers (in the spec's layouts), a float64 reference and a runner."""

    def __init__(self, spec: AttnSpec, seed=0, misalign=0, mask_fn=None, qk_scale=1.0):
        s = self.spec = spec
        rng = np.random.default_rng(seed)
        shapes = {
            "q": (s.B, s.H, s.Sq, s.D),
            "k": (s.B, s.H, s.Sk, s.D),
            "v": (s.B, s.H, s.Sk, s.Dv),
        }
        self.bufs, self.views = {}, {}
        for nm, st in (("q", s.q_strides), ("k", s.k_strides), ("v", s.v_strides)):
            n = extent(shapes[nm], st)
            buf = aligned(n, offset_elems=misalign)
            buf[:] = rng.standard_normal(n) * (qk_scale if nm != "v" else 1.0)
            self.bufs[nm] = buf
            self.views[nm] = view(buf, shapes[nm], st)
        self.mask = None
        if s.mask != "none":
            mshape = (s.B, s.H, s.Sq, s.Sk)
            n = extent(mshape, s.mask_strides)
            dt = np.bool_ if s.mask_dtype == "bool" else np.float32
            mbuf = aligned(n, dtype=dt, offset_elems=misalign)
            if mask_fn is not None:
                mbuf[:] = mask_fn(rng, n)
            elif s.mask == "add":
                mbuf[:] = rng.standard_normal(n)
            else:
                mbuf[:] = rng.random(n) < 0.7
            self.bufs["mask"] = mbuf
            self.mask = view(mbuf, mshape, s.mask_strides)
        self.ref = reference(spec, self.views["q"], self.views["k"], self.views["v"], self.mask)
        oshape = (s.B, s.H, s.Sq, s.Dv)
        self.o_len = extent(oshape, s.o_strides)
        self.guard = 64
        self.o_index = (
            np.arange(s.B)[:, None, None, None] * s.o_strides[0]
            + np.arange(s.H)[None, :, None, None] * s.o_strides[1]
            + np.arange(s.Sq)[None, None, :, None] * s.o_strides[2]
            + np.arange(s.Dv)[None, None, None, :] * s.o_strides[3]
        )

    def new_o(self):
        O = aligned(self.o_len + 2 * self.guard)
        O[:] = SENTINEL
        return O

    def args(self, O):
        ptrs = [self.bufs[n].ctypes.data for n in ("q", "k", "v")]
        if self.spec.mask != "none":
            ptrs.append(self.bufs["mask"].ctypes.data)
        ptrs.append(O.ctypes.data + 4 * self.guard)
        return (ctypes.c_void_p * len(ptrs))(*ptrs)

    def got(self, O):
        return O[self.guard : self.guard + self.o_len][self.o_index]

    def check(self, O, rtol=1e-4, atol=1e-5):
        np.testing.assert_allclose(self.got(O), self.ref, rtol=rtol, atol=atol)
        mask = np.ones(O.size, bool)
        mask[self.guard + self.o_index.reshape(-1)] = False
        assert np.all(O[mask] == SENTINEL), "kernel wrote outside O"


def build(spec: AttnSpec, tuning=None, name="attn", speed_level=0):
    module = ir.Module()
    fn = emit_attention(module, name, spec, tuning=tuning)
    assert fn.name == name
    return jit_kernel(module, name, speed_level)


def run_split(kernel, case: Case, tuning=None, splits=None):
    """Run the whole tile range as 2 cores would (and with empty ranges)."""
    spec = case.spec
    T = attention_num_tiles(spec, tuning)
    assert T >= 1
    wsb = attention_workspace_bytes(spec, tuning)
    assert wsb % 64 == 0
    O = case.new_o()
    # NaN workspace: the kernel must not depend on workspace contents
    run_splits(kernel, case.args(O), T, wsb, splits, ws_fill=np.nan)
    return O


def check_spec(spec: AttnSpec, tuning=None, splits=None, rtol=1e-4, atol=1e-5, **kw):
    case = Case(spec, **kw)
    kernel = build(spec, tuning)
    O = run_split(kernel, case, tuning, splits)
    case.check(O, rtol=rtol, atol=atol)
    return case, kernel


def dense(B, H, Sq, Sk, D, Dv=None, **kw):
    return AttnSpec.dense(B, H, Sq, Sk, D, Dv, **kw)


# ---------------------------------------------------------------------------
# shapes x layouts
# ---------------------------------------------------------------------------

SHAPES = [  # B, H, Sq, Sk, D, Dv
    (1, 1, 1, 1, 1, 1),
    (1, 1, 5, 5, 8, 8),
    (2, 3, 7, 7, 16, 16),
    (1, 2, 13, 13, 33, 33),
    (2, 2, 16, 16, 64, 64),
    (1, 1, 37, 53, 64, 64),  # Sq != Sk
    (1, 3, 70, 29, 80, 80),
    (2, 1, 33, 150, 16, 48),  # Dv != D, several key blocks
    (1, 1, 129, 130, 64, 64),
    (1, 2, 40, 200, 33, 17),
    (3, 1, 9, 300, 8, 100),
    (1, 1, 200, 7, 64, 64),
    (4, 3, 1, 200, 64, 64),  # decoding: one query row
    (2, 2, 3, 77, 40, 24),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes_layouts(shape):
    B, H, Sq, Sk, D, Dv = shape
    for kt, merged in itertools.product([False, True], [False, True]):
        spec = dense(
            B, H, Sq, Sk, D, Dv, k_transposed=kt, merged_heads_out=merged, scale=1.0 / np.sqrt(D)
        )
        check_spec(spec, seed=sum(shape))


def test_scale_values():
    for scale in (1.0, 0.125, 2.5):
        check_spec(dense(2, 2, 20, 40, 24, scale=scale), qk_scale=0.5)


def test_odd_strides_gather_paths():
    """Q/K/V/O with no unit stride anywhere, V stored transposed ([B,H,Dv,S])."""
    B, H, Sq, Sk, D, Dv = 2, 3, 11, 37, 20, 19
    # K as [S, B, D, H] (d stride H, s stride B*D*H); V^T as [B,H,Dv,S];
    # Q as [B,S,H,D] (merged heads); O as [H,B,Dv,S]
    ks = (D * H, 1, B * D * H, H)
    vs = (H * Dv * Sk, Dv * Sk, 1, Sk)
    qs = (Sq * H * D, D, H * D, 1)
    os_ = (Dv * Sq, B * Dv * Sq, 1, Sq)
    spec = AttnSpec(B, H, Sq, Sk, D, Dv, qs, ks, vs, os_, scale=0.3)
    assert attention_plan(spec).k_mode == "pack" and attention_plan(spec).v_mode == "pack"
    check_spec(spec)
    # V^T with unit key stride: transposed packing of V
    spec = AttnSpec(
        B,
        H,
        Sq,
        Sk,
        D,
        Dv,
        dense_strides(B, H, Sq, D),
        dense_strides(B, H, Sk, D),
        vs,
        dense_strides(B, H, Sq, Dv),
        scale=0.3,
    )
    check_spec(spec)


def test_broadcast_operands():
    """Stride-0 batch/head axes of Q, K, V (e.g. shared K/V over heads)."""
    B, H, Sq, Sk, D = 2, 4, 10, 30, 16
    ks = (Sk * D, 0, D, 1)
    spec = AttnSpec(
        B,
        H,
        Sq,
        Sk,
        D,
        D,
        dense_strides(B, H, Sq, D),
        ks,
        ks,
        dense_strides(B, H, Sq, D),
        scale=0.25,
    )
    check_spec(spec)


# ---------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------


def _mask_strides(kind, B, H, Sq, Sk):
    return {
        "full": dense_strides(B, H, Sq, Sk),  # [B,H,Sq,Sk]
        "key_pad": (Sk, 0, 0, 1),  # [B,1,1,Sk]
        "rows": (0, 0, Sk, 1),  # [1,1,Sq,Sk]
        "per_row": (Sq, 0, 1, 0),  # [B,1,Sq,1]
        "head": (0, 1, 0, 0),  # [1,H,1,1]
        "transposed": (H * Sk * Sq, Sk * Sq, 1, Sq),  # [B,H,Sk,Sq] read transposed
    }[kind]


MASK_KINDS = ["full", "key_pad", "rows", "per_row", "head", "transposed"]


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_add_mask(kind):
    for (B, H, Sq, Sk, D), after in [((2, 3, 17, 45, 32), True), ((1, 2, 70, 70, 64), False)]:
        spec = dense(
            B,
            H,
            Sq,
            Sk,
            D,
            scale=1 / np.sqrt(D),
            mask="add",
            mask_strides=_mask_strides(kind, B, H, Sq, Sk),
            score_bias_after_scale=after,
        )
        check_spec(spec)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", ["bool", "float32"])
def test_where_mask(kind, dtype):
    for (B, H, Sq, Sk, D), after in [((2, 3, 17, 45, 32), True), ((1, 2, 70, 70, 64), False)]:
        spec = dense(
            B,
            H,
            Sq,
            Sk,
            D,
            scale=1 / np.sqrt(D),
            mask="where",
            mask_strides=_mask_strides(kind, B, H, Sq, Sk),
            mask_dtype=dtype,
            score_bias_after_scale=after,
        )
        # float masks: nonzero (including negative and NaN) keeps
        fn = (
            None
            if dtype == "bool"
            else (
                lambda rng, n: np.where(
                    rng.random(n) < 0.7, rng.choice([1.0, -2.0, np.nan], n), 0.0
                )
            )
        )
        check_spec(spec, mask_fn=fn)


def test_bert_key_padding_mask():
    """[B,1,1,Sk] additive -10000 padding mask (the BERT export)."""
    B, H, S, D = 3, 4, 100, 64
    lens = [100, 37, 1]

    def fn(rng, n):
        m = np.zeros((B, S), np.float32)
        for b, L in enumerate(lens):
            m[b, L:] = -10000.0
        return m.reshape(-1)

    spec = dense(B, H, S, S, D, scale=0.125, mask="add", mask_strides=(S, 0, 0, 1))
    check_spec(spec, mask_fn=fn)
    # rows masked entirely with -10000 stay finite (softmax of nearly equal
    # values). Their float32 scores s + (-10000) carry only ~1e-3 absolute
    # precision (half an ulp of 1e4), in any float32 implementation of the
    # graph: one score rounding differently from the reference moves a weight
    # by ~0.1%, hence the looser tolerance of this case
    fn_all = lambda rng, n: np.full(n, -10000.0, np.float32)
    case, _ = check_spec(spec, mask_fn=fn_all, atol=1e-3)
    assert np.isfinite(case.ref).all()


def test_neg_inf_additive_mask():
    """-inf entries get weight 0 even when a whole key block is -inf; a row that
    is all -inf is NaN (as numpy and onnxruntime)."""
    B, H, Sq, Sk, D = 1, 2, 20, 150, 16

    def fn(rng, n):
        m = np.zeros((Sq, Sk), np.float32)
        m[:, :70] = -np.inf  # the first key block(s) entirely -inf
        m[3, :] = -np.inf  # one row all -inf -> NaN
        m[5, 100:] = -np.inf
        return m.reshape(-1)

    spec = dense(B, H, Sq, Sk, D, scale=0.25, mask="add", mask_strides=(0, 0, Sk, 1))
    case, _ = check_spec(spec, mask_fn=fn)
    assert np.isnan(case.ref[:, :, 3]).all() and not np.isnan(case.ref[:, :, 4]).any()


def test_where_fully_masked_rows_uniform():
    """Rows masked entirely with the float32-lowest fill get uniform weights."""
    B, H, Sq, Sk, D = 2, 2, 30, 140, 32

    def fn(rng, n):
        m = rng.random((B, Sq, Sk)) < 0.5
        m[0, 4, :] = False
        m[1, :, :] = False  # all rows of batch 1
        m[0, 7, :100] = False  # masked first blocks, then real scores
        return m.reshape(-1)

    spec = dense(
        B,
        H,
        Sq,
        Sk,
        D,
        scale=0.2,
        mask="where",
        mask_dtype="bool",
        mask_strides=(Sq * Sk, 0, Sk, 1),
        fill=F32_LOWEST,
    )
    case, _ = check_spec(spec, mask_fn=fn)
    np.testing.assert_allclose(
        case.ref[1],
        np.broadcast_to(
            case.views["v"][1].astype(np.float64).mean(1, keepdims=True), case.ref[1].shape
        ),
    )
    # fill = -inf: fully masked rows are NaN (numpy), the others unaffected
    spec = dense(
        B,
        H,
        Sq,
        Sk,
        D,
        scale=0.2,
        mask="where",
        mask_dtype="bool",
        mask_strides=(Sq * Sk, 0, Sk, 1),
        fill=float("-inf"),
    )
    check_spec(spec, mask_fn=fn)
    # another finite fill
    spec = dense(
        B,
        H,
        Sq,
        Sk,
        D,
        scale=0.2,
        mask="where",
        mask_dtype="bool",
        mask_strides=(Sq * Sk, 0, Sk, 1),
        fill=-1e9,
    )
    check_spec(spec, mask_fn=fn)


def test_sliced_causal_bool_buffer():
    """GPT-2 style: a [1,1,N,N] bool lower-triangular buffer sliced to [Sq,Sk]."""
    N = 64
    tri = np.tril(np.ones((N, N), bool))
    for Sq, Sk in [(20, 20), (5, 30), (30, 30)]:
        off = Sk - Sq
        # the slice tri[Sk-Sq:Sk, :Sk] as strides into the full [N,N] buffer
        buf_off = off * N

        def fn(rng, n, buf_off=buf_off):
            flat = tri.reshape(-1)
            return flat[buf_off : buf_off + n]

        spec = dense(
            1,
            3,
            Sq,
            Sk,
            32,
            scale=1 / np.sqrt(32),
            mask="where",
            mask_dtype="bool",
            mask_strides=(0, 0, N, 1),
            fill=F32_LOWEST,
        )
        check_spec(spec, mask_fn=fn)


# ---------------------------------------------------------------------------
# causal
# ---------------------------------------------------------------------------

CAUSAL_SHAPES = [
    (1, 1, 1, 1, 8),
    (1, 2, 7, 7, 16),
    (2, 3, 64, 64, 64),
    (1, 1, 150, 150, 64),  # zigzag order over 10 query blocks
    (1, 1, 5, 40, 33),  # Sq < Sk: decoding with a cache
    (2, 2, 1, 90, 16),
    (1, 2, 40, 25, 16),  # Sq > Sk: the first rows see no key -> NaN
    (2, 1, 130, 260, 80),
]


@pytest.mark.parametrize("shape", CAUSAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_causal(shape):
    B, H, Sq, Sk, D = shape
    for kt in (False, True):
        spec = dense(B, H, Sq, Sk, D, scale=1 / np.sqrt(D), causal=True, k_transposed=kt)
        case, _ = check_spec(spec, seed=Sq + Sk)
        if Sq > Sk:
            assert np.isnan(case.ref[:, :, : Sq - Sk]).all()
    # causal + masks
    B, H, Sq, Sk, D = 2, 2, 33, 33, 16
    spec = dense(B, H, Sq, Sk, D, scale=0.25, causal=True, mask="add", mask_strides=(Sk, 0, 0, 1))
    check_spec(spec, mask_fn=lambda rng, n: np.where(rng.random(n) < 0.2, -10000.0, 0.0))
    spec = dense(
        B,
        H,
        Sq,
        Sk,
        D,
        scale=0.25,
        causal=True,
        mask="where",
        mask_dtype="bool",
        mask_strides=dense_strides(B, H, Sq, Sk),
    )
    check_spec(spec)


def test_zigzag_balance():
    spec = dense(1, 1, 256, 256, 64, causal=True)
    p = attention_plan(spec)
    assert p.zigzag and p.nq >= 4


# ---------------------------------------------------------------------------
# tiling, forced plans, tile ranges
# ---------------------------------------------------------------------------


def test_forced_plans():
    B, H, Sq, Sk, D = 2, 2, 45, 170, 40
    for kt in (False, True):
        spec = dense(
            B, H, Sq, Sk, D, scale=0.2, mask="add", mask_strides=(Sk, 0, 0, 1), k_transposed=kt
        )
        for tuning in [
            {"scope": "block"},
            {"scope": "block", "KB": 32, "NV_s": 2},
            {"KB": 128},
            {"KB": 16, "NV_s": 1, "MR_s": 8},
            {"MQ": 8, "MR_s": 8, "MR_v": 2, "NV_v": 2},
            {"MQ": 5, "MR_s": 5, "MR_v": 1},
            {"MR_s": 6, "NV_s": 2, "MR_v": 6, "MQ": 12},
            {"unroll_d": 1, "unroll_j": 1},
            {"unroll_d": 3, "unroll_j": 3},
            {"v_mode": "pack"},
            {"v_mode": "pack", "scope": "block"},
            {"zigzag": True},
        ]:
            check_spec(spec, tuning=tuning)
    # K^T [B,H,D,S] forced through the packer
    spec = dense(B, H, Sq, Sk, D, scale=0.2, k_transposed=True)
    check_spec(spec, tuning={"k_mode": "pack"})


def test_tile_ranges():
    spec = dense(2, 3, 50, 60, 32, scale=0.2, causal=True)
    case = Case(spec)
    kernel = build(spec)
    T = attention_num_tiles(spec)
    for splits in ([0, T], [0, 1, T], [0, T - 1, T], list(range(T + 1)), [0, 3, 3, 7, T]):
        O = run_split(kernel, case, splits=splits)
        case.check(O)
    # one call per tile in reverse order (K packed fresh for each call)
    O = case.new_o()
    wsb = attention_workspace_bytes(spec)
    ws = aligned(wsb // 4)
    argv = case.args(O)
    for t in reversed(range(T)):
        kernel(argv, t, t + 1, ws.ctypes.data)
    case.check(O)


def test_merged_heads_prefetches():
    """Merged-heads Q, K, V, O ([B,S,H,D], rows H*D apart) turn on the prefetches of the
    next tile's query rows, the tile's output rows and the next head's key rows. They
    read ahead of the tile (the next tile, the next head: past the range's end and past
    the last head they are skipped), and change no result: the same output bit for bit
    as without them, over every split of the tile range."""
    spec = bert_layout(2, 3, 37, 37, 32, scale=1 / np.sqrt(32))
    plan = attention_plan(spec)
    assert plan.prefetch_q and plan.prefetch_o and plan.prefetch_k
    dense_plan = attention_plan(dense(2, 3, 37, 37, 32, scale=0.2))
    assert not (dense_plan.prefetch_q or dense_plan.prefetch_o or dense_plan.prefetch_k)
    case = Case(spec)
    kernel = build(spec)
    off = {"prefetch_q": False, "prefetch_o": False, "prefetch_k": False}
    ref = run_split(build(spec, off), case, off)
    case.check(ref)
    T = attention_num_tiles(spec)
    for splits in ([0, T], [0, 1, T], [0, T - 1, T], list(range(T + 1)), [0, 3, 3, 7, T]):
        O = run_split(kernel, case, splits=splits)
        np.testing.assert_array_equal(O, ref)


def test_two_threads_concurrently():
    """Both halves of the tile range at the same time (the JIT functions release
    the GIL), each with its own workspace, as the runtime calls them."""
    for spec in (
        dense(2, 3, 70, 90, 32, scale=0.2, mask="add", mask_strides=(90, 0, 0, 1)),
        dense(1, 1, 300, 300, 64, scale=0.125, causal=True),  # one head split in two
    ):
        case = Case(spec)
        kernel = build(spec)
        T = attention_num_tiles(spec)
        wsb = attention_workspace_bytes(spec)
        wss = [aligned(wsb // 4) for _ in range(2)]
        for _ in range(3):
            O = case.new_o()
            run_concurrently(kernel, case.args(O), tile_ranges(T, 2), [w.ctypes.data for w in wss])
            case.check(O)


def test_misaligned():
    spec = dense(2, 2, 19, 41, 24, Dv=40, scale=0.3, mask="add", mask_strides=(41, 0, 0, 1))
    check_spec(spec, misalign=1)
    spec = dense(
        1,
        2,
        19,
        41,
        24,
        Dv=40,
        scale=0.3,
        mask="where",
        mask_dtype="bool",
        mask_strides=(0, 0, 41, 1),
        k_transposed=True,
    )
    check_spec(spec, misalign=3)


def test_bert_base_shapes():
    for S in (128, 384):
        spec = dense(2, 12, S, S, 64, scale=0.125, mask="add", mask_strides=(S, 0, 0, 1))
        check_spec(spec, mask_fn=lambda rng, n: np.where(rng.random(n) < 0.1, -10000.0, 0.0))
    spec = dense(1, 12, 512, 512, 64, scale=0.125, causal=True, merged_heads_out=True)
    check_spec(spec)


def test_large_scores_and_long_rows():
    """Scores of magnitude ~100 (no overflow: exp(s - m)), several blocks, long Sk
    (packing per key block when K^T of one head is large)."""
    spec = dense(1, 1, 20, 3000, 64, scale=1.0)
    assert attention_plan(spec).scope == "block"  # K^T of a head: 750 KiB
    check_spec(spec, qk_scale=1.5, seed=3)
    check_spec(spec, qk_scale=1.5, seed=3, tuning={"scope": "bh"})
    spec = dense(1, 1, 17, 2500, 128, Dv=64, scale=0.1, mask="add", mask_strides=(0, 0, 0, 1))
    check_spec(spec, tuning={"scope": "block"})


def test_nan_propagates_to_its_row():
    spec = dense(1, 1, 6, 40, 16, scale=0.25)
    case = Case(spec)
    case.bufs["q"][2 * 16 + 5] = np.nan  # Q[0,0,2,5]
    case.ref = reference(spec, case.views["q"], case.views["k"], case.views["v"], None)
    kernel = build(spec)
    O = run_split(kernel, case)
    got = case.got(O)
    assert np.isnan(got[0, 0, 2]).all() and not np.isnan(got[0, 0, [0, 1, 3, 4, 5]]).any()
    case.check(O)


def test_zero_nan_rows():
    """zero_nan_rows (torch's Where(IsNaN(p), 0, p) after the softmax): a row whose
    scores are all -inf (over several key blocks), or that holds a NaN or a +inf score,
    comes out as 0, its neighbours as without it; without it those rows are NaN."""
    B, H, Sq, Sk, D = 1, 2, 20, 150, 16

    def fn(rng, n):
        m = np.zeros((Sq, Sk), np.float32)
        m[:, :70] = -np.inf
        m[3, :] = -np.inf       # all -inf
        m[5, 100:] = -np.inf
        m[7, 20] = np.nan       # a NaN score
        m[9, 120] = np.inf      # a +inf score
        return m.reshape(-1)

    bad = [3, 7, 9]
    for zero in (True, False):
        spec = dense(B, H, Sq, Sk, D, scale=0.25, mask="add", mask_strides=(0, 0, Sk, 1),
                     zero_nan_rows=zero)
        case, _ = check_spec(spec, mask_fn=fn)
        assert (case.ref[:, :, bad] == 0).all() if zero else np.isnan(case.ref[:, :, bad]).all()
        assert np.isfinite(np.delete(case.ref, bad, axis=2)).all()


def test_zero_nan_rows_fully_masked_row_reads_nan_in_v():
    """A fully masked row under zero_nan_rows is 0 @ V, as the guarded graph computes
    it: NaN in the column where V holds a NaN, 0 elsewhere."""
    B, H, Sq, Sk, D = 1, 1, 6, 40, 16
    spec = dense(B, H, Sq, Sk, D, scale=0.25, mask="add", mask_strides=(0, 0, Sk, 1),
                 zero_nan_rows=True)

    def fn(rng, n):
        m = np.zeros((Sq, Sk), np.float32)
        m[2, :] = -np.inf
        return m.reshape(-1)

    case = Case(spec, mask_fn=fn)
    case.bufs["v"][30 * D + 4] = np.nan                 # V[0,0,30,4]
    case.ref = reference(spec, case.views["q"], case.views["k"], case.views["v"], case.mask)
    O = run_split(build(spec), case)
    got = case.got(O)
    assert np.isnan(got[0, 0, :, 4]).all()
    assert (np.delete(got[0, 0, 2], 4) == 0).all()
    case.check(O)


def test_form_zero_nan_rows_causal_rows_without_keys():
    """The polymorphic kernel keeps zero_nan_rows in its form; causal rows that see no
    key at all (Sq > Sk) are 0 under it instead of NaN."""
    specs = [dense(B, 2, Sq, Sk, 24, scale=0.2, causal=True, zero_nan_rows=True)
             for B, Sq, Sk in [(1, 40, 25), (2, 7, 7), (1, 9, 3)]]
    form = check_form(specs)
    assert form.zero_nan_rows
    ref = reference(specs[0], *(np.ones((1, 2, n, 24)) for n in (40, 25, 25)), None)
    assert (ref[0, :, :15] == 0).all() and np.isfinite(ref).all()


def test_spec_validation():
    with pytest.raises(ValueError):
        dense(1, 1, 0, 4, 4)
    with pytest.raises(ValueError):
        dense(1, 1, 4, 4, 4, mask="mul")
    with pytest.raises(ValueError):
        dense(1, 1, 4, 4, 4, mask="add", mask_dtype="bool")
    with pytest.raises(ValueError):
        AttnSpec(1, 1, 4, 4, 4, 4, (16, 16, 4, 1), (16, 16, 4, 1), (16, 16, 4, 1), (16, 16, 0, 1))
    with pytest.raises(ValueError):
        attention_plan(dense(1, 1, 4, 4, 4), {"k_mode": "direct"})


# ---------------------------------------------------------------------------
# shape-polymorphic kernels (AttnForm: runtime B, Sq, Sk)
# ---------------------------------------------------------------------------


def run_form(kernel, case: Case, tuning=None, splits=None):
    """Run a form's kernel on ``case``: the runtime dims follow the pointers."""
    til = attention_tiling(case.spec, tuning)
    assert til.workspace_bytes % 64 == 0 and len(til.dims) == len(RT_DIMS)
    O = case.new_o()
    ptrs = [case.bufs[n].ctypes.data for n in ("q", "k", "v")]
    if case.spec.mask != "none":
        ptrs.append(case.bufs["mask"].ctypes.data)
    ptrs.append(O.ctypes.data + 4 * case.guard)
    vals = ptrs + list(til.dims)
    run_splits(kernel, (ctypes.c_int64 * len(vals))(*vals), til.num_tiles,
               til.workspace_bytes, splits, ws_fill=np.nan)
    return O


def check_form(specs, tuning=None, **kw):
    """One kernel, emitted for the form of specs[0], computes every spec."""
    form = attention_tiling(specs[0], tuning).form
    module = ir.Module()
    emit_attention(module, "attn_form", form, tuning=tuning)
    kernel = jit_kernel(module, "attn_form", 0)
    for i, spec in enumerate(specs):
        assert attention_tiling(spec, tuning).form == form, spec
        case = Case(spec, seed=i, **kw)
        case.check(run_form(kernel, case, tuning))
    return form


def bert_layout(B, H, Sq, Sk, D, Dv=None, mask="add", **kw):
    """Q, K, V read through the head-split Transposes of [B,S,H,D] tensors, O
    written in merged heads ([B,Sq,H,Dv]), a [B,1,1,Sk] key-padding mask."""
    Dv = D if Dv is None else Dv
    ms = {"add": (Sk, 0, 0, 1), "where": (Sk, 0, 0, 1), "none": (0, 0, 0, 0)}[mask]
    if mask == "add" and Sk == 1 or mask == "where" and Sk == 1:
        ms = (1, 0, 0, 0)   # what the fusion pass gives a [B,1,1,1] mask
    if B == 1:
        ms = (0,) + ms[1:]
    return AttnSpec(B, H, Sq, Sk, D, Dv, (Sq * H * D, D, H * D, 1), (Sk * H * D, D, H * D, 1),
                    (Sk * H * Dv, Dv, H * Dv, 1), (Sq * H * Dv, Dv, H * Dv, 1),
                    mask=mask, mask_strides=ms, mask_dtype="bool" if mask == "where" else
                    "float32", **kw)


RUNTIME_SIZES = [(1, 1), (2, 7), (3, 33), (1, 128), (2, 70), (1, 17)]  # (B, S)


@pytest.mark.parametrize("kt,merged", [(False, False), (True, False), (False, True), (True, True)])
def test_form_dense_layouts(kt, merged):
    specs = [dense(B, 2, S, S, 40, k_transposed=kt, merged_heads_out=merged, scale=0.2)
             for B, S in RUNTIME_SIZES]
    form = check_form(specs)
    # K^T stored ([B,H,D,S]): read in place with a runtime row stride (Sk)
    assert form.k_strides == ((None, None, 1, None) if kt else (None, None, 40, 1))


@pytest.mark.parametrize("mask", ["add", "where", "none"])
def test_form_bert_layout(mask):
    specs = [bert_layout(B, 3, S, S, 32, mask=mask, scale=1 / np.sqrt(32))
             for B, S in RUNTIME_SIZES]
    form = check_form(specs, mask_fn=lambda rng, n: rng.random(n) < 0.8)
    assert form.k_strides[2:] == (96, 1) and form.v_strides[2:] == (96, 1)


@pytest.mark.parametrize("kt", [False, True], ids=["k", "kt"])
def test_avx2_whole_and_short_key_chunks(monkeypatch, kt):
    """The AVX2 kernels (the host restricted as CANNC_ISA=avx2 does): chunks of keys that
    fill the micro-kernel's vectors load K^T unmasked, a block's short last chunk under
    masks; static specs and the polymorphic form, every layout of K."""
    from cannc.codegen import attention as attn_mod
    from tests.helpers import restrict_host_to_avx2
    spec = dense(1, 12, 128, 128, 32, scale=0.2)
    wide_plan = attention_plan(spec)
    restrict_host_to_avx2(monkeypatch)
    # (the plans are cached per spec and register file: AVX2's are its own)
    assert attention_plan(spec) is attn_mod._plan(spec, (), False)
    assert attention_plan(spec).NV_s == 1 < wide_plan.NV_s
    for shape in ((1, 2, 13, 13, 33, 33), (2, 1, 33, 150, 16, 48),
                  (1, 1, 129, 130, 64, 64), (4, 3, 1, 200, 64, 64)):
        B, H, Sq, Sk, D, Dv = shape
        spec = dense(B, H, Sq, Sk, D, Dv, k_transposed=kt, scale=1.0 / np.sqrt(D))
        assert attention_plan(spec).NV_s == 1
        check_spec(spec, seed=sum(shape))
    check_form([dense(B, 2, S, S, 40, k_transposed=kt, scale=0.2) for B, S in RUNTIME_SIZES])
    check_form([bert_layout(B, 3, S, S, 32, scale=1 / np.sqrt(32)) for B, S in RUNTIME_SIZES])


def test_form_cross_attention_and_masks():
    """Sq != Sk; masks [B,1,Sq,Sk], [1,1,Sq,Sk] and [B,H,Sq,Sk] (outer strides at run time)."""
    sizes = [(1, 1, 1), (2, 7, 30), (3, 33, 5), (1, 1, 129), (2, 80, 80)]
    for kind in ("full", "rows"):
        specs = [dense(B, 2, Sq, Sk, 16, scale=0.3, mask="add",
                       mask_strides=(0, 0, Sk, 1) if kind == "rows" or B == 1
                       else (Sq * Sk, 0, Sk, 1))
                 for B, Sq, Sk in sizes]
        check_form(specs)
    specs = [dense(B, 2, Sq, Sk, 16, scale=0.3, mask="where", mask_dtype="float32",
                   mask_strides=dense_strides(B, 2, Sq, Sk)) for B, Sq, Sk in sizes[1:]]
    check_form(specs, mask_fn=lambda rng, n: (rng.random(n) < 0.7).astype(np.float32))


def test_form_causal():
    """Causal with Sq == Sk, Sq < Sk (decoding) and Sq > Sk (rows with no key: NaN)."""
    sizes = [(1, 1, 1), (2, 7, 7), (1, 5, 40), (2, 1, 90), (1, 40, 25), (1, 150, 150)]
    for kt in (False, True):
        specs = [dense(B, 2, Sq, Sk, 24, scale=0.2, causal=True, k_transposed=kt)
                 for B, Sq, Sk in sizes]
        check_form(specs)


def test_form_odd_strides_at_run_time():
    """Inner strides that depend on B, Sq or Sk (K seq-first, V^T, O [H,B,Dv,S]) are
    runtime dims: gathers, transposed packing and scatters with runtime strides."""
    H, D, Dv = 3, 20, 19

    def spec(B, Sq, Sk):
        ks = (D * H, 1, B * D * H, H)
        vs = (H * Dv * Sk, Dv * Sk, 1, Sk)
        qs = (Sq * H * D, D, H * D, 1)
        os_ = (Dv * Sq, B * Dv * Sq, 1, Sq)
        return AttnSpec(B, H, Sq, Sk, D, Dv, qs, ks, vs, os_, scale=0.3)

    form = check_form([spec(2, 11, 37), spec(1, 4, 9), spec(3, 5, 20), spec(2, 1, 1)])
    assert form.k_strides == (None, None, None, H) and form.v_strides == (None, None, 1, None)
    assert form.o_strides == (None, None, None, None)
    # B = Sk = 1 leaves K's nesting (seq-first) ambiguous: another, still correct, form
    assert check_form([spec(1, 1, 1)]) != form


def test_form_block_scope_and_tuning():
    """Packing per key block (long sequences), and plan overrides."""
    specs = [bert_layout(B, 1, S, S, 128, Dv=64, scale=0.1) for B, S in [(1, 1), (2, 45), (1, 300)]]
    check_form(specs, tuning={"scope": "block"})
    check_form(specs, tuning={"KB": 128, "MQ": 32})
    long_ = bert_layout(1, 1, 4, 1200, 128, scale=0.1)
    assert attention_tiling(long_).form.scope == "block"    # K^T of a head: > 512 KiB
    assert attention_tiling(specs[1]).form.scope == "bh"


def test_form_key_has_no_runtime_dim():
    """The form (a kernel key) is the same at every B, Sq, Sk, including 1, and changes
    with what the code depends on."""
    forms = {attention_tiling(bert_layout(B, 4, S, S, 64, scale=0.125)).form
             for B, S in RUNTIME_SIZES}
    assert len(forms) == 1
    (form,) = forms
    assert form.H == 4 and form.D == 64 and form.mask == "add"
    assert attention_tiling(bert_layout(2, 2, 7, 7, 64, scale=0.125)).form != form
    assert attention_tiling(bert_layout(2, 4, 7, 7, 32, scale=0.125)).form != form
    assert attention_tiling(bert_layout(2, 4, 7, 7, 64, scale=0.5)).form != form
    til = attention_tiling(bert_layout(3, 4, 33, 33, 64))
    assert til.dims[:3] == (3, 33, 33) and til.num_tiles == 3 * 4 * 3


def test_form_equals_static_kernel_bit_for_bit():
    """Where the static plan is the form's (long sequences), both kernels do the same
    arithmetic: the runtime sizes change no result bit."""
    for spec in (bert_layout(2, 2, 128, 128, 64, scale=0.125),
                 dense(1, 2, 150, 150, 32, scale=0.2, causal=True, k_transposed=True)):
        case = Case(spec, seed=5)
        static = run_split(build(spec, speed_level=2), case)
        form = attention_tiling(spec).form
        module = ir.Module()
        emit_attention(module, "attn_form", form)
        poly = run_form(jit_kernel(module, "attn_form", 2), case)
        case.check(poly)
        np.testing.assert_array_equal(poly, static)
