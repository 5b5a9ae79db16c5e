"""The compiler driver: the pipeline as one readable list, and specialisation.

A model is imported once (symbolic shapes kept). For each set of concrete
input shapes the graph is specialised: the passes below run, every remaining
node is lowered to a native kernel, the kernels are compiled (through the
object cache) and the memory is planned. Specialisations are cached by input
shapes, so a model with dynamic batch and sequence compiles once per size.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .codegen.kernel import Kernel, LowerCtx, finish
from .codegen.target import ObjectCache, default_cache
from .errors import CanncError, CompileError, UnsupportedOpError
from .ir.graph import Graph, Node
from .ir.registry import Category, OpDef, lookup
from .passes import fold, fusion, legalize, patterns  # noqa: F401  (registers passes)
from .passes.manager import PassManager

# The optimisation pipelines, by name. Each entry is one named pass.
PIPELINES: dict[str, list[str]] = {
    "O0": [
        "infer_and_fold",             # bind shapes: every value gets a concrete type; fold
        "dce",                        # drop what no output needs (e.g. folded shape chains)
        "legalize_matmul_broadcast",  # partial batch broadcasts -> Expand + batched GEMM
        "legalize_attention",         # Attention: KV cache -> Concat, float16/bfloat16 -> float32
    ],
    "O1": [
        "infer_and_fold",
        "dce",
        "remove_identities",          # Identity / inference Dropout: read the source directly
        "legalize_matmul_broadcast",
        "legalize_attention",
        "fold_conv_bn",               # BatchNormalization after Conv folded into its weights
        "fuse_layernorm",             # decomposed LayerNorm (older exporters) -> one op
        "fuse_attention",             # QKᵀ/scale/mask/Softmax/·V (+ head transposes) -> one op
        "fusion",                     # one kernel per elementwise chain / GEMM + epilogue
    ],
}
DEFAULT_PIPELINE = "O1"


@dataclass
class CompileOptions:
    pipeline: str = DEFAULT_PIPELINE
    dump_after: set[str] = field(default_factory=set)
    cache: ObjectCache | None = None
    fusion: bool | dict[str, bool] = True     # False, or per-rule switches


@dataclass
class Specialization:
    graph: Graph
    kernels: list[Kernel]
    aliases: dict[str, str]               # value -> the value whose buffer it shares
    constants: dict[str, np.ndarray]      # every constant a kernel or output reads
    objects: dict[str, bytes]             # symbol -> object code
    pass_records: list[Any]
    dumps: dict[str, str]
    compile_seconds: float
    cache_hits: int
    cache_misses: int


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
    ins = [graph.values.get(v) if v else None for v in n.inputs]
    outs = [graph.values.get(v) for v in n.outputs if v]
    return op.unsupported_reason(n, ins, [o for o in outs if o is not None])


def specialize(base: Graph, shapes: dict[str, tuple[int, ...]],
               options: CompileOptions,
               values: dict[str, np.ndarray] | None = None) -> Specialization:
    """Compile `base` for concrete input shapes; inputs in `values` become constants
    (value specialisation, for inputs that decide shapes)."""
    t0 = time.perf_counter()
    if options.pipeline not in PIPELINES:
        raise CompileError(f"unknown pipeline {options.pipeline!r}; "
                           f"choose one of {', '.join(PIPELINES)}")
    unknown = unknown_ops(base)
    if unknown:
        raise UnsupportedOpError(unknown)
    g = base.copy()
    fold.bind_input_shapes(g, shapes)
    g.meta["fusion"] = options.fusion
    for name, value in (values or {}).items():
        g.inputs.remove(name)
        g.set_constant(name, np.asarray(value))
    pm = PassManager(PIPELINES[options.pipeline], dump_after=set(options.dump_after))
    pm.run(g)
    problems = support_problems(g)
    if problems:
        raise UnsupportedOpError(problems)
    kernels, aliases, constants, modules = lower_graph(g)
    cache = options.cache or default_cache()
    h0, m0 = cache.hits, cache.misses
    objects = compile_modules(modules, cache)
    return Specialization(g, kernels, aliases, constants, objects, pm.records, pm.dumps,
                          time.perf_counter() - t0, cache.hits - h0, cache.misses - m0)


def lower_graph(g: Graph) -> tuple[list[Kernel], dict[str, str], dict[str, np.ndarray],
                                   dict[str, str]]:
    kernels: list[Kernel] = []
    aliases: dict[str, str] = {}
    modules: dict[str, str] = {}
    constants = dict(g.constants)

    def root(v: str) -> str:
        while v in aliases:
            v = aliases[v]
        return v

    for n in g.nodes():
        op = lookup(n.op_type, n.domain)
        assert op is not None
        if op.category == Category.VIEW:
            src = root(n.inputs[0])
            for o in n.outputs[:1]:
                aliases[o] = src
            continue
        kernels.append(lower_node(g, n, op, root, constants, modules))
    return kernels, aliases, constants, modules


def lower_node(g: Graph, n: Node, op: OpDef, root: Any, constants: dict[str, np.ndarray],
               modules: dict[str, str]) -> Kernel:
    in_types = [g.values[v] if v else None for v in n.inputs]
    out_types = [g.values[v] for v in n.outputs if v]
    consts = [g.constants.get(root(v)) if v else None for v in n.inputs]
    ctx = LowerCtx(n, in_types, out_types, consts)
    ctx.opdef = op  # type: ignore[attr-defined]
    try:
        assert op.lower is not None
        op.lower(ctx)
    except CanncError:
        raise
    except Exception as e:
        raise CompileError(f"lowering {n.op_type} at node '{n.name}' failed: "
                           f"{type(e).__name__}: {e}") from e
    symbol, text = finish(ctx)
    modules.setdefault(symbol, text)
    inputs = []
    for i, v in enumerate(n.inputs):
        if i in ctx.dropped:
            continue
        if i in ctx.new_consts:
            cname = f"{n.name}::packed{i}"
            constants[cname] = ctx.new_consts[i]
            inputs.append(cname)
        else:
            inputs.append(root(v) if v else "")
    br = sum(t.nbytes for t in in_types if t is not None)
    bw = sum(t.nbytes for t in out_types)
    if op.flops is not None:
        flops = op.flops(n, in_types, out_types)
    else:
        flops = ctx.flops
    names, op_types = onnx_origin(n)
    return Kernel(symbol=symbol, nodes=names, op_types=op_types, inputs=inputs,
                  outputs=[v for v in n.outputs], num_tiles=max(1, int(ctx.num_tiles)),
                  workspace_bytes=int(ctx.workspace_bytes), single_core=bool(ctx.single_core),
                  flops=int(flops), bytes_read=br, bytes_written=bw, module_ir=text,
                  notes=dict(ctx.notes),
                  # maps read and write element i together: an output may overwrite an input
                  inplace=op.category in (Category.ELEMENTWISE, Category.BROADCAST)
                  and (op.name == "FusedMap" or "expr" in op.extra))


def onnx_origin(n: Node) -> tuple[list[str], list[str]]:
    """The ONNX node names and op types a (possibly fused or rewritten) node stands for."""
    body = n.attrs.get("body") if n.domain == "cannc" else None
    if body:
        names, ops = [], []
        for b in body:
            bn, bo = onnx_origin(b)
            names += bn
            ops += bo
        return names, ops
    if "fused_from" in n.attrs:
        return list(n.attrs["fused_from"]), list(n.attrs["fused_ops"])
    return [n.name], [n.op_type]


def compile_modules(modules: dict[str, str], cache: ObjectCache) -> dict[str, bytes]:
    items = sorted(modules.items())
    if len(items) <= 1:
        return {s: cache.compile(t, s) for s, t in items}
    workers = min(len(items), max(1, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as ex:
        objs = list(ex.map(lambda st: cache.compile(st[1], st[0]), items))
    return {s: o for (s, _), o in zip(items, objs)}
