"""Vectorisable transcendental and rounding functions emitted as LLVM IR.

LLVM lowers ``llvm.exp.v16f32`` and friends to sixteen scalar libm calls, which
is far too slow for elementwise kernels. The float32 functions here are written
out as straight-line IR instead -- range reduction, a minimax polynomial
evaluated with ``llvm.fma``, and ``select`` for the special cases -- so the
same code serves ``float`` and ``<N x float>`` and stays in zmm registers.

Every function takes ``(builder, x)`` where ``x`` has type ``float``,
``double``, ``half``, ``<N x float>``, ``<N x double>`` or ``<N x half>`` and
returns a value of the same type (``pow`` takes ``(builder, x, y)`` with ``y``
of the same type as ``x``). ``half`` (and a ``bfloat`` type, if one is used)
is computed in float32 and rounded back. float64 uses the LLVM intrinsics or
libm (``erf``, ``erfc``, ``log1p``), scalarised for vectors: accurate, not
fast.

No fast-math flags are used anywhere: the special-value handling relies on
IEEE semantics (NaN compares false, inf arithmetic).

Accuracy of the float32 versions, max relative error over normal results
against float64 references (``python tests/codegen/test_vmath.py`` prints
the table; the tests bound each figure):

- ``exp`` 7.6e-8 (< 1.3 ulp) on its whole domain; +inf above 88.7228,
  correctly rounded denormals down to -103.97, then 0; NaN propagates.
- ``log`` 7.9e-8; log(0) = -inf, log(x<0) = NaN, log(inf) = inf; denormal
  inputs are scaled exactly first. ``log1p`` 1.3e-7.
- ``erf`` 1.8e-7, ``tanh`` 1.5e-7, ``sigmoid`` 2.4e-7 with AVX-512 (a degree-5
  exp polynomial; 0 below x = -88.72, where it is denormal), 1.7e-7 otherwise
  (absolute <= 1.3e-7);
  ``softplus`` 1.7e-7; ``gelu_erf`` 4.6e-7 (from exp; with AVX-512 a table of erfc:
  5.8e-7, 1.1e-7 for x >= -4; with AVX2 an 8-row one: 4.1e-7); ``gelu_tanh`` 2.2e-7 (6.1e-7 where
  the sigmoid inside is denormal). erf/tanh are relative-accurate near 0 and
  keep -0; the left tails of sigmoid, softplus and both gelus are computed
  without cancellation (erfc directly; the gelu_tanh argument as a float pair).
  gelu_erf is -0 for x < -5.657 (true value above -4.4e-8).
- ``sin``/``cos`` 1.2e-7 for |x| <= 1e4 (three-part Cody-Waite reduction
  by pi/2; relative, also next to the zeros); bounded garbage beyond ~5e4.
- ``pow`` 6e-8: C99 special cases, generic case through log2/exp2 in double.
- Denormal *results* (and underflows) of ordinary arithmetic cost a microcode
  assist on Zen 4 (~1.5x slower vectors); exp computes far-underflowing lanes
  (exp(-1e4) in masked softmax) on a dummy value to avoid it. With AVX-512, exp
  and sigmoid apply 2^k with vscalefps instead, which rounds once and makes
  denormals and zeros at full speed (Zen 4, exp of -100: 5.2 ns a vector, 10.8
  with the integer scaling).

The polynomial coefficients were fitted for this module with a Remez
exchange against float64 references (relative error weighting), then rounded
to float32 where they are used on float32 data.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence

from llvmlite import ir

from ..native.emit import call_intrinsic, mangle

__all__ = [
    "call_intrinsic",
    "ceil",
    "cos",
    "erf",
    "exp",
    "fabs",
    "floor",
    "gelu_erf",
    "gelu_tanh",
    "log",
    "log1p",
    "log1p_exp",
    "mangle",
    "pow",
    "round_even",
    "rsqrt",
    "sigmoid",
    "sin",
    "softplus",
    "splat",
    "sqrt",
    "tanh",
    "trunc",
]

F32 = ir.FloatType()
F64 = ir.DoubleType()
I1 = ir.IntType(1)
I32 = ir.IntType(32)
I64 = ir.IntType(64)


# ---------------------------------------------------------------------------
# type helpers
# ---------------------------------------------------------------------------

def _elem(ty: ir.Type) -> ir.Type:
    return ty.element if isinstance(ty, ir.VectorType) else ty


def _like(ty: ir.Type, elem: ir.Type) -> ir.Type:
    """A type of the same shape as ``ty`` with element type ``elem``."""
    if isinstance(ty, ir.VectorType):
        return ir.VectorType(elem, ty.count)
    return elem


def _is_half_like(t: ir.Type) -> bool:
    return isinstance(t, ir.HalfType) or str(t) == "bfloat"


def splat(builder_or_type, value, like) -> ir.Constant:
    """A constant ``value`` with the shape of ``like`` (a value or a type).

    The element type is ``like``'s own element type when the first argument is
    a builder (or None); when it is an ``ir.Type`` its element type is used
    instead, e.g. ``splat(ir.IntType(32), 0x7f, x)`` for an integer vector
    shaped like the float vector ``x``.
    """
    like_ty = like if isinstance(like, ir.Type) else like.type
    if isinstance(builder_or_type, ir.Type):
        elem = _elem(builder_or_type)
    else:
        elem = _elem(like_ty)
    c = ir.Constant(elem, value)
    if isinstance(like_ty, ir.VectorType):
        return ir.Constant(ir.VectorType(elem, like_ty.count), [c] * like_ty.count)
    return c


def _module_of(builder: ir.IRBuilder) -> ir.Module:
    return builder.block.parent.module


def _libm_call(builder: ir.IRBuilder, name: str, x: ir.Value) -> ir.Value:
    """Call ``double name(double)`` from libm, lane by lane for vectors."""
    module = _module_of(builder)
    fn = module.globals.get(name)
    if fn is None:
        fn = ir.Function(module, ir.FunctionType(F64, [F64]), name=name)
    if not isinstance(x.type, ir.VectorType):
        return builder.call(fn, [x])
    out = ir.Constant(x.type, ir.Undefined)
    for i in range(x.type.count):
        idx = ir.Constant(I32, i)
        out = builder.insert_element(out, builder.call(fn, [builder.extract_element(x, idx)]), idx)
    return out


# ---------------------------------------------------------------------------
# a small emitter: float ops of one shape, without fast-math flags
# ---------------------------------------------------------------------------

_V16F = ir.VectorType(ir.FloatType(), 16)


def _has_avx512() -> bool:
    from ..native.target import host
    return host().has("avx512f")


class _E:
    def __init__(self, b: ir.IRBuilder, ty: ir.Type):
        self.b = b
        self.ty = ty
        fe = _elem(ty)
        self.is64 = isinstance(fe, ir.DoubleType)
        self.ity = _like(ty, I64 if self.is64 else I32)

    # constants
    def c(self, v: float) -> ir.Constant:
        return splat(None, float(v), self.ty)

    def ci(self, v: int) -> ir.Constant:
        return splat(self.ity, int(v), self.ty)

    # arithmetic
    def add(self, a, b): return self.b.fadd(a, b)
    def sub(self, a, b): return self.b.fsub(a, b)
    def mul(self, a, b): return self.b.fmul(a, b)
    def div(self, a, b): return self.b.fdiv(a, b)
    def neg(self, a): return self.b.fneg(a)
    def fma(self, a, b, c): return call_intrinsic(self.b, "llvm.fma", [a, b, c])
    def fabs(self, a): return call_intrinsic(self.b, "llvm.fabs", [a])
    def copysign(self, mag, sgn): return call_intrinsic(self.b, "llvm.copysign", [mag, sgn])
    def sqrt(self, a): return call_intrinsic(self.b, "llvm.sqrt", [a])
    def trunc(self, a): return call_intrinsic(self.b, "llvm.trunc", [a])

    # comparisons (ordered ones are false for NaN; 'ult' etc. are true)
    def cmp(self, op: str, a, b):
        if op.startswith("u"):
            return self.b.fcmp_unordered(op[1:], a, b)
        return self.b.fcmp_ordered(op, a, b)

    def isnan(self, a): return self.b.fcmp_unordered("uno", a, a)
    def sel(self, cond, a, b): return self.b.select(cond, a, b)

    def min_c(self, a, hi: float):
        """min(a, hi); NaN becomes hi (like x86 vminps)."""
        c = self.c(hi)
        return self.sel(self.cmp("<", a, c), a, c)

    def max_c(self, a, lo: float):
        """max(a, lo); NaN becomes lo."""
        c = self.c(lo)
        return self.sel(self.cmp(">", a, c), a, c)

    def clamp_keep_nan(self, a, lo: float | None, hi: float | None):
        """min(max(a, lo), hi) with NaN lanes kept: x86 vmaxps / vminps return their
        second operand where either is NaN, so the constant goes first. One instruction
        a bound, against a compare and a blend (min_c / max_c): where has_scalef() (a
        <16 x float> on an AVX-512 CPU) the AVX-512 intrinsics, elsewhere selects that
        LLVM matches to the same vmaxps / vminps."""
        if not self.has_scalef():
            for bound, op in ((lo, ">"), (hi, "<")):
                if bound is not None:
                    c = self.c(bound)
                    a = self.sel(self.cmp(op, c, a), c, a)
            return a
        for name, bound in (("max", lo), ("min", hi)):
            if bound is None:
                continue
            f = self.b.module.declare_intrinsic(
                f"llvm.x86.avx512.{name}.ps.512", fnty=ir.FunctionType(self.ty, [
                    self.ty, self.ty, ir.IntType(32)]))
            a = self.b.call(f, [self.c(bound), a, ir.Constant(ir.IntType(32), 4)])
        return a

    # bits
    def bits(self, a): return self.b.bitcast(a, self.ity)
    def from_bits(self, i): return self.b.bitcast(i, self.ty)
    def iadd(self, a, b): return self.b.add(a, b)
    def isub(self, a, b): return self.b.sub(a, b)
    def ishl(self, a, n: int): return self.b.shl(a, self.ci(n))
    def iashr(self, a, n: int): return self.b.ashr(a, self.ci(n))
    def iand(self, a, b): return self.b.and_(a, b)
    def ixor(self, a, b): return self.b.xor(a, b)
    def sitofp(self, i): return self.b.sitofp(i, self.ty)

    def recip(self, a):
        """1/a to ~1 ulp for a >= 1 (or +inf): a <16 x float> takes vrcp14ps and one
        Newton step where the CPU has AVX-512 (vdivps is the slowest vector op);
        otherwise an exact division."""
        if self.ty != _V16F or not _has_avx512():
            return self.div(self.c(1.0), a)
        f = self.b.module.declare_intrinsic(
            "llvm.x86.avx512.rcp14.ps.512", fnty=ir.FunctionType(self.ty, [
                self.ty, self.ty, ir.IntType(16)]))
        r0 = self.b.call(f, [a, self.c(0.0), ir.Constant(ir.IntType(16), -1)])
        return self.fma(r0, self.fma(self.neg(a), r0, self.c(1.0)), r0)

    def recip_fast(self, a):
        """1/a to ~2 ulp for finite a >= 1 (results below 2^-126 are 0; NaN propagates):
        vrcp14ps (AVX-512) or vrcpps (AVX, on each 8-lane half) and one Newton step,
        where the type is a <16 x float> and the CPU has them; otherwise a division."""
        if self.ty != _V16F:
            return self.div(self.c(1.0), a)
        if _has_avx512():
            return self.recip(a)
        v8 = ir.VectorType(ir.FloatType(), 8)
        f = self.b.module.declare_intrinsic("llvm.x86.avx.rcp.ps.256",
                                            fnty=ir.FunctionType(v8, [v8]))
        r0 = self.joined(*(self.b.call(f, [h]) for h in self.halves(a)))
        return self.fma(r0, self.fma(self.neg(a), r0, self.c(1.0)), r0)

    def halves(self, v) -> list[ir.Value]:
        """The two 8-lane halves of a 16-lane vector (each one ymm, for AVX intrinsics)."""
        return [self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 8),
                                                        list(range(h, h + 8))))
                for h in (0, 8)]

    def joined(self, lo, hi) -> ir.Value:
        """The 16-lane vector of two 8-lane halves (the inverse of halves)."""
        return self.b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 16),
                                                         list(range(16))))

    def avx512_vector(self) -> bool:
        """A <16 x float> on an AVX-512 CPU: its intrinsics (vscalefps, vpermt2ps) apply."""
        return self.ty == _V16F and _has_avx512()

    def has_scalef(self) -> bool:
        """vscalefps applies (a <16 x float> on an AVX-512 CPU)."""
        return self.avx512_vector()

    def scalef(self, a, k):
        """a * 2^k for a float k holding an integer (vscalefps: one rounding, denormal
        and zero results included; NaN propagates). Only where has_scalef()."""
        f = self.b.module.declare_intrinsic(
            "llvm.x86.avx512.mask.scalef.ps.512", fnty=ir.FunctionType(self.ty, [
                self.ty, self.ty, self.ty, ir.IntType(16), ir.IntType(32)]))
        return self.b.call(f, [a, k, self.c(0.0), ir.Constant(ir.IntType(16), -1),
                               ir.Constant(ir.IntType(32), 4)])

    def horner(self, x, coeffs: Sequence[float | ir.Value]):
        """c0 + c1*x + c2*x^2 + ... by Horner's rule with fma (coefficients constants, or
        values of x's type: a table's per-lane picks)."""
        def cv(cf):
            return cf if isinstance(cf, ir.Value) else self.c(cf)
        acc = cv(coeffs[-1])
        for cf in reversed(coeffs[:-1]):
            acc = self.fma(acc, x, cv(cf))
        return acc


def _dispatch(builder: ir.IRBuilder, x: ir.Value,
              f32: Callable[[_E, ir.Value], ir.Value],
              f64: Callable[[_E, ir.Value], ir.Value]) -> ir.Value:
    fe = _elem(x.type)
    if isinstance(fe, ir.FloatType):
        return f32(_E(builder, x.type), x)
    if isinstance(fe, ir.DoubleType):
        return f64(_E(builder, x.type), x)
    if _is_half_like(fe):
        wide = _like(x.type, F32)
        r = f32(_E(builder, wide), builder.fpext(x, wide))
        return builder.fptrunc(r, x.type)
    raise TypeError(f"vmath: unsupported type {x.type}")


def _intrinsic_unary(name: str):
    def fn(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
        fe = _elem(x.type)
        if not isinstance(fe, (ir.FloatType, ir.DoubleType)) and not _is_half_like(fe):
            raise TypeError(f"vmath: unsupported type {x.type}")
        return call_intrinsic(builder, name, [x])
    fn.__name__ = name.split(".")[-1]
    return fn


# ---------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------

_MAGIC32 = 12582912.0            # 1.5 * 2^23: adding it rounds |v| < 2^22 to an integer
_MAGIC32_BITS = 0x4B400000
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125      # 0x3F317200: few significant bits, k*LN2_HI is exact
_LN2_LO = 1.428606765330187e-06  # ln2 - LN2_HI, rounded to float
_FLT_MIN = 1.1754943508222875e-38
_INF = math.inf
_SQRT2 = math.sqrt(2.0)
_NAN = math.nan

# e^r = 1 + r*(1 + r*(c2 + c3 r + ... + c6 r^4)), |r| <= ln2/2; rel. error 3.1e-9
_EXP_P = (0.4999999403953552, 0.1666651964187622, 0.041668400168418884,
          0.00836885068565607, 0.0013814320554956794)
# the same to degree 5 (minimax, rel. error 1.1e-7; 1.9e-7 evaluated in float32)
_EXP_P5 = (0.4999924302101135, 0.16667111217975616, 0.041889019310474396,
           0.008312860503792763)
# log1p(f) = f - f^2/2 + f^3 * P(f), f in [sqrt(1/2)-1, sqrt(2)-1]; rel. error 5.9e-9
_LOG_P = (0.3333333134651184, -0.2500082552433014, 0.20001235604286194,
          -0.1662314385175705, 0.14201368391513824, -0.13162003457546234,
          0.1276542842388153, -0.07634390145540237)
# erf(x) = x * P(x^2), |x| < 0.875; rel. error 8.6e-9
_ERF_T = 0.875
_ERF_SMALL = (1.1283791065216064, -0.3761255145072937, 0.11282449960708618,
              -0.026791255921125412, 0.00503183901309967, -0.000620128819718957)
# log(erfcx(x)) = G(x - 2.4375) on [0.875, 4]; abs. error 1.2e-8
# erfc(x) = exp(-x^2 + G), with x^2 and the sum carried in two parts.
_ERFC_C = 2.4375
_ERFC_U = 4.0                    # erfc(4) = 1.5e-8 < ulp(1)/4: erf(x >= 4) = 1 in float
_ERFC_G = (-1.5345509052276611, -0.3598233759403229, 0.05819414556026459,
           -0.01141656655818224, 0.0023010449949651957, -0.00045031902845948935,
           8.344193338416517e-05, -1.4106020898907445e-05, 1.6024860087782145e-06)
# erfc(a) e^(a^2) = t P(t), t = 1 / (1 + p a), a in [0, 4]; rel. error 2.8e-8
_GELU_T_P = 0.40
_GELU_T = (0.2246476262807846, 0.23982663452625275, 0.12381957471370697,
           0.4490432143211365, -0.43419983983039856, 0.7375586628913879,
           -0.42022889852523804, 0.07953300327062607)


def _rows(width: int, text: str) -> tuple[tuple[float, ...], ...]:
    """A table written as whitespace-separated numbers, ``width`` to a row."""
    v = [float(t) for t in text.split()]
    return tuple(tuple(v[i:i + width]) for i in range(0, len(v), width))


# gelu_erf with AVX-512 (_gelu_erf_table_f32): H(u) = erfc(u / sqrt2) / 2 on 32 intervals
# of u = |x| in [0, 4 sqrt2), each a degree-5 polynomial in r = u - c (c the interval's
# middle). A row: c, then the coefficients of r^0 .. r^5. Fitted minimax in relative error
# (Lawson's reweighted least squares on Chebyshev nodes, coefficients rounded to float32).
# In the float32 evaluation the kernel does: 1.1e-7 for u < 4, 5.8e-7 worst (u -> 4 sqrt2,
# where gelu(-u) is ~4e-8). Degree 6 (1.5e-7 throughout) took two more vpermt2ps and FMAs,
# which share Zen 4's FMA pipe
_GELU_TAB_U = 5.656854                      # float32(4 sqrt2): erfc(4) / 2 = 7.7e-9
_GELU_TAB = _rows(7, """
0.088388346  0.46478403  -0.39738694  0.01756216
    0.065713614  -0.0043702666  -0.00975837
