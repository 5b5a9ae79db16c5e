"""The execution provider's partitioner: which nodes of a model cannc claims, in which
groups (one group = one fused node in ONNX Runtime = one cannc program).

    part = partition(model, allow=frozenset({"MatMul"}))
    for g in part.groups:
        sub = group_model(model, g)       # a standalone ModelProto cannc.compile loads
    part.rejected                         # node -> why cannc leaves it to ORT

Pure Python over an `onnx.ModelProto` (the EP mirrors ORT's graph into one). A node is
claimed when cannc's support report says it compiles (the same as `cannc check`), its op
passes the allow / deny lists and it has no subgraph. Claimed nodes are grouped greedily,
in topological order, into weakly connected, CONVEX groups: no path between two members
of a group passes through a node outside it (ORT would otherwise build a cycle between
the fused node and that outside node). Convexity is kept exactly with ancestor and
descendant bitsets (Python ints): the union of two convex groups is convex iff no node
outside it is both a descendant of one and an ancestor of the other.

Node names are cannc's: a node's own name, or `<op_type>_<index>` for an unnamed one,
made unique the way the frontend does it (`node_names`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import onnx

from ..compiler.report import support_report
from ..compiler.shapes import value_deciding_inputs
from ..errors import CanncError, ModelError
from ..frontend import import_model
from ..ir.graph import Graph

# ops whose bodies are graphs: the EP's mirror does not carry their subgraphs
CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})


@dataclass(frozen=True)
class Group:
    nodes: tuple[str, ...]         # node names, in the model's (topological) order
    inputs: tuple[str, ...]        # values read by the group and made outside it, not
                                   # initializers, in first-use order ('' excluded)
    outputs: tuple[str, ...]       # values made in the group and read outside it (by a node
                                   # not in the group, or as a graph output), production order
    initializers: tuple[str, ...]  # initializers the group reads, in first-use order


@dataclass(frozen=True)
class Partition:
    groups: tuple[Group, ...]
    rejected: dict[str, str]       # node name -> why cannc does not claim it (for logging)

    @property
    def claimed(self) -> tuple[str, ...]:
        """Every node in some group, group by group."""
        return tuple(n for g in self.groups for n in g.nodes)


# ---------------------------------------------------------------------------------------
# the model as a DAG


def node_names(model: onnx.ModelProto) -> list[str]:
    """cannc's name for each node of `model.graph.node`, in that order: the node's name,
    or `<op_type>_<index>` when it has none, made unique as the frontend does."""
    seen: set[str] = set()
    out = []
    for i, n in enumerate(model.graph.node):
        name = n.name or f"{n.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        seen.add(name)
        out.append(name)
    return out


def _subgraph_reads(g: onnx.GraphProto) -> list[str]:
    """Values a subgraph reads from enclosing graphs (recursively), in first-use order."""
    defined = {v.name for v in g.input} | {t.name for t in g.initializer}
    defined |= {t.values.name for t in g.sparse_initializer}
    reads: list[str] = []
    for n in g.node:
        for v in list(n.input) + [r for a in n.attribute for s in _graphs(a)
                                  for r in _subgraph_reads(s)]:
            if v and v not in defined and v not in reads:
                reads.append(v)
        defined.update(o for o in n.output if o)
    reads += [o.name for o in g.output if o.name not in defined and o.name not in reads]
    return reads


def _graphs(a: onnx.AttributeProto) -> list[onnx.GraphProto]:
    if a.type == onnx.AttributeProto.GRAPH:
        return [a.g]
    if a.type == onnx.AttributeProto.GRAPHS:
        return list(a.graphs)
    return []


def _has_subgraph(n: onnx.NodeProto) -> bool:
    return any(_graphs(a) for a in n.attribute)


class _Dag:
    """The nodes of a model in a stable topological order (the model's own when it is
    one), with their reads (inputs plus outer values their subgraphs read, or
    `implicit_inputs`), producers and consumers as node indices in that order."""

    def __init__(self, model: onnx.ModelProto,
                 implicit_inputs: Mapping[str, Sequence[str]] | None = None) -> None:
        protos = list(model.graph.node)
        names = node_names(model)
        implicit = dict(implicit_inputs or {})
        reads = []
        for name, n in zip(names, protos):
            r = [v for v in n.input if v]
            for v in list(implicit.get(name, ())) + [v for a in n.attribute for s in _graphs(a)
                                                     for v in _subgraph_reads(s)]:
                if v and v not in r:
                    r.append(v)
            reads.append(r)
        producer: dict[str, int] = {}
        for i, n in enumerate(protos):
            for v in n.output:
                if v:
                    if v in producer:
                        raise ModelError(f"value '{v}' is produced by two nodes, "
                                         f"'{names[producer[v]]}' and '{names[i]}'")
                    producer[v] = i
        # stable Kahn: always the ready node that comes first in the model
        preds = [sorted({producer[v] for v in r if v in producer} - {i})
                 for i, r in enumerate(reads)]
        if any(producer.get(v) == i for i, r in enumerate(reads) for v in r):
            bad = next(names[i] for i, r in enumerate(reads) if any(producer.get(v) == i
                                                                    for v in r))
            raise ModelError(f"node '{bad}' reads its own output")
        succs: list[list[int]] = [[] for _ in protos]
        for i, ps in enumerate(preds):
            for p in ps:
                succs[p].append(i)
        indeg = [len(ps) for ps in preds]
        ready = [i for i, d in enumerate(indeg) if d == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for s in succs[i]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(ready, s)
        if len(order) != len(protos):
            stuck = sorted(set(range(len(protos))) - set(order))
            raise ModelError("the graph has a cycle through node"
                             f"{'s' if len(stuck) > 1 else ''} "
                             + ", ".join(f"'{names[i]}'" for i in stuck[:5]))
        self.in_model_order = order == list(range(len(protos)))
        pos = {old: k for k, old in enumerate(order)}
        self.protos = [protos[i] for i in order]
        self.names = [names[i] for i in order]
        self.reads = [reads[i] for i in order]
        # (a producer listed once per node, in the node's read order: merges try them so)
        self.pred_order = []
        for r in self.reads:
            seen: list[int] = []
            for v in r:
                p = producer.get(v)
                if p is not None and pos[p] not in seen:
                    seen.append(pos[p])
            self.pred_order.append(seen)
        self.producer = {v: pos[i] for v, i in producer.items()}
        self.consumers: dict[str, list[int]] = {}
        for k, r in enumerate(self.reads):
            for v in r:
                self.consumers.setdefault(v, []).append(k)
        self.initializers = {t.name for t in model.graph.initializer}
        self.graph_outputs = {o.name for o in model.graph.output}
        self.index = {n: k for k, n in enumerate(self.names)}

    def sorted_model(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """`model` itself when its nodes are in topological order, else a copy whose nodes
        are (named as cannc names them, so names survive the reordering)."""
        if self.in_model_order:
            return model
        out = onnx.ModelProto()
        out.CopyFrom(model)
        del out.graph.node[:]
        for name, n in zip(self.names, self.protos):
            c = out.graph.node.add()
            c.CopyFrom(n)
            c.name = name
        return out


# ---------------------------------------------------------------------------------------
# grouping


def grow_groups(preds: Sequence[Sequence[int]], claimed: Sequence[bool]) -> list[list[int]]:
    """Greedy convex grouping of the claimed nodes of a DAG whose nodes 0..n-1 are in
    topological order (`preds[i]`: the nodes `i` reads from, all < i, in the order merges
    are tried). Each claimed node starts alone and joins the group of each claimed
    producer in turn when the union stays convex; then every edge between two groups is
    retried until nothing merges. Groups are weakly connected (they grow along edges
    only) and convex. Returns the groups as sorted index lists, by first member."""
    n = len(preds)
    anc = [0] * n            # bit j: j is an ancestor of i
    for i in range(n):
        a = 0
        for p in preds[i]:
            a |= anc[p] | (1 << p)
        anc[i] = a
    succs: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for p in preds[i]:
            succs[p].append(i)
    desc = [0] * n           # bit j: j is a descendant of i
    for i in range(n - 1, -1, -1):
        d = 0
        for s in succs[i]:
            d |= desc[s] | (1 << s)
        desc[i] = d

    parent = list(range(n))
    members = [1 << i for i in range(n)]
    ganc = anc[:]
    gdesc = desc[:]

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def try_merge(a: int, b: int) -> bool:
        a, b = find(a), find(b)
        if a == b:
            return False
        s = members[a] | members[b]
        # convex groups a, b: their union is convex iff no outside node lies between them
        if ((gdesc[a] & ganc[b]) | (gdesc[b] & ganc[a])) & ~s:
            return False
        if a > b:
            a, b = b, a
        parent[b] = a                      # the representative: the smallest index
        members[a], ganc[a], gdesc[a] = s, ganc[a] | ganc[b], gdesc[a] | gdesc[b]
        return True

    edges = [(p, i) for i in range(n) if claimed[i] for p in preds[i] if claimed[p]]
    for p, i in edges:
        try_merge(p, i)
    changed = True
    while changed:
        changed = False
        for p, i in edges:
            changed |= try_merge(p, i)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        if claimed[i]:
            groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def _make_group(dag: _Dag, idx: Sequence[int]) -> Group:
    inside = set(idx)
    made = {o for i in idx for o in dag.protos[i].output if o}
    inputs: list[str] = []
    inits: list[str] = []
    seen: set[str] = set()
    for i in idx:
        for v in dag.reads[i]:
            if v in seen or v in made:
                continue
            seen.add(v)
            (inits if v in dag.initializers else inputs).append(v)
    outputs = [o for i in idx for o in dag.protos[i].output
               if o and (o in dag.graph_outputs
                         or any(c not in inside for c in dag.consumers.get(o, ())))]
    return Group(nodes=tuple(dag.names[i] for i in idx), inputs=tuple(inputs),
                 outputs=tuple(dict.fromkeys(outputs)), initializers=tuple(inits))


def _ir_subgraph(graph: Graph, group: Group) -> Graph:
    """The group as an IR graph cut out of the whole model's (no re-import, no types
    needed): what `value_deciding_inputs` reads."""
    sub = Graph("group")
    for name in group.nodes:
        sub.add_node(graph.node(name))
    for c in group.initializers:
        if c in graph.constants:
            sub.constants[c] = graph.constants[c]
            sub.values[c] = graph.values[c]
    for v in group.inputs:
        if v in graph.values:
            sub.values[v] = graph.values[v]
    sub.inputs = list(group.inputs)
    sub.outputs = list(group.outputs)
    sub.opsets = dict(graph.opsets)
    return sub


def partition(model: onnx.ModelProto, *, allow: frozenset[str] | None = None,
              deny: frozenset[str] = frozenset(), min_group_size: int = 1,
              implicit_inputs: Mapping[str, Sequence[str]] | None = None) -> Partition:
    """The groups of nodes cannc claims in `model`, and why it leaves the others.

    `allow`: op types cannc may claim (None: all); `deny`: op types it must not claim;
    `min_group_size`: smaller groups are left to ORT. `implicit_inputs`: node name ->
    outer values its subgraphs read, for a mirror that does not carry the subgraphs
    (ORT's Node_GetImplicitInputs): they are dependencies too, so convexity counts them.
    A group whose input decides a shape at run time (a Reshape target computed outside
    it, ...) would need a compile per value: the nodes reading it are rejected and the
    model partitioned again, until no group has one."""
    if not isinstance(model, onnx.ModelProto):
        raise ModelError(f"partition expects an onnx.ModelProto, got {type(model).__name__}")
    if min_group_size < 1:
        raise CanncError(f"min_group_size must be at least 1, got {min_group_size}")
    allow = None if allow is None else frozenset(allow)
    deny = frozenset(deny)
    dag = _Dag(model, implicit_inputs)
    rejected: dict[str, str] = {}
    if not dag.names:
        return Partition(groups=(), rejected=rejected)
    graph = import_model(dag.sorted_model(model))[0]
    report = {r.name: r for r in support_report(graph).nodes if not r.inserted_by_compiler}
    for name, n in zip(dag.names, dag.protos):
        why = _why_not(name, n, report, allow, deny,
                       implicit=bool(implicit_inputs and implicit_inputs.get(name)))
        if why:
            rejected[name] = why

    vd_cache: dict[tuple[str, ...], tuple[str, ...]] = {}
    while True:
        claimed = [name not in rejected for name in dag.names]
        groups = [_make_group(dag, idx) for idx in grow_groups(dag.pred_order, claimed)]
        more = False
        for g in groups:
            if g.nodes not in vd_cache:
                vd_cache[g.nodes] = value_deciding_inputs(_ir_subgraph(graph, g)) \
                    if g.inputs else ()
            for v in vd_cache[g.nodes]:
                for name in g.nodes:
                    if name not in rejected and v in dag.reads[dag.index[name]]:
                        rejected[name] = (f"its input '{v}' decides a shape at run time "
                                          "and is computed outside cannc")
                        more = True
        if not more:
            break

    kept = []
    for g in groups:
        why = None
        if not g.outputs:
            why = "its group produces nothing used outside it (dead code)"
        elif all(dag.protos[dag.index[n]].op_type == "Constant" for n in g.nodes):
            why = "its group holds only Constant nodes (ORT keeps constants itself)"
        elif len(g.nodes) < min_group_size:
            why = (f"its group has {len(g.nodes)} node{'s' if len(g.nodes) > 1 else ''}, "
                   f"fewer than min_group_size={min_group_size}")
        if why:
            rejected.update(dict.fromkeys(g.nodes, why))
        else:
            kept.append(g)
    order = {n: k for k, n in enumerate(dag.names)}
    return Partition(groups=tuple(kept),
                     rejected=dict(sorted(rejected.items(), key=lambda kv: order[kv[0]])))


def _why_not(name: str, n: onnx.NodeProto, report: Mapping, allow: frozenset[str] | None,
             deny: frozenset[str], *, implicit: bool) -> str | None:
    if _has_subgraph(n) or n.op_type in CONTROL_FLOW_OPS or implicit:
        return f"{n.op_type} has subgraphs (control flow is left to ORT)"
    if allow is not None and n.op_type not in allow:
        return "not in op_type_allow_list"
    if n.op_type in deny:
        return "in op_type_deny_list"
    row = report.get(name)
    if row is None:
        return "not in cannc's support report"
    if not row.supported:
        return row.reason or "unsupported"
    return None


# ---------------------------------------------------------------------------------------
# one group as a model


def group_model(model: onnx.ModelProto, group: Group) -> onnx.ModelProto:
    """A standalone ModelProto of just `group`: its nodes (named as cannc names them), its
    inputs typed from the model's graph inputs / value_info (ONNX shape inference fills
    what those lack; an unknown dim becomes a fresh dim_param 'unk__<n>'), its outputs
    (typed when known), the initializers it reads, the model's opsets and ir_version."""
    if not isinstance(model, onnx.ModelProto):
        raise ModelError(f"group_model expects an onnx.ModelProto, got {type(model).__name__}")
    by_name = dict(zip(node_names(model), model.graph.node))
    missing = [n for n in group.nodes if n not in by_name]
    if missing:
        raise ModelError(f"group node{'s' if len(missing) > 1 else ''} not in the model: "
                         + ", ".join(f"'{n}'" for n in missing[:5]))
    inits = {t.name: t for t in model.graph.initializer}
    absent = [c for c in group.initializers if c not in inits]
    if absent:
        raise ModelError(f"group initializer '{absent[0]}' is not in the model")
    types = _Types(model)
    params = _DimNames(model)
    g = onnx.GraphProto(name=f"{model.graph.name or 'graph'}_cannc_group")
    for v in group.inputs:
        vi = types.get(v)
        if vi is None:
            raise ModelError(f"group input '{v}': its type is unknown to the model "
                             "(no graph input, value_info or inferred type has it)")
        g.input.append(params.fill(vi))
    for v in group.outputs:
        vi = types.get(v)
        g.output.append(params.fill(vi) if vi is not None else onnx.ValueInfoProto(name=v))
    for name in group.nodes:
        c = g.node.add()
        c.CopyFrom(by_name[name])
        c.name = name
    for c in group.initializers:
        g.initializer.append(inits[c])
    out = onnx.ModelProto(ir_version=model.ir_version, graph=g,
                          producer_name="cannc.ort.partition")
    out.opset_import.extend(model.opset_import)
    out.functions.extend(model.functions)
    return out


