"""The shared lowering of every elementwise op: its `expr` in one broadcasting loop nest.

An op defined with an `expr` (cannc/ir/ops/elementwise.py) and no lowering of its
own gets this one: `emit_map` (codegen/elementwise.py) emits the op's expression
over vectors and scalars with numpy broadcasting, and `map_tiling` makes the
kernel shape-polymorphic (the broadcast pattern is the key, extents runtime dims).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...artifact import Tiling
from ...ir.graph import Node
from ...ir.ops import lookup
from ...ir.types import TensorType
from ..elementwise import TV, emit_map, map_tiling
from ..kernel import LowerCtx
from .base import register_map_lowering


def _lower_map(ctx: LowerCtx) -> None:
    op = lookup(ctx.node.op_type, ctx.node.domain)
    assert op is not None and op.expr is not None, ctx.node.op_type
    expr = op.expr
    present = [i for i, v in enumerate(ctx.node.inputs) if v]
    types = [ctx.in_types[i] for i in present]
    emit_map(ctx, types, ctx.out_types, lambda E, vals: expr(E, ctx, _spread(ctx, vals)),
             operand_slots=present)
    ctx.flops = ctx.out_types[0].numel * op.flops_per_elem


def _map_tiling(node: Node, in_types: list[TensorType | None],
                out_types: list[TensorType]) -> Tiling | None:
    """Host tiling: the broadcast pattern is the key, the extents are runtime dims."""
    op = lookup(node.op_type, node.domain)
    types = [in_types[i] for i, v in enumerate(node.inputs) if v]
    return map_tiling(types, out_types, op.flops_per_elem if op else 1)


def _spread(ctx: LowerCtx, vals: Sequence[TV]) -> list[TV | None]:
    """Operands back at their input positions (None for absent optional inputs)."""
    it = iter(vals)
    return [next(it) if v else None for v in ctx.node.inputs]


register_map_lowering(_lower_map, tiling=_map_tiling)