0.26516503  0.39544117  -0.38516065  0.051065493
    0.059679687  -0.012442494  -0.008268002
0.44194174  0.32926568  -0.36182493  0.079952665
    0.048525833  -0.018651512  -0.005606338
0.61871845  0.26805094  -0.32944536  0.10191684
    0.033888098  -0.022188986  -0.0023167757
0.79549515  0.21316276  -0.2907345  0.11563884
    0.017792216  -0.02277612  9.693405e-04
0.97227186  0.16545767  -0.24867839  0.12089142
    0.002266521  -0.020673193  0.003686305
1.1490486  0.12526798  -0.20616162  0.118444815
    -0.0110060405  -0.016565008  0.0054550744
1.3258252  0.0924488  -0.16565552  0.10981513
    -0.02092259  -0.0113656735  0.0061415005
1.5026019  0.06647087  -0.12901266  0.09692736
    -0.027045524  -0.006002948  0.005844158
1.6793786  0.04653914  -0.09738386  0.08177223
    -0.029544719  -0.0012389225  0.0048281457
1.8561554  0.031715706  -0.07124754  0.06612331
    -0.029036956  0.0024368858  0.003431279
2.032932  0.021029694  -0.050522078  0.05135402
    -0.026379248  0.004831853  0.0019753505
