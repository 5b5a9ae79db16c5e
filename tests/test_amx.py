"""Tests of the AMX bf16 GEMM generator (cannc/codegen/amx.py).

Each kernel is JIT-compiled through the compiler's own pipeline, run over its tiles
split like two cores would (empty ranges too, a NaN-filled workspace with guards),
and compared with a float64 reference computed from the same bf16-rounded inputs.
Skipped, with the reason, where `amx_usable()` says AMX cannot run.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from cannc.codegen import amx
from cannc.codegen.gemm import GemmSpec, dynamic_spec
from cannc.native import target
from cannc.native.emit import F32, X86_AMX
from tests.helpers import aligned, run_concurrently, run_splits

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)

SPEED = 2   # the compiler's IR optimisation level (test_speed_level_0: without the optimiser)
_WHY = amx.amx_usable()
needs_amx = pytest.mark.skipif(_WHY is not None, reason=f"AMX not usable: {_WHY}")


def _bf(x):
    return np.asarray(x, np.float32).astype(BF16).astype(np.float64)


class Case:
    """Buffers, a float64 reference from the bf16-rounded inputs, a runner."""

    def __init__(self, spec: GemmSpec, a_dtype="float32", c_dtype="float32",
                 bias_dtype="float32", epilogue=None, ref_epilogue=None, seed=0, tuning=None,
                 build=True, speed=SPEED):
        s = self.spec = spec
        self.a_dtype, self.c_dtype = a_dtype, c_dtype
        rng = np.random.default_rng(seed)
        nbb = s.batch if s.b_batch_stride else 1
        lda, ldc = s.lda_, s.ldc_
        a_bs = s.a_batch_stride
        a_len = (s.batch - 1) * a_bs + (s.M - 1) * lda + s.K
        a_host = rng.standard_normal(a_len).astype(np.float32)
        self.a = aligned(a_len, BF16 if a_dtype == "bfloat16" else np.float32)
        self.a[:] = a_host.astype(self.a.dtype)
        bshape = (s.N, s.K) if s.trans_b else (s.K, s.N)
        self.b_mats = rng.standard_normal((nbb,) + bshape).astype(np.float32)
        packed = amx.amx_prepack_b(s, self.b_mats if nbb > 1 else self.b_mats[0])
        assert packed.size == amx.amx_prepacked_b_size(s) and packed.dtype == BF16
        self.bp = aligned(packed.size, BF16)
        self.bp[:] = packed
        self.bias = None
        if s.bias:
            blen = max(1, (s.M - 1) * s.bias_row_stride + (s.N - 1) * s.bias_col_stride + 1)
            self.bias = aligned(blen, BF16 if bias_dtype == "bfloat16" else np.float32)
            self.bias[:] = rng.standard_normal(blen).astype(self.bias.dtype)
        c_bs = s.c_batch_stride_
        c_len = (s.batch - 1) * c_bs + (s.M - 1) * ldc + s.N
        self.c = aligned(c_len, BF16 if c_dtype == "bfloat16" else np.float32)
        self.c[:] = np.float32(-7.0)   # a sentinel in the gaps between rows
        self.ptrs = [self.a, self.bp] + ([self.bias] if s.bias else []) + [self.c]
        self.argv = (ctypes.c_void_p * len(self.ptrs))(*[p.ctypes.data for p in self.ptrs])
        if build:
            m = target.new_module("amx_test")
            amx.emit_amx_gemm(m, "k", s, epilogue, a_dtype=a_dtype, c_dtype=c_dtype,
                              bias_dtype=bias_dtype, tuning=tuning)
            self.fn = target.jit_kernel(m, "k", speed)
            self.T = amx.amx_num_tiles(s, a_dtype, tuning)
            self.ws = amx.amx_workspace_bytes(s, a_dtype, tuning)

        # reference (float64 from the bf16-rounded inputs)
        A = _bf(self.a.astype(np.float32))
        self.ref, self.bound = [], []
        for i in range(s.batch):
            idx = i * a_bs + np.arange(s.M)[:, None] * lda + np.arange(s.K)[None, :]
            Ai = A[idx]
            Bi = _bf(self.b_mats[i if nbb > 1 else 0])
            Bi = Bi.T if s.trans_b else Bi
            r = s.alpha * (Ai @ Bi)
            if s.bias:
                bidx = (np.arange(s.M)[:, None] * s.bias_row_stride
                        + np.arange(s.N)[None, :] * s.bias_col_stride)
                r = r + s.beta * self.bias.astype(np.float64)[bidx]
            mag = abs(s.alpha) * (np.abs(Ai) @ np.abs(Bi)) + 1.0
            if ref_epilogue is not None:
                r = ref_epilogue(r, np.arange(s.M)[:, None], np.arange(s.N)[None, :])
            self.ref.append(r)
            self.bound.append(1e-5 * np.sqrt(s.K) * mag
                              + (2.0 ** -8 * np.abs(r) if c_dtype == "bfloat16" else 0))

    def out(self, i):
        s = self.spec
        idx = i * s.c_batch_stride_ + np.arange(s.M)[:, None] * s.ldc_ + np.arange(s.N)[None, :]
        return self.c.astype(np.float64)[idx]

    def check(self):
        s = self.spec
        for i in range(s.batch):
            err = np.abs(self.out(i) - self.ref[i])
            assert np.all(err <= self.bound[i]), (
                f"batch {i}: max err {err.max():.3g}, worst excess "
                f"{(err - self.bound[i]).max():.3g} ({s})")
        # the gaps between rows of C (ldc > N) are not written
        written = np.zeros(self.c.size, bool)
        for i in range(s.batch):
            written[i * s.c_batch_stride_ + np.arange(s.M)[:, None] * s.ldc_
                    + np.arange(s.N)[None, :]] = True
        assert np.all(self.c.astype(np.float32)[~written] == -7.0)

    def run(self, splits=None):
        run_splits(self.fn, self.argv, self.T, self.ws, splits)
        self.check()


SHAPES = [(1, 1, 1), (16, 16, 32), (5, 7, 3), (33, 17, 45), (100, 70, 200), (64, 96, 128),
          (50, 33, 64), (17, 48, 96), (40, 300, 77)]


@needs_amx
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_shapes_fp32_in_fp32_out(M, N, K):
    Case(GemmSpec(M=M, N=N, K=K, b_prepacked=True)).run()


@needs_amx
@pytest.mark.parametrize("grid", [(1, 1), (2, 3), (4, 5)])
def test_tuned_grid(grid):
    spec = GemmSpec(M=100, N=150, K=40, b_prepacked=True)
    p = amx.amx_plan(spec, tuning={"grid": grid})
    assert (p.mt, p.nt) == grid
    Case(spec, tuning={"grid": list(grid)}).run(splits=list(range(p.mt * p.nt + 1)))


@needs_amx
@pytest.mark.parametrize("M,N,K", [(48, 40, 64), (50, 33, 64), (37, 50, 70), (3, 20, 33)])
@pytest.mark.parametrize("c_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pack_a", [True, False])
def test_bf16_a(M, N, K, c_dtype, pack_a):
    # pack_a False: with K % 32 == 0, A read in place with its row stride
    spec = GemmSpec(M=M, N=N, K=K, b_prepacked=True)
    tuning = {"pack_a": pack_a}
    assert amx.amx_plan(spec, "bfloat16", tuning).pack_a == (pack_a or K % 32 != 0)
    Case(spec, a_dtype="bfloat16", c_dtype=c_dtype, tuning=tuning).run()


@needs_amx
def test_speed_level_0():
    Case(GemmSpec(M=50, N=40, K=70, b_prepacked=True, bias=True, bias_col_stride=1),
         c_dtype="bfloat16", speed=0).run()


@needs_amx
def test_bf16_out_bias_alpha_beta():
    spec = GemmSpec(M=45, N=50, K=40, b_prepacked=True, bias=True, bias_col_stride=1,
                    alpha=0.5, beta=2.0)
    Case(spec, c_dtype="bfloat16").run()
    Case(dataclasses.replace(spec, bias_col_stride=0, bias_row_stride=1),
         bias_dtype="bfloat16").run()
    # a full [M, N] C of Gemm (bf16)
    Case(dataclasses.replace(spec, bias_row_stride=50), bias_dtype="bfloat16",
         a_dtype="bfloat16").run()


@needs_amx
def test_epilogue_sees_rows_and_columns():
    def epi(b, v, m, n):
        # relu(v) + 0.25 * m - 0.125 * (n + lane)
        from llvmlite import ir
        vt = v.type
        relu = b.select(b.fcmp_ordered(">", v, ir.Constant(vt, [0.0] * 16)), v,
                        ir.Constant(vt, [0.0] * 16))
        mf = b.sitofp(m, F32)
        nf = b.sitofp(n, F32)
        lane = ir.Constant(vt, [float(i) for i in range(16)])
        sp = ir.Constant(vt, ir.Undefined)
        mv = b.shuffle_vector(b.insert_element(sp, mf, ir.Constant(ir.IntType(32), 0)), sp,
                              ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))
        nv = b.shuffle_vector(b.insert_element(sp, nf, ir.Constant(ir.IntType(32), 0)), sp,
                              ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))
        r = b.fadd(relu, b.fmul(mv, ir.Constant(vt, [0.25] * 16)))
        return b.fsub(r, b.fmul(b.fadd(nv, lane), ir.Constant(vt, [0.125] * 16)))

    def ref(r, m, n):
        return np.maximum(r, 0) + 0.25 * m - 0.125 * n

    spec = GemmSpec(M=70, N=45, K=64, b_prepacked=True, bias=True, bias_col_stride=1)
    Case(spec, epilogue=epi, ref_epilogue=ref).run()
    Case(spec, a_dtype="bfloat16", c_dtype="bfloat16", epilogue=epi, ref_epilogue=ref).run()


@needs_amx
@pytest.mark.parametrize("M,K", [(70, 160), (96, 128), (32, 1024), (33, 200)])
def test_overlapped_stores(M, K):
    """N a multiple of 32 and K >= 128: each full row pair's stores (bias, epilogue,
    narrow C) run inside the next pair's K loop (amx._Gen.pairs_overlapped); K = 160
    spreads 32 rows over 5 steps (7 a step, the last ones guarded), M = 70 and 33 end
    with an edge pair stored at once; every tile split sees the pending pair flushed."""
    def epi(b, v, m, n):                 # v + 0.25 m - 0.125 (n + lane)
        from llvmlite import ir
        vt = v.type
        sp = ir.Constant(vt, ir.Undefined)
        idx = ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16)

        def splat(x):
            return b.shuffle_vector(b.insert_element(sp, b.sitofp(x, F32),
                                                     ir.Constant(ir.IntType(32), 0)), sp, idx)
        lane = ir.Constant(vt, [float(i) for i in range(16)])
        r = b.fadd(v, b.fmul(splat(m), ir.Constant(vt, [0.25] * 16)))
        return b.fsub(r, b.fmul(b.fadd(splat(n), lane), ir.Constant(vt, [0.125] * 16)))

    def ref(r, m, n):
        return r + 0.25 * m - 0.125 * n

    spec = GemmSpec(M=M, N=64, K=K, b_prepacked=True, bias=True, bias_col_stride=1)
    c = Case(spec, epilogue=epi, ref_epilogue=ref)
    c.run(splits=list(range(amx.amx_num_tiles(spec) + 1)))
    Case(spec, a_dtype="bfloat16", c_dtype="bfloat16", epilogue=epi, ref_epilogue=ref).run()
    spec = GemmSpec(M=M, N=96, K=K, b_prepacked=True, bias=True, bias_row_stride=1)
    Case(spec, c_dtype="bfloat16").run()


@needs_amx
def test_batch_strides_and_trans_b():
    spec = GemmSpec(M=20, N=40, K=50, batch=3, a_batch_stride=20 * 60, b_batch_stride=1,
                    lda=60, ldc=48, b_prepacked=True)
    Case(spec).run(splits=list(range(amx.amx_num_tiles(spec) + 1)))
    spec = GemmSpec(M=33, N=20, K=64, batch=2, a_batch_stride=0, trans_b=True, ldc=24,
                    lda=70, b_prepacked=True)
    Case(spec, a_dtype="bfloat16").run()
    Case(spec, a_dtype="bfloat16", tuning={"pack_a": False}).run()


@needs_amx
@pytest.mark.parametrize("batched", [False, True])
def test_dynamic_kernel_serves_every_m(batched):
    """One kernel (M and the batch count at run time, AMX_DIMS) for many M: the edge
    rows' tile shapes come from M at run time."""
    N, K = 45, 70
    if batched:
        base = GemmSpec(M=8, N=N, K=K, batch=2, a_batch_stride=8 * K, b_batch_stride=K * N,
                        c_batch_stride=8 * N, b_prepacked=True)
    else:
        base = GemmSpec(M=8, N=N, K=K, b_prepacked=True, bias=True, bias_col_stride=1)
    canon = dynamic_spec(base)
    nptr = 4 if canon.bias else 3
    m = target.new_module("amx_dyn")
    amx.emit_amx_gemm(m, "k", canon, a_dtype="bfloat16", c_dtype="bfloat16", dims_slot=nptr)
    fn = target.jit_kernel(m, "k", SPEED)
    ws = amx.amx_workspace_bytes(canon, "bfloat16")
    for M, nb in [(1, 1), (16, 2), (17, 1), (31, 3), (33, 1), (100, 2), (300, 1)]:
        nb = nb if batched else 1
        static = dataclasses.replace(base, M=M, batch=nb, c_batch_stride=0,
                                     a_batch_stride=M * K if batched else 0,
                                     b_batch_stride=1 if batched else 0)
        c = Case(static, a_dtype="bfloat16", c_dtype="bfloat16", build=False, seed=M)
        dims, T = amx.amx_dims(canon, M, nb, "bfloat16")
        assert dims[:2] == (M, nb) and len(dims) == len(amx.AMX_DIMS)
        argv = (ctypes.c_void_p * (nptr + len(dims)))(*[p.ctypes.data for p in c.ptrs], *dims)
        run_splits(fn, argv, T, ws)
        c.check()
    with pytest.raises(ValueError):
        amx.amx_dims(canon, 0)


