"""Lowerings of the quantisation ops (cannc/ir/ops/quant.py).

(De)quantisation is a broadcasting map over x and its parameters viewed in x's
layout (ir's `param_view`), so the shared elementwise emitter does the work.
DynamicQuantizeLinear is one single-core kernel (a min/max pass, then the map).
The integer contractions use the MatMul loop nest (lower/contraction.py) with
zero points subtracted as the operands are loaded and, for QLinearMatMul, a
requantising epilogue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llvmlite.ir as ir
import numpy as np

from ...errors import UnsupportedOpError
from ...ir.epilogue import matmul_dims as _matmul_dims
from ...ir.graph import Node
from ...ir.ops.quant import _layout
from ...ir.types import TensorType, int_range, np_dtype, small_float
from ...native import emit
from ...native.emit import for_range, i64
from ..elementwise import TV, Expr, emit_map
from ..kernel import LowerCtx
from .base import register_lowering
from .contraction import emit_matmul_nest, load_as

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)


def _unsupported(n: Node, why: str) -> UnsupportedOpError:
    return UnsupportedOpError([(n.name, n.op_type, n.domain, n.opset, why)])


def _present(n: Node, i: int) -> bool:
    return i < len(n.inputs) and bool(n.inputs[i])


# ---------------------------------------------------------------------------
# QuantizeLinear
# ---------------------------------------------------------------------------

def _int_range(dt: np.dtype) -> tuple[int, int]:
    return int_range(dt)


def _compute_dtype(x: np.dtype, s: np.dtype, precision: int | None) -> np.dtype:
    if precision:
        return np_dtype(int(precision))
    x, s = np.dtype(x), np.dtype(s)
    if x == s:
        return x
    return np.dtype(np.float32) if np.float32 in (x, s) or "bfloat16" in (x.name, s.name) \
        else np.result_type(x, s)


def _operands(ctx: LowerCtx) -> tuple[bool, list[TensorType], list[int]]:
    """(has a zero point, map operand types, their input slots) of Quantize/
    DequantizeLinear: x, then scale and zero point in x's layout (per axis/block)."""
    xv, pv = _layout(ctx.node, ctx.in_types)
    has_zp = _present(ctx.node, 2)
    types = [TensorType(ctx.in_types[0].dtype, xv), TensorType(ctx.in_types[1].dtype, pv)]
    slots = [0, 1]
    if has_zp:
        types.append(TensorType(ctx.in_types[2].dtype, pv))
        slots.append(2)
    return has_zp, types, slots


def _lower_quantize(ctx: LowerCtx) -> None:
    n = ctx.node
    out_t = ctx.out_types[0]
    odt = np.dtype(out_t.dtype)
    xt, st = ctx.in_types[0], ctx.in_types[1]
    cdt = _compute_dtype(xt.dtype, st.dtype, n.attrs.get("precision"))
    has_zp, types, slots = _operands(ctx)
    fmt = small_float(odt)
    if fmt is not None:
        # float8/float4: x / scale with Cast's rounding; like the reference, a float8
        # zero point (zero by the spec) is not applied, a float4 one is added
        saturate = bool(int(n.attrs.get("saturate", 1)))
        add_zp = has_zp and fmt.kind == "sat"

        def fexpr(E: Expr, ops: Sequence[TV]) -> list[TV]:
            q = E.div(E.cast(ops[0], cdt), E.cast(ops[1], cdt))
            if add_zp:
                q = E.add(E.cast(q, F32), E.cast(ops[2], F32))
            return [E.cast(q, odt, saturate=saturate)]

        emit_map(ctx, types, [TensorType(odt, types[0].shape)], fexpr, operand_slots=slots)
        ctx.flops = xt.numel * 4
        return
    lo, hi = _int_range(odt)

    def expr(E: Expr, ops: Sequence[TV]) -> list[TV]:
        x, s = E.cast(ops[0], cdt), E.cast(ops[1], cdt)
        q = E.call("llvm.roundeven", E.div(x, s))
        # like the reference (rint, then int32): a saturating conversion to int32, NaN
        # to int32's minimum (so to the type's lowest value, as onnxruntime gives); then
        # in int64 the zero point cannot overflow it (inf + zp stays the highest value)
        q32 = E.cast(q, np.dtype(np.int32))
        q32 = E.select(E.isnan(q), E.const(-2**31, np.int32), q32)
        qi = E.cast(q32, np.dtype(np.int64))
        if has_zp:
            qi = E.add(qi, E.cast(ops[2], np.dtype(np.int64)))
        qi = E.min(E.max(qi, E.const(lo, np.int64)), E.const(hi, np.int64))
        return [E.cast(qi, odt)]

    emit_map(ctx, types, [TensorType(odt, types[0].shape)], expr, operand_slots=slots)
    ctx.flops = xt.numel * 4