2.2097087  0.013562693  -0.034723286  0.038364213
    -0.022470575  0.0060064574  7.034147e-04
2.3864856  0.008505138  -0.023130683  0.02760055
    -0.018100908  0.006190478  -2.47318e-04
2.563262  0.0051846886  -0.014934302  0.019140279
    -0.013864759  0.005689859  -8.403698e-04
2.7400389  0.003071596  -0.009345643  0.0128037175
    -0.010136614  0.0048081195  -0.001113908
2.9168155  0.0017681243  -0.0056684194  0.008266865
    -0.0070929215  0.0037949944  -0.0011470033
3.0935922  9.887456e-04  -0.0033322924  0.0051543713
    -0.004759824  0.0028240362  -0.0010291402
3.270369  5.370363e-04  -0.0018986817  0.0031046881
    -0.0030680816  0.0019933037  -8.3909516e-04
3.4471455  2.8327174e-04  -0.0010485527  0.0018072501
    -0.0019018942  0.0013400594  -6.344847e-04
3.6239223  1.4508438e-04  -5.612494e-04  0.0010169564
    -0.0011349454  8.606391e-04  -4.5012168e-04
3.800699  7.214425e-05  -2.911724e-04  5.5332494e-04
    -6.525019e-04  5.29222e-04  -3.0178684e-04
3.9774756  3.4825378e-05  -1.4641069e-04  2.911694e-04
    -3.61655e-04  3.1212188e-04  -1.921627e-04
4.1542525  1.631763e-05  -7.135481e-05  1.4821091e-04
    -1.9335435e-04  1.767958e-04  -1.16616175e-04
4.331029  7.420709e-06  -3.3705663e-05  7.298882e-05
    -9.976215e-05  9.628517e-05  -6.762397e-05
4.507806  3.2750743e-06  -1.5431562e-05  3.4780478e-05
    -4.969391e-05  5.0463386e-05  -3.754567e-05
4.6845827  1.4026546e-06  -6.8477066e-06  1.6038892e-05
    -2.3906588e-05  2.547117e-05  -1.9990277e-05
4.861359  5.829128e-07  -2.9451653e-06  7.158519e-06
    -1.1110691e-05  1.2389444e-05  -1.0219422e-05
5.038136  2.3504374e-07  -1.2277261e-06  3.0926046e-06
    -4.9898376e-06  5.8105416e-06  -5.021454e-06
5.2149124  9.195208e-08  -4.9604677e-07  1.2933602e-06
    -2.1659903e-06  2.6287275e-06  -2.373574e-06
5.3916893  3.48992e-08  -1.9425444e-07  5.236513e-07
    -9.089476e-07  1.1476529e-06  -1.0800859e-06
5.568466  1.284958e-08  -7.373056e-08  2.0527004e-07
    -3.6881957e-07  4.836868e-07  -4.734394e-07
