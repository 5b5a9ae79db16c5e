"""Reductions, arg-reductions, softmax, normalisations and scans: what they are.

Each op reads its ONNX semantics per opset version here (axes as attribute or
input, keepdims, noop_with_empty_axes, the 2-D coercion of Softmax before 13,
GroupNormalization's per-group (18) vs per-channel (21) scale); their lowerings
(codegen/lower/reduce.py) hand a layout plus a list of passes to the shared
emitters in codegen/reduce.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import UnsupportedOpError
from ..graph import Node
from ..registry import Amp, Category, Fusion, OpDef, register
from ..types import TensorType
from .conv import only_batch_empty

FLOATS = frozenset({"float32", "float64", "float16", "bfloat16"})
INTS = frozenset({"int32", "int64", "uint32", "uint64"})
SMALL_INTS = frozenset({"int8", "uint8", "int16", "uint16"})


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


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


# ---------------------------------------------------------------------------
# Reduce*
# ---------------------------------------------------------------------------

# (op, kind, input dtypes, first opset whose axes come as an input)
REDUCES = [
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


def node_reduce_axes(n: Node, rank: int, axes_input_from: int) -> list[int] | None:
    """The reduced axes (normalised, sorted) from the node alone ([] reduces nothing):
    None when the axes are an input (their values are not known here)."""
    if n.opset >= axes_input_from:
        if len(n.inputs) > 1 and n.inputs[1]:
            return None
        return [] if int(n.attrs.get("noop_with_empty_axes", 0)) else list(range(rank))
    axes = n.attrs.get("axes", None)
    if not axes:
        return list(range(rank))
    return sorted({norm_axis(int(a), rank) for a in axes})


def reduce_axes(n: Node, rank: int, axes_input_from: int,
                axes_value: Any = None) -> list[int]:
    """The reduced axes (normalised, sorted; [] reduces nothing), the axes input's value
    `axes_value` read where the opset takes them as an input."""
    axes = node_reduce_axes(n, rank, axes_input_from)
    if axes is not None:
        return axes
    a = np.asarray(axes_value).ravel() if axes_value is not None else np.zeros(0)
    if a.size == 0:
        return [] if int(n.attrs.get("noop_with_empty_axes", 0)) else list(range(rank))
    return sorted({norm_axis(int(v), rank) for v in a})


def _reduce_mean_reference(n: Node, inputs: list[Any]) -> list[np.ndarray]:
    """NumPy reference of ReduceMean. The mean of an empty set is 0, as onnxruntime
    computes it (ONNX leaves it undefined; NumPy's 0/0 would fold a NaN): an empty
    tensor folds like a constant, so this is what an empty batch or window answers."""
    x = np.asarray(inputs[0])
    axes = reduce_axes(n, x.ndim, 18, inputs[1] if len(inputs) > 1 else None)
    if not axes:
        return [x.copy()]
    keep = bool(int(n.attrs.get("keepdims", 1)))
    if any(x.shape[a] == 0 for a in axes):
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape) if keep or
                      i not in axes)
        return [np.zeros(shape, x.dtype)]
    # (narrow floats accumulate in float32, as the kernels do; ints divide a sum of
    # their own type, truncating, as onnxruntime does)
    acc = np.float32 if x.dtype.kind == "f" and x.dtype.itemsize < 4 else x.dtype
    y = np.mean(x, axis=tuple(axes), keepdims=keep, dtype=acc)
    return [np.asarray(y).astype(x.dtype)]


for _name, _kind, _dts, _from in REDUCES:
    # dtypes stay None: the int64 axes input would fail a check over all tensors
    register(OpDef(name=_name, category=Category.REDUCTION, check=_dtype_check(_dts),
                   value_inputs=(1,),
                   reference=_reduce_mean_reference if _kind == "mean" else None,
                   doc=f"reduce ({_kind}); axes as input from opset {_from}; "
                       f"data: {', '.join(sorted(_dts))}"))


# (a CNN's head between narrow convolutions: f32 sums in registers, under AMP narrow)
register(OpDef(name="GlobalAveragePool", category=Category.REDUCTION, dtypes=FLOATS,
               amp=Amp.FOLLOW, shape_check=only_batch_empty))
register(OpDef(name="GlobalMaxPool", category=Category.REDUCTION, dtypes=FLOATS,
               amp=Amp.FOLLOW, shape_check=only_batch_empty))


# ---------------------------------------------------------------------------
# ArgMax / ArgMin
# ---------------------------------------------------------------------------

def _arg_axis_nonempty(n: Node, ins: list) -> str | None:
    """The index of the extreme of nothing does not exist (onnxruntime rejects it too)."""
    x = ins[0] if ins else None
    if x is None or not x.is_static or x.rank == 0:
        return None
    axis = int(n.attrs.get("axis", 0))
    axis = axis + x.rank if axis < 0 else axis
    if 0 <= axis < x.rank and int(x.shape[axis]) == 0:
        return f"{n.op_type} over axis {axis}, which is empty"
    return None


for _name in ("ArgMax", "ArgMin"):
    register(OpDef(name=_name, category=Category.REDUCTION,
                   check=_dtype_check(FLOATS | INTS | SMALL_INTS),
                   shape_check=_arg_axis_nonempty,
                   doc="data: floats and ints; int64 indices"))


# ---------------------------------------------------------------------------
# Softmax, LogSoftmax, Hardmax
# ---------------------------------------------------------------------------

def softmax_axes(n: Node, rank: int) -> list[int]:
    """The normalised axes: the last `axis`.. before opset 13 (2-D coercion), else one."""
    if n.opset < 13:
        # the input is coerced to 2-D [prod(shape[:axis]), prod(shape[axis:])]
        axis = norm_axis(int(n.attrs.get("axis", 1)), rank)
        return list(range(axis, rank))
    return [norm_axis(int(n.attrs.get("axis", -1)), rank)]


def _softmax_reference(n: Node, inputs: list[Any]) -> list[np.ndarray]:
    """NumPy reference (the constant folder's) read at the node's opset: before 13 the
    input is coerced to 2-D at `axis` (onnx.reference reads every opset as 13's)."""
    x = np.asarray(inputs[0])
    r = x.ndim
    axes = softmax_axes(n, r) if r else []
    rest = [a for a in range(r) if a not in axes]
    xt = np.transpose(x, rest + axes)
    lead = xt.shape[:len(rest)]
    ct = np.float32 if x.dtype.itemsize < 4 else x.dtype
    v = xt.reshape(lead + (-1,)).astype(ct)
    if n.op_type == "Hardmax":
        y = np.zeros_like(v)
        if v.shape[-1]:
            np.put_along_axis(y, np.argmax(v, axis=-1)[..., None], 1, axis=-1)
    else:
        m = v - v.max(axis=-1, keepdims=True) if v.shape[-1] else v
        if n.op_type == "Softmax":
            e = np.exp(m)
            y = e / e.sum(axis=-1, keepdims=True)
        else:
            y = m - np.log(np.exp(m).sum(axis=-1, keepdims=True))
    y = y.reshape(xt.shape).astype(x.dtype)
    return [np.ascontiguousarray(np.transpose(y, np.argsort(rest + axes)))]


for _name in ("Softmax", "LogSoftmax", "Hardmax"):
    register(OpDef(name=_name, category=Category.REDUCTION, dtypes=FLOATS,
                   reference=_softmax_reference,
                   prologue=None if _name == "Hardmax" else Fusion(
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


def ln_params(n: Node, ins: list, axis_default: int = -1) -> tuple[str | None, list[int]]:
    """(why the scale/bias shapes are unsupported or None, their periods: 0 absent,
    1 scalar, else the numel of the trailing dims they cover)."""
    x = ins[0]
    rank = len(x.shape)
    axis = norm_axis(int(n.attrs.get("axis", axis_default)), rank)
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
    return ln_params(n, ins)[0]


register(OpDef(name="LayerNormalization", dtypes=FLOATS, category=Category.REDUCTION,
               min_opset=17, check=_ln_check))
register(OpDef(name="RMSNormalization", dtypes=FLOATS, category=Category.REDUCTION,
               min_opset=23, check=_ln_check))


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


register(OpDef(name="InstanceNormalization", dtypes=FLOATS, category=Category.REDUCTION,
               check=_nc_check(3, "N, C, D1, ...")))


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


# ONNX has no shape inference for GroupNormalization (a function op): infer=
register(OpDef(name="GroupNormalization", dtypes=FLOATS, category=Category.REDUCTION,
               min_opset=18, check=_gn_check, infer=_same_as_input,
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


def bn_param_shape(n: Node, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape BatchNormalization's per-channel parameters broadcast as against the input
    (opset < 9: per (C, D1...) element unless spatial)."""
    shape = tuple(int(d) for d in shape)
    spatial = int(n.attrs.get("spatial", 1)) if n.opset < 9 else 1
    return (shape[1],) + (1,) * (len(shape) - 2) if spatial else shape[1:]


def _bn_reference(n: Node, inputs: list[Any]) -> list[np.ndarray | None]:
    """Inference BatchNormalization at the node's opset (7/8: `spatial`); onnx.reference's
    opset-7 version returns a tuple and cannot fold."""
    x, scale, b, mean, var = (np.asarray(a) for a in inputs[:5])
    if _bn_check(n, [TensorType(x.dtype, x.shape)], []):
        raise UnsupportedOpError([(n.name, n.op_type, n.domain, n.opset,
                                   _bn_check(n, [TensorType(x.dtype, x.shape)], []) or "")])
    ps = bn_param_shape(n, x.shape)
    eps = float(n.attrs.get("epsilon", 1e-5))
    ct = np.float32 if x.dtype.itemsize < 4 else x.dtype.type
    k = (scale.astype(ct) / np.sqrt(var.astype(ct) + ct(eps))).reshape(ps)
    y = (x.astype(ct) - mean.astype(ct).reshape(ps)) * k + b.astype(ct).reshape(ps)
    return [y.astype(x.dtype)] + [None] * (len(n.outputs) - 1)


register(OpDef(name="BatchNormalization", dtypes=FLOATS, category=Category.OPAQUE,
               min_opset=7, check=_bn_check, reference=_bn_reference,
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


register(OpDef(name="LpNormalization", dtypes=FLOATS, category=Category.REDUCTION,
               check=_lp_check))


register(OpDef(name="MeanVarianceNormalization", category=Category.REDUCTION, min_opset=9,
               dtypes=FLOATS, infer=_same_as_input))


# ---------------------------------------------------------------------------
# CumSum
# ---------------------------------------------------------------------------

register(OpDef(name="CumSum", category=Category.OPAQUE, min_opset=11,
               check=_dtype_check(FLOATS | INTS), value_inputs=(1,),
               doc="data: floats, int32/64, uint32/64"))
