"""Bit-level conversions between float32 and the formats narrower than 16 bits.

float8 (E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ, E8M0) and float4 (E2M1) are stored one code
per byte (ml_dtypes' representation) and held inside expressions as float32 values
that lie on the format's grid (NaN and inf included where the format has them), the
way bfloat16 is held as float. Sub-byte integers (int4, uint4, int2, uint2) are stored
one per byte in the low bits and held as i8 values (sign- or zero-extended).

Every function works on scalars and on vectors alike: integer and float operations
and selects, no table lookups and no calls, so the loops around them vectorise.

Rounding follows ONNX's Cast (whose reference is ml_dtypes): round to nearest even;
a magnitude that rounds above the largest finite value overflows (to inf for E5M2,
NaN for E4M3FN and the FNUZ formats);
`saturate` clamps to the largest finite value first (NaN stays NaN); E2M1 always
saturates (it has neither inf nor NaN). E8M0 follows onnx.numpy_helper.to_float8e8m0
(round_mode up / down / nearest on the float32 exponent).
"""

from __future__ import annotations

import struct

import llvmlite.ir as ir

from ..ir.types import SmallFloat
from ..native import emit


def _ty(v: ir.Value, elem: ir.Type) -> ir.Type:
    return ir.VectorType(elem, v.type.count) if isinstance(v.type, ir.VectorType) else elem


def _c(v: int | float, t: ir.Type) -> ir.Constant:
    return emit.const_like(v, t)


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def small_to_f32(b: ir.IRBuilder, code: ir.Value, fmt: SmallFloat) -> ir.Value:
    """i8 codes (scalar or vector) of `fmt` -> float32 (exact)."""
    i32, f32 = _ty(code, emit.I32), _ty(code, emit.F32)
    c = b.zext(code, i32)
    if fmt.kind == "e8m0":
        # 2**(c - 127): the float32 exponent field; c = 0 is the subnormal 2**-127
        bits = b.select(b.icmp_unsigned("==", c, _c(0, i32)), _c(0x400000, i32),
                        b.shl(c, _c(23, i32)))
        bits = b.select(b.icmp_unsigned("==", c, _c(0xFF, i32)), _c(0x7FC00000, i32), bits)
        return b.bitcast(bits, f32)
    m, nb = fmt.mbits, fmt.nbits
    sign_bit = 1 << (nb - 1)
    mag = b.and_(c, _c(sign_bit - 1, i32))
    sign = b.shl(b.and_(c, _c(sign_bit, i32)), _c(32 - nb, i32))
    # normal: rebias the exponent, widen the mantissa
    normal = b.add(b.shl(mag, _c(23 - m, i32)), _c((127 - fmt.bias) << 23, i32))
    # subnormal (exponent 0): mantissa * 2**(1 - bias - m), exact in float32
    mant = b.and_(mag, _c((1 << m) - 1, i32))
    sub = b.fmul(b.uitofp(mant, f32), _c(2.0 ** (1 - fmt.bias - m), f32))
    is_sub = b.icmp_unsigned("<", mag, _c(1 << m, i32))
    bits = b.or_(b.select(is_sub, b.bitcast(sub, i32), normal), sign)
    nan = _c(0x7FC00000, i32)
    if fmt.kind == "fn":        # S.1111.111 is NaN
        bits = b.select(b.icmp_unsigned("==", mag, _c(sign_bit - 1, i32)), b.or_(nan, sign),
                        bits)
    elif fmt.kind == "ieee":    # top exponent: inf (mantissa 0) or NaN
        top = ((1 << fmt.ebits) - 1) << m
        is_top = b.icmp_unsigned(">=", mag, _c(top, i32))
        special = b.select(b.icmp_unsigned("==", mag, _c(top, i32)),
                           _c(0x7F800000, i32), nan)
        bits = b.select(is_top, b.or_(special, sign), bits)
    elif fmt.kind == "fnuz":    # 0x80 (negative zero's code) is the one NaN
        bits = b.select(b.icmp_unsigned("==", c, _c(sign_bit, i32)), nan, bits)
    return b.bitcast(bits, f32)


