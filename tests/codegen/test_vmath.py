"""Accuracy and vectorisation tests of cannc.codegen.vmath.

All kernels are built into one module, optimised and JIT-compiled once
through the compiler's own pipeline (cannc.native.target.jit_library; a
module-scoped fixture). Each kernel has the shape
``void f(ptr in, [ptr in2,] ptr out, i64 n)``: a ``<16 x T>`` loop and a
scalar tail, so both the vector and the scalar forms of every function run.

Run as a script (``python tests/codegen/test_vmath.py``) to print the error
table and the exp throughput against numpy.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import time

import llvmlite.binding as llvm
import numpy as np
import pytest
from llvmlite import ir

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from cannc.codegen import vmath
from cannc.native.target import jit_library
from tests.helpers import aligned

PTR = ir.PointerType()
I64 = ir.IntType(64)
F32 = ir.FloatType()
F64 = ir.DoubleType()
F16 = ir.HalfType()
W = 16

UNARY = ["exp", "log", "log1p", "erf", "tanh", "sigmoid", "gelu_erf", "gelu_tanh",
         "softplus", "sqrt", "rsqrt", "floor", "ceil", "round_even", "trunc", "fabs",
         "sin", "cos"]
POW_CONSTS = {"2": 2.0, "3": 3.0, "half": 0.5, "m1": -1.0, "0": 0.0, "1": 1.0}

FLT_MIN = float(np.finfo(np.float32).tiny)
DENORM_MIN = 2.0 ** -149


# ---------------------------------------------------------------------------
# kernel construction and JIT
# ---------------------------------------------------------------------------

def _emit_kernel(module: ir.Module, name: str, body, elem: ir.Type, nin: int,
                 width: int = W) -> None:
    """void name(ptr in0, ..., ptr out, i64 n): out[i] = body(b, in0[i], ...)."""
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR] * (nin + 1) + [I64]), name)
    ins, out, n = list(fn.args[:nin]), fn.args[nin], fn.args[nin + 1]
    vty = ir.VectorType(elem, width)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    entry = b.block
    nvec = b.and_(n, ir.Constant(I64, -width))
    vcond, vbody = fn.append_basic_block("vcond"), fn.append_basic_block("vbody")
    tcond, tbody = fn.append_basic_block("tcond"), fn.append_basic_block("tbody")
    done = fn.append_basic_block("done")
    b.branch(vcond)

    b.position_at_end(vcond)
    i = b.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    b.cbranch(b.icmp_signed("<", i, nvec), vbody, tcond)
    b.position_at_end(vbody)
    args = [b.load(b.gep(p, [i], source_etype=elem), typ=vty, align=4) for p in ins]
    b.store(body(b, *args), b.gep(out, [i], source_etype=elem), align=4)
    inext = b.add(i, ir.Constant(I64, width))
    i.add_incoming(inext, vbody)
    b.branch(vcond)

    b.position_at_end(tcond)
    j = b.phi(I64)
    j.add_incoming(i, vcond)
    b.cbranch(b.icmp_signed("<", j, n), tbody, done)
    b.position_at_end(tbody)
    args = [b.load(b.gep(p, [j], source_etype=elem), typ=elem, align=4) for p in ins]
    b.store(body(b, *args), b.gep(out, [j], source_etype=elem), align=4)
    j.add_incoming(b.add(j, ir.Constant(I64, 1)), tbody)
    b.branch(tcond)

    b.position_at_end(done)
    b.ret_void()


class Jit:
    def __init__(self, module: ir.Module, speed_level: int = 3) -> None:
        self.lib = jit_library(module, module.name, speed_level, keep_ir=True)
        self.optimised_ir = self.lib.optimised_ir
        self._fns: dict = {}

    def func(self, name: str, nin: int):
        key = (name, nin)
        if key not in self._fns:
            proto = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * (nin + 1)), ctypes.c_int64)
            self._fns[key] = proto(self.lib.address(name))
        return self._fns[key]

    def run(self, name: str, *xs: np.ndarray) -> np.ndarray:
        xs = [np.ascontiguousarray(x) for x in xs]
        out = np.empty_like(xs[0])
        self.func(name, len(xs))(*[x.ctypes.data for x in xs], out.ctypes.data, out.size)
        return out


def _const_pow(c: float):
    def body(b, x):
        return vmath.pow(b, x, vmath.splat(b, c, x))
    return body


def build_module() -> ir.Module:
    m = ir.Module(name="vmath_test")
    m.triple = llvm.get_process_triple()
    for elem, tag in ((F32, "f32"), (F64, "f64")):
        for name in UNARY:
            _emit_kernel(m, f"{name}_{tag}", getattr(vmath, name), elem, 1)
        _emit_kernel(m, f"pow_{tag}", vmath.pow, elem, 2)
    for k, c in POW_CONSTS.items():
        _emit_kernel(m, f"powc{k}_f32", _const_pow(c), F32, 1)
    _emit_kernel(m, "log1p_exp_f32", vmath.log1p_exp, F32, 1)
    for name in ("exp", "tanh", "pow"):
        _emit_kernel(m, f"{name}_f16", getattr(vmath, name), F16, 2 if name == "pow" else 1)
    # other vector widths
    for name in ("exp", "log", "gelu_tanh", "sin", "erf"):
        _emit_kernel(m, f"{name}_w8", getattr(vmath, name), F32, 1, width=8)
        _emit_kernel(m, f"{name}_d4", getattr(vmath, name), F64, 1, width=4)
    # exp alone, to inspect its optimised IR
    _emit_kernel(m, "exp_only", vmath.exp, F32, 1)
    return m


@pytest.fixture(scope="module")
def jit() -> Jit:
    return Jit(build_module(), speed_level=3)


# ---------------------------------------------------------------------------
# references and error measurement
# ---------------------------------------------------------------------------

_erf_u = np.frompyfunc(math.erf, 1, 1)
_erfc_u = np.frompyfunc(math.erfc, 1, 1)


def _sigmoid64(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0, e) / (1.0 + e)


def _gelu_tanh64(x):
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    return x * _sigmoid64(2 * u)


def _round_half_even(x):
    return np.round(x)


REF = {
    "exp": np.exp,
    "log": np.log,
    "log1p": np.log1p,
    "erf": lambda x: _erf_u(x).astype(np.float64),
    "tanh": np.tanh,
    "sigmoid": _sigmoid64,
    # 1 + erf(x/sqrt2) == erfc(-x/sqrt2), without cancellation in the reference
    "gelu_erf": lambda x: 0.5 * x * _erfc_u(-x / math.sqrt(2)).astype(np.float64),
    "gelu_tanh": _gelu_tanh64,
    "softplus": lambda x: np.logaddexp(0.0, x),
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "floor": np.floor,
    "ceil": np.ceil,
    "round_even": _round_half_even,
    "trunc": np.trunc,
    "fabs": np.abs,
    "sin": np.sin,
    "cos": np.cos,
}


def errors(got: np.ndarray, ref64: np.ndarray, x=None):
    """Check special-value agreement; return (max rel err over normal results,
    max abs err, max abs err where the result is not normal)."""
    with np.errstate(all="ignore"):
        got = got.astype(np.float64)
        ref32 = ref64.astype(np.float32).astype(np.float64)
    gn, rn = np.isnan(got), np.isnan(ref64)
    bad = np.flatnonzero(gn != rn)
    assert bad.size == 0, (f"NaN mismatch at x={x[bad[:5]] if x is not None else bad[:5]}: "
                           f"got {got[bad[:5]]} ref {ref64[bad[:5]]}")
    ginf, rinf = np.isinf(got), np.isinf(ref32)
    bad = np.flatnonzero((ginf | rinf) & (got != ref32))
    assert bad.size == 0, (f"inf mismatch at x={x[bad[:5]] if x is not None else bad[:5]}: "
                           f"got {got[bad[:5]]} ref {ref64[bad[:5]]}")
    fin = ~(gn | rn | ginf | rinf)
    g, r = got[fin], ref64[fin]
    err = np.abs(g - r)
    normal = np.abs(r) >= FLT_MIN
    rel = err[normal] / np.abs(r[normal])
    return (float(rel.max()) if rel.size else 0.0, float(err.max()) if err.size else 0.0,
            float(err[~normal].max()) if (~normal).any() else 0.0)


def rel_where(got, ref64, mask):
    with np.errstate(invalid="ignore"):
        got = got.astype(np.float64)
    m = mask & np.isfinite(ref64) & (np.abs(ref64) >= FLT_MIN)
    return float((np.abs(got[m] - ref64[m]) / np.abs(ref64[m])).max())


SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, FLT_MIN, -FLT_MIN,
                     DENORM_MIN, -DENORM_MIN, 1e-40, -1e-40, 3e-39, float(np.finfo(np.float32).max),
                     -float(np.finfo(np.float32).max), 1e-30, -1e-30, 0.5, -0.5, 2.5, -2.5],
                    dtype=np.float32)


def sweep(lo, hi, n=1_000_000, extra=()):
    x = np.linspace(lo, hi, n, dtype=np.float64).astype(np.float32)
    return np.concatenate([x, SPECIALS, np.asarray(extra, np.float32)])


def log_sweep(n=400_000):
    """Magnitudes from the smallest denormal to FLT_MAX, both signs."""
    mag = np.exp2(np.linspace(-149, 127.99, n)).astype(np.float32)
    return np.concatenate([mag, -mag[::7], SPECIALS])


def random_bits(n=400_000, seed=0):
    """Random float32 bit patterns (all exponents, incl. inf/nan)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def measure(jit, name, x, tag="f32"):
    with np.errstate(all="ignore"):
        ref = REF[name](x.astype(np.float64))
        got = jit.run(f"{name}_{tag}", x)
    return got, ref


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------

