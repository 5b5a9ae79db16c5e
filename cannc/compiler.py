"""The compiler driver: the pipeline as one readable list, and specialisation.

A model is imported once (symbolic shapes kept). For each set of concrete
input shapes the graph is specialised: the passes below run, every remaining
node is lowered to a native kernel, the kernels are compiled (through the
object cache) and the memory is planned. Specialisations are cached by input
shapes, so a model with dynamic batch and sequence compiles once per size.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import costmodel
from .codegen import target
from .codegen.kernel import ConstRef, Kernel, LowerCtx, Tiling, apply_recipe, finish
from .codegen.memo import (LoweringMemo, MemoEntry, baked_key, default_memo,
                           node_key)
from .codegen.memo import salt as memo_salt
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
    cache = options.cache or default_cache()
    h0, m0 = cache.hits, cache.misses
    kernels, aliases, constants, modules, objects = lower_graph(g, cache)
    objects.update(compile_modules(modules, cache))
    costmodel.annotate(kernels)  # notes['predicted_us'], notes['tiling'] (usable cores)
    return Specialization(g, kernels, aliases, constants, objects, pm.records, pm.dumps,
                          time.perf_counter() - t0, cache.hits - h0, cache.misses - m0)


def lower_graph(g: Graph, cache: ObjectCache | None = None, memo: LoweringMemo | None = None
                ) -> tuple[list[Kernel], dict[str, str], dict[str, np.ndarray],
                           dict[str, str], dict[str, bytes]]:
    """Lower every node (views alias their source). Returns the kernels, the
    aliases, the constants, the modules still to compile (symbol -> IR) and the
    object code of kernels the memo already had (symbol -> object)."""
    cache = cache or default_cache()
    memo = memo or default_memo()
    lw = _Lowering(cache, memo, memo_salt())
    kernels: list[Kernel] = []
    aliases: dict[str, str] = {}
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
        kernels.append(lw.lower_node(g, n, op, root, constants))
    return kernels, aliases, constants, lw.modules, lw.objects


_counts_lock = threading.Lock()
_lowerings = 0


def codegen_counts() -> tuple[int, int]:
    """(node lowerings run, LLVM modules compiled) in this process: what a run at
    a new shape of shape-polymorphic kernels must not increase."""
    with _counts_lock:
        return _lowerings, target.emitted_modules()


class _Lowering:
    """One specialisation's lowering: memo lookups, lowerings on a miss, replayed
    constant recipes on a hit."""

    def __init__(self, cache: ObjectCache, memo: LoweringMemo, salt: str) -> None:
        self.cache, self.memo, self.salt = cache, memo, salt
        self.modules: dict[str, str] = {}
        self.objects: dict[str, bytes] = {}

    def lower_node(self, g: Graph, n: Node, op: OpDef, root: Any,
                   constants: dict[str, np.ndarray]) -> Kernel:
        global _lowerings
        in_types = [g.values[v] if v else None for v in n.inputs]
        out_types = [g.values[v] for v in n.outputs if v]
        consts = [g.constants.get(root(v)) if v else None for v in n.inputs]
        tiling = op.tiling(n, in_types, out_types) if op.tiling is not None else None
        key = node_key(n, in_types, out_types, consts, tiling.key if tiling else None, self.salt,
                       tuple(op.extra.get("tiling_attrs", ())))
        entry = self._lookup(key, consts)
        if entry is None:
            with _counts_lock:
                _lowerings += 1
            entry = self._lower(n, op, in_types, out_types, consts, tiling, key)
        new_consts = {i: _replay(fn, args, consts) for i, (fn, args) in entry.recipes.items()}
        inputs = []
        for i, v in enumerate(n.inputs):
            if i in entry.dropped:
                continue
            if i in new_consts:
                cname = f"{n.name}::packed{i}"
                constants[cname] = new_consts[i]
                inputs.append(cname)
            else:
                inputs.append(root(v) if v else "")
        br = sum(t.nbytes for t in in_types if t is not None)
        bw = sum(t.nbytes for t in out_types)
        if tiling is not None:
            num_tiles, ws, single = tiling.num_tiles, tiling.workspace_bytes, tiling.single_core
            flops = tiling.flops
            notes = {**entry.notes, **tiling.notes}
        else:
            num_tiles, ws, single = entry.num_tiles, entry.workspace_bytes, entry.single_core
            flops, notes = None, dict(entry.notes)
        if flops is None:
            flops = op.flops(n, in_types, out_types) if op.flops is not None else entry.flops
        names, op_types = onnx_origin(n)
        return Kernel(symbol=entry.symbol, nodes=names, op_types=op_types, inputs=inputs,
                      outputs=[v for v in n.outputs], num_tiles=max(1, int(num_tiles)),
                      workspace_bytes=int(ws), single_core=bool(single),
                      flops=int(flops), bytes_read=br, bytes_written=bw,
                      object_key=entry.object_key, signature=key, notes=notes,
                      dims=tuple(int(d) for d in tiling.dims) if tiling else (),
                      shape_polymorphic=tiling is not None,
                      # maps read and write element i together: an output may overwrite an input
                      inplace=op.category in (Category.ELEMENTWISE, Category.BROADCAST)
                      and (op.name == "FusedMap" or "expr" in op.extra))

    def _lookup(self, key: str, consts: list[np.ndarray | None]) -> MemoEntry | None:
        e = self.memo.get(key)
        if e is not None and e.baked:
            e = self.memo.get(baked_key(key, consts, e.baked))
        if e is None:
            return None
        if e.symbol not in self.objects and e.symbol not in self.modules:
            obj = self.cache.get(e.object_key)
            if obj is None:        # the object was evicted: lower and compile again
                return None
            self.cache.hits += 1
            self.objects[e.symbol] = obj
        return e

    def _lower(self, n: Node, op: OpDef, in_types: list, out_types: list,
               consts: list[np.ndarray | None], tiling: Tiling | None, key: str) -> MemoEntry:
        ctx = LowerCtx(n, in_types, out_types, consts)
        ctx.opdef = op  # type: ignore[attr-defined]
        ctx.tiling = tiling
        try:
            assert op.lower is not None
            op.lower(ctx)
        except CanncError:
            raise
        except Exception as e:
            raise CompileError(f"lowering {n.op_type} at node '{n.name}' failed: "
                               f"{type(e).__name__}: {e}") from e
        symbol, text = finish(ctx)
        okey = self.cache.key(text, 2)
        if symbol not in self.objects:
            self.modules.setdefault(symbol, text)
        # a constant read without a recipe may be folded into the code
        baked = tuple(sorted(i for i in ctx.const_reads
                             if i not in ctx.recipes and consts[i] is not None))
        entry = MemoEntry(symbol=symbol, object_key=okey, dropped=tuple(sorted(ctx.dropped)),
                          recipes=dict(ctx.recipes), num_tiles=int(ctx.num_tiles),
                          workspace_bytes=int(ctx.workspace_bytes),
                          single_core=bool(ctx.single_core), flops=int(ctx.flops),
                          notes=dict(ctx.notes), baked=baked)
        if baked:
            self.memo.put(key, MemoEntry(symbol="", object_key="", dropped=(), recipes={},
                                         num_tiles=0, workspace_bytes=0, single_core=False,
                                         flops=0, baked=baked))
            self.memo.put(baked_key(key, consts, baked), entry)
        else:
            self.memo.put(key, entry)
        return entry


_recipe_cache: dict[tuple, tuple[list[weakref.ref], weakref.ref]] = {}
_recipe_lock = threading.Lock()


def _replay(fn: Any, args: tuple, consts: list[np.ndarray | None]) -> np.ndarray:
    """A constant recipe's result, shared while its source constants and result live
    (a second shape of the same model does not pack its weights again)."""
    srcs = [consts[a.index] for a in args if isinstance(a, ConstRef)]
    try:
        k = (fn.__module__, fn.__qualname__, tuple(id(s) for s in srcs), pickle.dumps(
            [None if isinstance(a, ConstRef) else a for a in args]))
    except (pickle.PicklingError, TypeError, AttributeError):   # not keyable: not shared
        return apply_recipe(fn, args, consts)
    with _recipe_lock:
        hit = _recipe_cache.get(k)
    if hit is not None:
        refs, out = hit
        v = out()
        if v is not None and all(r() is s for r, s in zip(refs, srcs)):
            return v
    v = apply_recipe(fn, args, consts)          # (read-only: shared)
    with _recipe_lock:
        if len(_recipe_cache) > 4096:
            for kk in [kk for kk, (rs, o) in _recipe_cache.items() if o() is None]:
                del _recipe_cache[kk]
        _recipe_cache[k] = ([weakref.ref(s) for s in srcs], weakref.ref(v))
    return v


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
