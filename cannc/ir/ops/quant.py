"""Quantisation ops: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear,
MatMulInteger, QLinearMatMul (lowered in codegen/lower/quant.py).

(De)quantisation is a broadcasting map: the scale and zero point are viewed with
the shape that broadcasts them over x (per-tensor: a scalar; per-axis: [C] at
`axis`; blocked: x viewed as [..., D/B, B, ...] and the parameters as
[..., D/B, 1, ...]): `param_view`.

The quantised type may also be a sub-byte integer (int4, uint4, int2, uint2: the
integer rule, saturating to the type's range) or a float8/float4 type (float8e4m3fn,
float8e4m3fnuz, float8e5m2, float8e5m2fnuz, float4e2m1, float6: x / scale converted with
Cast's rounding, `saturate` clamping to the largest finite value). As in ONNX's
reference, a float8 zero point is not applied (the spec requires it to be zero); a
float4 one is added by QuantizeLinear and not subtracted by DequantizeLinear; a float6
(float6e2m3, float6e3m2) one is added and subtracted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..graph import Node
from ..registry import Category, OpDef, register

QFLOATS = frozenset({"float32", "float16", "bfloat16"})
QINTS = frozenset({"uint8", "int8", "uint16", "int16", "int4", "uint4", "int2", "uint2"})
# float8 / float4 quantised types (float8e8m0 is a scale type, not a quantised one)
QSMALLFLOATS = frozenset({"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                          "float8_e5m2fnuz", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"})
QTYPES = QINTS | QSMALLFLOATS


def param_view(n: Node, x_shape: Sequence[int], p_shape: Sequence[int], axis: int,
               block: int) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    """(x view shape, parameter view shape) that broadcast a scale/zero point over x,
    or the reason the layout is unsupported."""
    x_shape, p_shape = tuple(int(d) for d in x_shape), tuple(int(d) for d in p_shape)
    r = len(x_shape)
    psize = int(np.prod(p_shape)) if p_shape else 1
    if psize == 1 and len(p_shape) <= 1 and not block:
        return x_shape, ()
    ax = axis + r if axis < 0 else axis
    if not 0 <= ax < r:
        return f"axis {axis} out of range for rank {r}"
    if block:
        if len(p_shape) != r:
            return f"blocked parameters must have the rank of x ({p_shape} vs {x_shape})"
        d = x_shape[ax]
        if d % block:
            return f"blocked quantisation of a dim of {d} by blocks of {block} (must divide)"
        if p_shape[ax] != d // block:
            return f"blocked parameters {p_shape} do not fit x {x_shape} with blocks of {block}"
        xv = x_shape[:ax] + (d // block, block) + x_shape[ax + 1:]
        pv = p_shape[:ax] + (d // block, 1) + p_shape[ax + 1:]
        return xv, pv
    if len(p_shape) != 1 or p_shape[0] != x_shape[ax]:
        return f"per-axis parameters of shape {p_shape} do not fit axis {ax} of {x_shape}"
    return x_shape, tuple(x_shape[ax] if i == ax else 1 for i in range(r))


def _layout(n: Node, ins: list) -> tuple | str:
    axis = int(n.attrs.get("axis", 1))
    block = int(n.attrs.get("block_size", 0)) if n.opset >= 21 else 0
    return param_view(n, ins[0].shape, ins[1].shape, axis, block)


def _check_common(n: Node, ins: list, outs: list, xtypes: frozenset[str]) -> str | None:
    x = ins[0]
    if np.dtype(x.dtype).name not in xtypes:
        return (f"x element type {np.dtype(x.dtype).name} not supported "
                f"({', '.join(sorted(xtypes))})")
    lay = _layout(n, ins)
    if isinstance(lay, str):
        return lay
    return None


def _check_quantize(n: Node, ins: list, outs: list) -> str | None:
    if outs and np.dtype(outs[0].dtype).name not in QTYPES:
        return (f"output element type {np.dtype(outs[0].dtype).name} "
                f"(supported: {', '.join(sorted(QTYPES))})")
    if len(ins) > 2 and ins[2] is not None and outs and \
            np.dtype(ins[2].dtype) != np.dtype(outs[0].dtype):
        return (f"zero point element type {np.dtype(ins[2].dtype).name} differs from the "
                f"output's {np.dtype(outs[0].dtype).name}")
    return _check_common(n, ins, outs, QFLOATS)


register(OpDef(name="QuantizeLinear", category=Category.BROADCAST,
               min_opset=10, check=_check_quantize,
               doc="per-tensor, per-axis and blocked; 16/8/4/2-bit integer, float8 and "
                   "float4 outputs"))


def _check_dequantize(n: Node, ins: list, outs: list) -> str | None:
    if outs and np.dtype(outs[0].dtype).name not in QFLOATS:
        return (f"output element type {np.dtype(outs[0].dtype).name} "
                f"(supported: {', '.join(sorted(QFLOATS))})")
    return _check_common(n, ins, outs, QTYPES | {"int32"})


register(OpDef(name="DequantizeLinear", category=Category.BROADCAST,
               min_opset=10, check=_check_dequantize,
               doc="per-tensor, per-axis and blocked; 16/8/4/2-bit integer, int32, float8 "
                   "and float4 inputs"))


register(OpDef(name="DynamicQuantizeLinear", category=Category.OPAQUE, min_opset=11,
               dtypes=frozenset({"float32", "uint8"}),
               doc="uint8; one single-core kernel (range pass, then quantise)"))


def _check_int_matmul(n: Node, ins: list, outs: list) -> str | None:
    for i in (0, 1) if n.op_type == "MatMulInteger" else (0, 3):
        if np.dtype(ins[i].dtype).name not in ("uint8", "int8"):
            return f"input {i} dtype {np.dtype(ins[i].dtype).name} (supported: int8, uint8)"
    return None


register(OpDef(name="MatMulInteger", category=Category.CONTRACTION, min_opset=10,
               check=_check_int_matmul,
               doc="int32 accumulation; per-tensor or per-column zero points"))


register(OpDef(name="QLinearMatMul", category=Category.CONTRACTION, min_opset=10,
               check=_check_int_matmul,
               doc="int32 accumulation, requantised in float64 (like the reference)"))