def test_exp_stays_vector(jit):
    text = jit.optimised_ir
    start = text.index("define void @exp_only(")
    body = text[start:text.index("\n}\n", start)]
    assert "expf" not in body and "llvm.exp" not in body
    assert "<16 x float>" in body
    calls = [ln for ln in body.splitlines() if " call " in ln]
    assert all("@llvm." in ln for ln in calls), calls
    # no float32 kernel calls out to libm at all
    for name in UNARY + ["pow"]:
        s = text.index(f"define void @{name}_f32(")
        fb = text[s:text.index("\n}\n", s)]
        assert not [ln for ln in fb.splitlines() if " call " in ln and "@llvm." not in ln], name


def test_call_intrinsic_reuses_declarations():
    m = ir.Module()
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), []), "f")
    b = ir.IRBuilder(fn.append_basic_block())
    v = vmath.splat(b, 1.5, ir.VectorType(F32, 16))
    s = ir.Constant(F32, 2.0)
    vmath.call_intrinsic(b, "llvm.fma", [v, v, v])
    vmath.call_intrinsic(b, "llvm.fma", [v, v, v])
    vmath.call_intrinsic(b, "llvm.maxnum", [s, s])
    vmath.call_intrinsic(b, "llvm.fma.v16f32", [v, v, v])
    b.ret_void()
    names = sorted(g.name for g in m.functions if g.name.startswith("llvm."))
    assert names == ["llvm.fma.v16f32", "llvm.maxnum.f32"]
    ints = vmath.splat(ir.IntType(32), 7, v)
    assert str(ints.type) == "<16 x i32>"
    assert vmath.mangle(ir.VectorType(F64, 8)) == "v8f64"
    llvm.parse_assembly(str(m)).verify()


