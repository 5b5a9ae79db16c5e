"""Reduced-precision GEMM kernels (cannc/codegen/gemm.py with bf16 / fp16 operands).

Each operand (A, B, bias) and C may be float32 or the narrow type; products are in the
compute precision (bf16: vdpbf16ps where the CPU has avx512_bf16, else widened to fp32
in registers; fp16: storage, fp32 FMA), accumulation in float32. The references are
computed in float64 from the SAME rounded inputs; a narrow C adds one rounding.
Every ISA path runs here through the CANNC_ISA restrictions (native.target.restrict_isa).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from llvmlite import ir

from cannc.codegen.amx import amx_usable
from cannc.codegen.gemm import (
    COMPUTE,
    GemmSpec,
    dpbf16_speedup,
    dynamic_spec,
    emit_gemm,
    gemm_dims,
    gemm_num_tiles,
    gemm_plan,
    gemm_workspace_bytes,
    host_dpbf16,
    np_elem,
    precision_note,
    prepack_b,
    prepacked_b_size,
    use_dpbf16,
)
from cannc.native import emit
from cannc.native.target import jit_kernel
from tests.helpers import aligned, run_splits

BF, F16, F32 = "bfloat16", "float16", "float32"
ULP = {BF: 2.0 ** -8, F16: 2.0 ** -11, F32: 0.0}   # half an ulp, relative (rounding)


# ---------------------------------------------------------------------------
# the ISA paths (this host: avx512_bf16; the others by restricting its features)
# ---------------------------------------------------------------------------

@pytest.fixture(params=["dp", "avx512-nobf16", "avx2"])
def isa(request, monkeypatch):
    """'dp': the vdpbf16ps kernels (chosen by default only where they beat fp32 FMA:
    use_dpbf16); the others: this host's features restricted as CANNC_ISA does."""
    from cannc.codegen import gemm
    from cannc.native import target

    h = target.host()
    if request.param == "dp":
        if not host_dpbf16():
            pytest.skip("this CPU has no avx512_bf16")
        monkeypatch.setattr(gemm, "use_dpbf16", lambda: True)
    else:
        monkeypatch.setattr(target, "_host", dataclasses.replace(
            h, features=target.restrict_isa(h.features, request.param)))
        assert not target.host().has("avx512bf16") and not target.host().has("avx512fp16")
        assert not target.host().has("amx-tile")
    return request.param


# ---------------------------------------------------------------------------
# buffers, reference, runner
# ---------------------------------------------------------------------------

def _round(x: np.ndarray, t: str) -> np.ndarray:
    return x.astype(np_elem(t)).astype(np.float64)


