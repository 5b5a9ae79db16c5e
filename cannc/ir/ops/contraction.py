"""Contractions: MatMul and Gemm (what they are; their lowerings onto the packed GEMM
generator and the loop nest are in codegen/lower/contraction.py).

numpy-style MatMul batches become one batched GEMM (stride 0 for a broadcast
operand); when B has no batch (the weight of a Linear layer) A's batch dims
fold into M, which gives the GEMM the large M it wants (`cannc.ir.epilogue.matmul_shape`).
"""

from __future__ import annotations

from typing import Any

from ..epilogue import gemm_operand, matmul_fit, matmul_operand
from ..graph import Node
from ..registry import Category, Fusion, OpDef, register

GEMM_DTYPES = frozenset({"float32", "float16", "bfloat16"})
MATMUL_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int32", "int64",
                           "uint32", "uint64"})


def _check_matmul(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    return None


register(OpDef(name="MatMul", category=Category.CONTRACTION,
               dtypes=MATMUL_DTYPES, check=_check_matmul,
               epilogue=Fusion(rule="gemm_epilogue", fused_op="FusedGemm",
                               operand=matmul_operand, node=matmul_fit, dtypes=GEMM_DTYPES),
               doc="float32, bfloat16, float16: packed, register-blocked GEMM (16-bit floats: "
                   "fp32 accumulation); other dtypes: a loop nest"))


def _check_gemm(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    if n.opset < 7:
        return "Gemm before opset 7 (broadcast attribute) is not supported"
    return None


register(OpDef(name="Gemm", category=Category.CONTRACTION, dtypes=GEMM_DTYPES,
               check=_check_gemm,
               epilogue=Fusion(rule="gemm_epilogue", fused_op="FusedGemm", operand=gemm_operand,
                               dtypes=GEMM_DTYPES),
               doc="packed, register-blocked GEMM with fused bias"))
