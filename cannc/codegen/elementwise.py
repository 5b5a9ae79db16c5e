"""Vectorised loop nests for maps with numpy broadcasting.

An elementwise kernel is described by its operand types, its output types and
an expression function `expr(E, operands) -> results` that builds the values of
one vector (or one scalar, for the tail) with the dtype-aware helpers of `E`.
The same expression is emitted twice, once over `<W x T>` vectors for the body
and once over scalars for the remainder, so it must not assume either.
Fusion builds bigger expressions out of the ops' own `expr` functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import llvmlite.ir as ir
import numpy as np

from ..ir.types import TensorType
from . import emit
from .emit import I64, for_range, i64, llvm_type

MAX_TILE_ELEMS = 16384


def is_bf16(dtype: np.dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def expr_scalar_type(dtype: np.dtype) -> ir.Type:
    """The LLVM type of one element inside an expression: bool is i1, bfloat16 is
    computed in float (LLVM has no bfloat arithmetic here); else the storage type."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return ir.IntType(1)
    if is_bf16(dt):
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
    fabs = lambda x: emit.intrinsic(b, "llvm.fabs", [x])  # noqa: E731
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
    """Dtype-aware builders for expression functions."""

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

    def neg(self, x: TV) -> TV:
        return TV(self.b.fneg(x.v) if self.is_float(x) else self.b.neg(x.v), x.dtype)

    def fma(self, x: TV, y: TV, z: TV) -> TV:
        return TV(emit.intrinsic(self.b, "llvm.fma", [x.v, y.v, z.v]), x.dtype)

    def call(self, name: str, *xs: TV) -> TV:
        """An overloaded LLVM intrinsic such as 'llvm.sqrt' on float operands."""
        return TV(emit.intrinsic(self.b, name, [x.v for x in xs]), xs[0].dtype)

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

    # -- conversions -------------------------------------------------------
    def cast(self, x: TV, dtype: np.dtype) -> TV:
        src, dst = np.dtype(x.dtype), np.dtype(dtype)
        b, t = self.b, self.ty(dst)
        if src == dst:
            return x
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


def collapse(out_shape: tuple[int, ...], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that every operand walks alike."""
    dims = [d for d in range(len(out_shape)) if out_shape[d] != 1]
    shape = [out_shape[d] for d in dims]
    sts = [[s[d] for d in dims] for s in strides]
    if not shape:
        return [1], [[0] for _ in strides]
    i = len(shape) - 2
    while i >= 0:
        if all(s[i] == s[i + 1] * shape[i + 1] for s in sts):
            shape[i] *= shape[i + 1]
            for s in sts:
                s[i] = s[i + 1]
                del s[i + 1]
            del shape[i + 1]
        i -= 1
    return shape, sts


def vector_lanes(dtypes: Sequence[np.dtype], vector_bytes: int = 64) -> int:
    # bfloat16 is computed in float: count it as 4 bytes
    widest = max(4 if is_bf16(d) else np.dtype(d).itemsize for d in dtypes)
    return max(1, min(16, vector_bytes // widest))


def load_tv(b: ir.IRBuilder, ptr: ir.Value, index: ir.Value, dtype: np.dtype,
            lanes: int, broadcast: bool) -> TV:
    dt = np.dtype(dtype)
    et = llvm_type(dt)
    p = emit.gep(b, ptr, index, et)
    if lanes == 1 or broadcast:
        v = b.load(p, typ=et)
        if dt == np.bool_:
            v = b.icmp_unsigned("!=", v, ir.Constant(et, 0))
        elif is_bf16(dt):
            v = bf16_bits_to_f32(b, v)
        if lanes > 1:
            v = emit.splat(b, v, lanes)
        return TV(v, dt)
    vt = ir.VectorType(et, lanes)
    v = b.load(p, typ=vt)
    v.align = dt.itemsize
    if dt == np.bool_:
        v = b.icmp_unsigned("!=", v, ir.Constant(vt, [0] * lanes))
    elif is_bf16(dt):
        v = bf16_bits_to_f32(b, v)
    return TV(v, dt)


def store_tv(b: ir.IRBuilder, ptr: ir.Value, index: ir.Value, x: TV, dtype: np.dtype) -> None:
    dt = np.dtype(dtype)
    et = llvm_type(dt)
    v = x.v
    if dt == np.bool_:
        t = ir.VectorType(et, x.lanes) if x.lanes > 1 else et
        v = b.zext(v, t)
    elif is_bf16(dt):
        v = f32_to_bf16_bits(b, v)
    st = b.store(v, emit.gep(b, ptr, index, et))
    st.align = dt.itemsize


def emit_map(ctx, operand_types: list[TensorType], out_types: list[TensorType],
             expr: ExprFn, operand_slots: list[int] | None = None) -> None:
    """Emit the whole kernel for a broadcasting map into ctx (a LowerCtx).

    operand_slots[i] is the argument index of operand i (default: input i).
    Outputs all have the same shape (out_types[0].shape) and are contiguous.
    """
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