""")
# gelu_erf with AVX2 (_gelu_erf_table_f32): the same H on 8 intervals uniform in
# y = u (1 + u/4) (narrower where H falls fastest relative to itself), each a degree-8
# polynomial in r = u - c, so that one vpermps per ymm picks a coefficient (an 8-entry
# permute; AVX2 has no two-register one). Fitted as _GELU_TAB; the index is trunc(y * scale),
# the scale a little below 8 / y(4 sqrt2) (the last interval ends past 4 sqrt2: the largest
# float32 below it still takes row 7). In the float32 evaluation the kernel does: 3.5e-7 for
# u < 4, 3.7e-7 worst; degree 7 reached 7.6e-7.
_GELU_TAB8_SCALE = 0.5857852697372437
_GELU_TAB8 = _rows(10, """
0.64532983  0.25935674  -0.32395074  0.104527265
    0.031507604  -0.022500472  -0.0018287896
    0.0031772184  -5.181237e-05  -2.9725116e-04
1.7463344  0.04037643  -0.08683196  0.07581884
    -0.029663058  3.13591e-04  0.004340755
    -0.0013019224  -1.9792731e-04  1.7029422e-04
2.575137  0.005010021  -0.014485552  0.01865114
    -0.013595501  0.0056439955  -8.6711586e-04
    -3.798523e-04  2.3918989e-04  -3.7517562e-05
3.2720673  5.3382077e-04  -0.0018881633  0.0030890983
    -0.003054549  0.001983845  -8.401875e-04
    1.9331495e-04  1.1284848e-05  -2.3271497e-05
3.8859038  5.097493e-05  -2.098615e-04  4.0775075e-04
    -4.931828e-04  4.1115898e-04  -2.4558321e-04
    1.0419056e-04  -2.8328286e-05  2.8093002e-06
4.4409766  4.477576e-06  -2.0810035e-05  4.620845e-05
    -6.493526e-05  6.439194e-05  -4.7448924e-05
    2.6550855e-05  -1.1270237e-05  3.2635944e-06
4.9515867  3.68054e-07  -1.8916821e-06  4.6834166e-06
    -7.4148547e-06  8.398012e-06  -7.2029356e-06
    4.8315505e-06  -2.598952e-06  1.0246124e-06
5.427009  2.8653103e-08  -1.6047102e-07  4.354393e-07
    -7.609695e-07  9.59827e-07  -9.2733274e-07
    7.1231403e-07  -4.5110968e-07  2.1368548e-07
""")
# tanh(x) = x + x^3 * P(x^2), |x| < 0.625; rel. error 4.4e-9
_TANH_T = 0.625
_TANH_P = (-0.3333328068256378, 0.1333143562078476, -0.053739115595817566,
           0.020637046545743942, -0.0057026115246117115)
# sin(r) = r + r^3 P(r^2), cos(r) = 1 - r^2/2 + r^4 Q(r^2), |r| <= pi/4
_SIN_P = (-0.16666653752326965, 0.008332150988280773, -0.0001951398007804528)
_COS_P = (0.04166664555668831, -0.0013887303648516536, 2.44316688622348e-05)
_2_OVER_PI = 0.6366197723675814
_PIO2_1 = 1.5707963705062866          # float(pi/2)
_PIO2_2 = -4.371139000186241e-08      # float(pi/2 - PIO2_1)
_PIO2_3 = -1.7151245100059206e-15     # float(pi/2 - PIO2_1 - PIO2_2)

# double kernels used by float32 pow
# ln(m) = 2s + s^3 R(s^2), s = (m-1)/(m+1), m in [sqrt(1/2), sqrt(2)); rel. error 3e-14
_DLOG_R = (0.6666666667581018, 0.3999999561625692, 0.2857210998144782,
           0.22176145591296964, 0.19584886442659083)
# 2^f = 1 + f*P(f), |f| <= 1/2; rel. error 7.8e-14
_DEXP2_P = (0.6931471805585395, 0.24022650695812922, 0.05550410874014466,
            0.009618129159488745, 0.0013333547291450366, 0.0001540345573357348,
            1.5258502526111923e-05, 1.3255263404806307e-06, 9.168548128407428e-08)
_MAGIC64 = 6755399441055744.0     # 1.5 * 2^52
_SQRT_HALF_BITS64 = 0x3FE6A09E667F3BCD


# ---------------------------------------------------------------------------
# float32 kernels
# ---------------------------------------------------------------------------

def _exp_reduced_f32(e: _E, xc: ir.Value, xlo: ir.Value | None = None,
                     coeffs: Sequence[float] = _EXP_P, negate: bool = False):
    """(p, k, magic + k): e^(xc + xlo) = p * 2^k, k = round(xc / ln2) as a float, p the
    polynomial of the reduced argument (in [sqrt(1/2), sqrt(2)]). ``negate``: of e^-xc
    instead, the reduction's constants negated (the negation folds into a vfnmsub)."""
    t = e.fma(xc, e.c(-_LOG2E if negate else _LOG2E), e.c(_MAGIC32))  # magic + round(x/ln2)
    kf = e.sub(t, e.c(_MAGIC32))
    r = e.fma(kf, e.c(-_LN2_HI), e.neg(xc) if negate else xc)         # exact
    r = e.fma(kf, e.c(-_LN2_LO), r)
    if xlo is not None:
        r = e.add(r, xlo)
    p = e.horner(r, coeffs)
    p = e.fma(p, r, e.c(1.0))
    p = e.fma(p, r, e.c(1.0))
    return p, kf, t


def _exp_f32(e: _E, x: ir.Value, xlo: ir.Value | None = None,
             special: bool = True, bounded: bool = False, scalef: bool = True,
             coeffs: Sequence[float] = _EXP_P, negate: bool = False) -> ir.Value:
    """e^(x + xlo); ``xlo`` is an optional tiny low part (|xlo| << ulp(1)).

    Results below 2^-150 (x < -103.97) are 0. Producing a denormal or an
    underflow costs a microcode assist (about 1.5x slower vectors), so lanes
    far below the threshold (masked softmax: exp(-1e4)) are computed on a
    dummy 0 and replaced; only genuinely denormal results pay.

    ``bounded``: the caller guarantees -87 <= x <= 88 or NaN, so no clamping,
    no special cases (NaN propagates by itself) and a single scaling.
    ``coeffs``: the polynomial of the reduced argument (_EXP_P, or the cheaper _EXP_P5).
    ``negate``: e^-x instead (bounded only, with -x within the bounds above).
    """
    assert bounded or not negate
    if scalef and e.has_scalef() and (bounded or xlo is None):
        # vscalefps applies 2^k with one rounding (denormal results, 0 below 2^-150 and
        # inf above the range included) and NaN propagates through it: only the
        # infinities need a clamp (the reduction turns them into NaN), and that keeps NaN.
        # (A low part of a clamped argument could be anything: those take the selects
        # below.)
        xc = x if bounded else e.clamp_keep_nan(x, -104.0, 89.0)
        p, kf, _ = _exp_reduced_f32(e, xc, xlo, coeffs, negate)
        return e.scalef(p, kf)
    if bounded:
        below = None
        xc = x
    else:
        below = e.cmp("<", x, e.c(-103.98))
        # above 89 the result overflows to inf by itself (no penalty); NaN is
        # clamped here and restored at the end
        xc = e.sel(below, e.c(0.0), e.min_c(x, 89.0))
    p, kf, t = _exp_reduced_f32(e, xc, xlo, coeffs, negate)
    ki = e.isub(e.bits(t), e.ci(_MAGIC32_BITS))    # k in [-150, 128]
    if bounded:                                    # k in [-126, 127]
        return e.mul(p, e.from_bits(e.ishl(e.iadd(ki, e.ci(127)), 23)))
    # 2^k as two normal powers of two, so denormal results round only once
    k1 = e.iashr(ki, 1)
    k2 = e.isub(ki, k1)
    s1 = e.from_bits(e.ishl(e.iadd(k1, e.ci(127)), 23))
    s2 = e.from_bits(e.ishl(e.iadd(k2, e.ci(127)), 23))
    res = e.sel(below, e.c(0.0), e.mul(e.mul(p, s1), s2))
    if special:
        res = e.sel(e.isnan(x), x, res)
    return res