class _Types:
    """ValueInfoProto of a value: graph inputs, value_info, graph outputs (the first
    with a tensor type and a shape wins), else ONNX shape inference (once, lazily)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.known: dict[str, onnx.ValueInfoProto] = {}
        self._add(list(model.graph.input) + list(model.graph.value_info)
                  + list(model.graph.output))
        self.inferred = False

    def _add(self, vis: Iterable[onnx.ValueInfoProto]) -> None:
        for vi in vis:
            if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.elem_type:
                continue
            old = self.known.get(vi.name)
            if old is None or (not old.type.tensor_type.HasField("shape")
                               and vi.type.tensor_type.HasField("shape")):
                self.known[vi.name] = vi

    def get(self, v: str) -> onnx.ValueInfoProto | None:
        vi = self.known.get(v)
        if (vi is None or not vi.type.tensor_type.HasField("shape")) and not self.inferred:
            self.inferred = True
            m = None
            for data_prop in (True, False):   # (data propagation resolves Reshape targets)
                try:
                    m = onnx.shape_inference.infer_shapes(self.model, data_prop=data_prop)
                    break
                except Exception:    # (a custom op ONNX cannot infer through, ...)
                    continue
            if m is not None:
                self._add(list(m.graph.value_info) + list(m.graph.output))
            vi = self.known.get(v)
        return vi


class _DimNames:
    """Fresh dim_params 'unk__<n>' for unknown dims, not clashing with the model's."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.used = {d.dim_param for vi in list(model.graph.input) + list(model.graph.output)
                     + list(model.graph.value_info) if vi.type.HasField("tensor_type")
                     for d in vi.type.tensor_type.shape.dim if d.dim_param}
        self.n = 0

    def fill(self, vi: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
        out = onnx.ValueInfoProto()
        out.CopyFrom(vi)
        for d in out.type.tensor_type.shape.dim:
            if not d.HasField("dim_value") and not d.HasField("dim_param"):
                while f"unk__{self.n}" in self.used:
                    self.n += 1
                d.dim_param = f"unk__{self.n}"
                self.used.add(d.dim_param)
        return out
