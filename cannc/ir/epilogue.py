"""What a contraction's epilogue can read: the checks behind the `Fusion` records of
MatMul, Gemm and Conv (`OpDef.epilogue`), and the indexing patterns that both the
fusion pass (can this operand be read at all?) and the fused kernels' lowerings (how is
it indexed?) use. Pure shape logic: imports nothing above `ir`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .graph import Node
    from .types import TensorType


def matmul_dims(a: tuple[int, ...], b: tuple[int, ...]):
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


def matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[MatmulShape | None, str | None]:
    """The GEMM shape of `a @ b` (operand shapes), or None and the reason it is not one
    batched GEMM. When B has no batch (the weight of a Linear layer) A's batch dims fold
    into M, which gives the GEMM the large M it wants."""
    batch, M, K, N, ab, bb = matmul_dims(tuple(a), tuple(b))
    nb = 1
    for d in batch:
        nb *= int(d)
    a_full, a_one = ab == batch, all(d == 1 for d in ab)
    b_full, b_one = bb == batch, all(d == 1 for d in bb)
    if not ((a_full or a_one) and (b_full or b_one)):
        return None, (f"batch broadcasting {list(a)} @ {list(b)} mixes broadcast "
                      "and non-broadcast batch dims within one operand")
    if b_one and a_full and nb > 1:
        # [.., M, K] @ [K, N]: fold the batch into M
        return MatmulShape(M=nb * M, N=N, K=K), None
    return MatmulShape(M=M, N=N, K=K, batch=nb,
                       a_batch_stride=0 if a_one else M * K,
                       b_batch_stride=0 if b_one else K * N,
                       c_batch_stride=M * N), None


def matmul_batch(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int | None, str | None]:
    """The GEMM batch count of a MatMul (1 when a [.., M, K] @ [K, N] batch folds into M),
    or (None, why) when one operand mixes broadcast and non-broadcast batch dims."""
    shape, why = matmul_shape(a, b)
    return (shape.batch if shape is not None else None), why


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


def gemm_view(operand: tuple[int, ...], out_shape: tuple[int, ...], a: tuple[int, ...],
              b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An epilogue operand's shape and the output's in the GEMM's own coordinates: a
    MatMul with a 1-D operand drops a GEMM dim from its output ([.., M, K] @ [K] is
    [.., M], the GEMM's N = 1), so the operand (broadcast against that output) and the
    output get the dropped dim back as 1; otherwise both are returned as they are."""
    out = tuple(out_shape)
    op = (1,) * (len(out) - len(operand)) + tuple(operand) if len(operand) < len(out) \
        else tuple(operand)
    if len(b) == 1:       # N dropped: the last dim
        out, op = out + (1,), op + (1,)
    if len(a) == 1:       # M dropped: before the last dim
        out, op = out[:-1] + (1,) + out[-1:], op[:-1] + (1,) + op[-1:]
    return op, out


@dataclass(frozen=True)
class _Shaped:
    shape: tuple[int, ...]


def matmul_operand_pattern(t: TensorType, out_shape: tuple[int, ...], a: tuple[int, ...],
                           b: tuple[int, ...], batched: bool) -> str | None:
    """operand_pattern of a MatMul epilogue operand, in the GEMM's coordinates (gemm_view)."""
    if len(a) > 1 and len(b) > 1:
        return operand_pattern(t, out_shape, batched)
    op, out = gemm_view(tuple(t.shape), tuple(out_shape), a, b)
    return operand_pattern(_Shaped(op), out, batched)


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


# -- the checks of the Fusion records (registry.OperandCheck / NodeCheck) --------------


def matmul_fit(node: Node, ins: list[TensorType], out: TensorType) -> str | None:
    """A MatMul takes an epilogue when its batch is one GEMM batch stride per operand."""
    return matmul_batch(tuple(ins[0].shape), tuple(ins[1].shape))[1]


def _gemm_operand(t: TensorType, out: TensorType, batched: bool) -> str | None:
    if operand_pattern(t, tuple(out.shape), batched) is None:
        return "is not a scalar, row, column or full tensor of the GEMM's output"
    return None


def gemm_operand(t: TensorType, node: Node, ins: list[TensorType],
                 out: TensorType) -> str | None:
    """A Gemm epilogue reads a scalar, a row, a column or the full output."""
    return _gemm_operand(t, out, False)


def matmul_operand(t: TensorType, node: Node, ins: list[TensorType],
                   out: TensorType) -> str | None:
    """As Gemm's (in the GEMM's coordinates when an operand is 1-D); a batched GEMM's
    epilogue reads a scalar or a row only."""
    a, b = tuple(ins[0].shape), tuple(ins[1].shape)
    nb, _ = matmul_batch(a, b)
    if matmul_operand_pattern(t, tuple(out.shape), a, b, nb is not None and nb > 1) is None:
        return "is not a scalar, row, column or full tensor of the GEMM's output"
    return None


def conv_operand(t: TensorType, node: Node, ins: list[TensorType],
                 out: TensorType) -> str | None:
    if conv_operand_pattern(t, tuple(out.shape)) is None:
        return "is not a scalar, per-channel or full tensor of the convolution's output"
    return None