def _log_core_f32(e: _E, x: ir.Value, denormals: bool = True) -> ir.Value:
    """ln(x) for positive finite x (garbage for other inputs)."""
    if denormals:
        small = e.cmp("<", x, e.c(_FLT_MIN))
        x = e.sel(small, e.mul(x, e.c(8388608.0)), x)              # * 2^23, exact
        ebias = e.sel(small, e.ci(-23), e.ci(0))
    bits = e.bits(x)
    ex = e.iashr(e.isub(bits, e.ci(0x3F3504F3)), 23)              # 0x3F3504F3 = sqrt(1/2)
    m = e.from_bits(e.isub(bits, e.ishl(ex, 23)))                 # m in [sqrt(1/2), sqrt(2))
    if denormals:
        ex = e.iadd(ex, ebias)
    f = e.sub(m, e.c(1.0))                                         # exact
    q = e.horner(f, _LOG_P)
    u = e.fma(q, f, e.c(-0.5))
    y = e.fma(e.mul(f, f), u, f)                                   # log1p(f)
    ef = e.sitofp(ex)
    return e.fma(ef, e.c(_LN2_HI), e.fma(ef, e.c(_LN2_LO), y))


def _log_f32(e: _E, x: ir.Value) -> ir.Value:
    res = _log_core_f32(e, x)
    res = e.sel(e.cmp("==", x, e.c(_INF)), e.c(_INF), res)
    res = e.sel(e.cmp("==", x, e.c(0.0)), e.c(-_INF), res)
    return e.sel(e.cmp("u<", x, e.c(0.0)), e.c(_NAN), res)        # x < 0 or NaN


def _log1p_parts_f32(e: _E, u: ir.Value, u_le_1: bool):
    """log1p(u) for u > -1 via log(1+u) plus the rounding error of 1+u."""
    w = e.add(e.c(1.0), u)
    wm1 = e.sub(w, e.c(1.0))
    if u_le_1:                                  # |u| <= 1: Fast2Sum is exact
        corr = e.sub(u, wm1)
    else:                                       # TwoSum
        a = e.sub(w, wm1)
        corr = e.add(e.sub(e.c(1.0), a), e.sub(u, wm1))
    return w, e.add(_log_core_f32(e, w, denormals=False), e.div(corr, w))


def _log1p_f32(e: _E, x: ir.Value) -> ir.Value:
    w, res = _log1p_parts_f32(e, x, u_le_1=False)
    res = e.sel(e.cmp("==", x, e.c(_INF)), e.c(_INF), res)
    res = e.sel(e.cmp("==", w, e.c(0.0)), e.c(-_INF), res)
    res = e.sel(e.cmp("u<", x, e.c(-1.0)), e.c(_NAN), res)        # x < -1 or NaN
    return e.sel(e.cmp("==", x, e.c(0.0)), x, res)                 # keeps -0


def _softplus_f32(e: _E, x: ir.Value) -> ir.Value:
    # max(x, 0) + log1p(exp(-|x|)); exact tail e^x for very negative x. (The exp's
    # integer scaling, not vscalefps: with it softplus ran 0.8 Gelem/s instead of 1.25 on
    # Zen 4, tests/codegen/test_vmath.py's throughput table, L2-resident)
    u = _exp_f32(e, e.neg(e.fabs(x)), special=False, scalef=False)
    _, lp = _log1p_parts_f32(e, u, u_le_1=True)
    res = e.add(e.sel(e.cmp(">", x, e.c(0.0)), x, e.c(0.0)), lp)
    return e.sel(e.isnan(x), x, res)


def _erf_parts_f32(e: _E, a: ir.Value, scaled: ir.Value | None = None):
    """For a = |x| >= 0: (is_small, erf(a) for a < 0.875, erfc(a) for a >= 0.875).

    With ``scaled`` = |v| where a = round(|v| / sqrt(2)), a^2 is taken as
    v^2 / 2 exactly: erfc(a) is ill-conditioned in a (relative condition
    ~2a^2), so the rounding of a itself would cost up to ~30 ulp.
    """
    small = e.cmp("<", a, e.c(_ERF_T))
    ps = e.horner(e.mul(a, a), _ERF_SMALL)          # erf(a) = a * ps
    ac = e.max_c(e.min_c(a, _ERFC_U), _ERF_T)
    if scaled is None:
        hi = e.mul(ac, ac)
        lo = e.fma(ac, ac, e.neg(hi))               # ac^2 = hi + lo exactly
    else:
        vc = e.max_c(e.min_c(scaled, _ERFC_U * _SQRT2), _ERF_T * _SQRT2)
        hi = e.mul(vc, vc)
        lo = e.mul(e.fma(vc, vc, e.neg(hi)), e.c(0.5))
        hi = e.mul(hi, e.c(0.5))                    # (vc/sqrt2)^2 = hi + lo exactly
    g = e.horner(e.sub(ac, e.c(_ERFC_C)), _ERFC_G)  # log(erfc(ac) * e^(ac^2))
    # s + t = g - hi exactly (Fast2Sum, |hi| >= |g| on this interval)
    nhi = e.neg(hi)
    s = e.add(nhi, g)
    t = e.sub(g, e.sub(s, nhi))
    ec = _exp_f32(e, s, xlo=e.sub(t, lo), bounded=True)       # s in [-18, 0]
    ec = e.sel(e.cmp(">=", a, e.c(_ERFC_U)), e.c(0.0), ec)
    return small, ps, ec


def _erf_f32(e: _E, x: ir.Value) -> ir.Value:
    a = e.fabs(x)
    small, ps, ec = _erf_parts_f32(e, a)
    res = e.sel(small, e.mul(x, ps), e.copysign(e.sub(e.c(1.0), ec), x))
    return e.sel(e.isnan(x), x, res)


def _table_picker(e: _E, t: ir.Value) -> Callable[[Sequence[float]], ir.Value]:
    """For t >= 0 (a <16 x float>, each lane its row index plus a fraction): a function
    from a table column to the vector of each lane's entry. With AVX-512, a column of 32
    by vpermt2ps from two registers; with AVX2, of 8 by vpermps on each ymm half. Lanes
    whose t is NaN, infinite or past the table pick some row (the caller replaces them):
    cvttps2dq gives 0x80000000 there, and the permutes read only the low index bits."""
    i32 = ir.IntType(32)
    if e.avx512_vector():
        vi = e.ity
        cvt = e.b.module.declare_intrinsic(
            "llvm.x86.avx512.mask.cvttps2dq.512", fnty=ir.FunctionType(vi, [
                e.ty, vi, ir.IntType(16), i32]))
        perm = e.b.module.declare_intrinsic(
            "llvm.x86.avx512.vpermi2var.ps.512", fnty=ir.FunctionType(e.ty, [e.ty, vi, e.ty]))
        idx = e.b.call(cvt, [t, ir.Constant(vi, None), ir.Constant(ir.IntType(16), -1),
                             ir.Constant(i32, 4)])
        return lambda col: e.b.call(perm, [ir.Constant(e.ty, list(col[:16])), idx,
                                           ir.Constant(e.ty, list(col[16:]))])
    v8, vi8 = ir.VectorType(F32, 8), ir.VectorType(i32, 8)
    cvt = e.b.module.declare_intrinsic("llvm.x86.avx.cvtt.ps2dq.256",
                                       fnty=ir.FunctionType(vi8, [v8]))
    perm = e.b.module.declare_intrinsic("llvm.x86.avx2.permps",
                                        fnty=ir.FunctionType(v8, [v8, vi8]))
    idx = [e.b.call(cvt, [h]) for h in e.halves(t)]

    def pick(col: Sequence[float]) -> ir.Value:
        c = ir.Constant(v8, list(col))
        return e.joined(*(e.b.call(perm, [c, i]) for i in idx))
    return pick