def test_exp(jit):
    x = np.concatenate([sweep(-110, 95), sweep(-1, 1, 200_000), random_bits(),
                        np.float32([88.72283, 88.722839, 88.72284, -87.33654, -103.97207,
                                    -103.972084, -104.0, 89.0])])
    got, ref = measure(jit, "exp", x)
    rel, _, abs_sub = errors(got, ref, x)
    assert rel <= 2e-7, rel
    assert abs_sub <= DENORM_MIN, abs_sub
    assert got[x == np.float32(88.72284)][0] == np.inf
    assert got[x == -104.0][0] == 0.0


def test_log(jit):
    x = np.concatenate([log_sweep(), sweep(0.5, 2.0, 400_000), random_bits(seed=1)])
    got, ref = measure(jit, "log", x)
    rel, _, _ = errors(got, ref, x)
    assert rel <= 2e-7, rel
    s = jit.run("log_f32", np.float32([0.0, -0.0, -1.0, np.inf, -np.inf, np.nan, DENORM_MIN]))
    assert s[0] == -np.inf and s[1] == -np.inf and np.isnan(s[2]) and s[3] == np.inf
    assert np.isnan(s[4]) and np.isnan(s[5]) and abs(s[6] - math.log(DENORM_MIN)) < 1e-5


def test_log1p(jit):
    x = np.concatenate([sweep(-0.999, 3, 400_000), log_sweep(200_000), np.float32([-1.0, -2.0])])
    got, ref = measure(jit, "log1p", x)
    rel, _, _ = errors(got, ref, x)
    assert rel <= 3e-7, rel
    assert np.signbit(jit.run("log1p_f32", np.float32([-0.0]))[0])


