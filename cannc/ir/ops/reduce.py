"""Reductions, arg-reductions, softmax, normalisations and scans.

Each op reads its ONNX semantics per opset version here (axes as attribute or
input, keepdims, noop_with_empty_axes, the 2-D coercion of Softmax before 13,
GroupNormalization's per-group (18) vs per-channel (21) scale) and hands a
layout plus a list of passes to the shared emitters in codegen/reduce.py.

Shape-polymorphic kernels (codegen/ABI.md "Runtime dimensions"): the ops below
declare a tiling function. The rows (batch x sequence...) are runtime dims; every
extent of Reduce* (axes as attributes) and Softmax/LogSoftmax/Hardmax is (the
reduced length is a sequence length in attention scores). The widths
that stay static (LayerNorm's normalised width, InstanceNorm/GroupNorm's
spatial size and channels) are in the Tiling key.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ...codegen import reduce as R
from ...codegen.elementwise import TV, Expr, emit_map, map_tiling
from ...codegen.kernel import ConstRef
from ...errors import UnsupportedOpError
from ..graph import Node
from ..registry import Category, Fusion, OpDef, register
from ..types import TensorType

FLOATS = frozenset({"float32", "float64", "float16", "bfloat16"})
INTS = frozenset({"int32", "int64", "uint32", "uint64"})
SMALL_INTS = frozenset({"int8", "uint8", "int16", "uint16"})


def _unsupported(ctx: Any, reason: str) -> UnsupportedOpError:
    n = ctx.node
    return UnsupportedOpError([(n.name, n.op_type, n.domain, n.opset, reason)])


def _dtype_check(allowed: frozenset[str], what: str = "input"):
    def check(n: Node, ins: list, outs: list) -> str | None:
        t = ins[0] if ins else None
        if t is not None and np.dtype(t.dtype).name not in allowed:
            return f"{what} dtype {np.dtype(t.dtype).name} not supported " \
                   f"(supported: {', '.join(sorted(allowed))})"
        return None
    return check


def _same_as_input(n: Node, ins: list) -> list[TensorType]:
    """Type inference for function ops ONNX infers nothing for: Y is like X."""
    return [TensorType(ins[0].dtype, tuple(ins[0].shape))]


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _static_shape(t: TensorType | None) -> list[int] | None:
    """The shape of an input a tiling function can handle: known, nothing empty."""
    if t is None or not t.shape:
        return None
    shape = [int(d) for d in t.shape]
    return None if 0 in shape else shape


def _rows_ext(ctx: Any, rows: int) -> int | R.RtDim:
    """The row count a lowering emits: a runtime dim under a Tiling."""
    return R.RtDim(R.ROWS_DIM) if getattr(ctx, "tiling", None) is not None else rows


# ---------------------------------------------------------------------------
# Reduce*
# ---------------------------------------------------------------------------

# (op, kind, input dtypes, first opset whose axes come as an input)
_REDUCES = [
    ("ReduceSum", "sum", FLOATS | INTS, 13),
    ("ReduceMean", "mean", FLOATS | INTS, 18),
    ("ReduceMax", "max", FLOATS | INTS | SMALL_INTS | {"bool"}, 18),
    ("ReduceMin", "min", FLOATS | INTS | SMALL_INTS | {"bool"}, 18),
    ("ReduceProd", "prod", FLOATS | INTS, 18),
    ("ReduceL1", "l1", FLOATS | INTS, 18),
    ("ReduceL2", "l2", FLOATS, 18),
    ("ReduceLogSum", "logsum", FLOATS, 18),
    ("ReduceLogSumExp", "logsumexp", FLOATS, 18),
    ("ReduceSumSquare", "sumsquare", FLOATS | INTS, 18),
]


def reduce_axes(ctx: Any, axes_input_from: int) -> list[int]:
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
    return sorted({_norm_axis(a, rank) for a in axes})


def _node_reduce_axes(n: Node, rank: int, axes_input_from: int) -> list[int] | None:
    """reduce_axes for a tiling function (no constants there): None when the axes are an
    input (their values are not known here)."""
    if n.opset >= axes_input_from:
        if len(n.inputs) > 1 and n.inputs[1]:
            return None
        return [] if int(n.attrs.get("noop_with_empty_axes", 0)) else list(range(rank))
    axes = n.attrs.get("axes", None)
    if not axes:
        return list(range(rank))
    return sorted({_norm_axis(int(a), rank) for a in axes})


def _make_reduce_tiling(kind: str, axes_input_from: int):
    npasses = 2 if kind == "logsumexp" else 1
    fpe = npasses * (10 if kind == "logsumexp" else 1)

    def tiling(n: Node, ins: list, outs: list) -> Any:
        shape = _static_shape(ins[0])
        if shape is None:
            return None
        axes = _node_reduce_axes(n, len(shape), axes_input_from)
        plan = R.poly_layout(shape, axes) if axes else None
        if plan is None:          # nothing reduced
            return None
        struct, lay, extra = plan
        wide = R.reduce_wide(kind, ins[0].dtype, extra[0], lay.row)
        return R.poly_tiling(("reduce", struct, wide), shape, plan, npasses, fpe)
    return tiling


def _make_reduce(kind: str, axes_input_from: int):
    def lower(ctx: Any) -> None:
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


for _name, _kind, _dts, _from in _REDUCES:
    # dtypes stay None: the int64 axes input would fail a check over all tensors
    register(OpDef(name=_name, category=Category.REDUCTION, lower=_make_reduce(_kind, _from),
                   check=_dtype_check(_dts), tiling=_make_reduce_tiling(_kind, _from),
                   value_inputs=(1,),
                   doc=f"reduce ({_kind}); axes as input from opset {_from}; "
                       f"data: {', '.join(sorted(_dts))}"))


def _lower_global_pool(kind: str):
    def lower(ctx: Any) -> None:
        rank = len(ctx.in_types[0].shape)
        R.emit_reduce(ctx, kind, list(range(2, rank)))
    return lower


def _global_pool_tiling(kind: str):
    """As _make_reduce_tiling: the reduction over axes 2.. with runtime extents (the
    batch, and the channels and spatial size too)."""
    def tiling(n: Node, ins: list, outs: list) -> Any:
        shape = _static_shape(ins[0])
        plan = R.poly_layout(shape, list(range(2, len(shape)))) if shape else None
        if plan is None:          # rank 2: nothing reduced
            return None
        struct, lay, extra = plan
        wide = R.reduce_wide(kind, ins[0].dtype, extra[0], lay.row)
        return R.poly_tiling(("reduce", struct, wide), shape, plan, 1, 1)
    return tiling


register(OpDef(name="GlobalAveragePool", category=Category.REDUCTION, dtypes=FLOATS,
               lower=_lower_global_pool("mean"), tiling=_global_pool_tiling("mean")))
register(OpDef(name="GlobalMaxPool", category=Category.REDUCTION, dtypes=FLOATS,
               lower=_lower_global_pool("max"), tiling=_global_pool_tiling("max")))


# ---------------------------------------------------------------------------
# ArgMax / ArgMin
# ---------------------------------------------------------------------------

def _make_arg(want_max: bool):
    def lower(ctx: Any) -> None:
        rank = len(ctx.in_types[0].shape)
        axis = _norm_axis(int(ctx.attr("axis", 0)), rank)
        last = bool(ctx.attr("select_last_index", 0))
        R.emit_argreduce(ctx, axis, want_max, last)
    return lower


for _name, _mx in (("ArgMax", True), ("ArgMin", False)):
    register(OpDef(name=_name, category=Category.REDUCTION, lower=_make_arg(_mx),
                   check=_dtype_check(FLOATS | INTS | SMALL_INTS),
                   doc="data: floats and ints; int64 indices"))


# ---------------------------------------------------------------------------
# Softmax, LogSoftmax, Hardmax
# ---------------------------------------------------------------------------

def _softmax_axes(n: Node, rank: int) -> list[int]:
    if n.opset < 13:
        # the input is coerced to 2-D [prod(shape[:axis]), prod(shape[axis:])]
        axis = _norm_axis(int(n.attrs.get("axis", 1)), rank)
        return list(range(axis, rank))
    return [_norm_axis(int(n.attrs.get("axis", -1)), rank)]


def softmax_axes(ctx: Any) -> list[int]:
    return _softmax_axes(ctx.node, len(ctx.in_types[0].shape))


def _make_softmax_tiling(kind: str):
    npasses, fpe = (2, 2) if kind == "hardmax" else (3, 15)

    def tiling(n: Node, ins: list, outs: list) -> Any:
        shape = _static_shape(ins[0])
        if shape is None:
            return None
        plan = R.poly_layout(shape, _softmax_axes(n, len(shape)))
        if plan is None:
            return None
        return R.poly_tiling((kind, plan[0]), shape, plan, npasses, fpe)
    return tiling


def _make_softmax(kind: str):
    def lower(ctx: Any) -> None:
        shape = ctx.in_types[0].shape
        if getattr(ctx, "tiling", None) is not None:
            plan = R.poly_layout(shape, softmax_axes(ctx))
            assert plan is not None
            lay = plan[1]
        else:
            lay = R.make_layout(shape, softmax_axes(ctx))
        R.emit_softmax(ctx, lay, kind)
    return lower


for _name, _kind in (("Softmax", "softmax"), ("LogSoftmax", "logsoftmax"),
                     ("Hardmax", "hardmax")):
    register(OpDef(name=_name, category=Category.REDUCTION, lower=_make_softmax(_kind),
                   dtypes=FLOATS, tiling=_make_softmax_tiling(_kind),
                   prologue=None if _kind == "hardmax" else Fusion(
                       rule="softmax_prologue", fused_op="FusedSoftmax")))


# ---------------------------------------------------------------------------
# LayerNormalization, RMSNormalization
# ---------------------------------------------------------------------------

def _param_period(pt: TensorType | None, xshape: Sequence[int], axis: int) -> int | None:
    """numel of a scale/bias broadcast over the normalised dims shape[axis:]: it must
    be a scalar or cover trailing dims (leading 1s allowed). None: unsupported."""
    if pt is None:
        return 0
    ps = [int(d) for d in pt.shape]
    while ps and ps[0] == 1:
        ps = ps[1:]
    if not ps:
        return 1
    norm = [int(d) for d in xshape[axis:]]
    if len(ps) > len(norm) or norm[len(norm) - len(ps):] != ps:
        return None
    return int(np.prod(ps))


def _ln_params(n: Node, ins: list, axis_default: int = -1) -> tuple[str | None, list[int]]:
    x = ins[0]
    rank = len(x.shape)
    axis = _norm_axis(int(n.attrs.get("axis", axis_default)), rank)
    rlen = int(np.prod([int(d) for d in x.shape[axis:]])) if axis < rank else 1
    periods = []
    for k in (1, 2):
        pt = ins[k] if len(ins) > k else None
        p = _param_period(pt, x.shape, axis)
        if p is None:
            return (f"input {k} of shape {tuple(pt.shape)} is not a scalar or the trailing "
                    f"dims of the normalised shape {tuple(x.shape[axis:])}"), []
        periods.append(p)
    partial = {p for p in periods if 1 < p < rlen}
    if len(partial) > 1:
        return "scale and bias broadcast with different periods", []
    return None, periods


def _ln_check(n: Node, ins: list, outs: list) -> str | None:
    r = _dtype_check(FLOATS)(n, ins, outs)
    if r:
        return r
    return _ln_params(n, ins)[0]


def _ln_tiling(rms: bool):
    def tiling(n: Node, ins: list, outs: list) -> Any:
        shape = _static_shape(ins[0])
        if shape is None:
            return None
        rank = len(shape)
        axis = _norm_axis(int(n.attrs.get("axis", -1)), rank)
        rows = int(np.prod(shape[:axis])) if axis else 1
        rlen = int(np.prod(shape[axis:])) if axis < rank else 1
        reason, periods = _ln_params(n, list(ins) + [None] * (3 - len(ins)))
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


def _lower_ln_like(ctx: Any, rms: bool) -> None:
    xt = ctx.in_types[0]
    shape = [int(d) for d in xt.shape]
    rank = len(shape)
    axis = _norm_axis(int(ctx.attr("axis", -1)), rank)
    rows = int(np.prod(shape[:axis])) if axis else 1
    rlen = int(np.prod(shape[axis:])) if axis < rank else 1
    ins = list(ctx.in_types) + [None] * (3 - len(ctx.in_types))
    reason, periods = _ln_params(ctx.node, ins)
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


register(OpDef(name="LayerNormalization", dtypes=FLOATS, category=Category.REDUCTION,
               min_opset=17, lower=lambda ctx: _lower_ln_like(ctx, rms=False), check=_ln_check,
               tiling=_ln_tiling(rms=False)))
register(OpDef(name="RMSNormalization", dtypes=FLOATS, category=Category.REDUCTION,
               min_opset=23, lower=lambda ctx: _lower_ln_like(ctx, rms=True), check=_ln_check,
               tiling=_ln_tiling(rms=True)))


# ---------------------------------------------------------------------------
# InstanceNormalization, GroupNormalization
# ---------------------------------------------------------------------------

def _nc_check(min_rank: int, dims: str) -> Any:
    """Float input of rank >= min_rank, laid out (N, C, ...)."""
    def check(n: Node, ins: list, outs: list) -> str | None:
        r = _dtype_check(FLOATS)(n, ins, outs)
        if r:
            return r
        if len(ins[0].shape) < min_rank:
            return f"the input must have rank >= {min_rank} ({dims})"
        return None
    return check


def _lower_instance_norm(ctx: Any) -> None:
    shape = [int(d) for d in ctx.in_types[0].shape]
    n_, c = shape[0], shape[1]
    hw = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    eps = float(ctx.attr("epsilon", 1e-5))
    R.layer_norm(ctx, _rows_ext(ctx, n_ * c), hw, eps, R.Param(1, "row", nrows=c),
                 R.Param(2, "row", nrows=c))


def _nc_tiling(n: Node, ins: list, outs: list) -> Any:
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


register(OpDef(name="InstanceNormalization", dtypes=FLOATS, category=Category.REDUCTION,
               lower=_lower_instance_norm, check=_nc_check(3, "N, C, D1, ..."), tiling=_nc_tiling))


def _gn_check(n: Node, ins: list, outs: list) -> str | None:
    r = _nc_check(2, "N, C, ...")(n, ins, outs)
    if r:
        return r
    g = int(n.attrs.get("num_groups", 0))
    c = int(ins[0].shape[1])
    if g <= 0 or c % g:
        return f"num_groups {g} does not divide the {c} channels"
    want = g if n.opset < 21 else c
    for k in (1, 2):
        if len(ins) > k and ins[k] is not None and int(np.prod(ins[k].shape)) != want:
            return f"input {k} must have {want} elements (opset {n.opset})"
    return None


def _lower_group_norm(ctx: Any) -> None:
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


# ONNX has no shape inference for GroupNormalization (a function op): extra["infer"]
register(OpDef(name="GroupNormalization", dtypes=FLOATS, category=Category.REDUCTION,
               min_opset=18, lower=_lower_group_norm, check=_gn_check, tiling=_nc_tiling,
               extra={"infer": _same_as_input},
               doc="opset 18: scale/bias per group; 21: per channel"))


# ---------------------------------------------------------------------------
# BatchNormalization (inference)
# ---------------------------------------------------------------------------

def _bn_check(n: Node, ins: list, outs: list) -> str | None:
    r = _dtype_check(FLOATS)(n, ins, outs)
    if r:
        return r
    if int(n.attrs.get("training_mode", 0)):
        return "training_mode=1 (only inference is supported)"
    if any(o for o in n.outputs[1:]):
        return "running/saved mean and variance outputs are training-mode outputs " \
               "(only inference is supported)"
    if len(ins[0].shape) < 2:
        return "the input must have rank >= 2 (N, C, ...)"
    return None


def _bn_fold(which: int, pshape: tuple, eps: float, cdt: np.dtype, sc: np.ndarray,
             b: np.ndarray, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """Inference BatchNorm as y = x*s + t: s (which=0) or t (which=1), folded in
    float64 and kept in the compute dtype (float32 for float16 inputs)."""
    sc, b, mean, var = (np.asarray(c, np.float64).reshape(pshape) for c in (sc, b, mean, var))
    s = sc / np.sqrt(var + np.float64(np.float32(eps)))
    return (s if which == 0 else b - mean * s).astype(cdt)


def _bn_pshape(n: Node, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape the per-channel parameters broadcast as against the input."""
    shape = tuple(int(d) for d in shape)
    spatial = int(n.attrs.get("spatial", 1)) if n.opset < 9 else 1
    return (shape[1],) + (1,) * (len(shape) - 2) if spatial else shape[1:]