def _gelu_erf_table_f32(e: _E, x: ir.Value) -> ir.Value:
    """gelu_erf of a <16 x float> with AVX-512 or AVX2: x (1 - H(|x|)) for x >= 0, x H(|x|)
    below, H = erfc(|x| / sqrt2) / 2 from a table of polynomials, each lane's interval row
    picked by permutes (_table_picker): with AVX-512 _GELU_TAB (32 rows of degree 5: 7
    multiplies or FMAs and 7 vpermt2ps a vector), with AVX2 _GELU_TAB8 (8 rows of degree 8:
    10 vpermps and 9 FMAs a ymm), where the exp-based form below takes ~30 multiplies or
    FMAs and a division. Zen 4 runs one zmm FMA (or vpermt2ps) a cycle, and in a GEMM's
    epilogue the activation competes with the products for it. H is 0 from 4 sqrt2 on
    (gelu is then -0 or x), for NaN (which the last product keeps) and for +-inf (gelu(-inf)
    is NaN, as the formula gives)."""
    ax = e.fabs(x)
    if e.avx512_vector():
        tab = _GELU_TAB
        pick = _table_picker(e, e.mul(ax, e.c(len(tab) / _GELU_TAB_U)))
    else:
        tab = _GELU_TAB8
        y = e.fma(ax, e.mul(ax, e.c(0.25)), ax)            # u (1 + u/4)
        pick = _table_picker(e, e.mul(y, e.c(_GELU_TAB8_SCALE)))
    r = e.sub(ax, pick([row[0] for row in tab]))
    h = e.horner(r, [pick([row[j] for row in tab]) for j in range(1, len(tab[0]))])
    h = e.sel(e.cmp("<", ax, e.c(_GELU_TAB_U)), h, e.c(0.0))
    return e.mul(x, e.sel(e.cmp(">=", x, e.c(0.0)), e.sub(e.c(1.0), h), h))


def _has_table_permutes(e: _E) -> bool:
    """The permutes _table_picker uses apply: a <16 x float> with AVX-512, or with AVX2."""
    from ..native.target import host
    return e.ty == _V16F and (host().has("avx512f") or host().has("avx2"))


def _gelu_erf_f32(e: _E, x: ir.Value) -> ir.Value:
    if _has_table_permutes(e):
        return _gelu_erf_table_f32(e, x)
    # 0.5 * x * (1 + erf(z)), z = x/sqrt2: the bracket is 2 - erfc(|z|) for z >= 0 and
    # erfc(|z|) for z < 0 (no cancellation in the left tail), so one branch-free
    # erfc(a) = t P(t) e^(-a^2), t = 1/(1 + p a), serves every lane (no erf branch for
    # small |z|: near 0 the bracket is ~1 and erfc's relative error suffices).
    # a^2 is taken as x^2 / 2 in two parts (see _erf_parts_f32: erfc is ill-conditioned
    # in a). erfc(a >= 4) < ulp(1)/4 is taken as 0 (gelu is -0 below x = -5.657).
    ax = e.fabs(x)
    t = e.recip(e.fma(ax, e.c(_GELU_T_P * 0.7071067811865476), e.c(1.0)))  # 1 + p |z|
    q = e.mul(t, e.horner(t, _GELU_T))              # erfc(a) e^(a^2)
    vc = e.min_c(ax, _ERFC_U * _SQRT2)
    hi = e.mul(vc, vc)
    lo = e.mul(e.fma(vc, vc, e.neg(hi)), e.c(-0.5))
    hi = e.mul(hi, e.c(-0.5))                       # -(vc/sqrt2)^2 = hi + lo exactly
    ec = e.mul(q, _exp_f32(e, hi, xlo=lo, bounded=True))     # hi in [-16, 0]
    ec = e.sel(e.cmp("<", ax, e.c(_ERFC_U * _SQRT2)), ec, e.c(0.0))
    br = e.sel(e.cmp(">=", x, e.c(0.0)), e.sub(e.c(2.0), ec), ec)
    # NaN x: 0.5 x is NaN whatever the bracket
    return e.mul(e.mul(x, e.c(0.5)), br)


def _tanh_f32(e: _E, x: ir.Value) -> ir.Value:
    a = e.fabs(x)
    x2 = e.mul(x, x)
    # copysign keeps tanh(-0) = -0 (x + x^3 P gives +0 there)
    ts = e.copysign(e.fma(e.mul(x, x2), e.horner(x2, _TANH_P), x), x)
    # 1 - 2/(e^(2a) + 1); a is capped at 10 (tanh(10) rounds to 1) so that
    # 2/(e^(2a) + 1) never becomes denormal (a slow microcode assist); the
    # cap keeps NaN, which then propagates
    a2 = e.add(a, a)
    cap = e.c(20.0)
    ex = _exp_f32(e, e.sel(e.cmp(">", a2, cap), cap, a2), bounded=True)
    tl = e.sub(e.c(1.0), e.div(e.c(2.0), e.add(ex, e.c(1.0))))
    return e.sel(e.cmp("<", a, e.c(_TANH_T)), ts, e.copysign(tl, x))


def _sigmoid_f32(e: _E, x: ir.Value, xlo: ir.Value | None = None) -> ir.Value:
    """sigmoid(x + xlo), xlo an optional tiny low part."""
    if e.has_scalef() and xlo is None:
        # 1 / (1 + e^-x), e^-x scaled by vscalefps. x is clamped to [-89, 104] (NaN kept;
        # the reduction needs finite arguments): below x = -88.72 e^-x overflows to inf
        # and the result is 0 (sigmoid is denormal there, below 6.1e-39). No |x| and no
        # select between 1 and e^-|x| by the sign: where x < 0 the relative error of e^-x
        # reaches the result damped by e^-x / (1 + e^-x) < 1. Zen 4: 3.44 -> 4.07 Gelem/s
        # (test_vmath.py's table, L2-resident); EfficientNet-B0, whose SiLUs were ~17% of
        # its time, x0.97 at 1 core. The exp polynomial one degree lower (rel. error
        # 1.5e-7 -> 2.4e-7): 4.07 -> 4.44 Gelem/s, EfficientNet-B0 x0.98-0.99
        xc = e.clamp_keep_nan(x, -89.0, 104.0)
        # (gelu_tanh's x * sigmoid(w + wl), with its pair, keeps the form below: x * e^w is
        # normal down to w = -92, where e^-w overflows)
        p, kf, _ = _exp_reduced_f32(e, e.neg(xc), coeffs=_EXP_P5)
        return e.div(e.c(1.0), e.add(e.c(1.0), e.scalef(p, kf)))
    if xlo is None and e.ty == _V16F and not _has_avx512():
        # AVX2: 1 / (1 + e^-x) as above, e^-x by the bounded exp (one scaling: x clamped
        # to [-88, 87.3], NaN kept; the reduction negates its constants, not x, one
        # instruction fewer a ymm half) and the reciprocal by vrcpps and a Newton step,
        # not vdivps. Below x = -87.3 the result is denormal in exact arithmetic; here it
        # is 0 (vrcpps flushes 1/a < 2^-126). Zen 4 under CANNC_ISA=avx2: 0.96 -> 2.90
        # Gelem/s (test_vmath's table, L2-resident); EfficientNet-B0 x0.86 at 1 core
        # (with pool.UNROLL_CHUNKS), its SiLUs following every conv
        ex = _exp_f32(e, e.clamp_keep_nan(x, -88.0, 87.3), bounded=True, coeffs=_EXP_P5,
                      negate=True)
        return e.recip_fast(e.add(e.c(1.0), ex))
    # t = e^-|x|;  x >= 0: 1/(1+t),  x < 0: t/(1+t)  (no overflow, no cancellation)
    if xlo is None:
        # beyond |x| = 104.5 e^-|x| rounds to 0: |x| is clamped there (NaN kept, and it
        # propagates through the exp and the division)
        a = e.fabs(x)
        ac = e.sel(e.cmp(">", a, e.c(104.5)), e.c(104.5), a)
        if e.has_scalef():
            # e^-|x| = p 2^k, the 2^k applied by vscalefps (one rounding, denormal tails
            # included)
            p, kf, _ = _exp_reduced_f32(e, e.neg(ac))
            t = e.scalef(p, kf)
        else:
            # the bounded exp (one scaling, no special cases: 30% faster); where e^-|x| is
            # denormal (|x| > 87.3) it takes 18 - |x| (exact) and the result is scaled by
            # e^-18
            far = e.cmp(">", a, e.c(87.3))
            t = _exp_f32(e, e.sub(e.sel(far, e.c(18.0), e.c(0.0)), ac), bounded=True)
            t = e.sel(far, e.mul(t, e.c(math.exp(-18.0))), t)
    else:
        neg = e.cmp("<", x, e.c(0.0))
        t = _exp_f32(e, e.neg(e.fabs(x)), xlo=e.sel(neg, xlo, e.neg(xlo)))
    num = e.sel(e.cmp("u>=", x, e.c(0.0)), e.c(1.0), t)
    return e.div(num, e.add(e.c(1.0), t))