@pytest.mark.parametrize("name", ["erf", "tanh", "sigmoid"])
def test_bounded(jit, name):
    lo, hi = {"erf": (-6, 6), "tanh": (-12, 12), "sigmoid": (-110, 40)}[name]
    x = np.concatenate([sweep(lo, hi), sweep(-1, 1, 300_000), random_bits(100_000, seed=2)])
    got, ref = measure(jit, name, x)
    rel, abse, _ = errors(got, ref, x)
    assert abse <= 3e-7, abse
    assert rel <= 1e-6, rel
    # tiny arguments: relative accuracy (no flush) and the sign of zero
    t = np.float32([1e-20, -1e-20, 1e-38, -3e-39, 1e-6, -0.0])
    g2, r2 = measure(jit, name, t)
    if name != "sigmoid":
        assert np.all(np.abs(g2 - r2) <= 1e-6 * np.abs(r2)), (g2, r2)
        assert np.signbit(g2[-1])
    sat = jit.run(f"{name}_f32", np.float32([np.inf, -np.inf, 50.0, -50.0]))
    want = {"erf": [1, -1, 1, -1], "tanh": [1, -1, 1, -1],
            "sigmoid": [1, 0, 1, 1.9287498e-22]}[name]
    np.testing.assert_allclose(sat, want, rtol=1e-6)


def test_sigmoid_avx2(monkeypatch):
    """The AVX2 sigmoid (CANNC_ISA=avx2 or an AVX2-only host): the bounded exp and vrcpps
    with a Newton step instead of vdivps, as accurate as test_bounded asks."""
    from tests.helpers import restrict_host_to_avx2
    restrict_host_to_avx2(monkeypatch)
    m = ir.Module(name="vmath_avx2_sigmoid")
    m.triple = llvm.get_process_triple()
    _emit_kernel(m, "sigmoid_f32", vmath.sigmoid, F32, 1)
    j = Jit(m, speed_level=3)
    assert "llvm.x86.avx.rcp.ps.256" in j.optimised_ir and "avx512" not in j.optimised_ir
    x = np.concatenate([sweep(-110, 40), sweep(-1, 1, 300_000), random_bits(100_000, seed=2)])
    got, ref = measure(j, "sigmoid", x)
    rel, abse, _ = errors(got, ref, x)
    assert abse <= 3e-7, abse
    assert rel <= 1e-6, rel
    # (16 lanes each: shorter arrays take the scalar loop)
    sat = j.run("sigmoid_f32", np.repeat(np.float32([np.inf, -np.inf, 50.0, -50.0, -87.0, 0.0]),
                                         16))
    np.testing.assert_allclose(sat, np.repeat([1, 0, 1, 1.9287498e-22, 1.6458115e-38, 0.5], 16),
                               rtol=1e-6)
    # below -87.3: 0 or the denormal (vrcpps flushes tiny results on Intel, not on Zen 4)
    tail = j.run("sigmoid_f32", np.full(16, -88.0, np.float32))
    assert np.all((tail == 0) | (np.abs(tail - 6.0546e-39) < 1e-42)), tail
    assert np.isnan(j.run("sigmoid_f32", np.float32([np.nan] * 17))).all()


