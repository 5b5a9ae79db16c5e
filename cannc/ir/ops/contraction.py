"""Contractions: MatMul and Gemm, lowered onto the packed GEMM generator.

numpy-style MatMul batches become one batched GEMM (stride 0 for a broadcast
operand); when B has no batch (the weight of a Linear layer) A's batch dims
fold into M, which gives the GEMM the large M it wants. Constant B is packed
once at compile time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...codegen.gemm import GemmSpec, emit_gemm, gemm_num_tiles, gemm_workspace_bytes, prepack_b
from ..graph import Node
from ..registry import Category, OpDef, register
from ..types import TensorType

F32 = frozenset({"float32"})


def _matmul_dims(a: tuple[int, ...], b: tuple[int, ...]):
    """(batch shape, M, K, N, a_batch, b_batch) of numpy matmul after 1-D promotion."""
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    M, K = a2[-2], a2[-1]
    N = b2[-1]
    ab, bb = a2[:-2], b2[:-2]
    r = max(len(ab), len(bb))
    ab = (1,) * (r - len(ab)) + ab
    bb = (1,) * (r - len(bb)) + bb
    out = tuple(max(x, y) for x, y in zip(ab, bb))
    return out, M, K, N, ab, bb


def _matmul_spec(a: TensorType, b: TensorType) -> tuple[GemmSpec | None, str | None]:
    batch, M, K, N, ab, bb = _matmul_dims(tuple(a.shape), tuple(b.shape))
    nb = int(np.prod(batch)) if batch else 1
    a_full, a_one = ab == batch, all(d == 1 for d in ab)
    b_full, b_one = bb == batch, all(d == 1 for d in bb)
    if not ((a_full or a_one) and (b_full or b_one)):
        return None, (f"batch broadcasting {list(a.shape)} @ {list(b.shape)} mixes broadcast "
                      "and non-broadcast batch dims within one operand")
    if b_one and a_full and nb > 1:
        # [.., M, K] @ [K, N]: fold the batch into M
        return GemmSpec(M=nb * M, N=N, K=K), None
    return GemmSpec(M=M, N=N, K=K, batch=nb,
                    a_batch_stride=0 if a_one else M * K,
                    b_batch_stride=0 if b_one else K * N,
                    c_batch_stride=M * N), None


def _check_matmul(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    if any(d == 0 for t in ins for d in t.shape if isinstance(d, int)):
        return "empty tensors are not supported"
    if all(t.is_static for t in ins):
        return _matmul_spec(ins[0], ins[1])[1]
    return None


def _lower_matmul(ctx: Any) -> None:
    spec = plan_contraction(ctx)
    emit_gemm(ctx.module, ctx.symbol, spec)
    finish_contraction(ctx, spec)


def plan_contraction(ctx: Any, node: Node | None = None) -> GemmSpec:
    """The GemmSpec of a MatMul/Gemm node (ctx.node by default; its inputs are ctx's first
    inputs); packs a constant B through ctx.replace_const and drops an unread Gemm C."""
    n = node or ctx.node
    if n.op_type == "MatMul":
        spec, why = _matmul_spec(ctx.in_types[0], ctx.in_types[1])
        assert spec is not None, why
    else:
        present_c = len(n.inputs) > 2 and bool(n.inputs[2])
        spec = _gemm_spec(ctx, n, ctx.in_types[:2] + ([ctx.in_types[2]] if present_c else []))
        if present_c and not spec.bias:
            ctx.drop_input(2)  # beta == 0: C is not read
    b = ctx.const(1)
    if b is not None:
        spec = _with(spec, b_prepacked=True)
        if n.op_type == "MatMul":
            nb = spec.batch if spec.b_batch_stride else 1
            b = b.reshape(nb, spec.K, spec.N) if spec.b_batch_stride else b.reshape(spec.K, spec.N)
        ctx.replace_const(1, prepack_b(spec, b))
    return spec


def finish_contraction(ctx: Any, spec: GemmSpec, extra_ws: int = 0) -> None:
    ctx.num_tiles = gemm_num_tiles(spec)
    ctx.workspace_bytes = gemm_workspace_bytes(spec) + extra_ws
    ctx.flops = 2 * spec.batch * spec.M * spec.N * spec.K
    ctx.notes["gemm"] = _describe(spec)


def _with(spec: GemmSpec, **kw: Any) -> GemmSpec:
    import dataclasses
    return dataclasses.replace(spec, **kw)


def _describe(spec: GemmSpec) -> str:
    s = f"{spec.M}x{spec.N}x{spec.K}"
    if spec.batch > 1:
        s = f"{spec.batch}x[{s}]"
    return s + (" B-prepacked" if spec.b_prepacked else "")


register(OpDef(name="MatMul", category=Category.CONTRACTION, lower=_lower_matmul, dtypes=F32,
               check=_check_matmul, doc="packed, register-blocked GEMM"))


def _gemm_spec(ctx_or_types: Any, n: Node, ins: list[TensorType]) -> GemmSpec:
    ta, tb = bool(n.attrs.get("transA", 0)), bool(n.attrs.get("transB", 0))
    a, b = ins[0].shape, ins[1].shape
    M, K = (a[1], a[0]) if ta else (a[0], a[1])
    N = b[0] if tb else b[1]
    alpha = float(n.attrs.get("alpha", 1.0))
    beta = float(n.attrs.get("beta", 1.0))
    c = ins[2] if len(ins) > 2 else None
    rs = cs = 0
    has_bias = c is not None and beta != 0.0
    if has_bias:
        cshape = (1,) * (2 - len(c.shape)) + tuple(c.shape)
        rs = 0 if cshape[0] == 1 else cshape[1]
        cs = 0 if cshape[1] == 1 else 1
    return GemmSpec(M=M, N=N, K=K, trans_a=ta, trans_b=tb, alpha=alpha, beta=beta,
                    bias=has_bias, bias_row_stride=rs, bias_col_stride=cs)


def _check_gemm(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    if n.opset < 7:
        return "Gemm before opset 7 (broadcast attribute) is not supported"
    return None


def _lower_gemm(ctx: Any) -> None:
    spec = plan_contraction(ctx)
    emit_gemm(ctx.module, ctx.symbol, spec)
    finish_contraction(ctx, spec)


register(OpDef(name="Gemm", category=Category.CONTRACTION, lower=_lower_gemm, dtypes=F32,
               check=_check_gemm, doc="packed, register-blocked GEMM with fused bias"))
