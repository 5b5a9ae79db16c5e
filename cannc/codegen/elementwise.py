"""Vectorised loop nests for maps with numpy broadcasting.

An elementwise kernel is described by its operand types, its output types and
an expression function `expr(E, operands) -> results` that builds the values of
one vector (or one scalar, for the tail) with the dtype-aware helpers of `E`.
The same expression is emitted twice, once over `<W x T>` vectors for the body
and once over scalars for the remainder, so it must not assume either.
Fusion builds bigger expressions out of the ops' own `expr` functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llvmlite.ir as ir
import numpy as np

from ..artifact import Tiling
from ..ir.types import TensorType, int_range, small_float, subbyte_int
from ..native import emit
from ..native.emit import I64, for_range, i64, llvm_type
from . import lowp, vmath

MAX_TILE_ELEMS = 16384


def is_bf16(dtype: np.dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def expr_scalar_type(dtype: np.dtype) -> ir.Type:
    """The LLVM type of one element inside an expression: bool is i1, bfloat16 is
    computed in float (LLVM has no bfloat arithmetic here), and so are float8/float4
    (codegen/lowp.py); sub-byte integers are i8; else the storage type."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return ir.IntType(1)
    if is_bf16(dt) or small_float(dt) is not None:
        return emit.F32
    return llvm_type(dt)