class LowpCase:
    def __init__(self, spec: GemmSpec, seed: int = 0):
        s = self.spec = spec
        rng = np.random.default_rng(seed)
        ct = COMPUTE[s.compute]
        ra, ca = (s.K, s.M) if s.trans_a else (s.M, s.K)
        rb, cb = (s.N, s.K) if s.trans_b else (s.K, s.N)
        na = s.batch if s.a_batch_stride else 1
        nb = s.batch if s.b_batch_stride else 1
        a = rng.standard_normal((na, ra, ca)).astype(np.float32)
        b = rng.standard_normal((nb, rb, cb)).astype(np.float32)
        self.A = self._buf(a.reshape(-1), s.a_type)
        if s.b_prepacked:
            packed = prepack_b(s, b if s.b_batch_stride else b[0])
            assert packed.size == prepacked_b_size(s) and packed.dtype == np_elem(ct)
            self.B = aligned(packed.size, packed.dtype)
            self.B[:] = packed
        else:
            self.B = self._buf(b.reshape(-1), s.b_type)
        # the operands as the kernel multiplies them: rounded to the compute precision
        ar = _round(_round(a, s.a_type), ct)
        br = _round(_round(b, s.b_type), ct)
        aop = ar.transpose(0, 2, 1) if s.trans_a else ar
        bop = br.transpose(0, 2, 1) if s.trans_b else br
        ref = s.alpha * np.matmul(aop, bop)
        self.mag = np.abs(s.alpha) * np.matmul(np.abs(aop), np.abs(bop))
        ref = np.broadcast_to(ref, (s.batch, s.M, s.N))
        self.bias = None
        if s.bias:
            blen = (s.M - 1) * s.bias_row_stride + (s.N - 1) * s.bias_col_stride + 1
            bias = rng.standard_normal(blen).astype(np.float32)
            self.bias = self._buf(bias, s.bias_type)
            bidx = (np.arange(s.M)[:, None] * s.bias_row_stride
                    + np.arange(s.N)[None, :] * s.bias_col_stride)
            ref = ref + s.beta * _round(bias, s.bias_type)[bidx]
        self.ref = ref
        self.guard = 64
        self.c_len = s.batch * s.M * s.N

    @staticmethod
    def _buf(x: np.ndarray, t: str) -> np.ndarray:
        out = aligned(x.size, np_elem(t))
        out[:] = x.astype(np_elem(t))
        return out

    def new_c(self) -> np.ndarray:
        C = aligned(self.c_len + 2 * self.guard, np_elem(self.spec.c_type))
        C.view(np.uint8)[:] = 0x7B   # a sentinel bit pattern
        return C

    def ptrs(self, C) -> list[int]:
        esz = np.dtype(np_elem(self.spec.c_type)).itemsize
        p = [self.A.ctypes.data, self.B.ctypes.data]
        if self.spec.bias:
            p.append(self.bias.ctypes.data)
        return p + [C.ctypes.data + esz * self.guard]

    def check(self, C, ref=None, mag_extra=0.0):
        s = self.spec
        ref = self.ref if ref is None else ref
        got = C[self.guard:self.guard + self.c_len].astype(np.float64).reshape(ref.shape)
        tol = (1e-5 * np.sqrt(s.K) * (self.mag + np.abs(ref) + mag_extra)
               + 1.01 * ULP[s.c_type] * np.abs(ref) + 1e-30)
        err = np.abs(got - ref)
        assert np.all(err <= tol), (
            f"max err {err.max():.3g} (tol {tol.flat[np.argmax(err - tol)]:.3g}) at "
            f"{np.unravel_index(np.argmax(err - tol), err.shape)}")
        raw = C.view(np.uint8).reshape(C.size, -1)
        g = self.guard
        assert np.all(raw[:g] == 0x7B) and np.all(raw[g + self.c_len:] == 0x7B), \
            "kernel wrote outside C"


def build(spec: GemmSpec, epilogue=None, name="gemm", dims_slot=None):
    module = ir.Module()
    emit_gemm(module, name, spec, epilogue, dims_slot=dims_slot)
    return jit_kernel(module, name, speed_level=0)


def check_spec(spec: GemmSpec, epilogue=None, ref=None, seed=0) -> LowpCase:
    case = LowpCase(spec, seed)
    kernel = build(spec, epilogue)
    C = case.new_c()
    p = case.ptrs(C)
    run_splits(kernel, (ctypes.c_void_p * len(p))(*p), gemm_num_tiles(spec),
               gemm_workspace_bytes(spec))
    case.check(C, ref=ref(case) if ref else None)
    return case


def check_dynamic(spec: GemmSpec, Ms, seed=0):
    dspec = dynamic_spec(spec)
    slot = 3 + spec.bias
    kernel = build(dspec, name="gemm_dyn", dims_slot=slot)
    for M in Ms:
        full = dataclasses.replace(spec, M=M)
        case = LowpCase(full, seed + M)
        dims, T = gemm_dims(dspec, M)
        C = case.new_c()
        vals = case.ptrs(C) + list(dims)
        run_splits(kernel, (ctypes.c_void_p * len(vals))(*vals), T,
                   gemm_workspace_bytes(dspec))
        case.check(C)


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------

# (a, b, c) element types per compute precision: each operand float32 or narrow
TYPES = {"bf16": [(BF, BF, BF), (F32, BF, F32), (BF, F32, BF), (F32, F32, F32)],
         "fp16": [(F16, F16, F16), (F32, F16, F32), (F16, F32, F16)]}
