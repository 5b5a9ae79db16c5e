"""The cannc IR: a dataflow graph over a networkx multigraph.

Nodes of the networkx graph are operation names; an edge producer -> consumer
carries the name of the value that flows along it (key = value name). Values
(name -> TensorType), constants (name -> ndarray), graph inputs and outputs are
kept beside it. Node attributes are plain Python values (ints, floats, strings,
lists, ndarrays) read once at import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .types import TensorType


@dataclass(frozen=True)
class Node:
    name: str
    op_type: str
    inputs: tuple[str, ...]        # '' marks an absent optional input
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    domain: str = ""
    opset: int = 0                 # the opset version of the node's domain
    proto: Any = field(default=None, hash=False, compare=False, repr=False)  # onnx.NodeProto

    def replace(self, **kw: Any) -> Node:
        return dataclasses.replace(self, **kw)

    def __getstate__(self) -> dict[str, Any]:
        # `proto` is a cache of the node's ONNX form (passes.fold.node_proto rebuilds it),
        # left out of pickles: unpickling one would import onnx (with ml_dtypes, ~0.6 s)
        # into a process that loads a compiled program from the cache and never needs it.
        # A control-flow node keeps it: ir.ops.control.own_inputs reads it.
        state = dict(self.__dict__)
        if state.get("proto") is not None and not any(isinstance(v, Graph)
                                                       for v in self.attrs.values()):
            state["proto"] = None
        return state

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)


def _nx() -> Any:
    """networkx, imported by the first graph built: a process that only runs programs
    from the program cache never builds one (their graphs' structure is pickled
    without networkx, see Graph.__getstate__), and importing networkx takes ~0.1 s."""
    import networkx

    return networkx


class Graph:
    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self._g: Any = _nx().MultiDiGraph()
        self._rows: list[tuple[str, Node, float]] | None = None   # unpickled: see g
        self._topo: list[str] | None = None     # node names in order (nodes())
        self.values: dict[str, TensorType] = {}
        self.constants: dict[str, np.ndarray] = {}
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.opsets: dict[str, int] = {}
        self.meta: dict[str, Any] = {}      # pass options and logs (e.g. fusion decisions)
        self._producer: dict[str, str] = {}
        self._consumers: dict[str, set[str]] = {}
        self._counter = 0

    @property
    def g(self) -> Any:
        """The networkx.MultiDiGraph of the nodes (built on first use after unpickling)."""
        g = self._g
        if g is None:
            g = self._g = _nx().MultiDiGraph()
            for name, node, order in self._rows or ():
                g.add_node(name, node=node, order=order)
            for name, node, _ in self._rows or ():
                for v in node.inputs:
                    p = self._producer.get(v) if v else None
                    if p is not None and p != name:
                        g.add_edge(p, name, key=v)
            self._rows = None
        return g

    @g.setter
    def g(self, g: Any) -> None:
        self._g, self._rows = g, None

    def __getstate__(self) -> dict[str, Any]:
        # the nodes as (name, node, order) rows rather than a networkx graph, so that
        # unpickling (a program-cache hit's specialisation) does not import networkx
        state = dict(self.__dict__)
        if self._g is not None:
            state["_rows"] = [(n, d["node"], d.get("order", 0))
                              for n, d in self._g.nodes(data=True)]
        state["_g"] = None
        return state

    # ---- construction -------------------------------------------------
    def add_node(self, node: Node, order: float | None = None) -> Node:
        if node.name in self.g:
            raise ValueError(f"duplicate node name {node.name!r}")
        if order is None:
            self._counter += 1
            order = self._counter
        self._topo = None
        self.g.add_node(node.name, node=node, order=order)
        for v in node.outputs:
            if v:
                self._producer[v] = node.name
        for v in node.inputs:
            if v:
                self._consumers.setdefault(v, set()).add(node.name)
                p = self._producer.get(v)
                if p is not None and p != node.name:
                    self.g.add_edge(p, node.name, key=v)
        for v in node.outputs:
            for c in self._consumers.get(v, ()):
                if c != node.name:
                    self.g.add_edge(node.name, c, key=v)
        return node

    def remove_node(self, name: str) -> None:
        node = self.node(name)
        for v in node.outputs:
            if self._producer.get(v) == name:
                del self._producer[v]
        for v in node.inputs:
            if v and v in self._consumers:
                self._consumers[v].discard(name)
        self._topo = None
        self.g.remove_node(name)

    def replace_node(self, old: str, new: Node) -> None:
        order = self.g.nodes[old].get("order")
        self.remove_node(old)
        self.add_node(new, order=order)

    def set_constant(self, name: str, value: np.ndarray) -> None:
        value = np.asarray(value)
        if not value.flags.c_contiguous:
            value = value.copy(order="C")  # (np.ascontiguousarray would turn 0-d into 1-d)
        self.constants[name] = value
        self.values[name] = TensorType(value.dtype, tuple(int(d) for d in value.shape))

    def input_values(self, n: Node) -> list[np.ndarray | None]:
        """The node's input values that are constants (None where not, or absent)."""
        return [self.constants.get(v) if v else None for v in n.inputs]

    def replace_uses(self, old: str, new: str) -> None:
        """Make every consumer of value `old` (and graph outputs) read `new` instead."""
        for cname in self.consumers(old):
            n = self.node(cname)
            ins = tuple(new if v == old else v for v in n.inputs)
            self.replace_node(cname, n.replace(inputs=ins))
        self.outputs = [new if v == old else v for v in self.outputs]

    # ---- queries ------------------------------------------------------
    # node() and nodes() read networkx's own node dict, and successors() its adjacency
    # dict, rather than through the views networkx builds on every lookup: passes ask
    # ~15000 times per specialisation of BERT-base (the views were a tenth of its time)
    def node(self, name: str) -> Node:
        return self.g._node[name]["node"]

    def nodes(self) -> Iterator[Node]:
        # the order is kept until a node is added or removed (passes and lowering ask
        # for it thousands of times: 0.19 s of a warm MiniLM compile)
        if self._topo is None:
            self._topo = list(_nx().lexicographical_topological_sort(self.g, key=self._order_key))
        nd = self.g._node
        for n in self._topo:
            yield nd[n]["node"]

    def successors(self) -> dict[str, dict[str, Any]]:
        """node name -> {name of a node reading one of its outputs: ...}: the adjacency
        to walk, never to change."""
        return self.g._succ

    def _order_key(self, name: str) -> Any:
        return self.g._node[name].get("order", 0), name

    def num_nodes(self) -> int:
        return self.g.number_of_nodes()

    def producer(self, value: str) -> Node | None:
        p = self._producer.get(value)
        return self.node(p) if p is not None else None

    def consumers(self, value: str) -> list[str]:
        return sorted(self._consumers.get(value, ()))

    def is_constant(self, value: str) -> bool:
        return value in self.constants

    def type(self, value: str) -> TensorType:
        return self.values[value]

    def copy(self) -> Graph:
        g = Graph(self.name)
        g.g = _copy_nx(self.g)
        g.values = dict(self.values)
        g.constants = dict(self.constants)
        g.inputs = list(self.inputs)
        g.outputs = list(self.outputs)
        g.opsets = dict(self.opsets)
        g.meta = {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                  for k, v in self.meta.items()}
        g._producer = dict(self._producer)
        g._consumers = {k: set(v) for k, v in self._consumers.items()}
        g._counter = self._counter
        g._topo = list(self._topo) if self._topo is not None else None
        return g

    def used_values(self) -> set[str]:
        used = set(self.outputs)
        for n in self.g.nodes(data=True):
            used.update(v for v in n[1]["node"].inputs if v)
        return used

    def dump(self) -> str:
        lines = [f"graph {self.name}("]
        lines += [f"    {i}: {self.values.get(i)}" for i in self.inputs]
        lines.append(") {")
        for n in self.nodes():
            outs = ", ".join(f"{o}: {self.values.get(o)}" for o in n.outputs)
            ins = ", ".join(
                (f"const {i}" if i in self.constants else i) if i else "_" for i in n.inputs
            )
            attrs = ", ".join(f"{k}={_short(v)}" for k, v in sorted(n.attrs.items()))
            lines.append(f"    {outs} = {n.op_type}[{attrs}]({ins})  # {n.name}")
        lines.append(f"    return {', '.join(self.outputs)}")
        lines.append("}")
        return "\n".join(lines)