def _check_gelu_erf(j):
    x = np.concatenate([sweep(-12, 12), sweep(-1, 1, 200_000), random_bits(100_000, seed=3)])
    got, ref = measure(j, "gelu_erf", x)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref) | (x == -np.inf))
        fin = np.isfinite(got) & np.isfinite(ref)
        assert np.all(got[~fin & ~np.isnan(got)] == ref[~fin & ~np.isnan(got)])
    # relative accuracy wherever erfc(|z|) is represented (x >= -4 sqrt2)
    assert rel_where(got, ref, fin & (x >= -5.6)) <= 1e-6
    small = fin & (np.abs(ref) <= 1)
    assert np.abs(got[small] - ref[small]).max() <= 3e-7
    assert np.abs(got[fin & (x < -5.6)] - ref[fin & (x < -5.6)]).max() <= 5e-8
    # (16 lanes each: shorter arrays take the scalar loop)
    edge = j.run("gelu_erf_f32", np.repeat(np.float32([np.inf, -0.0, 5.6569, -5.6569, 6.0]), 16))
    np.testing.assert_array_equal(edge[::16], np.float32([np.inf, -0.0, 5.6569, -0.0, 6.0]))
    assert np.signbit(edge[16:32]).all()


def test_gelu_erf(jit):
    """The host's gelu_erf: a table of H = erfc(|x|/sqrt2)/2, picked by vpermt2ps with
    AVX-512, by vpermps with AVX2."""
    if vmath._has_avx512():
        assert "llvm.x86.avx512.vpermi2var.ps.512" in jit.optimised_ir
    _check_gelu_erf(jit)


def _gelu_erf_jit(name: str) -> Jit:
    m = ir.Module(name=name)
    m.triple = llvm.get_process_triple()
    _emit_kernel(m, "gelu_erf_f32", vmath.gelu_erf, F32, 1)
    return Jit(m, speed_level=3)


def test_gelu_erf_avx2(monkeypatch):
    """The gelu_erf of CPUs without AVX-512 (CANNC_ISA=avx2 or an AVX2-only host): the
    8-row table, one vpermps a coefficient and ymm, as accurate as the AVX-512 one."""
    from tests.helpers import restrict_host_to_avx2
    restrict_host_to_avx2(monkeypatch)
    j = _gelu_erf_jit("vmath_avx2_gelu")
    assert "avx512" not in j.optimised_ir
    assert "llvm.x86.avx2.permps" in j.optimised_ir
    _check_gelu_erf(j)


def test_gelu_erf_without_permutes(monkeypatch):
    """The exp-based gelu_erf (erfc from t P(t) e^(-a^2)), which vectors without the
    tables' permutes take (other widths, a host without AVX2): as accurate as the tables."""
    monkeypatch.setattr(vmath, "_has_table_permutes", lambda e: False)
    j = _gelu_erf_jit("vmath_exp_gelu")
    assert "permps" not in j.optimised_ir and "vpermi2var" not in j.optimised_ir
    _check_gelu_erf(j)


def _table_worst(tab, index_of, u_max, n_rows):
    """The worst relative error of each row's polynomial (float32 coefficients, evaluated in
    float64) against H = erfc(u/sqrt2)/2 over the u that pick that row (index_of(u), exactly
    as the kernel computes it in float32), split at u = 4: {u < 4: err, u >= 4: err}."""
    u = np.linspace(0, u_max, 400_001, dtype=np.float32)[:-1]
    u = np.concatenate([u, np.nextafter(np.float32(u_max), np.float32(0))
                        - np.arange(4096, dtype=np.float32) * np.float32(2 ** -21)])
    idx = index_of(u)
    assert idx.min() == 0 and idx.max() == n_rows - 1, "every u in [0, 4 sqrt2) picks a row"
    t = np.float32(tab).astype(np.float64)
    ud = u.astype(np.float64)
    p = np.zeros_like(ud)
    for j in range(t.shape[1] - 1, 0, -1):
        p = p * (ud - t[idx, 0]) + t[idx, j]
    h = 0.5 * np.array([math.erfc(v / math.sqrt(2)) for v in ud])
    rel = np.abs(p / h - 1)
    return {True: float(rel[u < 4].max()), False: float(rel[u >= 4].max())}


def test_gelu_erf_table():
    """Each row of the AVX-512 table is H = erfc(u/sqrt2)/2 on its interval of u, evaluated
    in float64 (the coefficients as the kernel's float32 constants): within 1.2e-7 relative
    for u < 4, 6e-7 up to 4 sqrt2 (where gelu(-u) is ~4e-8)."""
    tab, u_max = vmath._GELU_TAB, vmath._GELU_TAB_U
    scale = np.float32(len(tab) / np.float32(u_max))
    worst = _table_worst(tab, lambda u: (u * scale).astype(np.int32), u_max, len(tab))
    assert worst[True] < 1.2e-7 and worst[False] < 6e-7, worst