SHAPES = [(1, 33, 17), (3, 70, 33), (7, 100, 65), (13, 64, 31), (40, 70, 300), (9, 8, 100),
          (50, 3, 70), (1, 300, 257), (200, 64, 121)]


@pytest.mark.parametrize("compute", ["bf16", "fp16"])
def test_shapes_layouts_types(isa, compute):
    """Edge tiles, odd K, few rows / columns, B in place, packed and prepacked, each
    operand float32 or narrow."""
    # (AVX2: the code of avx512-nobf16 in ymm halves and 16-column tiles: fewer shapes)
    SH = SHAPES[::3] if isa == "avx2" else SHAPES
    types = TYPES[compute]
    i = 0
    for M, N, K in SH:
        for tb, pre in [(False, False), (True, False), (False, True)]:
            ta, tbt, tc = types[i % len(types)]
            i += 1
            check_spec(GemmSpec(M, N, K, trans_b=tb, b_prepacked=pre, a_type=ta, b_type=tbt,
                                c_type=tc, compute=compute), seed=i)


def test_bias_alpha_transposed_a_kblocks(isa):
    cases = [("bf16", (BF, BF, BF)), ("fp16", (F16, F16, F32)), ("bf16", (F32, BF, F32))]
    for compute, (ta, tb, tc) in cases[1:2] if isa == "avx2" else cases:
        for bt in (F32, COMPUTE[compute]):
            check_spec(GemmSpec(30, 100, 81, b_prepacked=True, trans_a=True, bias=True,
                                bias_col_stride=1, bias_type=bt, alpha=0.5, a_type=ta,
                                b_type=tb, c_type=tc, compute=compute))
            check_spec(GemmSpec(17, 40, 33, bias=True, bias_row_stride=1, bias_type=bt,
                                a_type=ta, b_type=tb, c_type=tc, compute=compute))
        # A packed in MR-row panels (transposed, many columns)
        check_spec(GemmSpec(20, 300, 40, trans_a=True, b_prepacked=True, a_type=ta, b_type=tb,
                            c_type=tc, compute=compute))
        # K blocks (partial sums in a float32 C; a narrow C gets one K block)
        check_spec(GemmSpec(14, 70, 2501, a_type=ta, b_type=tb, c_type=tc, compute=compute))


def test_batched(isa):
    for pre in (False, True):
        check_spec(GemmSpec(5, 33, 11, batch=3, a_batch_stride=55, b_batch_stride=363,
                            b_prepacked=pre, a_type=BF, b_type=BF, c_type=BF, compute="bf16"))
        check_spec(GemmSpec(5, 33, 11, batch=3, a_batch_stride=55, b_prepacked=pre,
                            a_type=F32, b_type=F16, c_type=F16, compute="fp16"))


def index_epilogue(builder, value, m, n):
    """value * 0.5 + m + 0.25 * (n + lane), computed in float32."""
    vt = value.type
    lanes = ir.Constant(ir.VectorType(emit.I64, vt.count), list(range(vt.count)))
    cols = builder.add(emit.splat(builder, n, vt.count), lanes)
    fm = builder.sitofp(emit.splat(builder, m, vt.count), vt)
    fn_ = builder.sitofp(cols, vt)
    v = builder.fmul(value, ir.Constant(vt, [0.5] * vt.count))
    return builder.fadd(builder.fadd(v, fm), builder.fmul(fn_, ir.Constant(vt, [0.25] * 16)))


def _index_ref(case):
    s = case.spec
    return case.ref * 0.5 + np.arange(s.M)[:, None] + 0.25 * np.arange(s.N)[None, :]


def test_epilogue_in_f32_then_rounded(isa):
    for spec in [GemmSpec(20, 70, 40, b_prepacked=True, bias=True, bias_col_stride=1,
                          a_type=BF, b_type=BF, bias_type=BF, c_type=BF, compute="bf16"),
                 GemmSpec(3, 50, 33, a_type=F32, b_type=BF, c_type=BF, compute="bf16"),
                 GemmSpec(20, 70, 40, b_prepacked=True, a_type=F16, b_type=F16, c_type=F16,
                          compute="fp16")]:
        case = LowpCase(spec)
        kernel = build(spec, index_epilogue)
        C = case.new_c()
        p = case.ptrs(C)
        run_splits(kernel, (ctypes.c_void_p * len(p))(*p), gemm_num_tiles(spec),
                   gemm_workspace_bytes(spec))
        ref = _index_ref(case)
        case.check(C, ref=ref, mag_extra=np.abs(ref))


