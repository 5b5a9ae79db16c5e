"""The inspect report (`cannc inspect --json`, `Session.inspect()`): per kernel its ONNX
nodes, outputs, FLOPs, bytes, tiles, tiling, predicted time and runtime dims; the totals;
the memory plan; the passes; what did not fuse and why. Also the cost model's prediction
next to measured kernel times (`cannc profile`). Nothing here prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..artifact import Specialization
from ..runtime.profiler import Profile
from ..runtime.program import Program
from ..schedule import costmodel
from .shapes import type_string


def inspect_report(prog: Program, *, cores: int, pipeline: str,
                   input_shapes: dict[str, Sequence[int]], onnx_nodes: int,
                   fusion: bool | dict[str, bool]) -> dict[str, Any]:
    """Per kernel and in total: nodes, shapes, FLOPs, bytes, tiles; memory plan; passes.
    `prog` was compiled for `input_shapes` from a model of `onnx_nodes` nodes with these
    fusion switches; predictions are for `cores` AI cores (this annotates the kernels)."""
    spec = prog.spec
    g = spec.graph

    def root(v: str) -> str:
        while v in spec.aliases:
            v = spec.aliases[v]
        return v

    output_buffers = {root(o) for o in g.outputs}
    predicted_total = costmodel.annotate(spec.kernels, cores)  # for this many cores
    kernels = []
    for i, k in enumerate(spec.kernels):
        outs = [o for o in k.outputs if o]
        inter = sum(g.values[o].nbytes for o in outs if root(o) not in output_buffers)
        kernels.append({
            "index": i, "symbol": k.symbol, "nodes": list(k.nodes), "op_types": list(k.op_types),
            "outputs": [{"name": o, "dtype": np.dtype(g.values[o].dtype).name,
                         "shape": list(g.values[o].shape)} for o in outs],
            "flops": int(k.flops), "bytes_read": int(k.bytes_read),
            "bytes_written": int(k.bytes_written), "intermediate_bytes_written": int(inter),
            "tiles": int(k.num_tiles), "single_core": bool(k.single_core),
            "workspace_bytes": int(k.workspace_bytes),
            "tiling": k.notes.get("tiling", ""),
            "predicted_us": float(k.notes.get("predicted_us", 0.0)),
            # shape-polymorphic kernels read these sizes at run time (ABI.md)
            "runtime_dims": [int(d) for d in k.dims],
            "shape_polymorphic": bool(k.shape_polymorphic),
            "notes": {str(a): b for a, b in k.notes.items()},
        })
    return {
        "cores": cores, "pipeline": pipeline,
        "input_shapes": {n: list(s) for n, s in input_shapes.items()},
        "outputs": {o: type_string(g.values[o].dtype, g.values[o].shape) for o in g.outputs},
        "onnx_nodes": onnx_nodes, "views": len(spec.aliases),
        "num_kernels": len(kernels),
        "total_flops": sum(k["flops"] for k in kernels),
        "bytes_read": sum(k["bytes_read"] for k in kernels),
        "bytes_written": sum(k["bytes_written"] for k in kernels),
        "intermediate_bytes_written": sum(k["intermediate_bytes_written"] for k in kernels),
        "predicted_us": predicted_total,
        "cost_model": dataclasses.asdict(costmodel.cpu_model()),
        "memory": memory_report(prog),
        "passes": [{"name": r.name, "seconds": r.seconds, "changed": r.changed,
                    "nodes_after": r.nodes_after} for r in spec.pass_records],
        "compile_seconds": spec.compile_seconds,
        "cache_hits": spec.cache_hits, "cache_misses": spec.cache_misses,
        "fusion": {"switches": fusion, "not_fused": fusion_refusals(spec)},
        "kernels": kernels,
    }


def memory_report(prog: Program) -> dict[str, Any]:
    """The memory plan's figures: arena, naive (a buffer per intermediate), lower bound
    (the peak of live bytes), weights; the Concat nodes whose pieces are written in place
    (no kernel runs them)."""
    return {"arena_bytes": int(prog.plan.arena_bytes),
            "naive_bytes": int(prog.plan.naive_bytes),
            "lower_bound_bytes": int(prog.plan.lower_bound_bytes),
            "weights_bytes": int(prog.weights_bytes),
            "concats_in_place": list(prog.plan.in_place)}


def fusion_refusals(spec: Specialization) -> list[dict[str, Any]]:
    """Every neighbouring pair the fusion pass did not fuse: producer, consumer, rule,
    reason."""
    return [d.as_dict() for d in spec.graph.meta.get("fusion_log", [])]


def without_fusion(unfused: dict[str, Any]) -> dict[str, int]:
    """The figures of the report of the same model compiled without fusion that the
    with/without comparison shows (`report["fusion"]["without_fusion"]`)."""
    return {"num_kernels": unfused["num_kernels"],
            "intermediate_bytes_written": unfused["intermediate_bytes_written"],
            "arena_bytes": unfused["memory"]["arena_bytes"]}


def annotate_profile(prof: Profile, programs: Iterable[Program], cores: int) -> bool:
    """Put the cost model's prediction (for `cores`) next to each measured kernel time:
    prof.kernels[i]['predicted_ms'] and ['tiling']. False when none of `programs` is the
    one profiled."""
    symbols = [k["symbol"] for k in prof.kernels]
    prog = next((p for p in programs if [k.symbol for k in p.kernels] == symbols), None)
    if prog is None:
        return False
    costmodel.annotate(prog.kernels, cores)
    for row, k in zip(prof.kernels, prog.kernels):
        row["predicted_ms"] = float(k.notes["predicted_us"]) / 1e3
        row["tiling"] = k.notes.get("tiling", "")
    return True