def test_gelu_erf_table8():
    """The AVX2 table: its rows are intervals of y = u (1 + u/4) (y computed by one fma in
    float32, as the kernel does); within 2.5e-7 relative everywhere, and the largest float32
    below 4 sqrt2 still picks the last row (vpermps reads the index modulo 8)."""
    tab, u_max = vmath._GELU_TAB8, vmath._GELU_TAB_U
    scale = np.float32(vmath._GELU_TAB8_SCALE)

    def index_of(u):
        y = (u.astype(np.float64) * (u * np.float32(0.25)) + u).astype(np.float32)  # the fma
        return (y * scale).astype(np.int32)
    worst = _table_worst(tab, index_of, u_max, len(tab))
    assert worst[True] < 2.5e-7 and worst[False] < 2.5e-7, worst


def test_gelu_tanh(jit):
    x = np.concatenate([sweep(-30, 30), sweep(-1, 1, 200_000), random_bits(100_000, seed=4)])
    got, ref = measure(jit, "gelu_tanh", x)
    with np.errstate(all="ignore"):
        fin = np.isfinite(got) & np.isfinite(ref)
    assert rel_where(got, ref, fin) <= 1e-6
    small = fin & (np.abs(ref) <= 1)
    assert np.abs(got[small] - ref[small]).max() <= 3e-7


def test_softplus(jit):
    x = np.concatenate([sweep(-110, 100), sweep(-2, 2, 200_000), random_bits(100_000, seed=5)])
    got, ref = measure(jit, "softplus", x)
    rel, _, abs_sub = errors(got, ref, x)
    assert rel <= 1e-6, rel
    assert abs_sub <= DENORM_MIN
    np.testing.assert_array_equal(jit.run("log1p_exp_f32", x), got)


@pytest.mark.parametrize("name", ["sin", "cos"])
def test_sincos(jit, name):
    x = np.concatenate([sweep(-1e4, 1e4), sweep(-4, 4, 200_000),
                        np.float32(np.arange(1, 6000) * (np.pi / 2))])
    got, ref = measure(jit, name, x)
    fin = np.abs(x) <= 1e4
    err = np.abs(got[fin] - ref[fin])
    assert (err / np.maximum(np.abs(ref[fin]), 1.0)).max() <= 1e-6
    # relative accuracy, also next to the zeros
    assert rel_where(got, ref, fin & (np.abs(ref) > 1e-6)) <= 1e-6
    assert np.isnan(jit.run(f"{name}_f32", np.float32([np.inf, -np.inf, np.nan]))).all()
    if name == "sin":
        assert np.signbit(jit.run("sin_f32", np.float32([-0.0]))[0])
    huge = jit.run(f"{name}_f32", np.float32([1e20, -3e30, 1e7]))
    assert np.all(np.abs(huge) <= 1.0)


@pytest.mark.parametrize("name", ["sqrt", "floor", "ceil", "round_even", "trunc", "fabs"])
def test_exact(jit, name):
    x = np.concatenate([sweep(-20, 20, 100_000), np.float32([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 1e30,
                                                            8388609.0, 4.5, 5.5])])
    got, ref = measure(jit, name, x)
    with np.errstate(all="ignore"):
        ref32 = ref.astype(np.float32)
    np.testing.assert_array_equal(got, ref32)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(ref32))


def test_rsqrt(jit):
    x = np.concatenate([log_sweep(), random_bits(100_000, seed=6)])
    got, ref = measure(jit, "rsqrt", x)
    rel, _, _ = errors(got, ref, x)
    assert rel <= 1.2e-7, rel  # sqrt then divide: two roundings
    s = jit.run("rsqrt_f32", np.float32([0.0, -0.0, np.inf, -1.0, 4.0]))
    np.testing.assert_array_equal(s, np.float32([np.inf, -np.inf, 0.0, np.nan, 0.5]))


