"""Legalisation: rewrite nodes into forms the kernels support, without changing results."""

from __future__ import annotations

import numpy as np

from ..ir.graph import Graph, Node
from ..ir.types import TensorType
from .manager import graph_pass


@graph_pass("legalize_matmul_broadcast")
def legalize_matmul_broadcast(graph: Graph) -> bool:
    """MatMul whose batch dims broadcast partially within one operand (e.g. [2,1,M,K] @
    [3,K,N]): materialise the broadcast with an Expand so the GEMM sees one batch stride."""
    from ..ir.ops.contraction import _matmul_dims

    changed = False
    for n in list(graph.nodes()):
        if n.op_type != "MatMul":
            continue
        a, b = graph.values[n.inputs[0]], graph.values[n.inputs[1]]
        if not (a.is_static and b.is_static) or len(a.shape) < 2 or len(b.shape) < 2:
            continue
        batch, M, K, N, ab, bb = _matmul_dims(tuple(a.shape), tuple(b.shape))
        new_inputs = list(n.inputs)
        for i, (t, tb) in enumerate(((a, ab), (b, bb))):
            if tb == batch or all(d == 1 for d in tb):
                continue
            target = tuple(batch) + tuple(t.shape[-2:])
            shp_name = f"{n.name}::expand_shape{i}"
            out_name = f"{n.name}::expanded{i}"
            graph.set_constant(shp_name, np.array(target, dtype=np.int64))
            graph.values[out_name] = TensorType(t.dtype, target)
            graph.add_node(Node(name=f"{n.name}::expand{i}", op_type="Expand",
                                inputs=(n.inputs[i], shp_name), outputs=(out_name,),
                                opset=graph.opsets.get("", 13)),
                           order=graph.g.nodes[n.name]["order"] - 0.5)
            new_inputs[i] = out_name
        if tuple(new_inputs) != n.inputs:
            graph.replace_node(n.name, n.replace(inputs=tuple(new_inputs), proto=None))
            changed = True
    return changed