def f32_to_small(b: ir.IRBuilder, v: ir.Value, fmt: SmallFloat, saturate: bool = True,
                 round_mode: str = "up") -> ir.Value:
    """float32 (scalar or vector) -> i8 codes of `fmt`, rounded as ONNX's Cast does."""
    i32, i8 = _ty(v, emit.I32), _ty(v, emit.I8)
    if fmt.kind == "e8m0":
        return b.trunc(_f32_to_e8m0(b, v, saturate, round_mode), i8)
    f32 = v.type
    m, nb = fmt.mbits, fmt.nbits
    mx = fmt.max
    bits = b.bitcast(v, i32)
    sign = b.and_(b.lshr(bits, _c(32 - nb, i32)), _c(1 << (nb - 1), i32))
    av = emit.intrinsic(b, "llvm.fabs", [v])
    if saturate or fmt.kind == "sat":
        # clamp the magnitude (an ordered compare: NaN stays NaN, inf becomes max)
        av = b.select(b.fcmp_ordered(">", av, _c(mx, f32)), _c(mx, f32), av)
    a = b.bitcast(av, i32)
    shift = 23 - m
    # normal range: round the float32 mantissa to m bits (to nearest even), rebias
    odd = b.and_(b.lshr(a, _c(shift, i32)), _c(1, i32))
    r = b.lshr(b.add(b.add(a, _c((1 << (shift - 1)) - 1, i32)), odd), _c(shift, i32))
    normal = b.sub(r, _c((127 - fmt.bias) << m, i32))
    # below the smallest normal: adding 2**(24 - bias - m) rounds to the subnormal grid
    # (the hardware's round-to-nearest-even) and leaves the code in the low bits
    magic = 2.0 ** (24 - fmt.bias - m)
    s = b.fadd(av, _c(magic, f32))
    sub = b.sub(b.bitcast(s, i32), _c(_f32_bits(magic), i32))
    min_normal = (127 + 1 - fmt.bias) << 23
    code = b.select(b.icmp_unsigned("<", a, _c(min_normal, i32)), sub, normal)
    if fmt.kind == "sat":
        # NaN (no code for it): a zero of the opposite sign, as ml_dtypes gives
        code = b.or_(code, sign)
        nan_code = b.xor(sign, _c(1 << (nb - 1), i32))
        code = b.select(b.fcmp_unordered("uno", v, v), nan_code, code)
        return b.trunc(code, i8)
    # overflow: beyond the midpoint between max and the next grid point, or on it when
    # max's code is odd (the tie goes to the even code above: E5M2, the FNUZ formats)
    over_at = _f32_bits(mx) + (1 << (shift - 1))
    max_odd = (_f32_bits(mx) >> shift) & 1
    over = b.icmp_unsigned(">=" if max_odd else ">", a, _c(over_at, i32))  # inf, NaN too
    is_nan = b.icmp_unsigned(">", a, _c(0x7F800000, i32))
    top = (1 << (nb - 1)) - 1                               # S.111...1
    if fmt.kind == "fn":
        code = b.select(over, _c(top, i32), code)           # NaN (no inf)
        return b.trunc(b.or_(code, sign), i8)
    if fmt.kind == "ieee":
        inf = ((1 << fmt.ebits) - 1) << m
        code = b.select(over, _c(inf, i32), code)
        code = b.select(is_nan, _c(inf + (1 << (m - 1)), i32), code)
        return b.trunc(b.or_(code, sign), i8)
    # fnuz: one NaN (0x80) for NaN and overflow; no negative zero
    zero = b.icmp_unsigned("==", code, _c(0, i32))
    code = b.or_(code, b.select(zero, _c(0, i32), sign))
    code = b.select(over, _c(1 << (nb - 1), i32), code)
    return b.trunc(code, i8)


