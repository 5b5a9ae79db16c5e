"""Which nodes cannc can compile, and why not: asked before compiling and after the passes."""

from __future__ import annotations

from typing import Any

from ..ir.graph import Graph, Node
from ..ir.ops import all_ops, lookup


def supported_ops() -> list[dict[str, Any]]:
    """The table of supported ops: name, domain, category, dtypes, whether it fuses."""
    return [{"op": o.name, "domain": o.domain or "ai.onnx", "category": o.category.value,
             "min_opset": o.min_opset, "dtypes": sorted(o.dtypes) if o.dtypes else "any",
             "fusible": o.fusible} for o in all_ops()]


def unknown_ops(graph: Graph) -> list[tuple[str, str, str, int, str]]:
    """Nodes whose op cannc does not know at all (checked before any pass runs, so
    that every one of them is reported, not the first that a pass trips on)."""
    out = []
    for n in graph.nodes():
        if lookup(n.op_type, n.domain) is None:
            out.append((n.name, n.op_type, n.domain, n.opset, "no such op in cannc's registry"))
    return out


def support_problems(graph: Graph) -> list[tuple[str, str, str, int, str]]:
    problems = []
    for n in graph.nodes():
        reason = node_support(graph, n)
        if reason:
            problems.append((n.name, n.op_type, n.domain, n.opset, reason))
    return problems


def node_support(graph: Graph, n: Node) -> str | None:
    op = lookup(n.op_type, n.domain)
    if op is None:
        return "no such op in cannc's registry"
    if n.opset < op.min_opset:
        return f"opset {n.opset} is older than supported ({op.min_opset})"
    from ..codegen.lower import lowering_for  # (imports the code generators)

    if op.needs_kernel and lowering_for(op) is None:
        return "no native lowering yet"
    ins = [graph.values.get(v) if v else None for v in n.inputs]
    outs = [graph.values.get(v) for v in n.outputs if v]
    return op.schema_reason(n, ins, [o for o in outs if o is not None], graph.input_values(n))