@needs_amx
def test_two_cores_at_once():
    c = Case(GemmSpec(M=200, N=130, K=96, b_prepacked=True))
    assert c.T >= 2
    ws = [aligned(c.ws // 4 + 16) for _ in range(2)]
    run_concurrently(c.fn, c.argv, [(0, c.T // 2), (c.T // 2, c.T)],
                     [w.ctypes.data for w in ws])
    c.check()


def test_prepack_layout():
    spec = GemmSpec(M=4, N=20, K=40, b_prepacked=True)
    b = np.random.default_rng(1).standard_normal((40, 20)).astype(np.float32)
    p = amx.amx_prepack_b(spec, b)
    assert np.array_equal(p.view(np.uint16), amx.amx_prepack_b(spec, b.astype(BF16))
                          .view(np.uint16))
    full = np.zeros((64, 32), np.float32)
    full[:40, :20] = b.astype(BF16).astype(np.float32)
    t = p.astype(np.float32).reshape(1, 2, 2, 16, 16, 2)   # [panel][kk][tile][pair][col][e]
    for kk in range(2):
        for j in range(2):
            tile = t[0, kk, j]   # (pair, col, e): B[kk*32 + 2*pair + e, 16*j + col]
            want = full[kk * 32:(kk + 1) * 32, 16 * j:16 * j + 16].reshape(16, 2, 16)
            assert np.array_equal(tile, want.transpose(0, 2, 1))
    with pytest.raises(ValueError, match="does not match"):
        amx.amx_prepack_b(spec, b.T)


def test_unsupported_specs_are_refused():
    assert amx.amx_supports(GemmSpec(M=4, N=4, K=4)) is not None   # B not prepacked
    assert "transposed" in amx.amx_supports(GemmSpec(M=4, N=4, K=4, trans_a=True,
                                                     b_prepacked=True))
    with pytest.raises(ValueError, match="AMX GEMM"):
        amx.amx_plan(GemmSpec(M=4, N=4, K=4))
    with pytest.raises(ValueError, match="dtype"):
        amx.amx_plan(GemmSpec(M=4, N=4, K=4, b_prepacked=True), a_dtype="float16")


def test_isa_restriction_switches_amx_off(monkeypatch):
    real = target.host()
    small = target.HostTarget(real.triple, real.cpu, target.restrict_isa(real.features, "avx2"))
    monkeypatch.setattr(target, "_host", small)
    why = amx.amx_usable()
    assert why is not None and "amx" in why


def test_x86_amx_type():
    assert str(X86_AMX) == "x86_amx" and X86_AMX == type(X86_AMX)()


def test_permission_is_cached_and_reasoned():
    a = target.amx_permission()
    assert a == target.amx_permission()
    assert a is None or isinstance(a, str) and a