def _lower_dequantize(ctx: LowerCtx) -> None:
    odt = np.dtype(ctx.out_types[0].dtype)
    has_zp, types, slots = _operands(ctx)
    # a float8/float4 zero point is not subtracted (the reference ignores it; it
    # subtracts a float6 one)
    fmt = small_float(ctx.in_types[0].dtype)
    has_zp = has_zp and (fmt is None or fmt.name.startswith("float6"))

    def expr(E: Expr, ops: Sequence[TV]) -> list[TV]:
        # like the reference: (float32(x) - zp) * scale, rounded once to the output type
        x = E.cast(ops[0], F32)
        if has_zp:
            x = E.sub(x, E.cast(ops[2], F32))
        return [E.cast(E.mul(x, E.cast(ops[1], F32)), odt)]

    emit_map(ctx, types, [TensorType(odt, types[0].shape)], expr, operand_slots=slots)
    ctx.flops = ctx.in_types[0].numel * 2


# ---------------------------------------------------------------------------
# DynamicQuantizeLinear (uint8): scale and zero point from the data's range
# ---------------------------------------------------------------------------

def _lower_dynamic_quantize(ctx: LowerCtx) -> None:
    xt = ctx.in_types[0]
    total = xt.numel
    ctx.num_tiles = 1
    ctx.single_core = True
    ctx.flops = total * 6
    fn, b = ctx.begin()
    x = ctx.in_ptr(b, 0)
    y, ys, yz = (ctx.out_ptr(b, j) for j in range(3))
    f32 = emit.F32
    E = Expr(b, 1)
    lo_p, hi_p = b.alloca(f32), b.alloca(f32)
    # the range always includes 0
    b.store(ir.Constant(f32, 0.0), lo_p)
    b.store(ir.Constant(f32, 0.0), hi_p)
    with for_range(b, 0, total, name="mm") as i:
        v = b.load(emit.gep(b, x, i, f32), typ=f32)
        b.store(emit.intrinsic(b, "llvm.minnum", [b.load(lo_p, typ=f32), v]), lo_p)
        b.store(emit.intrinsic(b, "llvm.maxnum", [b.load(hi_p, typ=f32), v]), hi_p)
    lo, hi = TV(b.load(lo_p, typ=f32), F32), TV(b.load(hi_p, typ=f32), F32)
    scale = E.div(E.sub(hi, lo), E.const(255.0, F32))
    # zero point: saturate(round(0 - min / scale)); a zero range gives scale 0, zp 0
    zero = E.const(0.0, F32)
    safe = E.select(E.cmp("==", scale, zero), E.const(1.0, F32), scale)
    zpf = E.call("llvm.roundeven", E.sub(zero, E.div(lo, safe)))
    zpf = E.min(E.max(zpf, zero), E.const(255.0, F32))
    zp_u8 = E.cast(zpf, np.dtype(np.uint8))
    b.store(scale.v, ys)
    b.store(zp_u8.v, yz)
    zpv = E.cast(zp_u8, np.dtype(np.int32))
    with for_range(b, 0, total, name="q") as i:
        v = TV(b.load(emit.gep(b, x, i, f32), typ=f32), F32)
        q = E.cast(E.call("llvm.roundeven", E.div(v, safe)), I32)
        q = E.add(q, zpv)
        q = E.min(E.max(q, E.const(0, I32)), E.const(255, I32))
        b.store(b.trunc(q.v, emit.I8), emit.gep(b, y, i, emit.I8))
    b.ret_void()


# ---------------------------------------------------------------------------
# MatMulInteger, QLinearMatMul
# ---------------------------------------------------------------------------

def _zp_loader(ctx: LowerCtx, slot: int, n_cols: int | None):
    """A zero point input: None, a scalar, or (for B) one per column of N."""
    if not _present(ctx.node, slot):
        return None
    t = ctx.in_types[slot]
    size = int(np.prod([int(d) for d in t.shape])) if t.shape else 1
    if size == 1:
        return ("scalar", t.dtype)
    if n_cols is not None and size == n_cols:
        return ("col", t.dtype)
    raise _unsupported(ctx.node, f"zero point of shape {tuple(t.shape)} (per-tensor or "
                                 "per-column of B only)")


def _int_matmul(ctx: LowerCtx, a_slot: int, b_slot: int, a_zp: int | None, b_zp: int | None,
                store: Any, extra_ptrs: Sequence[int]) -> None:
    a_t, b_t = ctx.in_types[a_slot], ctx.in_types[b_slot]
    ash, bsh = tuple(int(d) for d in a_t.shape), tuple(int(d) for d in b_t.shape)
    _, M, K, N, _, _ = _matmul_dims(ash, bsh)
    za = _zp_loader(ctx, a_zp, None) if a_zp is not None else None
    zb = _zp_loader(ctx, b_zp, N) if b_zp is not None else None

    def prologue(b: ir.IRBuilder) -> dict:
        P = {"a": ctx.in_ptr(b, a_slot), "b": ctx.in_ptr(b, b_slot),
             "y": ctx.out_ptr(b, 0)}
        if za is not None:
            P["za"] = load_as(b, ctx.in_ptr(b, a_zp), i64(0), za[1], I32, 1)
        if zb is not None:
            P["zbp"] = ctx.in_ptr(b, b_zp)
            if zb[0] == "scalar":
                P["zb"] = load_as(b, P["zbp"], i64(0), zb[1], I32, 1)
        for s in extra_ptrs:
            P[s] = ctx.in_ptr(b, s)
        return P

    def load_a(b: ir.IRBuilder, P: dict, off: ir.Value) -> ir.Value:
        v = load_as(b, P["a"], off, a_t.dtype, I32, 1)
        return b.sub(v, P["za"]) if "za" in P else v

    def load_b(b: ir.IRBuilder, P: dict, off: ir.Value, n: ir.Value, w: int) -> ir.Value:
        v = load_as(b, P["b"], off, b_t.dtype, I32, w)
        if zb is None:
            return v
        if zb[0] == "scalar":
            z = P["zb"]
            return b.sub(v, emit.splat(b, z, w) if w > 1 else z)
        return b.sub(v, load_as(b, P["zbp"], n, zb[1], I32, w))

    emit_matmul_nest(ctx, ash, bsh, I32, load_a, load_b, store, prologue)


