"""Contractions: MatMul and Gemm (what they are; their lowerings onto the packed GEMM
generator and the loop nest are in codegen/lower/contraction.py).

numpy-style MatMul batches become one batched GEMM (stride 0 for a broadcast
operand); when B has no batch (the weight of a Linear layer) A's batch dims
fold into M, which gives the GEMM the large M it wants (`_matmul_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..epilogue import gemm_operand, matmul_fit, matmul_operand
from ..epilogue import matmul_dims as _matmul_dims
from ..graph import Node
from ..registry import Category, Fusion, OpDef, register
from ..types import TensorType

F32 = frozenset({"float32"})
MATMUL_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int32", "int64",
                           "uint32", "uint64"})


@dataclass(frozen=True)
class MatmulShape:
    """A MatMul as one (batched) GEMM: C[M,N] = A[M,K] @ B[K,N] per batch item, the
    operands' batch strides in elements (0: the same matrix for every item)."""

    M: int
    N: int
    K: int
    batch: int = 1
    a_batch_stride: int = 0
    b_batch_stride: int = 0
    c_batch_stride: int = 0


def _matmul_spec(a: TensorType, b: TensorType) -> tuple[MatmulShape | None, str | None]:
    """The GEMM shape of `a @ b`, or None and the reason it is not one batched GEMM."""
    batch, M, K, N, ab, bb = _matmul_dims(tuple(a.shape), tuple(b.shape))
    nb = int(np.prod(batch)) if batch else 1
    a_full, a_one = ab == batch, all(d == 1 for d in ab)
    b_full, b_one = bb == batch, all(d == 1 for d in bb)
    if not ((a_full or a_one) and (b_full or b_one)):
        return None, (f"batch broadcasting {list(a.shape)} @ {list(b.shape)} mixes broadcast "
                      "and non-broadcast batch dims within one operand")
    if b_one and a_full and nb > 1:
        # [.., M, K] @ [K, N]: fold the batch into M
        return MatmulShape(M=nb * M, N=N, K=K), None
    return MatmulShape(M=M, N=N, K=K, batch=nb,
                       a_batch_stride=0 if a_one else M * K,
                       b_batch_stride=0 if b_one else K * N,
                       c_batch_stride=M * N), None


def _check_matmul(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    return None


register(OpDef(name="MatMul", category=Category.CONTRACTION,
               dtypes=MATMUL_DTYPES, check=_check_matmul,
               epilogue=Fusion(rule="gemm_epilogue", fused_op="FusedGemm",
                               operand=matmul_operand, node=matmul_fit),
               doc="float32: packed, register-blocked GEMM; other dtypes: a loop nest"))


def _check_gemm(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    if n.opset < 7:
        return "Gemm before opset 7 (broadcast attribute) is not supported"
    return None


register(OpDef(name="Gemm", category=Category.CONTRACTION, dtypes=F32,
               check=_check_gemm,
               epilogue=Fusion(rule="gemm_epilogue", fused_op="FusedGemm", operand=gemm_operand),
               doc="packed, register-blocked GEMM with fused bias"))