def _split_f32(v: float) -> tuple[float, float]:
    hi = struct.unpack("f", struct.pack("f", v))[0]
    return hi, v - hi


def _gelu_tanh_f32(e: _E, x: ir.Value) -> ir.Value:
    # 0.5x(1 + tanh(z)) = x * sigmoid(w), w = 2z = x (A + B x^2).
    # In the left tail the result is ~e^w with |w| up to ~90, so w must be
    # known to ~1e-9 relative (plain float costs up to ~30 ulp there): w is
    # formed as a float pair (error-free products with fma, TwoSum) and the
    # pair goes to the exponential.
    c = math.sqrt(2.0 / math.pi)
    ah, al = _split_f32(2.0 * c)
    bh, bl = _split_f32(2.0 * c * 0.044715)
    h = e.mul(x, x)
    lo = e.fma(x, x, e.neg(h))                        # x^2 = h + lo
    p = e.mul(e.c(bh), h)
    pe = e.fma(e.c(bh), h, e.neg(p))                  # bh*h = p + pe
    kh = e.add(e.c(ah), p)                            # TwoSum(ah, p)
    bb = e.sub(kh, e.c(ah))
    err = e.add(e.sub(e.c(ah), e.sub(kh, bb)), e.sub(p, bb))
    kl = e.add(e.fma(e.c(bh), lo, e.fma(e.c(bl), h, pe)), e.add(err, e.c(al)))
    w = e.mul(x, kh)                                  # x * (kh + kl)
    wl = e.fma(x, kl, e.fma(x, kh, e.neg(w)))
    return e.mul(x, _sigmoid_f32(e, w, wl))


def _sincos_f32(e: _E, x: ir.Value, is_cos: bool) -> ir.Value:
    t = e.fma(x, e.c(_2_OVER_PI), e.c(_MAGIC32))
    kf = e.sub(t, e.c(_MAGIC32))
    q = e.bits(t)                                   # low bits: k mod 4
    if is_cos:
        q = e.iadd(q, e.ci(1))                      # cos(x) = sin(x + pi/2)
    r = e.fma(kf, e.c(-_PIO2_1), x)
    r = e.fma(kf, e.c(-_PIO2_2), r)
    r = e.fma(kf, e.c(-_PIO2_3), r)
    # |r| exceeds pi/4 by up to ~3e-8 |x| (k comes from a rounded x * 2/pi);
    # the polynomials are fitted up to 1.002 pi/4, so |x| <= 5e4 is served.
    # Beyond, clamping keeps the result bounded (the polynomials would
    # overflow to inf/NaN for huge x); NaN still propagates.
    lim = e.c(0.7869724)
    r = e.sel(e.cmp(">", r, lim), lim, r)
    r = e.sel(e.cmp("<", r, e.neg(lim)), e.neg(lim), r)
    r2 = e.mul(r, r)
    s = e.fma(e.mul(r, r2), e.horner(r2, _SIN_P), r)
    c = e.fma(r2, e.fma(r2, e.horner(r2, _COS_P), e.c(-0.5)), e.c(1.0))
    odd = e.b.icmp_unsigned("!=", e.iand(q, e.ci(1)), e.ci(0))
    res = e.sel(odd, c, s)
    sign = e.ishl(e.iand(q, e.ci(2)), 30)           # quadrants 2, 3: negate
    res = e.from_bits(e.ixor(e.bits(res), sign))
    if not is_cos:                                  # sin(-0) = -0 (r loses the sign)
        res = e.sel(e.cmp("==", x, e.c(0.0)), x, res)
    return res


# ---------------------------------------------------------------------------
# double helpers for float32 pow
# ---------------------------------------------------------------------------

def _log2_f64(d: _E, a: ir.Value) -> ir.Value:
    """log2(a) for a >= 0 (0 -> -inf, inf -> inf, NaN -> NaN); no denormals."""
    bits = d.bits(a)
    ex = d.iashr(d.isub(bits, d.ci(_SQRT_HALF_BITS64)), 52)
    m = d.from_bits(d.isub(bits, d.ishl(ex, 52)))
    s = d.div(d.sub(m, d.c(1.0)), d.add(m, d.c(1.0)))
    s2 = d.mul(s, s)
    ln_m = d.fma(d.mul(s, s2), d.horner(s2, _DLOG_R), d.add(s, s))
    res = d.fma(ln_m, d.c(_LOG2E), d.sitofp(ex))
    res = d.sel(d.cmp("==", a, d.c(0.0)), d.c(-_INF), res)
    res = d.sel(d.cmp("==", a, d.c(_INF)), d.c(_INF), res)
    return d.sel(d.isnan(a), a, res)


def _exp2_f64(d: _E, z: ir.Value) -> ir.Value:
    """2^z with |rel. error| ~1e-13, for results to be rounded to float32."""
    zc = d.max_c(d.min_c(z, 130.0), -160.0)
    t = d.add(zc, d.c(_MAGIC64))
    kf = d.sub(t, d.c(_MAGIC64))
    f = d.sub(zc, kf)                                      # exact, |f| <= 1/2
    p = d.fma(d.horner(f, _DEXP2_P), f, d.c(1.0))
    ki = d.isub(d.bits(t), d.bits(d.c(_MAGIC64)))
    scale = d.from_bits(d.ishl(d.iadd(ki, d.ci(1023)), 52))
    return d.sel(d.isnan(z), z, d.mul(p, scale))