def _pow_inputs():
    rng = np.random.default_rng(7)
    n = 300_000
    x = rng.uniform(0, 4, n).astype(np.float32)
    y = rng.uniform(-30, 30, n).astype(np.float32)
    x2 = np.exp2(rng.uniform(-140, 127, n)).astype(np.float32)
    y2 = rng.uniform(-3, 3, n).astype(np.float32)
    # negative bases with integer and non-integer exponents
    x3 = -rng.uniform(0, 10, n).astype(np.float32)
    y3 = np.where(rng.random(n) < 0.7, rng.integers(-20, 20, n),
                  rng.uniform(-5, 5, n)).astype(np.float32)
    sp = np.float32([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, np.inf, -np.inf, np.nan, 3.0, -3.0,
                     DENORM_MIN, 1e-40, 1e30, -1e30, 1e-30, 2.5, -2.5, 16777216.0, 1e10])
    xs, ys = np.meshgrid(sp, sp)
    return (np.concatenate([x, x2, x3, xs.ravel()]), np.concatenate([y, y2, y3, ys.ravel()]))


def test_pow(jit):
    x, y = _pow_inputs()
    got = jit.run("pow_f32", x, y)
    with np.errstate(all="ignore"):
        ref = np.power(x.astype(np.float64), y.astype(np.float64))
        ref_f = np.power(x, y)  # C powf semantics
    rel, _, abs_sub = errors(got, ref, x)
    assert rel <= 1.5e-7, rel
    assert abs_sub <= DENORM_MIN
    both = np.isfinite(ref_f) | np.isinf(ref_f)
    np.testing.assert_array_equal(np.signbit(got[both]), np.signbit(ref_f[both]))
    s = jit.run("pow_f32", np.float32([-2, -2, 0, np.nan, 1, -1, -8, 4, -0.0, -0.0]),
                np.float32([3, 2, 0, 0, np.nan, np.inf, 1 / 3, 0.5, -1, 3]))
    np.testing.assert_array_equal(s[:8], np.float32([-8, 4, 1, 1, 1, 1, np.nan, 2]))
    assert s[8] == -np.inf and s[9] == 0 and np.signbit(s[9])


@pytest.mark.parametrize("k", list(POW_CONSTS))
def test_pow_constant_exponent(jit, k):
    c = POW_CONSTS[k]
    x = np.concatenate([sweep(-10, 10, 20_000), np.float32([-0.0, -np.inf, np.inf, np.nan])])
    got = jit.run(f"powc{k}_f32", x)
    with np.errstate(all="ignore"):
        # an array exponent: numpy's scalar-exponent fast paths (sqrt for 0.5)
        # differ from C pow at -inf and -0
        ref = np.power(x, np.full_like(x, c))
        ref64 = np.power(x.astype(np.float64), np.full(x.shape, c))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.signbit(got), np.signbit(ref))
    rel, _, _ = errors(got, ref64, x)
    assert rel <= 1.2e-7


@pytest.mark.parametrize("name", UNARY)
def test_float64_variants(jit, name):
    x = np.concatenate([np.linspace(-30, 30, 4001), [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-300]])
    got, ref = measure(jit, name, x, tag="f64")
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        fin = np.isfinite(ref) & (np.abs(ref) > 1e-300)
        # the tails of the gelus are ill-conditioned (exp of a rounded argument)
        np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["exp", "log", "gelu_tanh", "sin", "erf"])
def test_other_widths(jit, name):
    x = np.concatenate([np.linspace(-20, 20, 5003), SPECIALS]).astype(np.float32)
    if name == "log":
        x = np.abs(x)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(jit.run(f"{name}_w8", x), jit.run(f"{name}_f32", x))
        xd = x.astype(np.float64)
        np.testing.assert_array_equal(jit.run(f"{name}_d4", xd), jit.run(f"{name}_f64", xd))


def test_pow_float64(jit):
    x = np.array([-2.0, 2.0, 0.0, 9.0, -8.0, np.nan, 1.0] * 3)
    y = np.array([3.0, 0.5, 0.0, 0.5, 1 / 3, 0.0, np.nan] * 3)
    got = jit.run("pow_f64", x, y)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(got, np.power(x, y))