def _lower_matmul_integer(ctx: LowerCtx) -> None:
    def store(b: ir.IRBuilder, P: dict, v: ir.Value, off: ir.Value, n: ir.Value) -> None:
        st = b.store(v, emit.gep(b, P["y"], off, emit.I32))
        st.align = 4

    _int_matmul(ctx, 0, 1, 2, 3, store, ())
    ctx.notes["matmul"] = "int8 loop nest"


def _lower_qlinear_matmul(ctx: LowerCtx) -> None:
    n = ctx.node
    odt = np.dtype(ctx.out_types[0].dtype)
    lo, hi = _int_range(odt)
    bt = ctx.in_types[3]
    N = int(bt.shape[-1]) if len(bt.shape) > 1 else 1
    for s in (1, 6):
        if ctx.in_types[s].numel != 1:
            raise _unsupported(n, f"input {s} must be a per-tensor scale")
    b_scale_cols = ctx.in_types[4].numel != 1
    if b_scale_cols and ctx.in_types[4].numel != N:
        raise _unsupported(n, "b_scale must be per-tensor or per-column")
    for s in (2, 5, 7):
        if (_present(n, s) and ctx.in_types[s].numel != 1
                and not (s == 5 and ctx.in_types[s].numel == N)):
            raise _unsupported(n, f"input {s} must be a per-tensor zero point")
    sdt = [np.dtype(ctx.in_types[s].dtype) for s in (1, 4, 6)]
    # the reference computes a_scale * b_scale / y_scale in the scales' dtype, then
    # multiplies the int32 sums by it (in float64 where the scales are float16/32
    # mixed with int32 promotion: int32 * float32 -> float64 in NumPy)
    mdt = np.result_type(*sdt)

    def multiplier(b: ir.IRBuilder, P: dict, n_: ir.Value, w: int) -> ir.Value:
        E = Expr(b, w)

        def ld(slot: int, idx: ir.Value) -> TV:
            t = ctx.in_types[slot]
            v = load_as(b, P[slot], idx, t.dtype, np.dtype(t.dtype), w if (
                slot == 4 and b_scale_cols) else 1)
            tv = TV(v, np.dtype(t.dtype))
            if w > 1 and not (slot == 4 and b_scale_cols):
                tv = TV(emit.splat(b, tv.v, w), tv.dtype)
            return E.cast(tv, mdt)

        m = E.div(E.mul(ld(1, i64(0)), ld(4, n_ if b_scale_cols else i64(0))), ld(6, i64(0)))
        return E.cast(m, np.dtype(np.float64)).v

    has_yzp = _present(n, 7)

    def store(b: ir.IRBuilder, P: dict, v: ir.Value, off: ir.Value, n_: ir.Value) -> None:
        w = v.type.count if isinstance(v.type, ir.VectorType) else 1
        E = Expr(b, w)
        acc = E.cast(TV(v, I32), np.dtype(np.float64))
        d = E.mul(acc, TV(multiplier(b, P, n_, w), np.dtype(np.float64)))
        if has_yzp:
            zt = ctx.in_types[7]
            z = TV(load_as(b, P[7], i64(0), zt.dtype, np.dtype(np.float64), 1),
                   np.dtype(np.float64))
            if w > 1:
                z = TV(emit.splat(b, z.v, w), z.dtype)
            d = E.add(d, z)
        q = E.call("llvm.roundeven", d)
        q = E.min(E.max(q, E.const(float(lo), np.float64)), E.const(float(hi), np.float64))
        r = E.cast(q, odt)
        st = b.store(r.v, emit.gep(b, P["y"], off, emit.llvm_type(odt)))
        st.align = 1

    extra = [1, 4, 6] + ([7] if has_yzp else [])
    _int_matmul(ctx, 0, 3, 2 if _present(n, 2) else None, 5 if _present(n, 5) else None,
                store, extra)
    ctx.notes["matmul"] = "int8 loop nest, requantised"


register_lowering("QuantizeLinear")(_lower_quantize)
register_lowering("DequantizeLinear")(_lower_dequantize)
register_lowering("DynamicQuantizeLinear")(_lower_dynamic_quantize)
register_lowering("MatMulInteger")(_lower_matmul_integer)
register_lowering("QLinearMatMul")(_lower_qlinear_matmul)