def _f32_to_e8m0(b: ir.IRBuilder, v: ir.Value, saturate: bool, round_mode: str) -> ir.Value:
    """onnx.numpy_helper.to_float8e8m0 on float32 bits (the sign is ignored)."""
    i32 = _ty(v, emit.I32)
    bits = b.bitcast(v, i32)
    exp = b.and_(b.lshr(bits, _c(23, i32)), _c(0xFF, i32))
    special = b.icmp_unsigned("==", exp, _c(0xFF, i32))
    if round_mode == "down":
        up = None
    elif round_mode == "up":
        up = b.icmp_unsigned("!=", b.and_(bits, _c(0x7FFFFF, i32)), _c(0, i32))
    elif round_mode == "nearest":
        nz = lambda mask: b.icmp_unsigned("!=", b.and_(bits, _c(mask, i32)), _c(0, i32))
        g, r, s = nz(0x400000), nz(0x200000), nz(0x1FFFFF)
        lsb = b.icmp_unsigned(">", exp, _c(0, i32))
        up = b.and_(g, b.or_(b.or_(r, s), lsb))
    else:
        raise ValueError(f"round_mode {round_mode!r}")
    if up is not None:
        if saturate:
            up = b.and_(up, b.icmp_unsigned("!=", exp, _c(0xFE, i32)))
        exp = b.add(exp, b.zext(up, i32))
    return b.select(special, _c(0xFF, i32), exp)


def round_to_small(b: ir.IRBuilder, v: ir.Value, fmt: SmallFloat, saturate: bool = True,
                   round_mode: str = "up") -> ir.Value:
    """A float32 rounded to `fmt`, kept as float32 (the expression representation)."""
    return small_to_f32(b, f32_to_small(b, v, fmt, saturate, round_mode), fmt)


def encode_small(b: ir.IRBuilder, v: ir.Value, fmt: SmallFloat) -> ir.Value:
    """The code of a float32 that already lies on `fmt`'s grid (a store)."""
    # on the grid nothing rounds; without saturation inf/NaN/overflow keep their codes
    return f32_to_small(b, v, fmt, saturate=False, round_mode="down")


def f64_to_f32_odd(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """double -> float rounded to odd: a later rounding to a format with at least two
    fewer mantissa bits is then correctly rounded (no double rounding)."""
    i32, f32 = _ty(v, emit.I32), _ty(v, emit.F32)
    f = b.fptrunc(v, f32)
    back = b.fpext(f, v.type)
    inexact = b.fcmp_ordered("!=", back, v)
    fb = b.bitcast(f, i32)
    fabs = lambda x: emit.intrinsic(b, "llvm.fabs", [x])
    away = b.fcmp_ordered(">", fabs(back), fabs(v))
    tz = b.select(away, b.sub(fb, _c(1, i32)), fb)
    odd = b.or_(tz, _c(1, i32))
    return b.bitcast(b.select(inexact, odd, fb), f32)


def subbyte_load(b: ir.IRBuilder, v: ir.Value, bits: int, signed: bool) -> ir.Value:
    """A stored byte (i8, scalar or vector) -> the i8 value of a sub-byte integer."""
    sh = _c(8 - bits, v.type)
    if signed:
        return b.ashr(b.shl(v, sh), sh)
    return b.and_(v, _c((1 << bits) - 1, v.type))


def subbyte_wrap(b: ir.IRBuilder, v: ir.Value, bits: int, signed: bool) -> ir.Value:
    """An i8 holding any value -> its low `bits` reinterpreted (two's complement)."""
    return subbyte_load(b, v, bits, signed)


def subbyte_store(b: ir.IRBuilder, v: ir.Value, bits: int) -> ir.Value:
    """An i8 value -> the stored byte (low bits, high bits zero as in ml_dtypes)."""
    return b.and_(v, _c((1 << bits) - 1, v.type))