def test_half(jit):
    x = np.linspace(-8, 8, 1001).astype(np.float16)
    got = jit.run("exp_f16", x)
    np.testing.assert_allclose(got.astype(np.float64), np.exp(x.astype(np.float64)), rtol=1e-3)
    got = jit.run("tanh_f16", x)
    np.testing.assert_allclose(got.astype(np.float64), np.tanh(x.astype(np.float64)),
                               rtol=1e-3, atol=1e-4)
    got = jit.run("pow_f16", x, np.full_like(x, 3))
    np.testing.assert_allclose(got.astype(np.float64), x.astype(np.float64) ** 3,
                               rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------
# report (python tests/codegen/test_vmath.py)
# ---------------------------------------------------------------------------

def _bench(fn, trials=30):
    """Best of ``trials`` (the machine is shared: the minimum is the stable figure)."""
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.min(ts))


def main() -> None:
    t0 = time.perf_counter()
    j = Jit(build_module(), speed_level=3)
    print(f"build + optimise + JIT of the test module: {time.perf_counter() - t0:.2f} s")
    cases = {
        "exp": np.concatenate([sweep(-110, 95), sweep(-1, 1), random_bits()]),
        "log": np.concatenate([log_sweep(), sweep(0.5, 2.0), random_bits(seed=1)]),
        "log1p": np.concatenate([sweep(-0.999, 3), log_sweep()]),
        "erf": np.concatenate([sweep(-6, 6), sweep(-1, 1)]),
        "tanh": np.concatenate([sweep(-12, 12), sweep(-1, 1)]),
        "sigmoid": np.concatenate([sweep(-110, 40), sweep(-1, 1)]),
        "gelu_erf": np.concatenate([sweep(-5.6, 12), sweep(-1, 1)]),
        "gelu_tanh": np.concatenate([sweep(-30, 30), sweep(-1, 1)]),
        "softplus": np.concatenate([sweep(-110, 100), sweep(-2, 2)]),
        "sin": sweep(-1e4, 1e4)[:-len(SPECIALS)],
        "cos": sweep(-1e4, 1e4)[:-len(SPECIALS)],
    }
    print("float32 vs float64 reference; rel over normal results, abs for bounded functions")
    print(f"{'function':10s} {'max rel err':>12s} {'max abs err':>12s}")
    for name, x in cases.items():
        got, ref = measure(j, name, x)
        rel, abse, _ = errors(got, ref, x)
        bounded = name in ("erf", "tanh", "sigmoid", "sin", "cos")
        print(f"{name:10s} {rel:12.3e} " + (f"{abse:12.3e}" if bounded else ""))
    x, y = _pow_inputs()
    got = j.run("pow_f32", x, y)
    with np.errstate(all="ignore"):
        rel, abse, _ = errors(got, np.power(x.astype(np.float64), y.astype(np.float64)), x)
    print(f"{'pow':10s} {rel:12.3e}")

    rng = np.random.default_rng(0)
    for n, reps in ((10_000_000, 1), (16_384, 50)):
        print(f"throughput, {n} floats in [-80, 80] (|x| for log)"
              + (", L2-resident, repeated" if reps > 1 else "") + ":")
        x, out = aligned(n), aligned(n)
        x[:] = rng.uniform(-80, 80, n).astype(np.float32)
        ax = aligned(n)
        ax[:] = np.abs(x)
        oa = out.ctypes.data
        for name in ("exp", "log", "tanh", "sigmoid", "erf", "gelu_erf", "gelu_tanh", "softplus",
                     "sin"):
            f = j.func(f"{name}_f32", 1)
            src = ax if name == "log" else x
            sa = src.ctypes.data

            def run_jit(f=f, sa=sa, oa=oa, n=n, reps=reps):
                for _ in range(reps):
                    f(sa, oa, n)
            t_jit = _bench(run_jit) / reps
            line = f"  {name:10s} jit {n / t_jit / 1e9:6.2f} Gelem/s"
            npf = {"exp": np.exp, "log": np.log, "tanh": np.tanh, "sin": np.sin}.get(name)
            if npf is not None:
                def run_np(npf=npf, src=src, out=out, reps=reps):
                    for _ in range(reps):
                        npf(src, out=out)
                t_np = _bench(run_np) / reps
                line += f"   numpy {n / t_np / 1e9:6.2f} Gelem/s   ratio x{t_np / t_jit:.2f}"
            print(line)



if __name__ == "__main__":
    main()
