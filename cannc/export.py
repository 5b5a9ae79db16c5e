"""Export a compiled specialisation as an ONNX graph with one node per kernel (domain
'cannc'), so the fused graph can be opened in Netron."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .artifact import Specialization
from .ir.types import NP_TO_ONNX


def fused_graph(spec: Specialization, name: str = "cannc_fused") -> onnx.ModelProto:
    g = spec.graph

    def root(v: str) -> str:
        while v in spec.aliases:
            v = spec.aliases[v]
        return v

    def vi(v: str) -> onnx.ValueInfoProto:
        t = g.values[v]
        return helper.make_tensor_value_info(v, NP_TO_ONNX[np.dtype(t.dtype)], list(t.shape))

    nodes, inits, seen = [], [], set()
    for i, k in enumerate(spec.kernels):
        for v in k.inputs:
            if v and v in spec.constants and v not in seen:
                seen.add(v)
                inits.append(numpy_helper.from_array(spec.constants[v], v))
        nodes.append(helper.make_node(
            "+".join(k.op_types), [v for v in k.inputs], [v for v in k.outputs],
            name=f"kernel_{i}", domain="cannc", onnx_nodes=list(k.nodes), flops=int(k.flops),
            bytes_read=int(k.bytes_read), bytes_written=int(k.bytes_written),
            tiles=int(k.num_tiles), symbol=k.symbol))
    # views (Reshape & co.) become Identity-like aliases so the graph stays connected
    for v, src in spec.aliases.items():
        nodes.append(helper.make_node("View", [root(src)], [v], name=f"view::{v}",
                                      domain="cannc"))
    inputs = [vi(v) for v in g.inputs]
    outputs = [vi(v) for v in g.outputs]
    values = {v for k in spec.kernels for v in list(k.inputs) + list(k.outputs) if v}
    value_info = [vi(v) for v in sorted(values) if v in g.values and v not in spec.constants
                  and v not in g.inputs and v not in g.outputs]
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=inits,
                              value_info=value_info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("cannc", 1)],
                             producer_name="cannc")


def save_fused_graph(spec: Specialization, path: str | Path) -> None:
    onnx.save(fused_graph(spec), str(path))