def test_dynamic(isa):
    check_dynamic(GemmSpec(1, 70, 41, b_prepacked=True, a_type=BF, b_type=BF, c_type=BF,
                           compute="bf16"), (1, 5, 6, 13, 29))
    check_dynamic(GemmSpec(1, 45, 33, a_type=F32, b_type=BF, c_type=F32, compute="bf16"),
                  (1, 7, 30))
    check_dynamic(GemmSpec(1, 64, 40, b_prepacked=True, bias=True, bias_col_stride=1,
                           a_type=F16, b_type=F16, c_type=F32, compute="fp16"), (2, 19))


def test_plans_and_notes(isa):
    """vdpbf16ps where the CPU has it (packed or prepacked B); widened otherwise. The
    tiling keys (gemm_signature) carry the element types."""
    from cannc.schedule.tuning import gemm_signature

    big = GemmSpec(256, 512, 300, b_prepacked=True, a_type=BF, b_type=BF, c_type=BF,
                   compute="bf16")
    p = gemm_plan(big)
    assert p.dp == (isa == "dp")
    note = precision_note(big)
    assert note == ("bf16 avx512_bf16" if isa == "dp"
                    else "bf16 widened to fp32 (no avx512_bf16)")
    # without vdpbf16ps: float32 panels and A rows for many rows (the fp32 micro-kernel)
    assert p.f32_panels == p.cvt_a == (isa != "dp")
    assert not gemm_plan(dataclasses.replace(big, M=4)).f32_panels   # few rows: narrow B
    # a kernel for any M: float32 panels for many rows, narrow ones for few (per call)
    dyn = gemm_plan(dynamic_spec(big))
    assert dyn.f32_panels == (isa != "dp") and (dyn.alt is not None) == (isa != "dp")
    if dyn.alt is not None:
        assert not dyn.alt.f32_panels and dyn.ws_bytes >= dyn.alt.ws_bytes
    # few rows of a B that is not prepacked: read in place, widened (memory-bound)
    assert not gemm_plan(dataclasses.replace(big, M=3, b_prepacked=False)).dp
    assert precision_note(GemmSpec(4, 4, 4)) is None
    assert precision_note(dataclasses.replace(big, compute="fp16", a_type=F16, b_type=F16,
                                              c_type=F16)) == "fp16 storage, fp32 FMA"
    # the prepacked B holds the narrow type: half the bytes of float32
    assert prepack_b(big, np.ones((300, 512), np.float32)).dtype == ml_dtypes.bfloat16
    # a narrow C: one K block (partial sums need float32)
    assert gemm_plan(dataclasses.replace(big, K=5000)).KC == 5000
    assert gemm_plan(dataclasses.replace(big, K=5000, c_type=F32)).KC < 5000
    sig = gemm_signature(big)
    assert sig["a_type"] == BF and sig["compute"] == "bf16"
    assert gemm_signature(GemmSpec(256, 512, 300, b_prepacked=True)) != sig
    with pytest.raises(ValueError, match="a_type"):
        GemmSpec(4, 4, 4, a_type="float64")
    with pytest.raises(ValueError, match="compute"):
        GemmSpec(4, 4, 4, compute="int8")


# ---------------------------------------------------------------------------
# the lowerings: ONNX-typed bf16 / fp16 MatMul, Gemm and FusedGemm onto gemm.py
# ---------------------------------------------------------------------------