def _const_value(y: ir.Value) -> float | None:
    """The common value of a (splat) float constant, else None."""
    if not isinstance(y, ir.Constant):
        return None
    v = y.constant
    if isinstance(v, (list, tuple)):
        vals = [c.constant if isinstance(c, ir.Constant) else c for c in v]
        if not vals or any(not isinstance(c, (int, float)) for c in vals):
            return None
        if any(c != vals[0] for c in vals):
            return None
        return float(vals[0])
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _pow_f32(e: _E, x: ir.Value, y: ir.Value) -> ir.Value:
    b = e.b
    dty = _like(e.ty, F64)
    d = _E(b, dty)
    ax = e.fabs(x)
    l2 = _log2_f64(d, b.fpext(ax, dty))
    z = d.mul(b.fpext(y, dty), l2)
    res = b.fptrunc(_exp2_f64(d, z), e.ty)
    # sign and domain
    ty_ = e.trunc(y)
    y_int = e.cmp("==", ty_, y)                      # true for +-inf, false for NaN
    hy = e.mul(y, e.c(0.5))
    y_odd = b.and_(y_int, e.cmp("!=", e.trunc(hy), hy))
    x_neg = e.b.icmp_signed("<", e.bits(x), e.ci(0))  # sign bit, includes -0
    res = e.sel(b.and_(x_neg, y_odd), e.neg(res), res)
    bad = b.and_(b.and_(e.cmp("<", x, e.c(0.0)), e.cmp("!=", x, e.c(-_INF))),
                 b.xor(y_int, splat(I1, 1, y_int)))
    res = e.sel(bad, e.c(_NAN), res)
    one = b.or_(e.cmp("==", y, e.c(0.0)), e.cmp("==", x, e.c(1.0)))
    one = b.or_(one, b.and_(e.cmp("==", x, e.c(-1.0)), e.cmp("==", e.fabs(y), e.c(_INF))))
    return e.sel(one, e.c(1.0), res)


# ---------------------------------------------------------------------------
# double versions (accurate, scalar libm / intrinsics)
# ---------------------------------------------------------------------------

def _exp_f64(e: _E, x): return call_intrinsic(e.b, "llvm.exp", [x])
def _log_f64(e: _E, x): return call_intrinsic(e.b, "llvm.log", [x])
def _erf_f64(e: _E, x): return _libm_call(e.b, "erf", x)
def _log1p_f64(e: _E, x): return _libm_call(e.b, "log1p", x)


def _tanh_f64(e: _E, x):
    return call_intrinsic(e.b, "llvm.tanh", [x])


def _sigmoid_f64(e: _E, x):
    t = _exp_f64(e, e.neg(e.fabs(x)))
    num = e.sel(e.cmp("u>=", x, e.c(0.0)), e.c(1.0), t)
    return e.div(num, e.add(e.c(1.0), t))


def _gelu_erf_f64(e: _E, x):
    z = e.mul(x, e.c(0.7071067811865476))
    br = e.sel(e.cmp("u>=", z, e.c(0.0)),
               e.add(e.c(1.0), _libm_call(e.b, "erf", z)),
               _libm_call(e.b, "erfc", e.neg(z)))
    return e.mul(e.mul(x, e.c(0.5)), br)


def _gelu_tanh_f64(e: _E, x):
    c = math.sqrt(2.0 / math.pi)
    k = e.fma(e.mul(x, x), e.c(2.0 * c * 0.044715), e.c(2.0 * c))
    return e.mul(x, _sigmoid_f64(e, e.mul(x, k)))


def _softplus_f64(e: _E, x):
    u = _exp_f64(e, e.neg(e.fabs(x)))
    res = e.add(e.sel(e.cmp(">", x, e.c(0.0)), x, e.c(0.0)), _log1p_f64(e, u))
    return e.sel(e.isnan(x), x, res)


def _sin_f64(e: _E, x): return call_intrinsic(e.b, "llvm.sin", [x])
def _cos_f64(e: _E, x): return call_intrinsic(e.b, "llvm.cos", [x])


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------

def exp(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """e^x."""
    return _dispatch(builder, x, _exp_f32, _exp_f64)


def log(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Natural logarithm."""
    return _dispatch(builder, x, _log_f32, _log_f64)


def log1p(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """log(1 + x), accurate for small x."""
    return _dispatch(builder, x, _log1p_f32, _log1p_f64)


def erf(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """The error function."""
    return _dispatch(builder, x, _erf_f32, _erf_f64)


def tanh(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Hyperbolic tangent (relative-accurate near 0, saturates to +-1)."""
    return _dispatch(builder, x, _tanh_f32, _tanh_f64)


def sigmoid(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """1 / (1 + e^-x), accurate in both tails."""
    return _dispatch(builder, x, _sigmoid_f32, _sigmoid_f64)


def gelu_erf(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """0.5 * x * (1 + erf(x / sqrt(2))) (gelu(-inf) is NaN, as the formula gives)."""
    return _dispatch(builder, x, _gelu_erf_f32, _gelu_erf_f64)


def gelu_tanh(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))."""
    return _dispatch(builder, x, _gelu_tanh_f32, _gelu_tanh_f64)


def softplus(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """log(1 + e^x), without overflow and exact in the left tail."""
    return _dispatch(builder, x, _softplus_f32, _softplus_f64)


log1p_exp = softplus


def sin(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Sine (float32: good for |x| < 1e4)."""
    return _dispatch(builder, x, lambda e, v: _sincos_f32(e, v, False), _sin_f64)


def cos(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Cosine (float32: good for |x| < 1e4)."""
    return _dispatch(builder, x, lambda e, v: _sincos_f32(e, v, True), _cos_f64)


sqrt = _intrinsic_unary("llvm.sqrt")
floor = _intrinsic_unary("llvm.floor")
ceil = _intrinsic_unary("llvm.ceil")
trunc = _intrinsic_unary("llvm.trunc")
fabs = _intrinsic_unary("llvm.fabs")
round_even = _intrinsic_unary("llvm.roundeven")
sqrt.__doc__ = "Square root (llvm.sqrt)."
floor.__doc__ = "Round toward -inf."
ceil.__doc__ = "Round toward +inf."
trunc.__doc__ = "Round toward zero."
fabs.__doc__ = "Absolute value."
round_even.__doc__ = "Round to nearest, ties to even (numpy.round)."


def rsqrt(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """1 / sqrt(x), correctly rounded divide (rsqrt(0) = inf, rsqrt(-0) = -inf)."""
    s = sqrt(builder, x)
    return builder.fdiv(splat(builder, 1.0, x), s)


def pow(builder: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    """x ** y with C99 / numpy semantics.

    Negative bases with integer exponents give signed results ((-2)^3 = -8),
    negative bases with non-integer exponents NaN, pow(x, 0) = pow(1, y) = 1
    even for NaN. Splat-constant exponents 0, 1, 2, 3, -1 and 0.5 are
    strength-reduced.
    """
    if x.type != y.type:
        raise TypeError(f"vmath.pow: operand types differ: {x.type} vs {y.type}")
    fe = _elem(x.type)
    if not isinstance(fe, (ir.FloatType, ir.DoubleType)) and not _is_half_like(fe):
        raise TypeError(f"vmath: unsupported type {x.type}")
    cy = _const_value(y)
    if cy is not None:
        if cy == 0.0:
            return splat(builder, 1.0, x)
        if cy == 1.0:
            return x
        if cy == 2.0:
            return builder.fmul(x, x)
        if cy == 3.0:
            return builder.fmul(builder.fmul(x, x), x)
        if cy == -1.0:
            return builder.fdiv(splat(builder, 1.0, x), x)
        if cy == 0.5:
            # sqrt(-0) = -0 but pow(-0, .5) = +0; pow(-inf, .5) = +inf
            s = builder.fadd(sqrt(builder, x), splat(builder, 0.0, x))
            is_ninf = builder.fcmp_ordered("==", x, splat(builder, -_INF, x))
            return builder.select(is_ninf, splat(builder, _INF, x), s)
    if isinstance(fe, ir.FloatType):
        return _pow_f32(_E(builder, x.type), x, y)
    if isinstance(fe, ir.DoubleType):
        return call_intrinsic(builder, "llvm.pow", [x, y])
    wide = _like(x.type, F32)
    r = _pow_f32(_E(builder, wide), builder.fpext(x, wide), builder.fpext(y, wide))
    return builder.fptrunc(r, x.type)
