"""Operator fusion.

Rules, each switchable by name (`cannc.compile(model, fusion={"gemm_epilogue": False})`
or `fusion=False` for none; the switches reach the passes in `PassContext.fusion`),
run in this order:

- `conv_bn`: Conv followed by BatchNormalization with constant parameters: BN
  folded into the convolution's weights and bias at compile time.
- `bn_affine`: any other float32 BatchNormalization with constant parameters becomes
  a per-channel Mul and Add, which join the elementwise groups below.
- `layernorm`: the decomposed ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add
  pattern becomes one LayerNormalization.
- `attention`: QKᵀ/scale/mask/Softmax/·V becomes one FusedAttention.
- `elementwise`: chains of elementwise/broadcast ops over the same iteration
  shape become one loop nest (TVM FuseOps style grouping, in topological order).
- `gemm_epilogue` / `conv_epilogue`: a contraction (an op with an `epilogue` Fusion
  record: MatMul, Gemm, Conv) whose result feeds only one elementwise group of its own
  shape takes the group as its epilogue (bias, activation, residual).
- `softmax_prologue`: an op with a `prologue` record (Softmax, LogSoftmax) computes the
  elementwise group that produces its input inside its own kernel.

Each rule is pattern + check + rewrite (`Rule`): the pattern finds a candidate, the
check returns the reason it cannot fuse (or None), the rewrite fuses it. Every reason
is logged with the rule and the pair of nodes, in `graph.meta["fusion_log"]`;
`cannc inspect` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.graph import Graph, Node
from ..ir.ops import lookup
from ..ir.registry import MAP_CATEGORIES, Fusion
from .manager import PassContext, graph_pass
from .rules import Refusal, Rule, log

RULES = ("conv_bn", "bn_affine", "layernorm", "gelu", "attention", "elementwise", "gemm_epilogue",
         "conv_epilogue", "softmax_prologue", "precision_casts", "concat_in_place")


def is_map(graph: Graph, n: Node) -> str | None:
    """None if n can join an elementwise group, else the reason it cannot."""
    op = lookup(n.op_type, n.domain)
    if op is None or op.category not in MAP_CATEGORIES or op.expr is None:
        cat = op.category.value if op is not None else "unknown"
        return f"{n.op_type} is not elementwise ({cat})"
    outs = [graph.values[v] for v in n.outputs if v]
    if len({tuple(t.shape) for t in outs}) != 1:
        return f"{n.op_type} outputs differ in shape"
    ins = [graph.values[v] if v else None for v in n.inputs]
    if op.schema_reason(n, ins, outs, graph.input_values(n)):
        return "unsupported"
    return None


# ---------------------------------------------------------------------------
# elementwise groups
# ---------------------------------------------------------------------------


class Groups:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.order = {n.name: i for i, n in enumerate(graph.nodes())}
        self.group_of: dict[str, int] = {}
        self.members: dict[int, list[str]] = {}
        self.shape: dict[int, tuple[int, ...]] = {}
        self.last = 0       # the latest position of a node ever grouped

    def new(self, n: Node, shape: tuple[int, ...]) -> int:
        gid = len(self.members)
        self.members[gid] = [n.name]
        self.group_of[n.name] = gid
        self.shape[gid] = shape
        self.last = max(self.last, self.order.get(n.name, 0))
        return gid

    def add(self, gid: int, n: Node) -> None:
        self.members[gid].append(n.name)
        self.group_of[n.name] = gid
        self.last = max(self.last, self.order.get(n.name, 0))

    def creates_cycle(self, gid: int, n: Node) -> str | None:
        """Joining n to the group is illegal if n reads a value that depends on the group:
        the fused kernel would depend on itself. The dependence is over kernels, not
        nodes: a node that joins another group makes that whole group depend on this one
        (Abs -> Pow in group A, Tanh -> Max in group B, Tanh -> Pow and Abs -> Max: A
        and B would each wait for the other), so reaching any member of a group reaches
        all of them."""
        g = self.graph
        members = set(self.members[gid])
        preds: set[str] = set()
        for v in n.inputs:
            p = g.producer(v) if v else None
            if p is not None and p.name not in members:
                preds.add(p.name)
        if not preds:
            return None
        targets = set(preds)
        for p in preds:
            h = self.group_of.get(p)
            if h is not None and h != gid and h in self.members:
                targets.update(self.members[h])
        # nodes after n that are in no group cannot lead back to n's inputs, unless some
        # group holds nodes after n (the epilogue rules run once all groups are built)
        limit = max(self.order.get(n.name, 0), self.last)
        succ = g.successors()   # (an out_edges view per node cost 3x the walk itself)
        seen, stack = set(members), list(members)
        while stack:
            x = stack.pop()
            for y in succ[x]:
                if y in seen:
                    continue
                h = self.group_of.get(y)
                live = h is not None and h != gid and h in self.members
                if not live and y in self.order and self.order[y] > limit:
                    continue
                seen.add(y)
                if y in targets:
                    return f"would create a cycle through node '{y}'"
                stack.append(y)
                if live:
                    for z in self.members[h]:
                        if z not in seen:
                            seen.add(z)
                            if z in targets:
                                return f"would create a cycle through node '{z}'"
                            stack.append(z)
        return None


def _join_reason(groups: Groups, gid: int, n: Node, shape: tuple[int, ...],
                 joined: int | None, ctx: PassContext) -> str | None:
    """The elementwise rule's check: why n cannot join the group gid of one of its
    producers (None: it joins)."""
    if not ctx.fusion_enabled("elementwise"):
        return "rule switched off"
    if joined is not None:
        return "consumer already fused with another producer's group"
    if groups.shape[gid] != shape:
        return f"shapes differ: {list(groups.shape[gid])} vs {list(shape)}"
    return groups.creates_cycle(gid, n)


def build_map_groups(graph: Graph, ctx: PassContext) -> Groups:
    """The elementwise rule's pattern: every map node joins the group of a producer it
    reads (first one whose check passes) or starts its own."""
    groups = Groups(graph)
    for n in graph.nodes():
        why = is_map(graph, n)
        if why is not None:
            for v in n.inputs:
                p = graph.producer(v) if v else None
                if p is not None and p.name in groups.group_of:
                    log(graph, p.name, n.name, "elementwise", why)
            continue
        shape = tuple(graph.values[n.outputs[0]].shape)
        joined = None
        for v in n.inputs:
            p = graph.producer(v) if v else None
            if p is None or p.name not in groups.group_of:
                continue
            gid = groups.group_of[p.name]
            if joined is not None and gid == joined:
                continue
            why = _join_reason(groups, gid, n, shape, joined, ctx)
            if why:
                log(graph, p.name, n.name, "elementwise", why)
                continue
            groups.add(gid, n)
            joined = gid
        if joined is None:
            groups.new(n, shape)
    return groups


def group_io(graph: Graph, names: list[str]) -> tuple[list[str], list[str]]:
    """External inputs (in first-use order) and outputs (values used outside or returned)."""
    members = set(names)
    produced: set[str] = set()
    ins: list[str] = []
    for nm in names:
        n = graph.node(nm)
        for v in n.inputs:
            if v and v not in produced and v not in ins:
                ins.append(v)
        produced.update(v for v in n.outputs if v)
    outs = []
    for nm in names:
        for v in graph.node(nm).outputs:
            if not v:
                continue
            used_outside = any(c not in members for c in graph.consumers(v))
            if used_outside or v in graph.outputs:
                outs.append(v)
    return ins, outs


def _replace_group(graph: Graph, names: list[str], op_type: str, inputs: list[str],
                   outputs: list[str], first: Node) -> Node:
    body = [graph.node(nm) for nm in names]
    types = {}
    for n in body:
        for v in list(n.inputs) + list(n.outputs):
            if v:
                types[v] = graph.values[v]
    order = min(graph.g.nodes[nm]["order"] for nm in names)
    for nm in names:
        graph.remove_node(nm)
    fused = Node(name=f"fused::{first.name}", op_type=op_type, inputs=tuple(inputs),
                 outputs=tuple(outputs), domain="cannc", opset=1,
                 attrs={"body": body, "types": types})
    graph.add_node(fused, order=order)
    return fused


# ---------------------------------------------------------------------------
# rules: pattern + check (a reason) + rewrite
# ---------------------------------------------------------------------------


@dataclass
class Match:
    """A contraction (or a row op) and the elementwise group next to it: `rule` is the
    switch of its op's Fusion record, `pairs` the (producer, consumer) nodes it joins."""

    rule: str
    fusion: Fusion
    node: Node
    pairs: tuple[tuple[str, str], ...]
    gid: int


