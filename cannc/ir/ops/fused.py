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

How an epilogue operand is indexed is `cannc.ir.epilogue`'s to say; FusedAttention's
`spec` attribute is a `cannc.ir.attnspec.AttnSpec`.
"""

from __future__ import annotations

from ..registry import Amp, Category, OpDef, register

DOMAIN = "cannc"


register(OpDef(name="FusedMap", domain=DOMAIN, category=Category.BROADCAST,
               inplace=True,     # its body's maps read and write element i together
               doc="elementwise/broadcast chain in one loop nest"))


# -- GEMM + epilogue ---------------------------------------------------------------


register(OpDef(name="FusedGemm", domain=DOMAIN, category=Category.CONTRACTION,
               doc="GEMM with an elementwise epilogue"))


# -- Conv + epilogue -----------------------------------------------------------------


register(OpDef(name="FusedConv", domain=DOMAIN, category=Category.CONTRACTION,
               doc="convolution with an elementwise epilogue"))


# -- attention ------------------------------------------------------------------------

register(OpDef(name="FusedAttention", domain=DOMAIN, category=Category.OPAQUE,
               amp=Amp.ALLOW,   # its two products narrow, the online softmax float32
               # the concrete AttnSpec (sizes, strides) is covered by the tiling key
               tiling_attrs=("spec",),
               doc="scaled dot-product attention, tiled with an online softmax"))


register(OpDef(name="FusedSoftmax", domain=DOMAIN, category=Category.REDUCTION,
               doc="Softmax/LogSoftmax reading an elementwise prologue (scale, mask...)"))