def test_gemm_types_contract():
    """Element types and compute precision of a node (contract: cannc_precision with
    each operand float32 or the narrow type; without it, the narrow type of the node)."""
    from cannc.codegen.lower.contraction import gemm_types
    from cannc.ir.graph import Node
    from cannc.ir.types import TensorType

    def tt(dt):
        return TensorType(np_elem(dt), (4, 4))

    mm = Node("m", "MatMul", ("a", "b"), ("c",))
    tagged = Node("m", "MatMul", ("a", "b"), ("c",), attrs={"cannc_precision": "bf16"})
    assert gemm_types(mm, [tt(F32), tt(F32)], tt(F32))["compute"] == "f32"
    assert gemm_types(mm, [tt(BF), tt(BF)], tt(BF)) == {
        "a_type": BF, "b_type": BF, "bias_type": F32, "c_type": BF, "compute": "bf16"}
    assert gemm_types(mm, [tt(F16), tt(F16)], tt(F16))["compute"] == "fp16"
    assert gemm_types(tagged, [tt(F32), tt(BF)], tt(F32)) == {
        "a_type": F32, "b_type": BF, "bias_type": F32, "c_type": F32, "compute": "bf16"}
    assert gemm_types(tagged, [tt(F32), tt(F32)], tt(F32))["compute"] == "bf16"
    assert gemm_types(tagged, [tt(F16), tt(F32)], tt(F32)) is None   # not its narrow type
    assert gemm_types(mm, [tt(BF), tt(F16)], tt(F32)) is None
    assert gemm_types(mm, [tt("float64"), tt("float64")], tt("float64")) is None
    g = Node("g", "Gemm", ("a", "b", "c"), ("y",), attrs={"cannc_precision": "fp16"})
    assert gemm_types(g, [tt(F16), tt(F16), tt(F32)], tt(F16))["bias_type"] == F32


def _model(nodes, inputs, outputs, inits=()):
    from onnx import helper

    from tests.helpers import model_of
    return model_of(nodes, [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                    [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs], inits,
                    opset=18)


def _onnx_t(t):
    from onnx import TensorProto
    return {BF: TensorProto.BFLOAT16, F16: TensorProto.FLOAT16, F32: TensorProto.FLOAT}[t]


def _f(a):
    return np.asarray(a).astype(np.float64)


def _check_close(got, ref, t, K, ulps=1.01, mag=None):
    assert got.dtype == np_elem(t)
    mag = np.abs(ref) if mag is None else mag
    tol = 1e-5 * np.sqrt(K) * (np.abs(ref).max() + 1) + ulps * ULP[t] * mag + 1e-6
    assert np.all(np.abs(_f(got) - ref) <= tol), np.abs(_f(got) - ref).max()


def _gemm_kernels(sess):
    return [k for k in sess.inspect()["kernels"]
            if k["op_types"][0] in ("MatMul", "Gemm")]


@pytest.mark.parametrize("t", [BF, F16])
def test_model_matmul_gemm(t):
    """A bf16/fp16 MatMul (constant and runtime B, batched) and Gemm (bias, transB) run
    on the GEMM generator, with kernel.notes['precision']."""
    from onnx import helper, numpy_helper

    import cannc

    dt, ot = np_elem(t), _onnx_t(t)
    R = np.random.default_rng(1)
    x = R.standard_normal((2, 37, 65)).astype(dt)
    w = R.standard_normal((65, 70)).astype(dt)
    y = R.standard_normal((2, 65, 21)).astype(dt)
    c = R.standard_normal((70,)).astype(dt)
    wt = R.standard_normal((70, 65)).astype(dt)
    x2 = R.standard_normal((37, 65)).astype(dt)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["o1"]),
             helper.make_node("MatMul", ["x", "y"], ["o2"]),
             helper.make_node("Gemm", ["x2", "wt", "c"], ["o3"], transB=1, alpha=0.5)]
    m = _model(nodes, [("x", ot, x.shape), ("y", ot, y.shape), ("x2", ot, x2.shape)],
               [("o1", ot, [2, 37, 70]), ("o2", ot, [2, 37, 21]), ("o3", ot, [37, 70])],
               [numpy_helper.from_array(w, "w"), numpy_helper.from_array(wt, "wt"),
                numpy_helper.from_array(c, "c")])
    sess = cannc.compile(m)
    o1, o2, o3 = sess.run(None, {"x": x, "y": y, "x2": x2})
    _check_close(o1, _f(x) @ _f(w), t, 65)
    _check_close(o2, _f(x) @ _f(y), t, 65)
    _check_close(o3, 0.5 * _f(x2) @ _f(wt).T + _f(c), t, 65)
    ks = _gemm_kernels(sess)
    assert len(ks) == 3 and all("loop nest" not in str(k["notes"]) for k in ks)
    want = ("fp16 storage, fp32 FMA" if t == F16 else
            "bf16 avx512_bf16" if use_dpbf16() else "bf16 widened")
    notes = [k["notes"]["precision"] for k in ks]
    if t == BF and amx_usable() is None:
        # a constant B (o1, o3) goes onto AMX tiles (codegen/amx.py), a runtime B stays
        assert notes[0].startswith("bf16 AMX") and notes[2].startswith("bf16 AMX"), notes
        assert notes[1].startswith(want), notes
    else:
        assert all(p.startswith(want) for p in notes), notes