# -- contraction epilogues (the op's `epilogue` record: MatMul, Gemm, Conv) ------------


def _epilogue_pattern(graph: Graph, groups: Groups, n: Node) -> Match | None:
    op = lookup(n.op_type, n.domain)
    if op is None or op.epilogue is None:
        return None
    cons = graph.consumers(n.outputs[0])
    if not cons:
        return None
    return Match(op.epilogue.rule, op.epilogue, n, tuple((n.name, c) for c in cons),
                 groups.group_of.get(cons[0], -1))


def _epilogue_check(graph: Graph, groups: Groups, m: Match) -> Refusal | None:
    why = _epilogue_reason(graph, groups, m)
    return Refusal(why, m.pairs) if why else None


def _epilogue_reason(graph: Graph, groups: Groups, m: Match) -> str | None:
    n = m.node
    cons = [c for _, c in m.pairs]
    out = n.outputs[0]
    t = graph.values[out]
    if np.dtype(t.dtype).name not in m.fusion.dtypes:
        return f"epilogues are generated for {'/'.join(sorted(m.fusion.dtypes))} results only"
    if out in graph.outputs:
        return f"'{out}' is a graph output"
    gids = {groups.group_of.get(c) for c in cons}
    if None in gids:
        other = next(c for c in cons if c not in groups.group_of)
        return f"'{out}' feeds node '{other}' ({graph.node(other).op_type}), " \
               "which is not elementwise"
    if len(gids) != 1:
        return f"'{out}' feeds {len(gids)} different elementwise groups"
    gid = gids.pop()
    names = groups.members[gid]
    if groups.shape[gid] != tuple(t.shape):
        return f"the epilogue's shape {list(groups.shape[gid])} differs from the GEMM's " \
               f"{list(t.shape)}"
    ins, outs = group_io(graph, names)
    if len(outs) != 1:
        return f"the epilogue group writes {len(outs)} values ({', '.join(outs)}); " \
               "a GEMM epilogue stores one"
    if np.dtype(graph.values[outs[0]].dtype).name not in m.fusion.dtypes:
        return f"the epilogue's result is not {'/'.join(sorted(m.fusion.dtypes))}"
    in_types = [graph.values[v] for v in n.inputs if v]
    if m.fusion.result is not None:
        why = m.fusion.result(n, in_types, t, graph.values[outs[0]])
        if why:
            return why
    if m.fusion.node is not None:
        why = m.fusion.node(n, in_types, t)
        if why:
            return why
    for v in ins:
        if v == out or m.fusion.operand is None:
            continue
        vt = graph.values[v]
        why = m.fusion.operand(vt, n, in_types, t)
        if why:
            return f"epilogue operand '{v}' of shape {list(vt.shape)} {why}"
    # the group must not read a value computed from the GEMM's result outside the group
    cyc = groups.creates_cycle(gid, graph.node(names[0]))
    if cyc:
        return cyc
    return None


