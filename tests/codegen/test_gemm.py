"""Tests of the fp32 GEMM kernel generator (cannc/codegen/gemm.py).

Every kernel is JIT-compiled for the host CPU through the compiler's own
pipeline (cannc.native.target.jit_kernel) and called through ctypes with the
tile range split like two cores would (plus empty ranges), then compared with
numpy (float64 reference).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import math
import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from llvmlite import ir

from cannc.codegen import gemm as gemm_mod
from cannc.codegen.gemm import (
    GEMM_DIMS,
    STRIP_LIB,
    GemmSpec,
    dynamic_spec,
    emit_gemm,
    gemm_dims,
    gemm_num_tiles,
    gemm_plan,
    gemm_workspace_bytes,
    host_isa,
    prepack_b,
    prepacked_b_size,
    variant_plan,
)
from cannc.codegen.vec import declare
from cannc.native import emit
from cannc.native.target import KernelFunction, jit_kernel, jit_library, library_needs
from cannc.schedule.machine import gemm_k_unroll, gemm_micro_rows, gemm_wide_tile, l2_b_block
from tests.helpers import aligned, run_splits

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def strided(buf, base, rows, cols, ld):
    idx = base + np.arange(rows)[:, None] * ld + np.arange(cols)[None, :]
    return buf[idx]


SENTINEL = np.float32(-12345.5)


class Case:
    """Buffers for one spec, a float64 reference and a runner."""

    def __init__(self, spec: GemmSpec, seed=0, misalign=0):
        s = self.spec = spec
        rng = np.random.default_rng(seed)
        ra, ca = (s.K, s.M) if s.trans_a else (s.M, s.K)
        rb, cb = (s.N, s.K) if s.trans_b else (s.K, s.N)
        na = s.batch if s.a_batch_stride else 1
        nb = s.batch if s.b_batch_stride else 1
        a_len = (na - 1) * s.a_batch_stride + (ra - 1) * s.lda_ + ca
        b_len = (nb - 1) * s.b_batch_stride + (rb - 1) * s.ldb_ + cb
        self.A = aligned(a_len, offset_elems=misalign)
        self.A[:] = rng.standard_normal(a_len)
        self.Braw = aligned(b_len, offset_elems=misalign)
        self.Braw[:] = rng.standard_normal(b_len)
        a_mats = np.stack(
            [strided(self.A, i * s.a_batch_stride, ra, ca, s.lda_) for i in range(na)]
        )
        b_mats = np.stack(
            [strided(self.Braw, i * s.b_batch_stride, rb, cb, s.ldb_) for i in range(nb)]
        )
        if s.b_prepacked:
            packed = prepack_b(s, b_mats if s.b_batch_stride else b_mats[0])
            assert packed.size == prepacked_b_size(s)
            self.B = aligned(packed.size, offset_elems=misalign)
            self.B[:] = packed
        else:
            self.B = self.Braw
        aop = a_mats.transpose(0, 2, 1) if s.trans_a else a_mats
        bop = b_mats.transpose(0, 2, 1) if s.trans_b else b_mats
        ref = s.alpha * np.matmul(aop.astype(np.float64), bop.astype(np.float64))
        ref = np.broadcast_to(ref, (s.batch, s.M, s.N))
        self.bias = None
        if s.bias:
            blen = (s.M - 1) * s.bias_row_stride + (s.N - 1) * s.bias_col_stride + 1
            self.bias = aligned(blen, offset_elems=misalign)
            self.bias[:] = rng.standard_normal(blen)
            bidx = (
                np.arange(s.M)[:, None] * s.bias_row_stride
                + np.arange(s.N)[None, :] * s.bias_col_stride
            )
            ref = ref + s.beta * self.bias[bidx].astype(np.float64)
        self.ref = ref
        cbs = s.c_batch_stride_
        self.c_len = (s.batch - 1) * cbs + (s.M - 1) * s.ldc_ + s.N
        self.guard = 64
        self.c_index = np.stack(
            [
                i * cbs + np.arange(s.M)[:, None] * s.ldc_ + np.arange(s.N)[None, :]
                for i in range(s.batch)
            ]
        )
        self.K = s.K

    def new_c(self):
        C = aligned(self.c_len + 2 * self.guard)
        C[:] = SENTINEL
        return C

    def args(self, C):
        ptrs = [self.A.ctypes.data, self.B.ctypes.data]
        if self.spec.bias:
            ptrs.append(self.bias.ctypes.data)
        ptrs.append(C.ctypes.data + 4 * self.guard)
        return (ctypes.c_void_p * len(ptrs))(*ptrs)

    def check(self, C, rtol=1e-4, atol=None, ref=None):
        ref = self.ref if ref is None else ref
        if atol is None:
            atol = 1e-5 * max(1.0, self.K**0.5) * max(1.0, abs(self.spec.alpha))
        got = C[self.guard : self.guard + self.c_len][self.c_index]
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol)
        # nothing outside the logical C (guards, ldc gaps, batch gaps) was written
        mask = np.ones(C.size, bool)
        mask[self.guard + self.c_index.reshape(-1)] = False
        assert np.all(C[mask] == SENTINEL), "kernel wrote outside C"


def build(spec: GemmSpec, epilogue=None, tuning=None, name="gemm"):
    module = ir.Module()
    fn = emit_gemm(module, name, spec, epilogue, tuning=tuning)
    assert fn.name == name
    return jit_kernel(module, name, speed_level=0)


def run_split(kernel, case: Case, tuning=None, splits=None, C=None):
    """Run the whole tile range as 2 cores would (and with empty ranges)."""
    spec = case.spec
    T = gemm_num_tiles(spec, tuning)
    assert T >= 1
    wsb = gemm_workspace_bytes(spec, tuning)
    assert wsb % 64 == 0
    if C is None:
        C = case.new_c()
    run_splits(kernel, case.args(C), T, wsb, splits, ws_fill=SENTINEL)
    return C


def check_spec(spec: GemmSpec, epilogue=None, tuning=None, ref=None, **kw):
    case = Case(spec, **kw)
    kernel = build(spec, epilogue, tuning)
    C = run_split(kernel, case, tuning)
    case.check(C, ref=ref(case) if callable(ref) else ref)
    return case, kernel


# ---------------------------------------------------------------------------
# shapes x transposes x B layouts
# ---------------------------------------------------------------------------

SHAPES = [
    (1, 1, 1),
    (1, 33, 17),
    (1, 300, 257),
    (2, 50, 40),
    (3, 17, 100),
    (5, 70, 33),
    (7, 33, 65),
    (8, 64, 128),
    (10, 45, 70),
    (13, 100, 3),
    (40, 70, 300),
    (100, 300, 500),
    (200, 64, 120),
    (30, 290, 200),
    (300, 1, 64),
    (50, 3, 70),
    (9, 8, 100),  # tiny N: dot-product kernels
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes_transposes_layouts(shape):
    M, N, K = shape
    for ta, tb, pre in itertools.product([False, True], [False, True], [False, True]):
        if tb and pre:
            continue  # same kernel as (not tb, pre): prepack_b absorbs the transpose
        check_spec(GemmSpec(M, N, K, trans_a=ta, trans_b=tb, b_prepacked=pre), seed=M + N + K)


def test_gemv_large():
    for tb, pre in [(False, False), (True, False), (False, True)]:
        check_spec(GemmSpec(1, 4096, 1024, trans_b=tb, b_prepacked=pre))


def test_k_blocking_and_forced_modes():
    # several K blocks (partial sums kept in C), every B mode, A packed or not
    spec = GemmSpec(29, 75, 410)
    for tuning in [
        {"KC": 64},
        {"KC": 64, "pack_a": True},
        {"KC": 50, "pack_a": False},
        {"b_mode": "direct", "KC": 16},
        {"b_mode": "pack", "unroll": 1},
        {"unroll": 4, "KC": 100},
        {"MR": 4, "NV": 4},
        {"grid": (3, 1)},
        {"grid": (1, 3)},
    ]:
        check_spec(spec, tuning=tuning)
    st = GemmSpec(29, 75, 410, trans_b=True)
    for tuning in [
        {"b_mode": "dot", "MR": 4, "NR": 4},
        {"b_mode": "pack", "KC": 64},
        {"b_mode": "dot", "MR": 1, "NR": 16},
    ]:
        check_spec(st, tuning=tuning)
    sp = GemmSpec(29, 75, 410, trans_a=True, b_prepacked=True)
    for tuning in [{"KC": 64, "pack_a": True}, {"KC": 64, "pack_a": False}, {"NV": 6, "MR": 2}]:
        check_spec(sp, tuning=tuning)


@pytest.mark.parametrize("tiles", [{"MR": 6, "NV": 2}, {"MR": 8, "NV": 2}])
@pytest.mark.parametrize("KC", [None, 700])
def test_long_k_blocks_sum_in_short_chains(tiles, KC):
    """A K block longer than SUBCHAIN is summed in chains of SUBCHAIN k whose sums are
    then added: in registers (6 x 32) or, where the 16 accumulators of an 8 x 32 tile
    leave no room, in C. Every chain-length remainder, one or several K blocks, edge
    rows and columns; the rounding error is that of short chains."""
    from cannc.codegen.gemm import SUBCHAIN
    spec = GemmSpec(21, 45, 2 * SUBCHAIN * 3 + 37, b_prepacked=True)
    tuning = dict(tiles, **({"KC": KC} if KC else {}))
    case, kernel = check_spec(spec, tuning=tuning)
    C = run_split(kernel, case, tuning)
    got = C[case.guard: case.guard + case.c_len][case.c_index].astype(np.float64)
    err = np.sqrt(np.mean((got - case.ref) ** 2) / np.mean(case.ref ** 2))
    # short chains: 2.9e-7; one chain of K (the 8 x 32 tile before): 6.6e-7
    assert err < 4e-7


# ---------------------------------------------------------------------------
# alpha / beta / bias
# ---------------------------------------------------------------------------

BIAS_MODES = {  # name -> (row stride, col stride) as functions of (M, N)
    "scalar": lambda M, N: (0, 0),
    "row_vector": lambda M, N: (0, 1),  # [N], broadcast over M
    "col_vector": lambda M, N: (1, 0),  # [M,1], broadcast over N
    "full": lambda M, N: (N, 1),  # [M,N]
    "full_transposed": lambda M, N: (1, M),  # [N,M] read transposed (gather)
}


@pytest.mark.parametrize("mode", list(BIAS_MODES))
def test_bias_alpha_beta(mode):
    alpha_beta = [(1.0, 1.0), (0.5, -2.0), (-1.5, 0.0)]
    for i, ((M, N, K), ta, tb, pre) in enumerate(
        [
            ((1, 37, 19), False, True, False),  # dot
            ((3, 40, 50), False, False, False),  # direct
            ((1, 130, 7), False, False, True),  # GEMV prepacked
            ((23, 45, 67), True, False, False),  # packed B
            ((19, 100, 300), False, False, True),  # prepacked, K blocks
            ((40, 3, 20), False, False, False),  # tiny N: dot with B^T in the workspace
        ]
    ):
        rs, cs = BIAS_MODES[mode](M, N)
        combos = alpha_beta if i == 3 else [alpha_beta[(i + len(mode)) % 3]]
        for alpha, beta in combos:
            check_spec(
                GemmSpec(
                    M,
                    N,
                    K,
                    trans_a=ta,
                    trans_b=tb,
                    b_prepacked=pre,
                    alpha=alpha,
                    beta=beta,
                    bias=True,
                    bias_row_stride=rs,
                    bias_col_stride=cs,
                ),
                seed=M * N,
            )


def test_alpha_without_bias():
    check_spec(GemmSpec(17, 45, 300, alpha=0.25, beta=3.0))  # beta unused without bias


# ---------------------------------------------------------------------------
# batches, leading dimensions, alignment
# ---------------------------------------------------------------------------


def test_batched():
    M, N, K = 9, 35, 21
    for a_bs, b_bs, pre, tb in [
        (M * K, K * N, False, False),  # both strided
        (0, K * N, False, False),  # broadcast A
        (M * K, 0, False, False),  # broadcast B
        (M * K, 0, True, False),  # broadcast prepacked B
        (M * K, K * N, True, False),  # batched prepacked B
        (M * K, K * N, False, True),  # packing trans B
        (0, 0, False, False),
    ]:
        check_spec(
            GemmSpec(
                M,
                N,
                K,
                batch=3,
                a_batch_stride=a_bs,
                b_batch_stride=b_bs,
                trans_b=tb,
                b_prepacked=pre,
            )
        )
    # attention-like small-M batched dot products (B = K^T)
    check_spec(
        GemmSpec(
            2,
            20,
            64,
            batch=5,
            a_batch_stride=128,
            b_batch_stride=20 * 64,
            trans_b=True,
            bias=True,
            bias_col_stride=1,
        )
    )
    # explicit C batch stride with gaps, row-broadcast bias
    check_spec(
        GemmSpec(
            4,
            10,
            8,
            batch=4,
            a_batch_stride=32,
            b_batch_stride=80,
            c_batch_stride=50,
            bias=True,
            bias_row_stride=1,
        )
    )
    # tiny N: B transposed into the workspace per batch item / prepacked as B^T
    for pre in (False, True):
        check_spec(
            GemmSpec(
                20,
                3,
                40,
                batch=3,
                a_batch_stride=800,
                b_batch_stride=120,
                b_prepacked=pre,
                bias=True,
                bias_row_stride=1,
            )
        )
    # many batch items, one tile each
    check_spec(GemmSpec(6, 32, 16, batch=40, a_batch_stride=96, b_batch_stride=512))


def test_leading_dimensions_and_misalignment():
    for ta, tb, pre in itertools.product([False, True], [False, True], [False, True]):
        M, N, K = 11, 37, 29
        spec = GemmSpec(
            M,
            N,
            K,
            trans_a=ta,
            trans_b=tb,
            b_prepacked=pre,
            lda=(M if ta else K) + 3,
            ldb=(K if tb else N) + 5,
            ldc=N + 7,
            batch=2,
            a_batch_stride=400,
            b_batch_stride=1300,
            c_batch_stride=M * (N + 7) + 2,
        )
        check_spec(spec, misalign=1)  # pointers 4 bytes off 64-byte alignment


# ---------------------------------------------------------------------------
# epilogue
# ---------------------------------------------------------------------------


def relu_epilogue(builder, value, m, n):
    return emit.intrinsic(builder, "llvm.maxnum", [value, ir.Constant(value.type, None)])


def index_epilogue(builder, value, m, n):
    """value + 0.5*m + 0.25*(n + lane): checks the indices passed."""
    vt = value.type
    lanes = ir.Constant(ir.VectorType(emit.I64, vt.count), list(range(vt.count)))
    cols = builder.add(emit.splat(builder, n, vt.count), lanes)
    fm = builder.sitofp(emit.splat(builder, m, vt.count), vt)
    fn_ = builder.sitofp(cols, vt)
    half = ir.Constant(vt, [0.5] * vt.count)
    quarter = ir.Constant(vt, [0.25] * vt.count)
    return builder.fadd(builder.fadd(value, builder.fmul(fm, half)), builder.fmul(fn_, quarter))


def _index_ref(case):
    s = case.spec
    return case.ref + 0.5 * np.arange(s.M)[:, None] + 0.25 * np.arange(s.N)[None, :]


@pytest.mark.parametrize(
    "spec",
    [
        GemmSpec(1, 77, 33),
        GemmSpec(3, 40, 20, trans_b=True),
        GemmSpec(14, 70, 2500, bias=True, bias_col_stride=1, alpha=2.0),  # K > KC_MAX
        GemmSpec(30, 100, 80, b_prepacked=True, trans_a=True, bias=True, bias_row_stride=1),
        GemmSpec(5, 33, 10, batch=2, a_batch_stride=50, b_batch_stride=330),
    ],
    ids=["gemv", "dot", "kblocks", "prepacked", "batched"],
)
def test_epilogue(spec):
    check_spec(spec, epilogue=relu_epilogue, ref=lambda c: np.maximum(c.ref, 0.0))
    check_spec(spec, epilogue=index_epilogue, ref=_index_ref)


def test_epilogue_can_use_kernel_arguments():
    """An epilogue runs inside the kernel: it can read another tensor via args."""
    spec = GemmSpec(10, 50, 30, bias=True, bias_row_stride=50, bias_col_stride=1, beta=0.0)

    def residual(builder, value, m, n):
        res = emit.load_arg(builder, builder.function.args[0], 2)
        off = builder.add(builder.mul(m, emit.i64(50)), n)
        p = emit.gep(builder, res, off, emit.F32)
        lanes = ir.Constant(ir.VectorType(emit.I64, 16), list(range(16)))
        cols = builder.add(lanes, emit.splat(builder, n, 16))
        rows = emit.splat(builder, m, 16)
        mask = builder.and_(
            builder.icmp_signed("<", cols, emit.splat(builder, emit.i64(50), 16)),
            builder.icmp_signed("<", rows, emit.splat(builder, emit.i64(10), 16)),
        )
        ml = declare(
            builder.module,
            "llvm.masked.load.v16f32.p0",
            value.type,
            [emit.PTR, emit.I32, mask.type, value.type],
        )
        r = builder.call(ml, [p, emit.i32(4), mask, ir.Constant(value.type, None)])
        return builder.fadd(value, r)

    # the "bias" input (beta=0, unused by the GEMM itself) is the residual
    check_spec(spec, epilogue=residual, ref=lambda c: c.ref + c.bias[:500].reshape(10, 50))

    # the same epilogue naming the lines it reads (epilogue.prefetch): the micro-tiles
    # prefetch them (rows past M too: prefetches do not fault), the results unchanged
    calls = []

    def prefetch(builder, args, m, n):
        calls.append((m.type, n.type))
        res = emit.load_arg(builder, args, 2)
        p = emit.gep(builder, res, builder.add(builder.mul(m, emit.i64(50)), n), emit.F32)
        emit.call_intrinsic(builder, "llvm.prefetch", [p, emit.i32(0), emit.i32(3),
                                                       emit.i32(1)], ret_type=emit.VOID)

    residual.prefetch = prefetch
    check_spec(spec, epilogue=residual, ref=lambda c: c.ref + c.bias[:500].reshape(10, 50))
    assert calls and all(c == (emit.I64, emit.I64) for c in calls)


# ---------------------------------------------------------------------------
# tiles: disjoint writes, every split, balance
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        GemmSpec(50, 70, 30),
        GemmSpec(1, 300, 40, trans_b=True),
        GemmSpec(20, 100, 300, b_prepacked=True),
        GemmSpec(7, 20, 9, batch=3, a_batch_stride=63, b_batch_stride=180),
    ],
    ids=["rows", "dot", "prepacked", "batch"],
)
def test_tiles_are_disjoint_and_cover_c(spec):
    case = Case(spec)
    kernel = build(spec)
    T = gemm_num_tiles(spec)
    owner = np.full(case.c_len, -1)
    for t in range(T):
        C = case.new_c()
        run_split(kernel, case, splits=[t, t + 1], C=C)
        written = C[case.guard : case.guard + case.c_len] != SENTINEL
        assert written.any(), f"tile {t} wrote nothing"
        assert np.all(owner[written] == -1), f"tile {t} overlaps another tile"
        owner[written] = t
    assert np.all(owner[case.c_index.reshape(-1)] >= 0)
    # any split into contiguous ranges gives the full result
    for cut in range(T + 1):
        case.check(run_split(kernel, case, splits=[0, cut, T]))
    case.check(run_split(kernel, case, splits=list(range(T + 1))))  # one tile per call


def _core_work(spec, plan, lo, hi):
    """Multiply-adds one call does for tiles [lo, hi) (padded to the micro-tile)."""
    per_b = plan.mt * plan.nt
    work = 0
    for t in range(lo, hi):
        r = t % per_b
        jt, it = divmod(r, plan.mt)
        rows = min(plan.MB, spec.M - it * plan.MB)
        cols = min(plan.NB, spec.N - jt * plan.NB)
        work += -(-rows // plan.MR) * plan.MR * -(-cols // plan.NR) * plan.NR * spec.K
    return work


@pytest.mark.parametrize(
    "shape,b_prepacked,trans_b",
    [
        ((1, 4096, 1024), True, False),
        ((1, 4096, 1024), False, False),
        ((1, 4096, 1024), False, True),
        ((8, 512, 512), True, False),
        ((8, 512, 512), False, False),
        ((8, 512, 512), False, True),
        ((3136, 64, 576), True, False),
        ((3136, 64, 576), False, False),
        ((128, 768, 3072), True, False),
        ((128, 768, 3072), False, False),
        ((128, 768, 3072), False, True),
        ((1024, 1024, 1024), True, False),
        ((256, 768, 3072), True, False),
        ((49, 512, 4608), True, False),
    ],
)
def test_two_core_balance(shape, b_prepacked, trans_b):
    spec = GemmSpec(*shape, b_prepacked=b_prepacked, trans_b=trans_b)
    plan = gemm_plan(spec)
    T = gemm_num_tiles(spec)
    assert 2 <= T <= 512
    w0 = _core_work(spec, plan, 0, T // 2)
    w1 = _core_work(spec, plan, T // 2, T)
    assert max(w0, w1) <= 1.1 * (w0 + w1) / 2, (plan, w0, w1)


# ---------------------------------------------------------------------------
# misc
# ---------------------------------------------------------------------------


def test_prepack_layout():
    spec = GemmSpec(2, 40, 3, b_prepacked=True)
    B = np.arange(3 * 40, dtype=np.float32).reshape(3, 40)
    p = prepack_b(spec, B).reshape(2, 3, 32)
    np.testing.assert_array_equal(p[0], B[:, :32])
    np.testing.assert_array_equal(p[1, :, :8], B[:, 32:])
    assert np.all(p[1, :, 8:] == 0)
    st = GemmSpec(2, 40, 3, b_prepacked=True, trans_b=True)
    np.testing.assert_array_equal(prepack_b(st, B.T.copy()), prepack_b(spec, B))
    flat = GemmSpec(2, 40, 3, b_prepacked=True, ldb=45)
    Bp = np.zeros((3, 45), np.float32)
    Bp[:, :40] = B
    np.testing.assert_array_equal(prepack_b(flat, Bp.reshape(-1)), prepack_b(spec, B))
    with pytest.raises(ValueError):
        prepack_b(spec, B.T)
    # tiny N: B^T ([N][K])
    small = GemmSpec(20, 3, 5, b_prepacked=True)
    Bs = np.arange(15, dtype=np.float32).reshape(5, 3)
    np.testing.assert_array_equal(prepack_b(small, Bs), Bs.T.reshape(-1))
    assert prepacked_b_size(small) == 15


def test_spec_validation():
    with pytest.raises(ValueError):
        GemmSpec(0, 1, 1)
    with pytest.raises(ValueError):
        GemmSpec(2, 3, 4, lda=3)
    assert GemmSpec(3, 4, 5, batch=2).c_batch_stride_ == 12
    assert GemmSpec(3, 4, 5, trans_a=True, trans_b=True).lda_ == 3
    assert GemmSpec(3, 4, 5, trans_a=True, trans_b=True).ldb_ == 5


def test_several_kernels_in_one_module():
    module = ir.Module()
    s1, s2 = GemmSpec(5, 40, 30), GemmSpec(20, 40, 300, trans_b=True)
    emit_gemm(module, "k1", s1)
    emit_gemm(module, "k2", s2, relu_epilogue)
    lib = jit_library(module, "two_gemms", speed_level=0)
    for name, spec, post in [("k1", s1, lambda r: r), ("k2", s2, lambda r: np.maximum(r, 0))]:
        case = Case(spec)
        C = run_split(KernelFunction(lib.address(name)), case)
        case.check(C, ref=post(case.ref))


def test_compile_time_is_small():
    spec = GemmSpec(1024, 1024, 1024, b_prepacked=True)
    module = ir.Module()
    emit_gemm(module, "gemm", spec)
    t0 = time.perf_counter()
    jit_kernel(module, "gemm", speed_level=0)
    dt = time.perf_counter() - t0
    assert dt < 1.0, dt  # ~0.03-0.06 s on the project's machine; loose for noisy CI


# ---------------------------------------------------------------------------
# shape-polymorphic kernels: M and the batch count at run time
# ---------------------------------------------------------------------------

DYN_MS = [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 37, 150, 301]


def _dyn_spec(spec: GemmSpec, M: int, batch: int | None = None) -> GemmSpec:
    """``spec`` with M rows (and ``batch`` items): its batch strides follow M."""
    batch = spec.batch if batch is None else batch
    return dataclasses.replace(
        spec, M=M, batch=batch,
        a_batch_stride=M * spec.K if spec.a_batch_stride else 0,
        b_batch_stride=spec.b_batch_stride if batch > 1 else 0,
        c_batch_stride=M * spec.N if batch > 1 else 0,
        bias_row_stride=spec.bias_row_stride)


def run_dynamic(kernel, dspec: GemmSpec, spec: GemmSpec, epilogue_ref=None, seed=0,
                splits=None, dims_slot=None, dims_spec=None):
    """Run the dynamic kernel of ``dspec`` on the shapes of the static ``spec`` (its
    runtime dims from gemm_dims, of ``dims_spec`` if given) and check C against the
    float64 reference."""
    case = Case(spec, seed=seed)
    dims, T = gemm_dims(dims_spec or dspec, spec.M, spec.batch)
    C = case.new_c()
    ptrs = list(case.args(C))
    slot = len(ptrs) if dims_slot is None else dims_slot
    vals = ptrs + [0] * (slot - len(ptrs)) + list(dims)
    argv = (ctypes.c_void_p * len(vals))(*vals)
    run_splits(kernel, argv, T, gemm_workspace_bytes(dspec), splits, ws_fill=SENTINEL)
    case.check(C, ref=epilogue_ref(case) if epilogue_ref else None)
    return dims, T


def build_dynamic(spec: GemmSpec, epilogue=None, dims_slot=None):
    dspec = dynamic_spec(spec)
    module = ir.Module()
    slot = (3 + spec.bias) if dims_slot is None else dims_slot
    emit_gemm(module, "gemm_dyn", dspec, epilogue, dims_slot=slot)
    return dspec, jit_kernel(module, "gemm_dyn", speed_level=0)


@pytest.mark.parametrize(
    "spec",
    [
        GemmSpec(1, 100, 70, b_prepacked=True),
        GemmSpec(1, 40, 2100, b_prepacked=True),           # several K blocks (> 6 rows)
        GemmSpec(1, 45, 33),                                 # B packed per block
        GemmSpec(1, 45, 2100),                               # ... in several K blocks
        GemmSpec(1, 64, 40, trans_b=True),
        GemmSpec(1, 3, 70, b_prepacked=True),                # N <= 8: dot products
        GemmSpec(1, 5, 40),
        GemmSpec(1, 6, 50, trans_b=True),
        GemmSpec(1, 70, 50, b_prepacked=True, trans_b=True, bias=True, bias_col_stride=1,
                 alpha=0.5, beta=2.0),
        GemmSpec(1, 40, 30, bias=True, bias_row_stride=1),   # a column (per row) bias
        GemmSpec(1, 40, 30, b_prepacked=True, bias=True, bias_row_stride=40,
                 bias_col_stride=1),                          # a full [M, N] bias
    ],
    ids=["prepacked", "kblocks", "pack", "pack_kblocks", "trans_b", "dot_prepacked",
         "dot_pack", "dot_rows",
         "bias_row", "bias_col", "bias_full"],
)
def test_dynamic_m(spec):
    """One kernel, every M: full row panels, each remainder strip (1..5 rows), several
    row blocks; the split between cores at every tile boundary for a few M."""
    dspec, kernel = build_dynamic(spec)
    assert dynamic_spec(_dyn_spec(spec, 77)) == dspec     # the code depends on no M
    for i, M in enumerate(DYN_MS):
        s = _dyn_spec(spec, M)
        dims, T = gemm_dims(dspec, M)
        assert dims[0] == M and T == dims[2] * dims[3]
        run_dynamic(kernel, dspec, s, seed=i)
        # a tiling function does not know whether B is a constant: the dims it computes
        # for a prepacked B serve a kernel that packs B, and the other way round
        other = dataclasses.replace(dspec, b_prepacked=not dspec.b_prepacked)
        run_dynamic(kernel, dspec, s, seed=i, dims_spec=other)
        if M in (5, 37):
            for cut in range(T + 1):
                run_dynamic(kernel, dspec, s, seed=i, splits=[0, cut, T])


def test_dynamic_batched():
    base = GemmSpec(5, 33, 10, batch=3, a_batch_stride=50, b_batch_stride=330,
                    c_batch_stride=165)
    for pre, a_bcast in itertools.product([False, True], [False, True]):
        spec = dataclasses.replace(base, b_prepacked=pre, a_batch_stride=0 if a_bcast else 50)
        dspec, kernel = build_dynamic(spec)
        for M, nb in [(1, 3), (2, 3), (7, 3), (40, 3), (6, 3)]:
            run_dynamic(kernel, dspec, _dyn_spec(spec, M, nb))
    # a batch count at run time too (B not shared: it has a batch of its own per call)
    spec = dataclasses.replace(base, batch=2, b_batch_stride=330)
    dspec, kernel = build_dynamic(spec)
    for M, nb in [(1, 1), (3, 2), (9, 5), (17, 40)]:
        run_dynamic(kernel, dspec, _dyn_spec(spec, M, nb))


def test_dynamic_epilogue_and_dims_slot():
    """The epilogue sees the true (m, n) in every strip; the dims may sit past other
    argument slots."""
    spec = GemmSpec(1, 70, 40, b_prepacked=True, bias=True, bias_col_stride=1)
    dspec, kernel = build_dynamic(spec, index_epilogue, dims_slot=6)
    for M in (1, 4, 5, 6, 13, 29):
        run_dynamic(kernel, dspec, _dyn_spec(spec, M), epilogue_ref=_index_ref, dims_slot=6)


def test_dynamic_epilogue_inline():
    """A dynamic kernel inlines the epilogue in its own micro-tile and in the pass that
    finishes its strips, not a call per output vector (which spilled the tile's
    accumulators: Zen 4, ELECTRA's fused GEMMs 2-4% slower than static kernels of the
    same plan); the true (m, n) at every remainder, over several K blocks."""
    spec = GemmSpec(1, 150, 2100, b_prepacked=True, bias=True, bias_col_stride=1)
    dspec = dynamic_spec(spec)
    module = ir.Module()
    emit_gemm(module, "g", dspec, index_epilogue, dims_slot=4)
    assert "g.epilogue" not in str(module)
    kernel = jit_kernel(module, "g", speed_level=0)
    for M in (1, 5, 8, 13, 37):
        dims, _ = run_dynamic(kernel, dspec, _dyn_spec(spec, M), epilogue_ref=_index_ref)
        assert M == 1 or dims[GEMM_DIMS.index("KC")] < spec.K     # several K blocks


@pytest.mark.parametrize("isa", ["host", "avx2"])
@pytest.mark.parametrize("spec", [
    # K in several blocks; the one-row strip's wide tile and its masked tail
    GemmSpec(1, 150, 2100, b_prepacked=True, bias=True, bias_col_stride=1),
    GemmSpec(1, 45, 300),                   # B packed per block: the workspace's panels
], ids=["prepacked", "pack"])
def test_shared_strips_match_inline_ones(request, monkeypatch, isa, spec):
    """The last M mod MR rows of a dynamic kernel call the shared strip kernels (library
    modules, compiled once per program): the same sums in the same order as strips
    inlined in the kernel, bit for bit, and the epilogue given the true (m, n) after the
    last K block, for every remainder."""
    if isa == "avx2":
        request.getfixturevalue("avx2_host")
    dspec = dynamic_spec(spec)
    slot = 3 + spec.bias
    kernels = {}
    for shared in (False, True):
        monkeypatch.setattr(gemm_mod, "SHARED_STRIPS", shared)
        module = ir.Module()
        emit_gemm(module, "g", dspec, index_epilogue, dims_slot=slot)
        needs = library_needs(str(module))
        assert bool(needs) == shared and all(n.startswith(STRIP_LIB) for n in needs), needs
        kernels[shared] = jit_kernel(module, "g", speed_level=0)
    for M in (1, 2, 3, 4, 5, 7, 8, 13, 37):
        case = Case(_dyn_spec(spec, M), seed=M)
        dims, T = gemm_dims(dspec, M)
        outs = []
        for shared in (False, True):
            C = case.new_c()
            vals = list(case.args(C)) + list(dims)
            run_splits(kernels[shared], (ctypes.c_void_p * len(vals))(*vals), T,
                       gemm_workspace_bytes(dspec), None, ws_fill=SENTINEL)
            case.check(C, ref=_index_ref(case))
            outs.append(C.copy())
        assert np.array_equal(outs[0], outs[1]), M


def test_library_symbols():
    """A module's library needs are the cannc_lib_* functions it declares; a library
    symbol no registered builder makes is a CompileError, and a strip kernel's name is
    the whole of what its module depends on."""
    from cannc.errors import CompileError
    from cannc.native.target import library_ir
    text = ('declare void @"cannc_lib_gstrip_avx2_r1v4lpw"(ptr %".1")\n'
            'declare <16 x float> @"llvm.fma.v16f32"(<16 x float>, <16 x float>, <16 x float>)\n'
            'define void @"k"() {\n  ret void\n}\n')
    assert library_needs(text) == ["cannc_lib_gstrip_avx2_r1v4lpw"]
    assert library_needs('define void @"cannc_lib_x"() {\n  ret void\n}\n') == []
    with pytest.raises(CompileError, match="no library defines cannc_lib_unknown_x"):
        library_ir("cannc_lib_unknown_x")
    sym = gemm_mod.strip_symbol("avx512", 3, 4, True, True, False)
    assert library_ir(sym) == library_ir(sym) and f'define void @"{sym}"' in library_ir(sym)


@pytest.mark.parametrize("dyn", [False, True])
def test_mid_rows_k_blocks(dyn):
    """FEW_ROWS < M <= MID_ROWS rows over a prepacked B: K blocks of at least
    MID_ROWS_KC (a wider N block re-reads A less); K below twice that is one block;
    more rows, or a B packed per block, keep the long blocks."""
    def kc(M, K, prepacked=True):
        spec = GemmSpec(M, 768, K, b_prepacked=prepacked)
        if dyn:
            return dict(zip(GEMM_DIMS, gemm_dims(dynamic_spec(spec), M)[0]))["KC"]
        return gemm_plan(spec).KC
    assert kc(128, 768) == 768 and kc(128, 1000) == 1000
    assert kc(128, 1024) == 512 and kc(128, 3072) == 512 and kc(512, 4096) == 512
    assert kc(200, 1600) == 534                 # three even blocks
    assert kc(1024, 3072) == 1536               # KC_MAX, balanced
    if not dyn:
        assert kc(128, 3072, prepacked=False) > 512
    # and the sums are right across the blocks (static kernel, float64 reference)
    check_spec(GemmSpec(100, 70, 1100, b_prepacked=True))


def test_dynamic_plan_and_grid():
    spec = GemmSpec(1, 1024, 1024, b_prepacked=True)
    dspec = dynamic_spec(spec)
    p = gemm_plan(dspec)
    avx512 = host_isa() == "avx512"
    assert p.strips and p.mt == 0
    wide = avx512 and gemm_wide_tile()
    assert (p.MR, p.NR) == ((6, 64) if wide else (gemm_micro_rows(), 32) if avx512 else (6, 16))
    # the wide tile's kernel runs the 8 x 32 tile for 17-256 rows (GemmPlan.alt_mid)
    assert (p.alt is not None and p.alt_mid and (p.alt.MR, p.alt.NR) == (8, 32)
            and p.ws_bytes >= p.alt.ws_bytes) if wide else p.alt is None
    # the grid and KC for these M are the static plan's for the same micro-kernel
    # (whole 8-row panels only: 130 rows run the main plan)
    for M in (1, 3, 24, 128, 130, 256, 512, 1024):
        variant = 1 if M <= 12 else 2 if wide and 16 < M <= 256 and M % 8 == 0 else 0
        q = variant_plan(p, variant)
        assert q is (p.alt if variant == 2 else p)
        st = gemm_plan(dataclasses.replace(spec, M=M),
                       {"MR": q.MR, "NV": q.NV} if M > 8 else None)
        dims, T = gemm_dims(dspec, M)
        assert dict(zip(GEMM_DIMS, dims)) == {
            "M": M, "batch": 1, "mt": st.mt, "nt": st.nt, "MB": st.MB, "NB": st.NB,
            "KC": st.KC, "NC": st.NC, "variant": variant}
        assert T == st.mt * st.nt
    # B not prepacked: the few-rows variant reads it in place (as a static plan would)
    for raw, alt_mode in ((GemmSpec(1, 768, 768), "direct"),
                          (GemmSpec(1, 768, 768, trans_b=True), "dot")):
        dp = gemm_plan(dynamic_spec(raw))
        assert dp.b_mode == "pack" and dp.alt.b_mode == alt_mode
        assert dp.ws_bytes >= dp.alt.ws_bytes
        for M in (1, 7, 12, 13, 100):
            dims, _ = gemm_dims(dynamic_spec(raw), M)
            assert (dims[GEMM_DIMS.index("variant")] == 1) == (M <= 12)
            assert variant_plan(dp, dims[GEMM_DIMS.index("variant")]) is (
                dp.alt if M <= 12 else dp)
    # tiles that are asked for are the tiles of every M
    assert gemm_plan(dspec, {"MR": 6, "NV": 4}).alt is None
    with pytest.raises(ValueError, match="transposed"):
        dynamic_spec(GemmSpec(4, 8, 8, trans_a=True))
    with pytest.raises(ValueError, match="not batched"):
        gemm_dims(dspec, 4, batch=2)


# ---------------------------------------------------------------------------
# the AVX2 fallback (this host has AVX-512: the target is restricted as CANNC_ISA=avx2 does)
# ---------------------------------------------------------------------------


@pytest.fixture
def avx2_host(monkeypatch):
    from cannc.native import target

    h = target.host()
    monkeypatch.setattr(target, "_host",
                        dataclasses.replace(h, features=target.restrict_isa(h.features, "avx2")))
    assert not target.host().has("avx512f") and target.host().has("avx2")
    return target.host()


def test_avx2_plans_fit_16_registers(avx2_host):
    assert host_isa() == "avx2"
    p = gemm_plan(GemmSpec(300, 200, 100, b_prepacked=True))
    assert (p.MR, p.NV, p.NR, p.isa) == (6, 1, 16, "avx2")      # 6 x 16: 12 ymm accumulators
    for M in range(1, 7):
        q = gemm_plan(GemmSpec(M, 200, 100, b_prepacked=True))
        assert 2 * q.MR * q.NV <= 12
    d = gemm_plan(GemmSpec(300, 4, 100, b_prepacked=True))    # dot products
    assert d.b_mode == "dot" and d.MR * d.NR <= 6
    # the 3 x 32 tile (12 accumulators + 4 B vectors + a broadcast: 17 ymm) unrolls k
    # twice, not four times (it spilled); the others four times
    unrolls = {M: gemm_plan(GemmSpec(M, 200, 100, b_prepacked=True)).unroll
               for M in range(1, 7)}
    assert unrolls[3] == 2 and all(unrolls[M] == 4 for M in (1, 2, 4, 5, 6)), unrolls


@pytest.mark.parametrize("shape", [(1, 300, 257), (3, 70, 33), (5, 33, 65), (13, 100, 30),
                                   (200, 64, 120), (40, 50, 2100), (9, 8, 100), (50, 3, 70)],
                         ids=lambda s: "x".join(map(str, s)))
def test_avx2_shapes(avx2_host, shape):
    M, N, K = shape
    for tb, pre in [(False, False), (True, False), (False, True)]:
        check_spec(GemmSpec(M, N, K, trans_b=tb, b_prepacked=pre), seed=M + N)
    check_spec(GemmSpec(M, N, K, bias=True, bias_col_stride=1, b_prepacked=True),
               epilogue=index_epilogue, ref=_index_ref)


def test_avx2_dynamic_and_code(avx2_host):
    """The kernel for any M on AVX2; its code uses no zmm register and its micro-kernel
    loops no stack slot but the prefetch cadence (the accumulators stay in the 16 ymm
    registers)."""
    for spec in (GemmSpec(1, 100, 70, b_prepacked=True), GemmSpec(1, 45, 33),
                 GemmSpec(1, 70, 50, b_prepacked=True, bias=True, bias_col_stride=1)):
        dspec, kernel = build_dynamic(spec)
        for M in (1, 2, 3, 4, 5, 6, 7, 11, 37):
            run_dynamic(kernel, dspec, _dyn_spec(spec, M))
    module = ir.Module()
    emit_gemm(module, "g", GemmSpec(64, 256, 256, b_prepacked=True))
    blocks = _asm_blocks(module)
    assert not any("zmm" in ln for lines in blocks.values() for ln in lines)
    fmas = {b: sum("vfmadd" in ln for ln in lines) for b, lines in blocks.items()}
    loops = [b for b, n in fmas.items() if n >= 12]
    # (a 256 KiB B carries the prefetch stream, whose cadence may be reloaded)
    assert loops and all(_no_spills_but_the_cadence(blocks[b]) for b in loops), fmas


def _no_spills_but_the_cadence(hot: list[str]) -> bool:
    """No stack access in a k loop but (at most) one reload of a general register: the
    B prefetch cadence that a block sets at run time (_Gen.pf_next), where A's rows and
    the streams take every other general register. One load from L1 an iteration of
    48 FMAs: BERT-base ran as fast as with the constant cadence."""
    stack = [ln.split() for ln in hot if "%rsp" in ln]
    return len(stack) <= 1 and all(
        op == "movq" and src.endswith("(%rsp),") and "mm" not in dst
        for op, src, dst in stack)


def _asm_blocks(module: ir.Module) -> dict[str, list[str]]:
    """The assembly of a module's kernels (cannc's optimisation pipeline), by basic
    block label."""
    import re

    from cannc.native.target import _optimise

    mod, tm = _optimise(str(module), "g", 0)
    block, blocks = None, {}
    for line in tm.emit_assembly(mod).splitlines():
        if re.match(r"^\.LBB", line):
            block = line
        blocks.setdefault(block, []).append(line)
    return blocks


def test_static_rows_pad_least():
    """A GEMM of M rows known when it is compiled takes the micro-kernel rows (the
    measured choice, or 8) that pad M to fewer rows; a dynamic one the measured choice.
    Where the wide 6 x 64 tile is the CPU's choice, a static M takes it unless its 6-row
    padding costs more than the tile gains (128 rows: 132 against 128)."""
    if host_isa() != "avx512":
        pytest.skip("AVX-512 plans")
    many = gemm_micro_rows()
    if gemm_wide_tile():
        cases = ((128, (8, 32)), (1024, (6, 64)), (16, (8, 32)), (198, (6, 64)),
                 (480, (6, 64)), (50, (6, 64)))
        dyn = (6, 64)
    else:
        cases = tuple((M, (r, 32)) for M, r in ((128, 8), (1024, 8), (16, 8),
                                                (198, 6 if many == 6 else 8), (480, many),
                                                (50, 6 if many == 6 else 8)))
        dyn = (many, 32)
    for M, want in cases:
        p = gemm_plan(GemmSpec(M, 768, 768, b_prepacked=True))
        assert (p.MR, p.NR) == want, M
    p = gemm_plan(dynamic_spec(GemmSpec(128, 768, 768, b_prepacked=True)))
    assert (p.MR, p.NR) == dyn
    # fewer than 64 columns never take the wide tile
    assert gemm_plan(dynamic_spec(GemmSpec(128, 48, 768, b_prepacked=True))).NR == 32


def test_grid_does_not_stream_b_once_per_chunk():
    """A grid of row blocks makes each chunk a core claims read all of B: the grid of
    a BERT-base down projection (128 x 768 x 3072) splits columns, for the wide and the
    narrow tiles alike, while 1024 rows of A (beyond the L2) may still be split by rows."""
    for tun in (None, {"MR": 6, "NV": 4}, {"MR": 8, "NV": 2}):
        for N, K in ((768, 3072), (768, 768)):
            dspec = dynamic_spec(GemmSpec(1, N, K, b_prepacked=True))
            dims = dict(zip(GEMM_DIMS, gemm_dims(dspec, 128, 1, tun)[0]))
            assert dims["mt"] == 1 and dims["nt"] > 1, (tun, N, K, dims)
            st = gemm_plan(GemmSpec(128, N, K, b_prepacked=True), tun)
            assert st.mt == 1, (tun, N, K)
    # the model: a rows-only grid of 6-row blocks costs far more than the column grid
    spec = GemmSpec(128, 768, 3072, b_prepacked=True)
    from cannc.codegen.gemm import _grid_cost

    rows = _grid_cost(spec, 6, 64, 6, 768, 22, 1, False, False)
    cols = _grid_cost(spec, 6, 64, 132, 64, 1, 12, False, False)
    assert rows[0] == pytest.approx(cols[0], rel=0.02)    # the products balance alike
    assert rows[1] > 1.3 * cols[1]                        # the rereads of B do not


def test_dynamic_remainder_rows_of_a_narrow_block():
    """The few rows after the full panels of a dynamic kernel run 32 columns at a time
    where the column block is narrower than their wide micro-tile (at M = 128 the grid
    gives 32-column blocks); every M and N edge agrees with the reference."""
    for N in (32, 70, 96, 130):
        spec = GemmSpec(1, N, 64, b_prepacked=True)
        dspec, kernel = build_dynamic(spec)
        for M in (1, 2, 7, 13, 128, 131):
            run_dynamic(kernel, dspec, _dyn_spec(spec, M))


def test_micro_kernel_rows_and_l2_block_follow_the_cpu():
    """8 x 32 tiles on cores that issue two 512-bit FMAs a cycle (their k loop unrolled
    4 times), 6 x 32 on those that issue one (unrolled twice); the B block scales with
    the L2 (never below the 1 MiB-L2 figure)."""
    assert gemm_micro_rows(2) == 8 and gemm_micro_rows(1) == 6
    assert gemm_k_unroll(2) == 4 and gemm_k_unroll(1) == 2
    assert gemm_k_unroll(2, accumulators=24) == 2 and gemm_k_unroll(1, accumulators=24) == 2
    assert gemm_wide_tile(2) and not gemm_wide_tile(1)
    assert l2_b_block() >= 192 << 10
    p = gemm_plan(GemmSpec(480, 768, 768, b_prepacked=True))   # (6 and 8 rows: no padding)
    if host_isa() == "avx512" and gemm_wide_tile():
        assert (p.MR, p.NR, p.unroll) == (6, 64, 2)
    elif host_isa() == "avx512":
        assert p.MR == gemm_micro_rows()
        assert p.unroll == gemm_k_unroll()
        assert p.NC == max(32, l2_b_block() // (4 * p.KC) // 32 * 32)


# ---------------------------------------------------------------------------
# the wide 6 x 64 tile (cores with two 512-bit FMA pipes), forced on any AVX-512 host
# ---------------------------------------------------------------------------


def _two_fma_pipes(monkeypatch):
    """Plans as on a core that issues two 512-bit FMAs a cycle, whatever this one does
    (fma_pipes is measured: on Zen 4, one, the micro-rows are 6, the k loop is unrolled
    twice rather than 4 times and there is no wide tile, and these tests failed there)."""
    import cannc.schedule.machine as machine

    monkeypatch.setattr(machine, "fma_pipes", lambda: 2)


@pytest.fixture
def wide_tiles(monkeypatch):
    """Plans as on a core that issues two 512-bit FMAs a cycle: 6 x 64 tiles for many
    rows (the plan cache is cleared on both sides, so no other test sees these plans)."""
    import cannc.codegen.gemm as gemm_mod

    if host_isa() != "avx512":
        pytest.skip("AVX-512 plans")
    _two_fma_pipes(monkeypatch)     # (and so gemm_wide_tile)
    gemm_mod._plan.cache_clear()
    yield
    gemm_mod._plan.cache_clear()


@pytest.mark.parametrize("N", [64, 96, 100, 130, 200])
def test_wide_tile_column_edges(wide_tiles, N):
    """Whole 64-column tiles, then the rest one 32-column panel at a time (a 6 x 32
    tile, masked at N's edge): every column of every N, static and dynamic M, K blocks
    summed in C (K = 600 > 256) and a bias."""
    for K in (40, 600):
        spec = GemmSpec(50, N, K, b_prepacked=True, bias=True, bias_col_stride=1)
        p = gemm_plan(spec)
        assert (p.MR, p.NR) == (6, 64)
        case, kernel = check_spec(spec)
        T = gemm_num_tiles(spec)
        for cut in sorted({1, T // 2}):       # two cores, at different tile boundaries
            case.check(run_split(kernel, case, splits=[0, cut, T]))
        dspec, kernel = build_dynamic(spec)
        assert (gemm_plan(dspec).MR, gemm_plan(dspec).NR) == (6, 64)
        for i, M in enumerate((1, 5, 6, 13, 64, 131, 136, 257, 264)):
            run_dynamic(kernel, dspec, _dyn_spec(spec, M), seed=i)
    # B packed per block (not a constant) takes the tile too
    spec = GemmSpec(200, 100, 70)
    assert (gemm_plan(spec).b_mode, gemm_plan(spec).NR) == ("pack", 64)
    check_spec(spec)


def test_mid_rows_variant(wide_tiles):
    """A dynamic kernel of a prepacked float32 B on the wide tile runs the 8 x 32 tile
    for 17-256 rows in whole 8-row panels (runtime 'variant'), from K = MID_ROWS_8_K:
    every column of N edges, K blocks, a bias, split over two cores; the rows just
    outside run the 6 x 64 plan."""
    from cannc.codegen.gemm import MID_ROWS_8_K, VARIANT_MAIN, VARIANT_MID_ROWS

    assert gemm_plan(dynamic_spec(GemmSpec(1, 768, MID_ROWS_8_K - 1, b_prepacked=True))).alt \
        is None
    for N in (100, 256):
        spec = GemmSpec(1, N, MID_ROWS_8_K + 40, b_prepacked=True, bias=True,
                        bias_col_stride=1)
        dspec, kernel = build_dynamic(spec)
        p = gemm_plan(dspec)
        assert (p.MR, p.NR, p.alt.MR, p.alt.NR, p.alt.strips) == (6, 64, 8, 32, False)
        for i, M in enumerate((16, 24, 130, 136, 256, 264)):
            dims, T = gemm_dims(dspec, M)
            mid = 16 < M <= 256 and M % 8 == 0
            assert dims[GEMM_DIMS.index("variant")] == (VARIANT_MID_ROWS if mid
                                                        else VARIANT_MAIN)
            run_dynamic(kernel, dspec, _dyn_spec(spec, M), seed=i,
                        splits=[0, T // 2, T] if T > 1 else None)


def test_wide_tile_code_has_no_masked_loads_or_spills(wide_tiles):
    """The k loop of a 6 x 64 tile reads B without masks (the tile only ever runs on
    whole 64-column widths, _Gen.col_tiles): a wide tile over the last, narrower columns
    had masked B loads whose masks spilled, and with them the accumulators (1024^3,
    1 core: 110 GFLOP/s against 148)."""
    spec = dynamic_spec(GemmSpec(512, 768, 768, b_prepacked=True))
    module = ir.Module()
    emit_gemm(module, "gemm_wide", spec, dims_slot=3)
    blocks = _asm_blocks(module).values()
    p = gemm_plan(spec)
    # the k loops of the 6 x 64 tile and of the 8 x 32 one of 17-256 rows (GemmPlan.alt)
    for q in (p, p.alt):
        hot = [b for b in blocks if sum("vfmadd" in ln for ln in b) == q.MR * q.NV * q.unroll]
        assert hot, (q.MR, q.NV)
        assert not [ln for ln in hot[0] if "{%k" in ln] and _no_spills_but_the_cadence(hot[0])


@pytest.fixture
def small_pf_min(monkeypatch):
    """B prefetching (pf_b) from a 64 KiB B, for small products (the plan cache is
    cleared on both sides)."""
    import cannc.codegen.gemm as gemm_mod

    if host_isa() != "avx512":
        pytest.skip("AVX-512 plans")
    _two_fma_pipes(monkeypatch)
    monkeypatch.setattr(gemm_mod, "PF_B_MIN_BYTES", 64 << 10)
    gemm_mod._plan.cache_clear()
    yield
    gemm_mod._plan.cache_clear()


@pytest.mark.parametrize("tiles", [{"MR": 6, "NV": 4}, {"MR": 8, "NV": 2}], ids=["6x64", "8x32"])
def test_b_prefetch_stream(small_pf_min, tiles):
    """A prepacked B (a weight) is prefetched a micro-panel ahead (GemmPlan.pf_b):
    the products are those of the reference -- static and dynamic M, one and several K
    blocks (the panel after a block's last one is the next K block's), edge columns, two
    cores cut at a tile boundary -- and the dynamic kernel's k loop holds one L2 prefetch
    an iteration and no spills (but the prefetch cadence, _no_spills_but_the_cadence)."""
    _check_b_prefetch_stream(tiles)


def _check_b_prefetch_stream(tiles: dict, tile: tuple | None = None) -> None:
    """The products of streamed plans (static and dynamic M, one and several K blocks,
    edge columns, a split at a tile boundary) and the dynamic kernel's hot loop: one L2
    prefetch an iteration, no spills but the cadence. ``tile``: the (MR, NV, isa) the
    plans must have."""
    for K, KC in ((100, None), (600, 256)):
        spec = GemmSpec(131, 200, K, b_prepacked=True)
        tuning = dict(tiles, **({"KC": KC} if KC else {}))
        plan = gemm_plan(spec, tuning)
        assert plan.pf_b and (tile is None or (plan.MR, plan.NV, plan.isa) == tile)
        case, kernel = check_spec(spec, tuning=tuning)
        T = gemm_num_tiles(spec, tuning)
        case.check(run_split(kernel, case, tuning, splits=[0, T // 2, T]))
    spec = GemmSpec(64, 200, 600, b_prepacked=True)
    dspec, kernel = build_dynamic(spec)
    assert gemm_plan(dspec).pf_b
    for i, M in enumerate((1, 7, 64, 131)):
        run_dynamic(kernel, dspec, _dyn_spec(spec, M), seed=i)
    module = ir.Module()
    emit_gemm(module, "gemm_pf", dspec, dims_slot=3)
    hot = max(_asm_blocks(module).values(), key=lambda lines: sum("vfmadd" in ln for ln in lines))
    assert sum("prefetcht1" in ln for ln in hot) == 1
    assert _no_spills_but_the_cadence(hot), hot


def test_b_prefetch_stream_avx2(avx2_host, monkeypatch):
    """AVX2's stream over half panels (16 columns, NV 1; the next micro-panel may be a
    panel's second half), checked as test_b_prefetch_stream checks AVX-512's."""
    import cannc.codegen.gemm as gemm_mod

    monkeypatch.setattr(gemm_mod, "PF_B_MIN_BYTES", 64 << 10)
    gemm_mod._plan.cache_clear()
    try:
        _check_b_prefetch_stream({}, (6, 1, "avx2"))
    finally:
        gemm_mod._plan.cache_clear()


def test_b_prefetch_for_weights_of_any_size_but_tiny(monkeypatch):
    """pf_b: a prepacked float32 B (a weight, which comes from memory in a model) of at
    least PF_B_MIN_BYTES, whether or not it fits in L2 (a 512 x 512 one does on every
    core cannc has met); not for a tiny one, nor for a B packed per block; on cores of
    one FMA pipe or two, whose k loops are unrolled (the stream's cadence: twice with
    AVX-512 and one pipe, 4 times with two; AVX2's 6 x 16 tile 4 times on any core)."""
    import cannc.codegen.gemm as gemm_mod
    from cannc.codegen.gemm import PF_B_MIN_BYTES

    avx512 = host_isa() == "avx512"
    monkeypatch.setattr("cannc.schedule.machine.fma_pipes", lambda: 1)
    gemm_mod._plan.cache_clear()
    plan = gemm_plan(GemmSpec(128, 2048, 2048, b_prepacked=True))
    assert plan.pf_b and plan.unroll == (2 if avx512 else 4)
    assert not gemm_plan(GemmSpec(128, 2048, 2048)).pf_b
    _two_fma_pipes(monkeypatch)
    gemm_mod._plan.cache_clear()
    assert gemm_plan(GemmSpec(128, 512, 512, b_prepacked=True)).pf_b
    assert gemm_plan(GemmSpec(128, 2048, 2048, b_prepacked=True)).pf_b
    n = math.isqrt(PF_B_MIN_BYTES // 4) // 2
    assert not gemm_plan(GemmSpec(128, n, n, b_prepacked=True)).pf_b
    assert not gemm_plan(GemmSpec(128, 2048, 2048)).pf_b
    gemm_mod._plan.cache_clear()


def test_grid_choice_reads_the_cache_sizes_once(monkeypatch):
    """The grid model's L2 size is read once per process: read from sysfs at each of
    the ~25 grids costed per GEMM it made the first run of a new BERT-base shape
    spend 0.8 s in the planner."""
    from cannc.schedule import machine

    gemm_dims(dynamic_spec(GemmSpec(1, 768, 3072, b_prepacked=True)), 128)
    calls = []
    monkeypatch.setattr(machine, "_data_caches", lambda *a, **k: calls.append(a) or [])
    for M in (77, 512):
        gemm_dims(dynamic_spec(GemmSpec(1, 768, 3072 + M, b_prepacked=True)), M)
    assert not calls
