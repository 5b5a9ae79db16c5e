"""Operator fusion.

Rules, each switchable by name (`cannc.compile(model, fusion={"gemm_epilogue": False})`
or `fusion=False` for none), run in this order:

- `conv_bn`: Conv followed by BatchNormalization with constant parameters: BN
  folded into the convolution's weights and bias at compile time.
- `layernorm`: the decomposed ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add
  pattern becomes one LayerNormalization.
- `elementwise`: chains of elementwise/broadcast ops over the same iteration
  shape become one loop nest (TVM FuseOps style grouping, in topological order).
- `gemm_epilogue`: a MatMul/Gemm whose result feeds only one elementwise group
  of its own shape takes the group as its epilogue (bias, activation, residual).

Every decision not to fuse two neighbouring nodes is logged with the rule that
refused and why, in `graph.meta["fusion_log"]`; `cannc inspect` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ir.graph import Graph, Node
from ..ir.ops import lookup
from ..ir.registry import Category
from ..ir.types import TensorType
from .manager import graph_pass

RULES = ("conv_bn", "layernorm", "attention", "elementwise", "gemm_epilogue", "conv_epilogue",
         "softmax_prologue")
EPILOGUE_RULE = {"MatMul": "gemm_epilogue", "Gemm": "gemm_epilogue", "Conv": "conv_epilogue"}
FUSED_OP = {"MatMul": "FusedGemm", "Gemm": "FusedGemm", "Conv": "FusedConv"}
MAP_CATEGORIES = (Category.ELEMENTWISE, Category.BROADCAST)


@dataclass(frozen=True)
class Decision:
    producer: str
    consumer: str
    rule: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"producer": self.producer, "consumer": self.consumer, "rule": self.rule,
                "reason": self.reason}


def enabled(graph: Graph, rule: str) -> bool:
    sw = graph.meta.get("fusion", True)
    if isinstance(sw, bool):
        return sw
    return bool(sw.get(rule, True))


def log(graph: Graph, producer: str, consumer: str, rule: str, reason: str) -> None:
    graph.meta.setdefault("fusion_log", []).append(Decision(producer, consumer, rule, reason))


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
    if op.schema_reason(n, ins, outs):
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

    def new(self, n: Node, shape: tuple[int, ...]) -> int:
        gid = len(self.members)
        self.members[gid] = [n.name]
        self.group_of[n.name] = gid
        self.shape[gid] = shape
        return gid

    def add(self, gid: int, n: Node) -> None:
        self.members[gid].append(n.name)
        self.group_of[n.name] = gid

    def creates_cycle(self, gid: int, n: Node) -> str | None:
        """Joining n to the group is illegal if n reads (through nodes outside the group) a
        value that depends on the group: the fused kernel would depend on itself."""
        g = self.graph
        members = set(self.members[gid])
        limit = self.order[n.name]
        outside_preds = []
        for v in n.inputs:
            p = g.producer(v) if v else None
            if p is not None and p.name not in members:
                outside_preds.append(p.name)
        if not outside_preds:
            return None
        # forward search from the group, through nodes outside it, up to n's position
        seen, stack = set(), [m for m in members]
        while stack:
            x = stack.pop()
            for _, y in g.g.out_edges(x):
                if y in seen or self.order.get(y, 1 << 30) >= limit:
                    continue
                seen.add(y)
                if y in outside_preds and y not in members:
                    return f"would create a cycle through node '{y}'"
                stack.append(y)
        return None


def build_map_groups(graph: Graph) -> Groups:
    groups = Groups(graph)
    on = enabled(graph, "elementwise")
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
            if not on:
                log(graph, p.name, n.name, "elementwise", "rule switched off")
                continue
            if joined is not None:
                log(graph, p.name, n.name, "elementwise",
                    "consumer already fused with another producer's group")
                continue
            if groups.shape[gid] != shape:
                log(graph, p.name, n.name, "elementwise",
                    f"shapes differ: {list(groups.shape[gid])} vs {list(shape)}")
                continue
            cyc = groups.creates_cycle(gid, n)
            if cyc:
                log(graph, p.name, n.name, "elementwise", cyc)
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
# the pass
# ---------------------------------------------------------------------------


@graph_pass("fusion")
def fusion(graph: Graph) -> bool:
    """Group elementwise chains; give contractions their epilogues."""
    groups = build_map_groups(graph)
    changed = False
    # contraction epilogues first: they take whole groups
    for n in list(graph.nodes()):
        rule = EPILOGUE_RULE.get(n.op_type)
        if rule is None or n.domain:
            continue
        out = n.outputs[0]
        cons = graph.consumers(out)
        if not cons:
            continue
        if not enabled(graph, rule):
            for c in cons:
                log(graph, n.name, c, rule, "rule switched off")
            continue
        reason = _epilogue_reason(graph, n, cons, groups)
        if reason:
            for c in cons:
                log(graph, n.name, c, rule, reason)
            continue
        gid = groups.group_of[cons[0]]
        names = groups.members.pop(gid)
        ins, outs = group_io(graph, names)
        ext = [v for v in ins if v != out]
        _replace_group(graph, [n.name] + names, FUSED_OP[n.op_type], list(n.inputs) + ext,
                       outs, n)
        changed = True
    # elementwise producers of a Softmax (scale, additive mask...) read inside it
    for n in list(graph.nodes()):
        if n.op_type not in ("Softmax", "LogSoftmax") or n.domain:
            continue
        p = graph.producer(n.inputs[0])
        if p is None or p.name not in groups.group_of:
            continue
        gid = groups.group_of[p.name]
        if gid not in groups.members:
            continue
        reason = _prologue_reason(graph, n, groups, gid)
        if reason:
            log(graph, p.name, n.name, "softmax_prologue", reason)
            continue
        names = groups.members.pop(gid)
        ins, _ = group_io(graph, names)
        _replace_group(graph, names + [n.name], "FusedSoftmax", ins, list(n.outputs),
                       graph.node(names[0]))
        changed = True
    for gid, names in groups.members.items():
        if len(names) < 2:
            continue
        ins, outs = group_io(graph, names)
        _replace_group(graph, names, "FusedMap", ins, outs, graph.node(names[0]))
        changed = True
    return changed


def _prologue_reason(graph: Graph, sm: Node, groups: Groups, gid: int) -> str | None:
    if not enabled(graph, "softmax_prologue"):
        return "rule switched off"
    x = sm.inputs[0]
    t = graph.values[x]
    rank = len(t.shape)
    if np.dtype(t.dtype) != np.float32:
        return "prologues are generated for float32 only"
    axis = sm.attrs.get("axis", -1 if sm.opset >= 13 else 1)
    if rank == 0 or axis % rank != rank - 1 or int(t.shape[-1]) <= 1:
        return f"{sm.op_type} is not over the last axis"
    if groups.shape[gid] != tuple(t.shape):
        return "the prologue's shape differs from the Softmax input"
    _, outs = group_io(graph, groups.members[gid])
    if outs != [x] or graph.consumers(x) != [sm.name]:
        return f"the prologue also writes values used elsewhere ({', '.join(outs)})"
    return None


def _epilogue_reason(graph: Graph, n: Node, cons: list[str], groups: Groups) -> str | None:
    from ..ir.ops.fused import conv_operand_pattern, operand_pattern

    out = n.outputs[0]
    t = graph.values[out]
    if np.dtype(t.dtype) != np.float32:
        return "epilogues are generated for float32 GEMMs only"
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
    if np.dtype(graph.values[outs[0]].dtype) != np.float32:
        return "the epilogue's result is not float32"
    from ..ir.ops.contraction import _matmul_spec
    batched = False
    if n.op_type == "MatMul":
        spec, why = _matmul_spec(graph.values[n.inputs[0]], graph.values[n.inputs[1]])
        if spec is None:
            return why
        batched = spec.batch > 1
    for v in ins:
        if v == out:
            continue
        vt = graph.values[v]
        if n.op_type == "Conv":
            if conv_operand_pattern(vt, tuple(t.shape)) is None:
                return f"epilogue operand '{v}' of shape {list(vt.shape)} is not a scalar, " \
                       "per-channel or full tensor of the convolution's output"
        elif operand_pattern(vt, tuple(t.shape), batched) is None:
            return f"epilogue operand '{v}' of shape {list(vt.shape)} is not a " \
                   "scalar, row, column or full tensor of the GEMM's output"
    # the group must not read a value computed from the GEMM's result outside the group
    cyc = groups.creates_cycle(gid, graph.node(names[0]))
    if cyc:
        return cyc
    return None


