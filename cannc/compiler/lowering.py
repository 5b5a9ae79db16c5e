"""Lowering a specialised graph: one kernel per node, through the lowering memo.

A node whose signature the memo holds is not lowered again: its constant
recipes are replayed on this graph's weights; otherwise its lowering (registered
onto the op by codegen) fills an LLVM module, which is compiled through the
object cache, with the library modules it calls (native.target.library_needs: each
once per program).
"""

from __future__ import annotations

import pickle
import threading
import weakref
from typing import Any

import numpy as np

from .. import progress
from ..artifact import Kernel, Tiling
from ..codegen.kernel import ConstRef, LowerCtx, apply_recipe, finish
from ..codegen.lower import Lowering, lowering_for
from ..codegen.memo import LoweringMemo, MemoEntry, baked_key, default_memo, node_key
from ..codegen.memo import salt as memo_salt
from ..errors import CanncError, CompileError
from ..ir.graph import Graph, Node
from ..ir.ops import lookup
from ..ir.registry import Category, OpDef
from ..native import target
from ..native.target import ObjectBatch, ObjectCache, default_cache, library_ir, library_needs


def lower_graph(g: Graph, cache: ObjectCache | None = None, memo: LoweringMemo | None = None,
                batch: ObjectBatch | None = None
                ) -> tuple[list[Kernel], dict[str, str], dict[str, np.ndarray],
                           dict[str, str], dict[str, bytes]]:
    """Lower every node (views alias their source). Returns the kernels, the
    aliases, the constants, the modules still to compile (symbol -> IR) and the
    object code of kernels the memo already had (symbol -> object). With a `batch`
    (cache.batch()), each module is submitted to it as soon as it is made, so LLVM
    compiles it in a worker process while the next kernels are lowered."""
    cache = cache or default_cache()
    memo = memo or default_memo()
    lw = _Lowering(cache, memo, memo_salt(), batch)
    kernels: list[Kernel] = []
    aliases: dict[str, str] = {}
    constants = dict(g.constants)

    def root(v: str) -> str:
        while v in aliases:
            v = aliases[v]
        return v

    nodes = [(n, lookup(n.op_type, n.domain)) for n in g.nodes()]
    with progress.stage("kernels lowered", sum(
            op is not None and op.category != Category.VIEW for _, op in nodes),
            "kernel") as shown:
        for n, op in nodes:
            assert op is not None
            if op.category == Category.VIEW:
                src = root(n.inputs[0])
                for o in n.outputs[:1]:
                    aliases[o] = src
                continue
            try:
                kernels.append(lw.lower_node(g, n, op, root, constants))
            except CanncError:
                raise
            except Exception as e:   # (tiling, memo keys, ...: anything around the lowering)
                raise CompileError(f"lowering {n.op_type} at node '{n.name}' failed: "
                                   f"{type(e).__name__}: {e}") from e
            shown.advance()
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

    def __init__(self, cache: ObjectCache, memo: LoweringMemo, salt: str,
                 batch: ObjectBatch | None = None) -> None:
        self.cache, self.memo, self.salt, self.batch = cache, memo, salt, batch
        self.modules: dict[str, str] = {}
        self.objects: dict[str, bytes] = {}

    def lower_node(self, g: Graph, n: Node, op: OpDef, root: Any,
                   constants: dict[str, np.ndarray]) -> Kernel:
        global _lowerings
        in_types = [g.values[v] if v else None for v in n.inputs]
        out_types = [g.values[v] for v in n.outputs if v]
        consts = [g.constants.get(root(v)) if v else None for v in n.inputs]
        lowering = lowering_for(op)
        if lowering is None:
            raise CompileError(f"no native lowering of {n.op_type} (node '{n.name}')")
        if lowering.tiling is None:
            tiling = None
        elif lowering.tiling_consts:
            tiling = lowering.tiling(n, in_types, out_types,
                                     consts=tuple(c is not None for c in consts))
        elif lowering.tiling_values:
            tiling = lowering.tiling(n, in_types, out_types, values=tuple(consts))
        else:
            tiling = lowering.tiling(n, in_types, out_types)
        key = node_key(n, in_types, out_types, consts, tiling.key if tiling else None, self.salt,
                       op.tiling_attrs)
        entry = self._lookup(key, consts)
        if entry is None:
            with _counts_lock:
                _lowerings += 1
            entry = self._lower(n, op, lowering, in_types, out_types, consts, tiling, key)
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
        br = (op.bytes_read(n, in_types, out_types) if op.bytes_read is not None
              else sum(t.nbytes for t in in_types if t is not None))
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
                      inplace=op.inplace,
                      overwrites=root(n.inputs[notes["overwrites"]])
                      if "overwrites" in notes else "", needs=entry.needs)

    def _lookup(self, key: str, consts: list[np.ndarray | None]) -> MemoEntry | None:
        e = self.memo.get(key)
        if e is not None and e.baked:
            e = self.memo.get(baked_key(key, consts, e.baked))
        if e is None:
            return None
        for sym, okey in ((e.symbol, e.object_key), *e.needs):
            if sym not in self.objects and sym not in self.modules:
                obj = self.cache.get(okey)
                if obj is None:        # the object was evicted: lower and compile again
                    return None
                self.cache.hits += 1
                self.objects[sym] = obj
        return e

    def _add_module(self, symbol: str, text: str) -> None:
        """A module to compile (submitted to the batch at once), unless it is here."""
        if symbol not in self.objects and symbol not in self.modules:
            self.modules[symbol] = text
            if self.batch is not None:
                self.batch.submit(symbol, text)

    def _lower(self, n: Node, op: OpDef, lowering: Lowering, in_types: list, out_types: list,
               consts: list[np.ndarray | None], tiling: Tiling | None, key: str) -> MemoEntry:
        ctx = LowerCtx(n, in_types, out_types, consts)
        ctx.opdef = op
        ctx.tiling = tiling
        try:
            lowering.lower(ctx)
        except CanncError:
            raise
        except Exception as e:
            raise CompileError(f"lowering {n.op_type} at node '{n.name}' failed: "
                               f"{type(e).__name__}: {e}") from e
        symbol, text = finish(ctx)
        okey = self.cache.key(text, 2)
        needs = []
        for sym in library_needs(text):   # (library modules: one per program)
            lib = library_ir(sym)
            needs.append((sym, self.cache.key(lib, 2)))
            self._add_module(sym, lib)
        self._add_module(symbol, text)
        # a constant read without a recipe may be folded into the code
        baked = tuple(sorted(i for i in ctx.const_reads
                             if i not in ctx.recipes and consts[i] is not None))
        entry = MemoEntry(symbol=symbol, object_key=okey, dropped=tuple(sorted(ctx.dropped)),
                          recipes=dict(ctx.recipes), num_tiles=int(ctx.num_tiles),
                          workspace_bytes=int(ctx.workspace_bytes),
                          single_core=bool(ctx.single_core), flops=int(ctx.flops),
                          notes=dict(ctx.notes), baked=baked, needs=tuple(needs))
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


def compile_modules(modules: dict[str, str], cache: ObjectCache,
                    batch: ObjectBatch | None = None) -> dict[str, bytes]:
    """The objects of `modules`: compiled now, or the rest of those lower_graph
    submitted to `batch` (compiled, in part, while it lowered)."""
    with progress.stage("LLVM", len(modules), "module") as shown:
        if batch is None:
            return cache.compile_many(sorted(modules.items()), done=shown.advance)
        out = batch.finish(shown.advance)
    return {s: out[s] for s in modules}
