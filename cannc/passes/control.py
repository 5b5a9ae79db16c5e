"""Control flow: a node whose subgraph is chosen by values known at compile time (an If
whose condition folds, as PyTorch exports of `if x.size(0) > 1:` give) becomes that
subgraph. Runs before type inference: the condition is evaluated by folding the part of
the graph it depends on. Which subgraph an op takes is the op's `branch` in the registry.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import CanncError, UnsupportedOpError
from ..ir.graph import Graph, Node
from ..ir.ops import lookup
from ..ir.ops.control import own_inputs
from ..ir.types import TensorType
from .fold import FoldOptions, infer_and_fold
from .manager import PassContext, graph_pass


def _evaluate(graph: Graph, v: str, ctx: PassContext) -> np.ndarray | None:
    """The value of `v` if it is known at compile time: a constant, or computed from
    constants and shapes alone (the cone of nodes it depends on, folded on a copy)."""
    if not v or v in graph.constants:
        return graph.constants.get(v) if v else None
    p = graph.producer(v)
    if p is None:
        return None                       # a graph input: known only at run time
    import networkx  # (imported by the graph already: not at this module's top, see ir.graph)

    cone = networkx.ancestors(graph.g, p.name) | {p.name}
    for name in cone:
        op = lookup(graph.node(name).op_type, graph.node(name).domain)
        if op is None or op.subgraphs:
            return None                   # (an unresolved If upstream: not known)
    g = graph.copy()
    for name in [m for m in g.g.nodes if m not in cone]:
        g.remove_node(name)
    g.outputs = [v]
    try:
        infer_and_fold(g, dataclasses.replace(ctx, options=FoldOptions()))
    except CanncError:
        return None
    return g.constants.get(v)


def _fresh(graph: Graph, name: str) -> str:
    out, i = name, 1
    while out in graph.values or graph.producer(out) is not None or out in graph.g:
        out, i = f"{name}_{i}", i + 1
    return out


def _rename_free(sub: Graph, ren: dict[str, str]) -> Graph:
    """A copy of subgraph `sub` reading renamed outer values (its captures)."""
    caps = sub.meta.get("captures", [])
    if not any(c in ren for c in caps):
        return sub
    local = set(sub.inputs) | set(sub.constants) | {o for m in sub.nodes() for o in m.outputs}
    inner = {k: v for k, v in ren.items() if k not in local}
    out = sub.copy()
    for m in list(out.nodes()):
        attrs = {k: _rename_free(a, inner) if isinstance(a, Graph) else a
                 for k, a in m.attrs.items()}
        out.replace_node(m.name, m.replace(inputs=tuple(inner.get(v, v) for v in m.inputs),
                                           attrs=attrs))
    out.outputs = [inner.get(v, v) for v in out.outputs]
    for c in caps:
        if c in inner and c in out.values:
            out.values[inner[c]] = out.values.pop(c)
    out.meta["captures"] = [inner.get(c, c) for c in caps]
    return out


def inline_subgraph(graph: Graph, n: Node, sub: Graph) -> None:
    """Replace node `n` by the nodes of `sub` (a subgraph without formal inputs): its
    values renamed under the node's name, its outputs feeding `n`'s through Identity."""
    order = graph.g.nodes[n.name].get("order")
    graph.remove_node(n.name)
    local = set(sub.constants) | {o for m in sub.nodes() for o in m.outputs if o}
    ren = {v: _fresh(graph, f"{n.name}/{v}") for v in sorted(local)}
    for c, arr in sub.constants.items():
        graph.set_constant(ren[c], arr)
    for m in sub.nodes():
        attrs = {k: _rename_free(a, ren) if isinstance(a, Graph) else a
                 for k, a in m.attrs.items()}
        for o in m.outputs:
            if o:
                graph.values[ren[o]] = sub.values.get(o, TensorType(np.dtype("float32"), ()))
        graph.add_node(m.replace(name=_fresh(graph, f"{n.name}/{m.name}"),
                                 inputs=tuple(ren.get(v, v) for v in m.inputs),
                                 outputs=tuple(ren.get(v, v) for v in m.outputs),
                                 attrs=attrs, proto=None), order=order)
    opset = graph.opsets.get("", n.opset)
    for i, (o, so) in enumerate(zip(n.outputs, sub.outputs)):
        if o:
            graph.add_node(Node(name=_fresh(graph, f"{n.name}/output{i}"), op_type="Identity",
                                inputs=(ren.get(so, so),), outputs=(o,), opset=opset),
                           order=order)


@dataclasses.dataclass(frozen=True)
class InlineOptions:
    runtime_choice: bool = False   # leave runtime control flow (If on data, Loop, Scan) to
                                   # a host program


def has_subgraphs(graph: Graph) -> bool:
    """Whether any node of `graph` is a control-flow node (the op holds subgraphs)."""
    for n in graph.nodes():
        op = lookup(n.op_type, n.domain)
        if op is not None and op.subgraphs:
            return True
    return False


@graph_pass("inline_branches", options=InlineOptions)
def inline_branches(graph: Graph, ctx: PassContext) -> bool:
    """Every node whose subgraph is known at compile time (the op's `branch`: an If whose
    condition folds) becomes that subgraph; one whose choice depends on runtime data is
    reported (UnsupportedOpError naming it), as are Loop and Scan, unless `runtime_choice`
    (the compiler then makes a host program of the graph: cannc.compiler.control)."""
    changed = False
    while True:
        for n in graph.nodes():
            op = lookup(n.op_type, n.domain)
            if op is None or op.branch is None:
                continue
            attr = op.branch(n, [_evaluate(graph, v, ctx) for v in own_inputs(n)])
            if attr is None:
                continue
            sub = n.attrs.get(attr)
            if not isinstance(sub, Graph):
                continue
            inline_subgraph(graph, n, sub)
            changed = True
            break
        else:
            break
    left = []
    for n in graph.nodes():
        op = lookup(n.op_type, n.domain)
        if op is not None and op.subgraphs:
            if ctx.options.runtime_choice and op.control is not None:
                continue
            reason = op.check(n, [], []) if op.check is not None else None
            left.append((n.name, n.op_type, n.domain, n.opset,
                         reason or "control flow with a runtime choice is not supported"))
    if left:
        raise UnsupportedOpError(left)
    return changed
