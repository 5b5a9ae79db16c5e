"""Fused kernels: one node of domain 'cannc' stands for a group of ONNX nodes.

The group's nodes are kept in the node's `body` attribute (in order); the
node's inputs are the group's external inputs and its outputs the values the
group must write to memory. Each fused op lowers to ONE generated function
(codegen/lower/fused.py):

- FusedMap: a chain of elementwise/broadcast ops as one vectorised loop nest
  (the ops' own `expr` functions composed; scalar constants become immediates);
- FusedGemm: a MatMul/Gemm whose elementwise consumers (bias, activation,
  residual add...) run in the GEMM's epilogue, in registers, before the store;
- FusedConv: the same around a Conv; FusedAttention: scaled dot-product attention;
  FusedSoftmax: a Softmax/LogSoftmax computing its elementwise producers.

`operand_pattern` and `conv_operand_pattern` say how an epilogue operand is
indexed (the fusion pass asks them whether an operand can be read at all).
"""

from __future__ import annotations

from ..registry import Category, OpDef, register
from ..types import TensorType

DOMAIN = "cannc"


register(OpDef(name="FusedMap", domain=DOMAIN, category=Category.BROADCAST,
               doc="elementwise/broadcast chain in one loop nest"))


# -- GEMM + epilogue ---------------------------------------------------------------


def operand_pattern(t: TensorType, out_shape: tuple[int, ...], batched: bool) -> str | None:
    """How an epilogue operand is indexed from the GEMM's (m, n): 'scalar' (offset 0),
    'row' (n), 'col' (m), 'full' (m*N + n); None when it is none of these. An operand
    of the output's rank and extents is 'full' (and [.., 1] 'col') even when the rows are
    one (M = 1), so a kernel for any M indexes it the same way at every M."""
    shape = tuple(t.shape)
    r = len(out_shape)
    if not batched and len(shape) == r and r >= 2:
        if shape == tuple(out_shape):
            return "full"
        if shape[-1] == 1 and out_shape[-1] != 1 and shape[:-1] == tuple(out_shape[:-1]):
            return "col"
    shape = (1,) * (r - len(shape)) + shape
    if all(d == 1 for d in shape):
        return "scalar"
    if all(d == 1 for d in shape[:-1]) and shape[-1] == out_shape[-1]:
        return "row"
    if batched:
        return None
    if shape == tuple(out_shape):
        return "full"
    if shape[-1] == 1 and shape[:-1] == tuple(out_shape[:-1]):
        return "col"
    return None


register(OpDef(name="FusedGemm", domain=DOMAIN, category=Category.CONTRACTION,
               doc="GEMM with an elementwise epilogue"))


# -- Conv + epilogue -----------------------------------------------------------------


def conv_operand_pattern(t: TensorType, out_shape: tuple[int, ...]) -> str | None:
    """How an epilogue operand of a Conv output [N, M, *spatial] is indexed: 'scalar',
    'channel' (one value per output channel) or 'full'; None otherwise."""
    shape = tuple(t.shape)
    r = len(out_shape)
    shape = (1,) * (r - len(shape)) + shape
    if all(d == 1 for d in shape):
        return "scalar"
    if shape == tuple(out_shape):
        return "full"
    if r >= 2 and shape[1] == out_shape[1] and all(
            d == 1 for i, d in enumerate(shape) if i != 1):
        return "channel"
    return None


register(OpDef(name="FusedConv", domain=DOMAIN, category=Category.CONTRACTION,
               doc="convolution with an elementwise epilogue"))


register(OpDef(name="FusedAttention", domain=DOMAIN, category=Category.OPAQUE,
               # the concrete AttnSpec (sizes, strides) is covered by the tiling key
               tiling_attrs=("spec",),
               doc="scaled dot-product attention, tiled with an online softmax"))


register(OpDef(name="FusedSoftmax", domain=DOMAIN, category=Category.REDUCTION,
               doc="Softmax/LogSoftmax reading an elementwise prologue (scale, mask...)"))
