"""The support report (`cannc check`, `cannc.check`): every node of a model, before
compiling, with op, domain, opset, input dtypes and whether it compiles -- and if not, why.

    rep = support_report("model.onnx", {"x": (1, 256)})
    rep.supported, [r.name for r in rep.unsupported()], rep.to_dict()

It prints nothing and needs no CLI: an execution provider asks it which nodes to claim.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import CanncError, CompileError
from ..ir.graph import Graph, Node
from ..ir.ops import lookup
from ..ir.registry import Category
from ..passes.fold import bind_input_shapes, foldable_op, shape_fold
from ..passes.manager import PassManager
from .pipeline import DEFAULT_PIPELINE, PIPELINES
from .shapes import Shapes, complete_input_shapes, type_string
from .support import node_support

# A node's status; every status but "unsupported" compiles.
STATUSES = ("ok", "folded", "view", "unused", "rewritten", "unsupported")

# what it means for a node that a pass removed it
_REMOVED_STATUS = {"infer_and_fold": "folded", "dce": "unused"}


@dataclass(frozen=True)
class NodeSupport:
    """One node: `status` is one of STATUSES; `reason` says why it is unsupported, or which
    pass removed it. `inserted_by_compiler`: a node a pass added (not in the model)."""

    name: str
    op: str
    domain: str                      # 'ai.onnx' for the default domain
    opset: int
    input_dtypes: tuple[str, ...]    # '' for an absent optional input, '?' if unknown
    status: str = "ok"
    reason: str | None = None
    inserted_by_compiler: bool = False

    @property
    def supported(self) -> bool:
        return self.status != "unsupported"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "op": self.op, "domain": self.domain,
                             "opset": self.opset, "input_dtypes": list(self.input_dtypes),
                             "status": self.status, "reason": self.reason}
        if self.inserted_by_compiler:
            d["inserted_by_compiler"] = True
        return d


@dataclass(frozen=True)
class SupportReport:
    """Every node of a model (`nodes`, model order, then nodes the passes inserted).
    `shape_inference_error`: compile-time shape inference failed (the nodes were then
    checked on the symbolic graph)."""

    model: str | None
    opsets: dict[str, int]
    inputs: dict[str, str]           # input -> 'float32[batch, 64]'
    nodes: tuple[NodeSupport, ...]
    shape_inference_error: str | None = None

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.nodes) for s in STATUSES}

    @property
    def supported(self) -> bool:
        """The whole model compiles."""
        return self.shape_inference_error is None and all(r.supported for r in self.nodes)

    def unsupported(self) -> list[NodeSupport]:
        return [r for r in self.nodes if not r.supported]

    def to_dict(self) -> dict[str, Any]:
        """What `cannc check --json` prints."""
        return {"model": self.model, "opsets": dict(self.opsets), "inputs": dict(self.inputs),
                "nodes": [r.to_dict() for r in self.nodes], "counts": self.counts,
                "shape_inference_error": self.shape_inference_error,
                "supported": self.supported}


def support_report(model: Any, shapes: Shapes | None = None, pipeline: str = DEFAULT_PIPELINE,
                   *, name: str | None = None) -> SupportReport:
    """Every node of `model` (an ir.Graph, or a path, bytes or ModelProto): ok / folded /
    view / unused / rewritten / unsupported (with the reason), as compiling it for `shapes`
    (symbolic dims not given: 1) with `pipeline` would see it. `name` is the report's model
    name (default: the path, when `model` is one)."""
    if pipeline not in PIPELINES:
        raise CompileError(f"unknown pipeline {pipeline!r}; choose one of {', '.join(PIPELINES)}")
    if name is None and isinstance(model, (str, os.PathLike)):
        name = str(model)
    if isinstance(model, Graph):
        graph = model
    else:
        from ..frontend import import_model

        graph = import_model(model)[0]
    # What compilation will see: shapes bound, constants and shape chains folded, dead code
    # dropped. If that already fails, the nodes are checked on the symbolic graph instead.
    spec: Graph | None = None
    stop = None
    removed_by: dict[str, str] = {}   # node -> the pass that removed it
    try:
        spec = graph.copy()
        bind_input_shapes(spec, complete_input_shapes(graph, shapes or {}))
        for pass_name in PIPELINES[pipeline]:
            before = set(spec.g.nodes)
            PassManager([pass_name]).run(spec)
            removed_by.update(dict.fromkeys(before - set(spec.g.nodes), pass_name))
    except CanncError as e:
        spec, stop = None, f"{type(e).__name__}: {e}"
    static_folded = _static_folds(graph) if spec is None else set()

    def row(g: Graph, n: Node, inserted: bool = False) -> NodeSupport:
        base = NodeSupport(
            name=n.name, op=n.op_type, domain=n.domain or "ai.onnx", opset=n.opset,
            input_dtypes=tuple(np.dtype(graph.values[v].dtype).name if v in graph.values
                               else (np.dtype(g.values[v].dtype).name if v in g.values
                                     else "?") if v else "" for v in n.inputs),
            inserted_by_compiler=inserted)
        if spec is not None and not inserted and n.name not in spec.g:
            by = removed_by.get(n.name, "?")
            return replace(base, status=_REMOVED_STATUS.get(by, "rewritten"),
                           reason=f"removed by pass '{by}'")
        if spec is None and n.name in static_folded:
            return replace(base, status="folded")
        try:
            why = node_support(g, g.node(n.name))
        except Exception as e:  # an op check that needs concrete shapes
            why = f"cannot be checked ({type(e).__name__}: {e})"
        if why:
            return replace(base, status="unsupported", reason=why)
        op = lookup(n.op_type, n.domain)
        if op is not None and op.category == Category.VIEW:
            return replace(base, status="view")
        return base

    rows = [row(spec if spec is not None else graph, n) for n in graph.nodes()]
    if spec is not None:
        rows += [row(spec, n, inserted=True) for n in spec.nodes() if n.name not in graph.g]
    return SupportReport(
        model=name, opsets={d or "ai.onnx": v for d, v in graph.opsets.items()},
        inputs={n: type_string(graph.values[n].dtype, graph.values[n].shape)
                for n in graph.inputs},
        nodes=tuple(rows), shape_inference_error=stop)


def _static_folds(graph: Graph) -> set[str]:
    """Nodes the constant folder will remove: all inputs constant, or shape-only ops."""
    known, folded = set(graph.constants), set()
    for n in graph.nodes():
        op = lookup(n.op_type, n.domain)
        shape_only = shape_fold(op) is not None
        if foldable_op(op) and (shape_only or all(v in known for v in n.inputs if v)):
            folded.add(n.name)
            known.update(v for v in n.outputs if v)
    return folded
