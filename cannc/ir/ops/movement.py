"""Data-movement ops: each output element is one input element (or a fill value).

Transpose, Concat, Split, Slice, Expand, Tile, DepthToSpace and SpaceToDepth
become lists of strided-copy pieces run by one kernel; Pad (every mode) becomes
per-dim source tables written row by row. Gather, GatherElements, GatherND,
ScatterElements, ScatterND, OneHot and Trilu read indices (or k) at run time;
every index is checked in native code: an index outside [-dim, dim) reads zeros
(gathers) or is skipped (scatters), so native code never touches memory outside
its tensors. Resize (nearest, linear) builds per-dim source tables at compile
time. The lowerings are in codegen/lower/movement.py.

Values deciding a shape (Slice starts/ends, Pad pads, Tile repeats, Expand
shape, Split sizes, OneHot depth, Resize scales/sizes) are constant by the
time a node is lowered: shape inference could not have bound the output shape
otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..graph import Node
from ..registry import Category, OpDef, register

FLOATS = frozenset({"float32", "float64", "float16"})
INTS = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})
ALL = FLOATS | INTS | {"bool", "bfloat16"}
NUMERIC = FLOATS | INTS


def _reg(name: str, dtypes: frozenset[str] = ALL, check: Any = None,
         min_opset: int = 1, doc: str = "", reference: Any = None,
         value_inputs: tuple[int, ...] = (), bytes_read: Any = None) -> None:
    register(OpDef(name=name, category=Category.INJECTIVE, dtypes=dtypes,
                   check=check, min_opset=min_opset, doc=doc,
                   reference=reference, value_inputs=value_inputs, bytes_read=bytes_read))


def _reads_output_sized(n: Node, ins: list[Any], outs: list[Any]) -> int:
    """Bytes read by an op that takes as many elements of its data (input 0) as it writes
    (a gather, a slice), plus its other inputs (indices, starts, ...) whole."""
    return sum(t.nbytes for t in outs) + sum(t.nbytes for t in ins[1:] if t is not None)


_reg("Transpose", doc="strided copy; blocked in-register transpose")
def _concat_reference(n: Node, inputs: list) -> list[np.ndarray] | None:
    """np.concatenate for the constant folder; None (the general evaluator) for anything
    unusual."""
    xs = [x for x in inputs if x is not None]
    axis = n.attrs.get("axis")
    if (not xs or axis is None or not all(isinstance(x, np.ndarray) for x in xs)
            or len({x.dtype for x in xs}) != 1 or len({x.ndim for x in xs}) != 1
            or not -xs[0].ndim <= int(axis) < xs[0].ndim):
        return None
    try:
        return [np.concatenate(xs, axis=int(axis))]
    except ValueError:
        return None


_reg("Concat", doc="one copy per input, one kernel", reference=_concat_reference)


def _split_check(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    if any(not o for o in n.outputs):
        return "an output of Split is unnamed (absent)"
    return None


_reg("Split", check=_split_check, doc="one copy per output, one kernel", value_inputs=(1,))


_reg("Slice", doc="strided copy (negative steps walk backwards)", value_inputs=(1, 2, 3, 4),
     bytes_read=_reads_output_sized)
_reg("Expand", doc="strided copy with stride-0 (broadcast) dims", value_inputs=(1,))
_reg("Tile", min_opset=6, doc="strided copy over (repeat, dim) pairs", value_inputs=(1,))


def _rank4(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    if ins and ins[0] is not None and len(ins[0].shape) != 4:
        return f"input must be 4-D (got rank {len(ins[0].shape)})"
    return None


_reg("DepthToSpace", check=_rank4, doc="transpose of a 6-D view")
_reg("SpaceToDepth", check=_rank4, doc="transpose of a 6-D view")


# ---------------------------------------------------------------------------
# Pad
# ---------------------------------------------------------------------------

PAD_MODES = ("constant", "reflect", "edge", "wrap")


def _pad_check(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    mode = n.attrs.get("mode", "constant")
    if mode not in PAD_MODES:
        return f"pad mode '{mode}' (supported: {', '.join(PAD_MODES)})"
    return None


def pad_reference(n: Any, inputs: list) -> list[np.ndarray]:
    """Pad of every opset, negative pads included (they crop, which ONNX allows and
    np.pad, which onnx.reference uses, refuses): crop first, then pad the rest."""
    x = np.asarray(inputs[0])
    r = x.ndim
    if n.opset < 11:
        pads = list(n.attrs.get("pads", n.attrs.get("paddings", [0] * 2 * r)))
        value = float(n.attrs.get("value", 0.0))
        axes = list(range(r))
    else:
        pads = [int(p) for p in np.asarray(inputs[1]).reshape(-1)]
        cv = inputs[2] if len(inputs) > 2 else None
        value = np.asarray(cv).reshape(-1)[0] if cv is not None and np.size(cv) else 0
        ax = inputs[3] if len(inputs) > 3 else None
        axes = [int(a) % r for a in np.asarray(ax).reshape(-1)] if ax is not None \
            else list(range(r))
    k = len(axes)
    before, after = [0] * r, [0] * r
    for i, a in enumerate(axes):
        before[a], after[a] = int(pads[i]), int(pads[i + k])
    crop = tuple(slice(max(-b, 0), x.shape[d] - max(-e, 0))
                 for d, (b, e) in enumerate(zip(before, after)))
    x = x[crop]
    widths = [(max(b, 0), max(e, 0)) for b, e in zip(before, after)]
    mode = n.attrs.get("mode", "constant")
    if isinstance(mode, bytes):
        mode = mode.decode()
    if mode == "constant":
        return [np.pad(x, widths, mode="constant", constant_values=value).astype(x.dtype)]
    return [np.pad(x, widths, mode={"edge": "edge", "reflect": "reflect",
                                    "wrap": "wrap"}[mode])]


_reg("Pad", check=_pad_check, doc="constant/reflect/edge/wrap; copy + fill pieces",
     value_inputs=(1, 3), reference=pad_reference)


def _gather_reference(n: Node, inputs: list) -> list[np.ndarray] | None:
    """np.take for the constant folder when every index is in range; None (the general
    evaluator) otherwise."""
    if len(inputs) < 2 or not all(isinstance(x, np.ndarray) for x in inputs[:2]):
        return None
    x, idx = inputs[0], inputs[1]
    axis = int(n.attrs.get("axis", 0))
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim or idx.dtype.kind not in "iu":
        return None
    d = x.shape[axis]
    if idx.size and (idx.min() < -d or idx.max() >= d):
        return None
    return [np.take(x, idx.astype(np.int64), axis=axis)]


_reg("Gather", doc="runtime indices, checked natively (out of range: zeros)",
     reference=_gather_reference, bytes_read=_reads_output_sized)


def _gather_elements_reference(n: Any, inputs: list) -> list[np.ndarray]:
    """np.take_along_axis (onnx.reference's GatherElements mis-handles indices
    narrower than the data on a non-gathered axis, e.g. torch.gather of
    position ids from an expanded [1, 512] buffer)."""
    data, idx = np.asarray(inputs[0]), np.asarray(inputs[1]).astype(np.int64)
    axis = int(n.attrs.get("axis", 0)) % max(data.ndim, 1)
    idx = np.where(idx < 0, idx + data.shape[axis], idx)
    if np.any(idx < 0) or np.any(idx >= data.shape[axis]):
        raise ValueError("GatherElements index out of range")
    sl = tuple(slice(0, e) if d != axis else slice(None) for d, e in enumerate(idx.shape))
    return [np.take_along_axis(data[sl], idx, axis=axis)]


_reg("GatherElements", doc="runtime indices, checked natively",
     reference=_gather_elements_reference, bytes_read=_reads_output_sized)


_reg("GatherND", doc="runtime index tuples, checked natively",
     bytes_read=_reads_output_sized)


def _scatter_check(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    how = n.attrs.get("reduction", "none")
    if how not in ("none", "add", "mul", "max", "min"):
        return f"reduction '{how}'"
    if how != "none" and ins and ins[0] is not None and np.dtype(ins[0].dtype) == np.bool_:
        return f"reduction '{how}' on bool"
    return None


_reg("ScatterElements", check=_scatter_check,
     doc="runtime indices, checked natively (out of range: skipped)")
_reg("Scatter", check=_scatter_check,
     doc="deprecated alias of ScatterElements (opset 9-10)")


_reg("ScatterND", check=_scatter_check,
     doc="runtime index tuples, checked natively (out of range: skipped)")


_reg("OneHot", doc="runtime indices (out of range: all off)", value_inputs=(1,))


def _bitcast_check(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    if ins and outs and np.dtype(ins[0].dtype).itemsize != np.dtype(outs[0].dtype).itemsize:
        return "BitCast between element types of different sizes (the shape changes)"
    return None


_reg("BitCast", check=_bitcast_check, min_opset=26,
     doc="a copy of the bits (equal element sizes)")


_reg("EyeLike", check=lambda n, ins, outs: None if ins[0] is None or len(
    ins[0].shape) == 2 else "the input must be 2-D", min_opset=9,
     doc="zeros with ones on diagonal k (only the input's shape is read)")


_reg("Trilu", min_opset=14, doc="row copies and zero fills (k may be runtime)")


# ---------------------------------------------------------------------------
# Resize / Upsample
# ---------------------------------------------------------------------------

COORD_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
               "asymmetric", "tf_half_pixel_for_nn", "tf_crop_and_resize")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
LINEAR_DTYPES = frozenset({"float32", "float64"})


def _resize_attrs(n: Node) -> tuple[str, str, str]:
    mode = n.attrs.get("mode", "nearest")
    if n.op_type == "Upsample" or n.opset < 11:
        return mode, "asymmetric", "simple"
    return (mode, n.attrs.get("coordinate_transformation_mode", "half_pixel"),
            n.attrs.get("nearest_mode", "round_prefer_floor"))


def _resize_check(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    mode, coord, nearest = _resize_attrs(n)
    if mode not in ("nearest", "linear", "bilinear", "cubic"):
        return f"mode '{mode}' (supported: nearest, linear, cubic)"
    if coord not in COORD_MODES:
        return f"coordinate_transformation_mode '{coord}'"
    if mode == "nearest" and nearest not in NEAREST_MODES + ("simple",):
        return f"nearest_mode '{nearest}'"
    if n.attrs.get("antialias", 0):
        return "antialias=1"
    if n.attrs.get("exclude_outside", 0) and mode not in ("nearest", "cubic"):
        return "exclude_outside=1"
    if mode != "nearest" and ins and ins[0] is not None \
            and np.dtype(ins[0].dtype).name not in LINEAR_DTYPES:
        return f"linear mode on {np.dtype(ins[0].dtype).name} (supported: float32, float64)"
    return None


_reg("Resize", check=_resize_check, min_opset=10,
     doc="nearest and (multi)linear; coordinate tables built at compile time",
     value_inputs=(1, 2, 3))
def _upsample_reference(n: Node, inputs: list[Any]) -> list[np.ndarray]:
    """Upsample (7: `scales` attribute; 9: input), asymmetric coordinates, nearest (floor)
    or (multi)linear, separably per dim (onnx.reference has no Upsample-7)."""
    x = np.asarray(inputs[0])
    scales = n.attrs["scales"] if n.opset < 9 else np.asarray(inputs[1]).reshape(-1)
    mode = n.attrs.get("mode", "nearest")
    ct = np.float32 if x.dtype.itemsize < 4 or x.dtype.kind != "f" else x.dtype
    y = x.astype(ct) if mode != "nearest" else x
    for d, sc in enumerate(float(v) for v in scales):
        size = x.shape[d]
        out = int(np.floor(size * sc))
        pos = np.arange(out, dtype=np.float64) / sc
        if mode == "nearest":
            y = np.take(y, np.minimum(np.floor(pos).astype(np.int64), size - 1), axis=d)
            continue
        pos = np.clip(pos, 0, size - 1)
        i0 = np.floor(pos).astype(np.int64)
        i1 = np.minimum(i0 + 1, size - 1)
        w = (pos - i0).astype(ct).reshape((-1,) + (1,) * (x.ndim - d - 1))
        y = np.take(y, i0, axis=d) * (1 - w) + np.take(y, i1, axis=d) * w
    return [np.ascontiguousarray(y).astype(x.dtype)]


_reg("Upsample", check=_resize_check, min_opset=7, reference=_upsample_reference,
     doc="deprecated: Resize with asymmetric coordinates", value_inputs=(1,))