def _bn_tiling(n: Node, ins: list, outs: list) -> Any:
    """A broadcasting map (codegen.elementwise.map_tiling): the batch and spatial extents
    are runtime. The four parameters take part in the pattern even when the lowering
    folds them into two (scale, shift)."""
    shape = _static_shape(ins[0])
    if shape is None or len(shape) < 2:
        return None
    pt = TensorType(ins[0].dtype, _bn_pshape(n, shape))
    return map_tiling([ins[0]] + [pt] * 4, outs[:1], 2)


def _lower_batch_norm(ctx: Any) -> None:
    xt = ctx.in_types[0]
    shape = tuple(int(d) for d in xt.shape)
    xdt = np.dtype(xt.dtype)
    eps = float(ctx.attr("epsilon", 1e-5))
    pshape = _bn_pshape(ctx.node, shape)
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


register(OpDef(name="BatchNormalization", dtypes=FLOATS, category=Category.OPAQUE,
               min_opset=7, lower=_lower_batch_norm, check=_bn_check, tiling=_bn_tiling,
               doc="inference: per-channel scale/shift folded at compile time"))


# ---------------------------------------------------------------------------
# LpNormalization, MeanVarianceNormalization
# ---------------------------------------------------------------------------

def _lp_check(n: Node, ins: list, outs: list) -> str | None:
    r = _dtype_check(FLOATS)(n, ins, outs)
    if r:
        return r
    p = int(n.attrs.get("p", 2))
    if p not in (1, 2):
        return f"p={p} (ONNX allows 1 or 2)"
    return None