def _epilogue_rewrite(graph: Graph, groups: Groups, m: Match) -> None:
    n = m.node
    names = groups.members.pop(m.gid)
    ins, outs = group_io(graph, names)
    ext = [v for v in ins if v != n.outputs[0]]
    _replace_group(graph, [n.name] + names, m.fusion.fused_op, list(n.inputs) + ext, outs, n)


EPILOGUE: Rule[Groups, Match] = Rule("epilogue", _epilogue_pattern, _epilogue_check,
                                     _epilogue_rewrite, switch=lambda m: m.rule,
                                     pairs=lambda m: m.pairs)


# -- prologues (the op's `prologue` record: Softmax, LogSoftmax) -----------------------


def _prologue_pattern(graph: Graph, groups: Groups, n: Node) -> Match | None:
    op = lookup(n.op_type, n.domain)
    if op is None or op.prologue is None:
        return None
    p = graph.producer(n.inputs[0])
    if p is None or p.name not in groups.group_of:
        return None
    gid = groups.group_of[p.name]
    if gid not in groups.members:
        return None
    return Match(op.prologue.rule, op.prologue, n, ((p.name, n.name),), gid)


def _prologue_check(graph: Graph, groups: Groups, m: Match) -> Refusal | None:
    why = _prologue_reason(graph, groups, m)
    return Refusal(why, m.pairs) if why else None


def _prologue_reason(graph: Graph, groups: Groups, m: Match) -> str | None:
    sm = m.node
    x = sm.inputs[0]
    t = graph.values[x]
    rank = len(t.shape)
    if np.dtype(t.dtype) != np.float32:
        return "prologues are generated for float32 only"
    axis = sm.attrs.get("axis", -1 if sm.opset >= 13 else 1)
    if rank == 0 or axis % rank != rank - 1 or int(t.shape[-1]) <= 1:
        return f"{sm.op_type} is not over the last axis"
    if groups.shape[m.gid] != tuple(t.shape):
        return "the prologue's shape differs from the Softmax input"
    if x in graph.outputs:      # the fused kernel stores only the Softmax's result
        return f"'{x}' is a graph output"
    _, outs = group_io(graph, groups.members[m.gid])
    if outs != [x] or graph.consumers(x) != [sm.name]:
        return f"the prologue also writes values used elsewhere ({', '.join(outs)})"
    return None


def _prologue_rewrite(graph: Graph, groups: Groups, m: Match) -> None:
    names = groups.members.pop(m.gid)
    ins, _ = group_io(graph, names)
    _replace_group(graph, names + [m.node.name], m.fusion.fused_op, ins, list(m.node.outputs),
                   graph.node(names[0]))


PROLOGUE: Rule[Groups, Match] = Rule("prologue", _prologue_pattern, _prologue_check,
                                     _prologue_rewrite, switch=lambda m: m.rule,
                                     pairs=lambda m: m.pairs)


# ---------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------


@graph_pass("fusion")
def fusion(graph: Graph, ctx: PassContext) -> bool:
    """Group elementwise chains; give contractions their epilogues, row ops their
    prologues; every remaining group of two or more nodes becomes one FusedMap."""
    groups = build_map_groups(graph, ctx)
    changed = False
    # contraction epilogues first: they take whole groups
    for rule in (EPILOGUE, PROLOGUE):
        changed |= rule.run(graph, groups, ctx)
    for _gid, names in groups.members.items():
        if len(names) < 2:
            continue
        ins, outs = group_io(graph, names)
        _replace_group(graph, names, "FusedMap", ins, outs, graph.node(names[0]))
        changed = True
    return changed