def _copy_nx(src: Any) -> Any:
    """A copy of the MultiDiGraph `src` (nodes' and edges' data dicts copied, their values
    shared), built as networkx's own dicts: its `copy()` adds each edge through
    add_edges_from, 3-4x slower (~4 ms a copy of BERT-base's 1100 nodes)."""
    h = src.__class__()
    h.graph.update(src.graph)
    h._node = {n: dict(d) for n, d in src._node.items()}
    succ: dict[str, dict[str, Any]] = {}
    pred: dict[str, dict[str, Any]] = {n: {} for n in h._node}
    for u, nbrs in src._succ.items():
        su = succ[u] = {}
        for v, keys in nbrs.items():
            su[v] = pred[v][u] = {k: dict(d) for k, d in keys.items()}
    h._succ = h._adj = succ
    h._pred = pred
    return h


def _short(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"array{list(v.shape)}" if v.size > 8 else repr(v.tolist())
    s = repr(v)
    return s if len(s) < 60 else s[:57] + "..."


def verify(graph: Graph) -> None:
    """Check the IR's invariants; raise AssertionError naming the first broken one."""
    defined = set(graph.inputs) | set(graph.constants)
    for n in graph.nodes():
        for v in n.inputs:
            if v and v not in defined:
                raise AssertionError(f"node {n.name!r} reads {v!r} before it is defined")
        for v in n.outputs:
            if not v:
                continue  # an absent optional output
            if v in defined:
                raise AssertionError(f"value {v!r} defined twice (at node {n.name!r})")
            if v and v not in graph.values:
                raise AssertionError(f"value {v!r} of node {n.name!r} has no type")
            defined.add(v)
    for o in graph.outputs:
        if o not in defined:
            raise AssertionError(f"graph output {o!r} is never defined")
    if not _nx().is_directed_acyclic_graph(graph.g):
        raise AssertionError("graph has a cycle")