def _lower_lp(ctx: Any) -> None:
    rank = len(ctx.in_types[0].shape)
    axis = _norm_axis(int(ctx.attr("axis", -1)), rank)
    R.emit_lp_norm(ctx, axis, int(ctx.attr("p", 2)))


register(OpDef(name="LpNormalization", dtypes=FLOATS, category=Category.REDUCTION,
               lower=_lower_lp, check=_lp_check))


def _lower_mvn(ctx: Any) -> None:
    rank = len(ctx.in_types[0].shape)
    axes = ctx.attr("axes", [0, 2, 3])
    R.emit_mvn(ctx, sorted({_norm_axis(int(a), rank) for a in axes}))


register(OpDef(name="MeanVarianceNormalization", category=Category.REDUCTION, min_opset=9,
               lower=_lower_mvn, dtypes=FLOATS, extra={"infer": _same_as_input}))


# ---------------------------------------------------------------------------
# CumSum
# ---------------------------------------------------------------------------

def _lower_cumsum(ctx: Any) -> None:
    c = ctx.const(1)
    if c is None:
        raise _unsupported(ctx, "the axis is a runtime input (must be constant)")
    rank = len(ctx.in_types[0].shape)
    axis = _norm_axis(int(np.asarray(c).reshape(-1)[0]), max(rank, 1))
    R.emit_cumsum(ctx, axis, bool(ctx.attr("exclusive", 0)), bool(ctx.attr("reverse", 0)))


register(OpDef(name="CumSum", category=Category.OPAQUE, min_opset=11, lower=_lower_cumsum,
               check=_dtype_check(FLOATS | INTS), value_inputs=(1,), doc="data: floats, int32/64, uint32/64"))