@pytest.mark.parametrize("t", [BF, F16])
def test_model_fused_epilogue_and_dynamic(t):
    """MatMul + Add(bias) + Add(residual) + Relu typed bf16/fp16: one FusedGemm kernel
    (the epilogue in float32 registers for bf16), for any batch (symbolic dim)."""
    from onnx import helper, numpy_helper

    import cannc
    from tests.helpers import with_dynamic_dims

    dt, ot = np_elem(t), _onnx_t(t)
    R = np.random.default_rng(2)
    K, N = 65, 70
    w = R.standard_normal((K, N)).astype(dt)
    bias = R.standard_normal((N,)).astype(dt)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]),
             helper.make_node("Add", ["mm", "bias"], ["a"]),
             helper.make_node("Add", ["a", "res"], ["a2"]),
             helper.make_node("Relu", ["a2"], ["y"])]
    m = _model(nodes, [("x", ot, [5, K]), ("res", ot, [5, N])], [("y", ot, [5, N])],
               [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "bias")])
    m = with_dynamic_dims(m, {"x": {0: "b"}, "res": {0: "b"}})
    sess = cannc.compile(m)
    for M in (5, 40, 1):
        x = R.standard_normal((M, K)).astype(dt)
        res = R.standard_normal((M, N)).astype(dt)
        got = sess.run(None, {"x": x, "res": res})[0]
        acc = _f(x) @ _f(w)
        ref = np.maximum(acc + _f(bias) + _f(res), 0)
        # float16: the ONNX-typed epilogue rounds after each op (3 roundings)
        mag = np.abs(acc) + np.abs(_f(bias)) + np.abs(_f(res))
        _check_close(got, ref, t, K, ulps=3.03 if t == F16 else 1.01, mag=mag)
    ks = _gemm_kernels(sess)
    assert [k["op_types"] for k in ks] == [["MatMul", "Add", "Add", "Relu"]]
    assert "precision" in ks[0]["notes"]


def test_dp_choice_is_measured():
    """vdpbf16ps is used where it beats fp32 FMA (measured peaks), never without it."""
    from cannc.native.target import host

    if not host_dpbf16():
        assert not use_dpbf16()
        return
    r = dpbf16_speedup(host().features)
    assert 0.1 < r < 10
    assert use_dpbf16() == (r >= 1.25)


def test_cost_model_knows_the_precision():
    """The GEMM record carries the compute precision; vdpbf16ps scales the modelled peak
    by its measured speedup; the signature (tuning key) differs per element type."""
    from cannc.codegen.plans import gemm_record, gemm_spec_of
    from cannc.schedule.costmodel import predict_gemm_us

    spec = GemmSpec(256, 512, 300, b_prepacked=True, a_type=BF, b_type=BF, c_type=BF,
                    compute="bf16")
    rec = gemm_record(spec)
    assert rec["compute"] == "bf16" and rec["dp"] == gemm_plan(spec).dp
    fast = dict(rec, dp=True, dp_speedup=2.0)
    slow = dict(rec, dp=False)
    assert predict_gemm_us(fast, 1) == pytest.approx(predict_gemm_us(slow, 1) / 2)
    assert gemm_spec_of(rec["signature"]) == spec