def bf16_bits_to_f32(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """i16 (or <n x i16>) bfloat16 bits -> float (exact)."""
    n = v.type.count if isinstance(v.type, ir.VectorType) else 0
    i32 = ir.VectorType(emit.I32, n) if n else emit.I32
    f32 = ir.VectorType(emit.F32, n) if n else emit.F32
    w = b.shl(b.zext(v, i32), emit.const_like(16, i32))
    return b.bitcast(w, f32)


def f32_to_bf16_bits(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """float -> bfloat16 bits (i16), rounding to nearest even; NaN stays a (quiet) NaN."""
    n = v.type.count if isinstance(v.type, ir.VectorType) else 0
    i32 = ir.VectorType(emit.I32, n) if n else emit.I32
    i16 = ir.VectorType(ir.IntType(16), n) if n else ir.IntType(16)
    bits = b.bitcast(v, i32)
    hi = b.lshr(bits, emit.const_like(16, i32))
    lsb = b.and_(hi, emit.const_like(1, i32))
    r = b.lshr(b.add(b.add(bits, emit.const_like(0x7FFF, i32)), lsb), emit.const_like(16, i32))
    nan = b.or_(hi, emit.const_like(0x40, i32))
    r = b.select(b.fcmp_unordered("uno", v, v), nan, r)
    return b.trunc(r, i16)


def round_to_bf16(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """A float rounded to the nearest bfloat16, kept as float."""
    return bf16_bits_to_f32(b, f32_to_bf16_bits(b, v))


def f64_to_f16(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """double -> half with one correct rounding and no runtime library call
    (LLVM lowers a direct fptrunc to __truncdfhf2): round to float *to odd*, then
    to half (round-to-odd into a format with > 2 more bits is innocuous)."""
    n = v.type.count if isinstance(v.type, ir.VectorType) else 0
    f32 = ir.VectorType(emit.F32, n) if n else emit.F32
    i32 = ir.VectorType(emit.I32, n) if n else emit.I32
    h = ir.VectorType(ir.HalfType(), n) if n else ir.HalfType()
    f = b.fptrunc(v, f32)
    back = b.fpext(f, v.type)
    inexact = b.fcmp_ordered("!=", back, v)
    bits = b.bitcast(f, i32)
    fabs = lambda x: emit.intrinsic(b, "llvm.fabs", [x])
    # rounded away from zero: step the magnitude back toward zero
    away = b.fcmp_ordered(">", fabs(back), fabs(v))
    tz = b.select(away, b.sub(bits, emit.const_like(1, i32)), bits)
    odd = b.or_(tz, emit.const_like(1, i32))
    f = b.bitcast(b.select(inexact, odd, bits), f32)
    return b.fptrunc(f, h)


@dataclass
class TV:
    """A typed value: an LLVM value (scalar or vector) and the numpy dtype it holds.
    Booleans are held as i1 (vectors of i1) inside expressions; bfloat16 values are
    held as float (rounded to bfloat16 where a result is stored or cast)."""

    v: ir.Value
    dtype: np.dtype

    @property
    def lanes(self) -> int:
        return self.v.type.count if isinstance(self.v.type, ir.VectorType) else 1


class Expr:
    """Dtype-aware builders for expression functions: implements the builder protocol
    `cannc.ir.expr.ExprBuilder` that the ops' `expr` functions are written against."""

    def __init__(self, b: ir.IRBuilder, lanes: int) -> None:
        self.b = b
        self.lanes = lanes

    # -- types and constants ----------------------------------------------
    def ty(self, dtype: np.dtype) -> ir.Type:
        t = expr_scalar_type(dtype)
        return ir.VectorType(t, self.lanes) if self.lanes > 1 else t

    def const(self, value: float | int | bool, dtype: np.dtype) -> TV:
        dt = np.dtype(dtype)
        v = emit.const_like(int(value) if dt.kind in "iub" else value, self.ty(dt))
        return TV(v, dt)

    def is_float(self, x: TV) -> bool:
        return emit.is_float(x.dtype)

    # -- arithmetic --------------------------------------------------------
    def add(self, x: TV, y: TV) -> TV:
        return TV(self.b.fadd(x.v, y.v) if self.is_float(x) else self.b.add(x.v, y.v), x.dtype)

    def sub(self, x: TV, y: TV) -> TV:
        return TV(self.b.fsub(x.v, y.v) if self.is_float(x) else self.b.sub(x.v, y.v), x.dtype)

    def mul(self, x: TV, y: TV) -> TV:
        return TV(self.b.fmul(x.v, y.v) if self.is_float(x) else self.b.mul(x.v, y.v), x.dtype)

    def div(self, x: TV, y: TV) -> TV:
        if self.is_float(x):
            return TV(self.b.fdiv(x.v, y.v), x.dtype)
        # integer division by zero is undefined in ONNX; keep native code from trapping
        zero = emit.const_like(0, y.v.type)
        one = emit.const_like(1, y.v.type)
        safe = self.b.select(self.b.icmp_unsigned("==", y.v, zero), one, y.v)
        if emit.is_signed(x.dtype):
            # numpy/onnxruntime integer Div truncates toward zero (C semantics)
            return TV(self.b.sdiv(x.v, safe), x.dtype)
        return TV(self.b.udiv(x.v, safe), x.dtype)

    def rem(self, x: TV, y: TV) -> TV:
        """The remainder of truncating division (frem, srem or urem by dtype)."""
        if self.is_float(x):
            return TV(self.b.frem(x.v, y.v), x.dtype)
        if emit.is_signed(x.dtype):
            return TV(self.b.srem(x.v, y.v), x.dtype)
        return TV(self.b.urem(x.v, y.v), x.dtype)

    def neg(self, x: TV) -> TV:
        return TV(self.b.fneg(x.v) if self.is_float(x) else self.b.neg(x.v), x.dtype)

    def fma(self, x: TV, y: TV, z: TV) -> TV:
        return TV(emit.intrinsic(self.b, "llvm.fma", [x.v, y.v, z.v]), x.dtype)

    def call(self, name: str, *xs: TV) -> TV:
        """An overloaded LLVM intrinsic such as 'llvm.sqrt' on float operands."""
        return TV(emit.intrinsic(self.b, name, [x.v for x in xs]), xs[0].dtype)

    def math(self, name: str, *xs: TV) -> TV:
        """A `codegen.vmath` function ('exp', 'log', 'tanh', 'pow', ...) on float operands."""
        return TV(getattr(vmath, name)(self.b, *[x.v for x in xs]), xs[0].dtype)

    def min(self, x: TV, y: TV) -> TV:
        if self.is_float(x):
            # numpy/onnx propagate NaN
            return TV(emit.intrinsic(self.b, "llvm.minimum", [x.v, y.v]), x.dtype)
        cmp = self.b.icmp_signed if emit.is_signed(x.dtype) else self.b.icmp_unsigned
        return TV(self.b.select(cmp("<", x.v, y.v), x.v, y.v), x.dtype)

    def max(self, x: TV, y: TV) -> TV:
        if self.is_float(x):
            return TV(emit.intrinsic(self.b, "llvm.maximum", [x.v, y.v]), x.dtype)
        cmp = self.b.icmp_signed if emit.is_signed(x.dtype) else self.b.icmp_unsigned
        return TV(self.b.select(cmp(">", x.v, y.v), x.v, y.v), x.dtype)

    def abs(self, x: TV) -> TV:
        if self.is_float(x):
            return self.call("llvm.fabs", x)
        if not emit.is_signed(x.dtype):
            return x
        return TV(self.b.select(self.cmp("<", x, self.const(0, x.dtype)).v,
                                self.b.neg(x.v), x.v), x.dtype)

    # -- comparisons and logic ----------------------------------------------
    def cmp(self, op: str, x: TV, y: TV) -> TV:
        if self.is_float(x):
            r = self.b.fcmp_ordered(op, x.v, y.v)
        elif emit.is_signed(x.dtype):
            r = self.b.icmp_signed(op, x.v, y.v)
        else:
            r = self.b.icmp_unsigned(op, x.v, y.v)
        return TV(r, np.dtype(np.bool_))

    def ucmp(self, op: str, x: TV, y: TV) -> TV:
        """An integer comparison as unsigned, whatever the dtype."""
        return TV(self.b.icmp_unsigned(op, x.v, y.v), np.dtype(np.bool_))

    def isnan(self, x: TV) -> TV:
        return TV(self.b.fcmp_unordered("uno", x.v, x.v), np.dtype(np.bool_))

    def select(self, c: TV, x: TV, y: TV) -> TV:
        return TV(self.b.select(c.v, x.v, y.v), x.dtype)

    def and_(self, x: TV, y: TV) -> TV:
        return TV(self.b.and_(x.v, y.v), x.dtype)

    def or_(self, x: TV, y: TV) -> TV:
        return TV(self.b.or_(x.v, y.v), x.dtype)

    def xor(self, x: TV, y: TV) -> TV:
        return TV(self.b.xor(x.v, y.v), x.dtype)

    def not_(self, x: TV) -> TV:
        return TV(self.b.not_(x.v), x.dtype)

    def shl(self, x: TV, y: TV) -> TV:
        return TV(self.b.shl(x.v, y.v), x.dtype)

    def shr(self, x: TV, y: TV) -> TV:
        """Arithmetic shift for signed dtypes, logical for unsigned."""
        if emit.is_signed(x.dtype):
            return TV(self.b.ashr(x.v, y.v), x.dtype)
        return TV(self.b.lshr(x.v, y.v), x.dtype)

    # -- conversions -------------------------------------------------------
    def cast(self, x: TV, dtype: np.dtype, saturate: bool = True,
             round_mode: str = "up") -> TV:
        """saturate and round_mode: ONNX Cast's, for float8 destinations (lowp.py)."""
        src, dst = np.dtype(x.dtype), np.dtype(dtype)
        b, t = self.b, self.ty(dst)
        if src == dst:
            return x
        if dst != np.bool_ and src != np.bool_:
            if small_float(dst) is not None:
                v32 = self._to_f32(x)
                return TV(lowp.round_to_small(b, v32, small_float(dst), saturate, round_mode),
                          dst)
            if small_float(src) is not None:      # held as float32: convert from that
                return self.cast(TV(x.v, np.dtype(np.float32)), dst)
            if subbyte_int(dst) is not None:
                return TV(self._to_subbyte(x, dst), dst)
        if dst == np.bool_:
            if self.is_float(x):
                return TV(b.fcmp_unordered("!=", x.v, emit.const_like(0.0, x.v.type)), dst)
            return TV(b.icmp_unsigned("!=", x.v, emit.const_like(0, x.v.type)), dst)
        if src == np.bool_:
            if emit.is_float(dst):
                return TV(b.uitofp(x.v, t), dst)
            return TV(b.zext(x.v, t), dst)
        if emit.is_float(src) and emit.is_float(dst):
            return TV(self._fconvert(x.v, src, dst), dst)
        if emit.is_float(src):
            # float -> int: C truncation, like numpy's astype; saturate NaN/out-of-range
            fn = "llvm.fptosi.sat" if emit.is_signed(dst) else "llvm.fptoui.sat"
            return TV(self._sat_convert(fn, x.v, t), dst)
        if emit.is_float(dst):
            v = b.sitofp(x.v, t) if emit.is_signed(src) else b.uitofp(x.v, t)
            return TV(round_to_bf16(b, v) if is_bf16(dst) else v, dst)
        if src.itemsize == dst.itemsize:
            return TV(x.v, dst)
        if src.itemsize > dst.itemsize:
            return TV(b.trunc(x.v, t), dst)
        return TV(b.sext(x.v, t) if emit.is_signed(src) else b.zext(x.v, t), dst)

    def _to_f32(self, x: TV) -> ir.Value:
        """Any non-bool value as float32, rounded once (doubles and wide integers to
        odd, so that a following narrower rounding is correct)."""
        b, src = self.b, np.dtype(x.dtype)
        f32, f64 = self.ty(np.dtype(np.float32)), self.ty(np.dtype(np.float64))
        if emit.is_float(src):
            if isinstance(x.v.type, ir.VectorType):
                et = x.v.type.element
            else:
                et = x.v.type
            if isinstance(et, ir.DoubleType):
                return lowp.f64_to_f32_odd(b, x.v)
            if isinstance(et, ir.HalfType):
                return b.fpext(x.v, f32)
            return x.v
        cv = b.sitofp if emit.is_signed(src) else b.uitofp
        if src.itemsize >= 4:
            return lowp.f64_to_f32_odd(b, cv(x.v, f64))
        return cv(x.v, f32)

    def _to_subbyte(self, x: TV, dst: np.dtype) -> ir.Value:
        """-> int4/uint4/int2/uint2 (held as i8). From a float: truncation toward zero,
        and an out-of-range value (NaN included) gives 0, like ONNX's reference
        (ml_dtypes); from an integer: the low bits, reinterpreted (ONNX's rule)."""
        b = self.b
        bits, signed = subbyte_int(dst)
        lo, hi = int_range(dst)
        i8 = self.ty(dst)
        if emit.is_float(x.dtype):
            i32 = ir.VectorType(emit.I32, self.lanes) if self.lanes > 1 else emit.I32
            q = self._sat_convert("llvm.fptosi.sat", x.v, i32)
            oor = b.or_(b.icmp_signed("<", q, emit.const_like(lo, i32)),
                        b.icmp_signed(">", q, emit.const_like(hi, i32)))
            q = b.select(oor, emit.const_like(0, i32), q)
            return b.trunc(q, i8)
        src = np.dtype(x.dtype)
        v = x.v
        if src.itemsize > 1 and subbyte_int(src) is None:
            v = b.trunc(v, i8)
        return lowp.subbyte_wrap(b, v, bits, signed)

    def _fconvert(self, v: ir.Value, src: np.dtype, dst: np.dtype) -> ir.Value:
        """float -> float in expression representation (bfloat16 held as float)."""
        b = self.b
        st, dt_ = expr_scalar_type(src), expr_scalar_type(dst)
        width = {ir.HalfType: 16, ir.FloatType: 32, ir.DoubleType: 64}
        ws, wd = width[type(st)], width[type(dt_)]
        t = self.ty(dst)
        if isinstance(st, ir.DoubleType) and isinstance(dt_, ir.HalfType):
            r = f64_to_f16(b, v)
        elif ws < wd:
            r = b.fpext(v, t)
        elif ws > wd:
            r = b.fptrunc(v, t)
        else:
            r = v
        if is_bf16(dst):
            r = round_to_bf16(b, r)
        return r

    def _sat_convert(self, name: str, v: ir.Value, t: ir.Type) -> ir.Value:
        full = f"{name}.{emit._mangle(t)}.{emit._mangle(v.type)}"
        fn = self.b.module.globals.get(full)
        if fn is None:
            fn = ir.Function(self.b.module, ir.FunctionType(t, [v.type]), name=full)
        return self.b.call(fn, [v])


ExprFn = Callable[[Expr, Sequence[TV]], Sequence[TV]]


def _strides(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[int]:
    """Element strides of an operand of `shape` broadcast to `out_shape`."""
    r = len(out_shape)
    shape = (1,) * (r - len(shape)) + tuple(shape)
    st, acc = [0] * r, 1
    for d in range(r - 1, -1, -1):
        st[d] = 0 if shape[d] == 1 else acc
        acc *= shape[d]
    return st


def collapse(out_shape: tuple[int, ...], strides: list[list[int]], keep_ones: bool = False
             ) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that every operand walks alike. With
    ``keep_ones`` dims of extent 1 stay, apart from their neighbours (a runtime
    batch of 1 keeps the merged rank of larger batches)."""
    dims = [d for d in range(len(out_shape)) if keep_ones or out_shape[d] != 1]
    shape = [int(out_shape[d]) for d in dims]
    sts = [[s[d] for d in dims] for s in strides]
    if not shape:
        return [1], [[0] for _ in strides]
    i = len(shape) - 2
    while i >= 0:
        if (not keep_ones or (shape[i] != 1 and shape[i + 1] != 1)) and \
                all(s[i] == s[i + 1] * shape[i + 1] for s in sts):
            shape[i] *= shape[i + 1]
            for s in sts:
                s[i] = s[i + 1]
                del s[i + 1]
            del shape[i + 1]
        i -= 1
    return shape, sts


def vector_lanes(dtypes: Sequence[np.dtype], vector_bytes: int = 64) -> int:
    # bfloat16 is computed in float: count it as 4 bytes
    widest = max(4 if is_bf16(d) or small_float(d) is not None else np.dtype(d).itemsize
                 for d in dtypes)
    return max(1, min(16, vector_bytes // widest))


def load_tv(b: ir.IRBuilder, ptr: ir.Value, index: ir.Value, dtype: np.dtype,
            lanes: int, broadcast: bool) -> TV:
    dt = np.dtype(dtype)
    et = llvm_type(dt)
    p = emit.gep(b, ptr, index, et)
    if lanes == 1 or broadcast:
        v = _from_storage(b, b.load(p, typ=et), dt)
        if lanes > 1:
            v = emit.splat(b, v, lanes)
        return TV(v, dt)
    vt = ir.VectorType(et, lanes)
    v = b.load(p, typ=vt)
    v.align = dt.itemsize
    return TV(_from_storage(b, v, dt), dt)


def _from_storage(b: ir.IRBuilder, v: ir.Value, dt: np.dtype) -> ir.Value:
    """Loaded storage (scalar or vector) -> the expression representation."""
    if dt == np.bool_:
        return b.icmp_unsigned("!=", v, emit.const_like(0, v.type))
    if is_bf16(dt):
        return bf16_bits_to_f32(b, v)
    fmt = small_float(dt)
    if fmt is not None:
        return lowp.small_to_f32(b, v, fmt)
    sb = subbyte_int(dt)
    if sb is not None:
        return lowp.subbyte_load(b, v, *sb)
    return v


def store_tv(b: ir.IRBuilder, ptr: ir.Value, index: ir.Value, x: TV, dtype: np.dtype) -> None:
    dt = np.dtype(dtype)
    et = llvm_type(dt)
    v = x.v
    if dt == np.bool_:
        t = ir.VectorType(et, x.lanes) if x.lanes > 1 else et
        v = b.zext(v, t)
    elif is_bf16(dt):
        v = f32_to_bf16_bits(b, v)
    elif small_float(dt) is not None:
        v = lowp.encode_small(b, v, small_float(dt))
    elif subbyte_int(dt) is not None:
        v = lowp.subbyte_store(b, v, subbyte_int(dt)[0])
    st = b.store(v, emit.gep(b, ptr, index, et))
    st.align = dt.itemsize


def emit_map(ctx, operand_types: list[TensorType], out_types: list[TensorType],
             expr: ExprFn, operand_slots: list[int] | None = None,
             folded_types: Sequence[TensorType] = ()) -> None:
    """Emit the whole kernel for a broadcasting map into ctx (a LowerCtx).

    operand_slots[i] is the argument index of operand i (default: input i).
    Outputs all have the same shape (out_types[0].shape) and are contiguous.
    With ``ctx.tiling`` set (by ``map_tiling`` over the same operands, plus any
    fully broadcast operands the lowering folds into immediates) the kernel reads
    its extents at run time; without, it is specialised to the static shapes.
    folded_types: operands the tiling function saw but the lowering folded into
    the expression (scalar constants): they take part in the pattern's merges.
    """
    if ctx.tiling is not None:
        _emit_map_runtime(ctx, operand_types, out_types, expr, operand_slots, folded_types)
        return
    out_shape = tuple(int(d) for d in out_types[0].shape)
    if any(d == 0 for d in out_shape):
        # nothing to compute: an empty kernel
        ctx.num_tiles = 1
        ctx.single_core = True
        _, b = ctx.begin()
        b.ret_void()
        return
    slots = operand_slots if operand_slots is not None else list(range(len(operand_types)))
    strides = [_strides(tuple(t.shape), out_shape) for t in operand_types]
    strides += [_strides(out_shape, out_shape) for _ in out_types]
    shape, sts = collapse(out_shape, strides)
    inner = shape[-1]
    outer = shape[:-1]
    rows = int(np.prod(outer)) if outer else 1
    lanes = vector_lanes([t.dtype for t in operand_types] + [t.dtype for t in out_types])
    chunk = inner if inner <= MAX_TILE_ELEMS else MAX_TILE_ELEMS
    cpr = (inner + chunk - 1) // chunk
    ctx.num_tiles = max(1, rows * cpr)
    total = rows * inner
    ctx.single_core = total < 4096

    fn, b = ctx.begin()
    ptrs = [ctx.in_ptr(b, s) for s in slots] + [ctx.out_ptr(b, j) for j in range(len(out_types))]
    nops = len(operand_types)
    with for_range(b, ctx.tile_begin, ctx.tile_end, name="tile") as t:
        row = b.udiv(t, i64(cpr)) if cpr > 1 else t
        start = b.mul(b.urem(t, i64(cpr)), i64(chunk)) if cpr > 1 else i64(0)
        n = b.sub(i64(inner), start)
        if cpr > 1:
            n = b.select(b.icmp_signed("<", n, i64(chunk)), n, i64(chunk))
        # base offset of each operand for this row
        bases = [start if s[-1] == 1 else (i64(0) if s[-1] == 0 else b.mul(start, i64(s[-1])))
                 for s in sts]
        rem = row
        for d in range(len(outer) - 1, -1, -1):
            idx = b.urem(rem, i64(outer[d])) if d > 0 else rem
            rem = b.udiv(rem, i64(outer[d])) if d > 0 else rem
            bases = [base if s[d] == 0 else b.add(base, b.mul(idx, i64(s[d])))
                     for base, s in zip(bases, sts)]

        def body(j: ir.Value, w: int) -> None:
            ex = Expr(b, w)
            vals = []
            for k in range(nops):
                s = sts[k][-1]
                off = bases[k] if s == 0 else b.add(bases[k], j if s == 1 else b.mul(j, i64(s)))
                vals.append(load_tv(b, ptrs[k], off, operand_types[k].dtype, w, s == 0))
            res = expr(ex, vals)
            for k, (r, ot) in enumerate(zip(res, out_types)):
                off = b.add(bases[nops + k], j)
                store_tv(b, ptrs[nops + k], off, r, ot.dtype)

        nvec = b.mul(b.udiv(n, i64(lanes)), i64(lanes)) if lanes > 1 else n
        if lanes > 1:
            with for_range(b, 0, nvec, step=lanes, name="v") as j:
                body(j, lanes)
        with for_range(b, nvec, n, name="s") as j:
            body(j, 1)
    b.ret_void()


# ---------------------------------------------------------------------------
# shape-polymorphic maps (ABI.md "Runtime dimensions")
#
# The broadcast *pattern* is static: after aligning ranks, every operand axis is
# either walked ("present") or broadcast, and adjacent axes that every operand
# treats alike are merged. The merged extents are runtime dims. A tile is a
# flat range of TILE elements of the output; it walks its rows (the innermost
# merged axis) with the vector body + scalar remainder of the static kernel.
# ---------------------------------------------------------------------------

MIN_TILE_ELEMS = 2048


def map_layout(operand_shapes: Sequence[Sequence[int]], out_shape: Sequence[int],
               n_out: int = 1) -> tuple[tuple[tuple[bool, ...], ...], tuple[int, ...]] | None:
    """(per operand then per output: which merged axes it walks; the merged extents),
    or None for an empty output. An operand axis is broadcast when it is missing
    (rank alignment) or 1 against a larger output extent; an axis where the output
    is 1 too counts as walked, so a runtime batch of 1 keeps the pattern of larger
    batches for operands that carry the batch axis. A one-element operand of
    another shape than the output is a scalar, broadcast on every axis."""
    out = [int(d) for d in out_shape] or [1]
    if any(d == 0 for d in out):
        return None
    r = len(out)
    bits = []
    for shp in operand_shapes:
        shp = [int(d) for d in shp]
        pad = r - len(shp)
        if int(np.prod(shp)) == 1 and shp != out:   # a scalar: broadcast on every axis
            bits.append([False] * r)
            continue
        bits.append([d >= pad and not (shp[d - pad] == 1 and out[d] != 1) for d in range(r)])
    bits += [[True] * r for _ in range(n_out)]
    groups: list[list[int]] = [[0]]
    for d in range(1, r):
        if all(bt[d] == bt[groups[-1][-1]] for bt in bits):
            groups[-1].append(d)
        else:
            groups.append([d])
    ext = tuple(int(np.prod([out[d] for d in g])) for g in groups)
    pattern = tuple(tuple(bt[g[0]] for g in groups) for bt in bits)
    return pattern, ext


def map_tile_elems(total: int) -> int:
    """Elements per tile: ~16 tiles for the cores to share, each a vector multiple."""
    t = -(-total // 16)
    t = -(-t // 64) * 64
    return max(MIN_TILE_ELEMS, min(MAX_TILE_ELEMS, t))


def map_tiling(operand_types: Sequence[TensorType], out_types: Sequence[TensorType],
               flops_per_elem: int = 0) -> Tiling | None:
    """The host tiling of a broadcasting map (see emit_map): dims are
    (tile elements, total elements, merged extents...); None for empty outputs."""
    out_shape = tuple(int(d) for d in out_types[0].shape)
    lay = map_layout([tuple(t.shape) for t in operand_types], out_shape, len(out_types))
    if lay is None:
        return None
    pattern, ext = lay
    total = int(np.prod(out_shape)) if out_shape else 1
    tile = map_tile_elems(total)
    return Tiling(key=("map", pattern), dims=(tile, total) + ext,
                  num_tiles=max(1, -(-total // tile)), single_core=total < 4096,
                  flops=total * flops_per_elem)


def _emit_map_runtime(ctx, operand_types: list[TensorType], out_types: list[TensorType],
                      expr: ExprFn, operand_slots: list[int] | None,
                      folded_types: Sequence[TensorType]) -> None:
    out_shape = tuple(int(d) for d in out_types[0].shape)
    lay = map_layout([tuple(t.shape) for t in list(operand_types) + list(folded_types)],
                     out_shape, len(out_types))
    assert lay is not None
    pattern, ext = lay
    nops = len(operand_types)
    pattern = pattern[:nops] + pattern[nops + len(folded_types):]
    assert tuple(ctx.tiling.dims[2:]) == ext, (ctx.tiling.dims, ext)
    r = len(ext)
    slots = operand_slots if operand_slots is not None else list(range(len(operand_types)))
    dtypes = [t.dtype for t in operand_types] + [t.dtype for t in out_types]
    lanes = vector_lanes(dtypes)

    fn, b = ctx.begin()
    ptrs = [ctx.in_ptr(b, s) for s in slots] + [ctx.out_ptr(b, j) for j in range(len(out_types))]
    tile, total = ctx.rt_dim(b, 0), ctx.rt_dim(b, 1)
    e = [ctx.rt_dim(b, 2 + d) for d in range(r)]
    # element strides of every operand along the merged axes (None: broadcast)
    strides: list[list[ir.Value | None]] = []
    for bits in pattern:
        st: list[ir.Value | None] = [None] * r
        acc: ir.Value | None = None          # None stands for 1
        for d in range(r - 1, -1, -1):
            if bits[d]:
                st[d] = acc if acc is not None else i64(1)
                acc = e[d] if acc is None else b.mul(acc, e[d])
        strides.append(st)
    inner = [bits[-1] for bits in pattern]   # walks the row (stride 1) or is splat
    n = e[-1]
    # the row walk's state for rank > 2 (in the entry block: it becomes SSA values)
    dslot = [b.alloca(I64, name=f"dig{d}") for d in range(r - 1)] if r > 2 else []
    rslot = [b.alloca(I64, name=f"rb{k}") for k in range(len(pattern))] if r > 2 else []

    def segment(bases: list[ir.Value], cnt: ir.Value) -> None:
        """Elements [0, cnt) of a row piece whose operand offsets are `bases`: full
        vectors, then scalars (a masked vector tail measured slower on Zen 4)."""
        # a broadcast operand is one value for the whole piece: load it once
        splat_vals = {k: load_tv(b, ptrs[k], bases[k], operand_types[k].dtype, 1, True)
                      for k in range(nops) if not inner[k]}

        def body(j: ir.Value, w: int) -> None:
            vals = []
            for k in range(nops):
                if k in splat_vals:
                    sv = splat_vals[k]
                    vals.append(TV(emit.splat(b, sv.v, w), sv.dtype) if w > 1 else sv)
                else:
                    vals.append(load_tv(b, ptrs[k], b.add(bases[k], j),
                                        operand_types[k].dtype, w, False))
            res = expr(Expr(b, w), vals)
            for k, (rv, ot) in enumerate(zip(res, out_types)):
                store_tv(b, ptrs[nops + k], b.add(bases[nops + k], j), rv, ot.dtype)

        nvec = i64(0)
        if lanes > 1:
            nvec = b.and_(cnt, i64(-lanes)) if lanes & (lanes - 1) == 0 else \
                b.mul(b.udiv(cnt, i64(lanes)), i64(lanes))
            with for_range(b, 0, nvec, step=lanes, name="v") as j:
                body(j, lanes)
        with for_range(b, nvec, cnt, name="s") as j:
            body(j, 1)

    with for_range(b, ctx.tile_begin, ctx.tile_end, name="tile") as t:
        f0 = b.mul(t, tile)
        f1 = b.add(f0, tile)
        f1 = b.select(b.icmp_signed("<", f1, total), f1, total)
        if r == 1:
            segment([f0 if inner[k] else i64(0) for k in range(len(pattern))], b.sub(f1, f0))
        else:
            # rows [r0, r1] of the tile; the first starts at column c0, the last ends at c1
            r0 = b.udiv(f0, n)
            c0 = b.sub(f0, b.mul(r0, n))
            r1 = b.udiv(b.sub(f1, i64(1)), n)
            c1 = b.sub(f1, b.mul(r1, n))
            if r > 2:
                # digits of r0 over the outer merged axes, and each operand's row offset
                digits, rem = [None] * (r - 1), r0
                for d in range(r - 2, -1, -1):
                    if d == 0:
                        digits[d] = rem
                    else:
                        digits[d] = b.urem(rem, e[d])
                        rem = b.udiv(rem, e[d])
                for d in range(r - 1):
                    b.store(digits[d], dslot[d])
                for k, st in enumerate(strides):
                    rb = i64(0)
                    for d in range(r - 1):
                        if st[d] is not None:
                            rb = b.add(rb, b.mul(digits[d], st[d]))
                    b.store(rb, rslot[k])
            with for_range(b, r0, b.add(r1, i64(1)), name="row") as row:
                lo = b.select(b.icmp_signed("==", row, r0), c0, i64(0))
                hi = b.select(b.icmp_signed("==", row, r1), c1, n)
                bases = []
                for k, st in enumerate(strides):
                    if r > 2:
                        rb = b.load(rslot[k], typ=I64)
                    else:
                        rb = b.mul(row, st[0]) if st[0] is not None else i64(0)
                    bases.append(b.add(rb, lo) if inner[k] else rb)
                segment(bases, b.sub(hi, lo))
                if r > 2:
                    _advance_row(b, r, e, strides, dslot, rslot)
    b.ret_void()


def _advance_row(b: ir.IRBuilder, r: int, e: list[ir.Value],
                 strides: list[list[ir.Value | None]], dslot: list[ir.Value],
                 rslot: list[ir.Value]) -> None:
    """Step the row digits (outer merged axes) by one, carrying, and the row offsets."""

    def step(d: int) -> None:
        dg = b.add(b.load(dslot[d], typ=I64), i64(1))
        b.store(dg, dslot[d])
        for k, st in enumerate(strides):
            if st[d] is not None:
                b.store(b.add(b.load(rslot[k], typ=I64), st[d]), rslot[k])
        if d == 0:
            return
        with b.if_then(b.icmp_signed("==", dg, e[d])):
            b.store(i64(0), dslot[d])
            for k, st in enumerate(strides):
                if st[d] is not None:
                    span = b.mul(e[d], st[d])
                    b.store(b.sub(b.load(rslot[k], typ=I64), span), rslot[k])
            step(d - 1)

    step(r - 2)
