"""Lowerings of the reductions, softmax, normalisations and scans (cannc/ir/ops/reduce.py).

Shape-polymorphic kernels (codegen/ABI.md "Runtime dimensions"): the ops below
declare a tiling function. The rows (batch x sequence...) are runtime dims; every
extent of Reduce* (axes as attributes) and Softmax/LogSoftmax/Hardmax is (the
reduced length is a sequence length in attention scores). The widths
that stay static (LayerNorm's normalised width, InstanceNorm/GroupNorm's
spatial size and channels) are in the Tiling key.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...artifact import Tiling
from ...errors import UnsupportedOpError
from ...ir.graph import Node
from ...ir.ops.reduce import (
    REDUCES,
    bn_param_shape,
    ln_params,
    node_reduce_axes,
    norm_axis,
    softmax_axes,
)
from ...ir.ops.reduce import reduce_axes as reduce_axes_of
from ...ir.types import TensorType
from .. import reduce as R
from ..elementwise import TV, Expr, emit_map, map_tiling
from ..kernel import ConstRef, LowerCtx
from .base import register_lowering

Types = list["TensorType | None"]


def _unsupported(ctx: LowerCtx, reason: str) -> UnsupportedOpError:
    n = ctx.node
    return UnsupportedOpError([(n.name, n.op_type, n.domain, n.opset, reason)])


def _static_shape(t: TensorType | None) -> list[int] | None:
    """The shape of an input a tiling function can handle: known, nothing empty."""
    if t is None or not t.shape:
        return None
    shape = [int(d) for d in t.shape]
    return None if 0 in shape else shape


def _rows_ext(ctx: LowerCtx, rows: int) -> int | R.RtDim:
    """The row count a lowering emits: a runtime dim under a Tiling."""
    return R.RtDim(R.ROWS_DIM) if getattr(ctx, "tiling", None) is not None else rows


# ---------------------------------------------------------------------------
# Reduce*
# ---------------------------------------------------------------------------

def reduce_axes(ctx: LowerCtx, axes_input_from: int) -> list[int]:
    """The reduced axes (normalised, sorted); [] reduces nothing (noop_with_empty_axes)."""
    rank = len(ctx.in_types[0].shape)
    node = ctx.node
    if ctx.opset >= axes_input_from:
        axes = None
        if len(node.inputs) > 1 and node.inputs[1]:
            c = ctx.const(1)
            if c is None:
                raise _unsupported(ctx, "axes given as a runtime input (must be constant)")
            axes = [int(a) for a in np.asarray(c).reshape(-1)]
        noop = int(ctx.attr("noop_with_empty_axes", 0))
    else:
        axes = ctx.attr("axes", None)
        axes = None if axes is None else [int(a) for a in axes]
        noop = 0
    if not axes:
        return [] if noop else list(range(rank))
    return sorted({norm_axis(a, rank) for a in axes})


def _make_reduce_tiling(kind: str, axes_input_from: int):
    npasses = 2 if kind == "logsumexp" else 1
    fpe = npasses * (10 if kind == "logsumexp" else 1)

    def tiling(n: Node, ins: Types, outs: list[TensorType],
               values: Sequence[np.ndarray | None] = ()) -> Tiling | None:
        shape = _static_shape(ins[0])
        if shape is None:
            return None
        axes = node_reduce_axes(n, len(shape), axes_input_from)
        if axes is None:          # the axes are an input: its constant value
            value = values[1] if len(values) > 1 else None
            if value is None:     # (a runtime input: the lowering says it is unsupported)
                return None
            axes = reduce_axes_of(n, len(shape), axes_input_from, value)
        plan = R.poly_layout(shape, axes) if axes else None
        if plan is None:          # nothing reduced
            return None
        struct, lay, extra = plan
        wide = R.reduce_wide(kind, ins[0].dtype, extra[0], lay.row)
        return R.poly_tiling(("reduce", struct, wide), shape, plan, npasses, fpe)
    return tiling


def _make_reduce(kind: str, axes_input_from: int):
    def lower(ctx: LowerCtx) -> None:
        axes = reduce_axes(ctx, axes_input_from)
        if np.dtype(ctx.in_types[0].dtype) == np.bool_:
            # bool is stored as uint8 0/1: max is any, min is all
            shape = [int(d) for d in ctx.in_types[0].shape]
            if kind == "min" and any(shape[a] == 0 for a in axes):
                raise _unsupported(ctx, "ReduceMin of bool over an empty set")
            u8 = np.dtype(np.uint8)
            ctx.in_types = [TensorType(u8, ctx.in_types[0].shape)] + list(ctx.in_types[1:])
            ctx.out_types = [TensorType(u8, t.shape) for t in ctx.out_types]
        R.emit_reduce(ctx, kind, axes)
    return lower


for _name, _kind, _dts, _from in REDUCES:
    register_lowering(_name, tiling=_make_reduce_tiling(_kind, _from), tiling_values=True)(
        _make_reduce(_kind, _from))


def _lower_global_pool(kind: str):
    def lower(ctx: LowerCtx) -> None:
        rank = len(ctx.in_types[0].shape)
        R.emit_reduce(ctx, kind, list(range(2, rank)))
    return lower


def _global_pool_tiling(kind: str):
    """As _make_reduce_tiling: the reduction over axes 2.. with runtime extents (the
    batch, and the channels and spatial size too)."""
    def tiling(n: Node, ins: Types, outs: list[TensorType]) -> Tiling | None:
        shape = _static_shape(ins[0])
        plan = R.poly_layout(shape, list(range(2, len(shape)))) if shape else None
        if plan is None:          # rank 2: nothing reduced
            return None
        struct, lay, extra = plan
        wide = R.reduce_wide(kind, ins[0].dtype, extra[0], lay.row)
        return R.poly_tiling(("reduce", struct, wide), shape, plan, 1, 1)
    return tiling


register_lowering("GlobalAveragePool", tiling=_global_pool_tiling("mean"))(
    _lower_global_pool("mean"))
register_lowering("GlobalMaxPool", tiling=_global_pool_tiling("max"))(_lower_global_pool("max"))


# ---------------------------------------------------------------------------
# ArgMax / ArgMin
# ---------------------------------------------------------------------------

def _make_arg(want_max: bool):
    def lower(ctx: LowerCtx) -> None:
        rank = len(ctx.in_types[0].shape)
        axis = norm_axis(int(ctx.attr("axis", 0)), rank)
        last = bool(ctx.attr("select_last_index", 0))
        R.emit_argreduce(ctx, axis, want_max, last)
    return lower


for _name, _mx in (("ArgMax", True), ("ArgMin", False)):
    register_lowering(_name)(_make_arg(_mx))


# ---------------------------------------------------------------------------
# Softmax, LogSoftmax, Hardmax
# ---------------------------------------------------------------------------

def _make_softmax_tiling(kind: str):
    npasses, fpe = (2, 2) if kind == "hardmax" else (3, 15)

    def tiling(n: Node, ins: Types, outs: list[TensorType]) -> Tiling | None:
        shape = _static_shape(ins[0])
        if shape is None:
            return None
        plan = R.poly_layout(shape, softmax_axes(n, len(shape)))
        if plan is None:
            return None
        return R.poly_tiling((kind, plan[0]), shape, plan, npasses, fpe)
    return tiling


def _make_softmax(kind: str):
    def lower(ctx: LowerCtx) -> None:
        shape = ctx.in_types[0].shape
        if getattr(ctx, "tiling", None) is not None:
            plan = R.poly_layout(shape, softmax_axes(ctx.node, len(shape)))
            assert plan is not None
            lay = plan[1]
        else:
            lay = R.make_layout(shape, softmax_axes(ctx.node, len(shape)))
        R.emit_softmax(ctx, lay, kind)
    return lower


for _name, _kind in (("Softmax", "softmax"), ("LogSoftmax", "logsoftmax"),
                     ("Hardmax", "hardmax")):
    register_lowering(_name, tiling=_make_softmax_tiling(_kind))(_make_softmax(_kind))


# ---------------------------------------------------------------------------
# LayerNormalization, RMSNormalization
# ---------------------------------------------------------------------------

def _ln_tiling(rms: bool):
    def tiling(n: Node, ins: Types, outs: list[TensorType]) -> Tiling | None:
        shape = _static_shape(ins[0])
        if shape is None:
            return None
        rank = len(shape)
        axis = norm_axis(int(n.attrs.get("axis", -1)), rank)
        rows = int(np.prod(shape[:axis])) if axis else 1
        rlen = int(np.prod(shape[axis:])) if axis < rank else 1
        reason, periods = ln_params(n, list(ins) + [None] * (3 - len(ins)))
        if reason:
            return None
        # the rows are runtime; the normalised width and the parameters' periods static
        return R.row_tiling(("ln", rlen, tuple(periods)), rows, rlen, 2 if rms else 3, 8)
    return tiling


def _param(slot: int, period: int, rlen: int) -> R.Param | None:
    if period == 0:
        return None
    if period == 1:
        return R.Param(slot, "scalar")
    return R.Param(slot, "elem", period=period)


def _lower_ln_like(ctx: LowerCtx, rms: bool) -> None:
    xt = ctx.in_types[0]
    shape = [int(d) for d in xt.shape]
    rank = len(shape)
    axis = norm_axis(int(ctx.attr("axis", -1)), rank)
    rows = int(np.prod(shape[:axis])) if axis else 1
    rlen = int(np.prod(shape[axis:])) if axis < rank else 1
    ins = list(ctx.in_types) + [None] * (3 - len(ctx.in_types))
    reason, periods = ln_params(ctx.node, ins)
    if reason:
        raise _unsupported(ctx, reason)
    scale = _param(1, periods[0], rlen)
    bias = _param(2, periods[1], rlen) if not rms else None
    partial = [p for p in periods if 1 < p < rlen]
    split = [(rlen // partial[0], partial[0]), (partial[0], 1)] if partial else None
    outs = ctx.node.outputs
    mean_out = 1 if (not rms and len(outs) > 1 and outs[1]) else None
    rstd_out = 2 if (not rms and len(outs) > 2 and outs[2]) else None
    eps = float(ctx.attr("epsilon", 1e-5))
    R.layer_norm(ctx, _rows_ext(ctx, rows), rlen, eps, scale, bias, mean_out, rstd_out, rms=rms,
                 split=split)


@register_lowering("LayerNormalization", tiling=_ln_tiling(rms=False))
def _lower_layer_norm(ctx: LowerCtx) -> None:
    _lower_ln_like(ctx, rms=False)


@register_lowering("RMSNormalization", tiling=_ln_tiling(rms=True))
def _lower_rms_norm(ctx: LowerCtx) -> None:
    _lower_ln_like(ctx, rms=True)


# ---------------------------------------------------------------------------
# InstanceNormalization, GroupNormalization
# ---------------------------------------------------------------------------

def _nc_tiling(n: Node, ins: Types, outs: list[TensorType]) -> Tiling | None:
    """InstanceNorm / GroupNorm: the batch is runtime; channels, groups and the spatial
    size are static."""
    shape = _static_shape(ins[0])
    if shape is None or len(shape) < 2:
        return None
    c = shape[1]
    hw = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    g = int(n.attrs.get("num_groups", c)) if n.op_type == "GroupNormalization" else c
    if g <= 0 or c % g:
        return None
    return R.row_tiling(("nc", c, g, hw), shape[0] * g, (c // g) * hw, 3, 8)


@register_lowering("InstanceNormalization", tiling=_nc_tiling)
def _lower_instance_norm(ctx: LowerCtx) -> None:
    shape = [int(d) for d in ctx.in_types[0].shape]
    n_, c = shape[0], shape[1]
    hw = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    eps = float(ctx.attr("epsilon", 1e-5))
    R.layer_norm(ctx, _rows_ext(ctx, n_ * c), hw, eps, R.Param(1, "row", nrows=c),
                 R.Param(2, "row", nrows=c))


@register_lowering("GroupNormalization", tiling=_nc_tiling)
def _lower_group_norm(ctx: LowerCtx) -> None:
    shape = [int(d) for d in ctx.in_types[0].shape]
    n_, c = shape[0], shape[1]
    hw = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    g = int(ctx.attr("num_groups"))
    eps = float(ctx.attr("epsilon", 1e-5))
    cpg = c // g
    split = None
    if ctx.opset < 21 or cpg == 1:
        # opset 18: scale/bias per group (= per row); 21 with one channel per group too
        sc, bi = R.Param(1, "row", nrows=g), R.Param(2, "row", nrows=g)
    else:
        sc = R.Param(1, "seg", nrows=g, seg_div=cpg)
        bi = R.Param(2, "seg", nrows=g, seg_div=cpg)
        if hw > 1:
            split = [(cpg, hw), (hw, 1)]
    R.layer_norm(ctx, _rows_ext(ctx, n_ * g), cpg * hw, eps, sc, bi, split=split)


# ---------------------------------------------------------------------------
# BatchNormalization (inference)
# ---------------------------------------------------------------------------

def _bn_fold(which: int, pshape: tuple, eps: float, cdt: np.dtype, sc: np.ndarray,
             b: np.ndarray, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """Inference BatchNorm as y = x*s + t: s (which=0) or t (which=1), folded in
    float64 and kept in the compute dtype (float32 for float16 inputs)."""
    sc, b, mean, var = (np.asarray(c, np.float64).reshape(pshape) for c in (sc, b, mean, var))
    s = sc / np.sqrt(var + np.float64(np.float32(eps)))
    return (s if which == 0 else b - mean * s).astype(cdt)


def _bn_tiling(n: Node, ins: Types, outs: list[TensorType]) -> Tiling | None:
    """A broadcasting map (codegen.elementwise.map_tiling): the batch and spatial extents
    are runtime. The four parameters take part in the pattern even when the lowering
    folds them into two (scale, shift)."""
    shape = _static_shape(ins[0])
    if shape is None or len(shape) < 2:
        return None
    pt = TensorType(ins[0].dtype, bn_param_shape(n, shape))
    return map_tiling([ins[0]] + [pt] * 4, outs[:1], 2)


@register_lowering("BatchNormalization", tiling=_bn_tiling)
def _lower_batch_norm(ctx: LowerCtx) -> None:
    xt = ctx.in_types[0]
    shape = tuple(int(d) for d in xt.shape)
    xdt = np.dtype(xt.dtype)
    eps = float(ctx.attr("epsilon", 1e-5))
    pshape = bn_param_shape(ctx.node, shape)
    consts = [ctx.const(i) for i in range(1, 5)]
    cdt = R.compute_dtype(xdt)
    if all(c is not None for c in consts):
        refs = [ConstRef(i) for i in range(1, 5)]
        ctx.replace_const(1, _bn_fold, 0, pshape, eps, cdt, *refs)
        ctx.replace_const(2, _bn_fold, 1, pshape, eps, cdt, *refs)
        pt = TensorType(cdt, pshape)

        def expr(E: Expr, ops: Sequence[TV]) -> list[TV]:
            x, s_, t_ = (E.cast(v, cdt) for v in ops)
            return [E.cast(E.fma(x, s_, t_), xdt)]

        emit_map(ctx, [xt, pt, pt], ctx.out_types[:1], expr, operand_slots=[0, 1, 2],
                 folded_types=[pt, pt])
        ctx.flops = xt.numel * 2
        return

    types = [xt] + [TensorType(ctx.in_types[i].dtype, pshape) for i in range(1, 5)]

    def expr_rt(E: Expr, ops: Sequence[TV]) -> list[TV]:
        x, sc_, b_, m_, v_ = (E.cast(v, cdt) for v in ops)
        inv = E.div(sc_, E.call("llvm.sqrt", E.add(v_, E.const(eps, cdt))))
        return [E.cast(E.fma(E.sub(x, m_), inv, b_), xdt)]

    emit_map(ctx, types, ctx.out_types[:1], expr_rt, operand_slots=[0, 1, 2, 3, 4])
    ctx.flops = xt.numel * 4


# ---------------------------------------------------------------------------
# LpNormalization, MeanVarianceNormalization
# ---------------------------------------------------------------------------

@register_lowering("LpNormalization")
def _lower_lp(ctx: LowerCtx) -> None:
    rank = len(ctx.in_types[0].shape)
    axis = norm_axis(int(ctx.attr("axis", -1)), rank)
    R.emit_lp_norm(ctx, axis, int(ctx.attr("p", 2)))


@register_lowering("MeanVarianceNormalization")
def _lower_mvn(ctx: LowerCtx) -> None:
    rank = len(ctx.in_types[0].shape)
    axes = ctx.attr("axes", [0, 2, 3])
    R.emit_mvn(ctx, sorted({norm_axis(int(a), rank) for a in axes}))


# ---------------------------------------------------------------------------
# CumSum
# ---------------------------------------------------------------------------

@register_lowering("CumSum")
def _lower_cumsum(ctx: LowerCtx) -> None:
    c = ctx.const(1)
    if c is None:
        raise _unsupported(ctx, "the axis is a runtime input (must be constant)")
    rank = len(ctx.in_types[0].shape)
    axis = norm_axis(int(np.asarray(c).reshape(-1)[0]), max(rank, 1))
    R.emit_cumsum(ctx, axis, bool(ctx.attr("exclusive", 0)), bool(ctx.attr("reverse", 0)))


