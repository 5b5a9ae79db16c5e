"""The compiler driver: the pipeline as one readable list, and specialisation.

A model is imported once (symbolic shapes kept). For each set of concrete
input shapes the graph is specialised: the passes below run, every remaining
node is lowered to a native kernel, the kernels are compiled (through the
object cache) and the memory is planned. Specialisations are cached by input
shapes, so a model with dynamic batch and sequence compiles once per size.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..artifact import Kernel, MemoryPlan, Specialization
from ..errors import CanncError, CompileError, UnsupportedOpError
from ..ir.graph import Graph
from ..native.target import ObjectCache, default_cache
from ..passes import control, fold, fusion, legalize, patterns  # noqa: F401  (registers passes)
from ..passes.manager import PassContext, PassManager
from ..schedule import costmodel
from .planning import concat_in_place, plan_memory
from .support import support_problems, unknown_ops

# The optimisation pipelines, by name. Each entry is one named pass.
PIPELINES: dict[str, list[str]] = {
    "O0": [
        "inline_branches",            # If with a condition known at compile time -> its branch
        "infer_and_fold",             # bind shapes: every value gets a concrete type; fold
        "dce",                        # drop what no output needs (e.g. folded shape chains)
        "legalize_matmul_broadcast",  # partial batch broadcasts -> Expand + batched GEMM
        "legalize_attention",         # Attention: KV cache -> Concat
        "mixed_precision",            # precision="bf16"/"fp16": narrow nodes by policy
    ],
    "O1": [
        "inline_branches",
        "infer_and_fold",
        "dce",
        "remove_identities",          # Identity / inference Dropout: read the source directly
        "legalize_matmul_broadcast",
        "legalize_attention",
        "legalize_einsum",            # an Einsum that is a batched matrix product -> MatMul
        "fold_conv_bn",               # BatchNormalization after Conv folded into its weights
        "prune_conv_taps",            # Conv taps that only ever read padding dropped
        "fuse_layernorm",             # decomposed LayerNorm (older exporters) -> one op
        "fuse_gelu",                  # decomposed erf GELU (BERT exporters) -> Gelu
        "fuse_attention",             # QKᵀ/scale/mask/Softmax/·V (+ head transposes) -> one op
        "mixed_precision",            # precision="bf16"/"fp16": narrow nodes by policy
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
    pass_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # by pass name

    def pass_manager(self) -> PassManager:
        """The pipeline's passes with these options (resolving it checks every name)."""
        if self.pipeline not in PIPELINES:
            raise CompileError(f"unknown pipeline {self.pipeline!r}; "
                               f"choose one of {', '.join(PIPELINES)}")
        ctx = PassContext(fusion=self.fusion, pass_options=self.pass_options)
        return PassManager(PIPELINES[self.pipeline], ctx, dump_after=set(self.dump_after))


@contextlib.contextmanager
def _stage(name: str) -> Iterator[None]:
    """The stages after the passes, like the passes themselves (PassManager.run): an
    internal failure leaves as a CompileError naming the stage."""
    try:
        yield
    except CanncError:
        raise
    except Exception as e:
        raise CompileError(f"{name} failed: {type(e).__name__}: {e}") from e


def specialize(base: Graph, shapes: dict[str, tuple[int, ...]],
               options: CompileOptions,
               values: dict[str, np.ndarray] | None = None,
               while_llvm: Callable[[Graph, list[Kernel], dict[str, np.ndarray], MemoryPlan],
                                    None] | None = None,
               ) -> Specialization:
    """Compile `base` for concrete input shapes; inputs in `values` become constants
    (value specialisation, for inputs that decide shapes). ``while_llvm(graph, kernels,
    constants, memory plan)`` runs once the kernels are planned, while LLVM still
    compiles (the caller uploads the weights meanwhile)."""
    from .lowering import compile_modules, lower_graph  # (imports the code generators)

    t0 = time.perf_counter()
    pm = options.pass_manager()
    unknown = unknown_ops(base)
    if unknown:
        raise UnsupportedOpError(unknown)
    g = base.copy()
    fold.bind_input_shapes(g, shapes)
    for name, value in (values or {}).items():
        g.inputs.remove(name)
        g.set_constant(name, np.asarray(value))
    pm.run(g)
    problems = support_problems(g)
    if problems:
        raise UnsupportedOpError(problems)
    cache = options.cache or default_cache()
    h0, m0 = cache.hits, cache.misses
    batch = cache.batch()       # LLVM starts on each module as soon as it is lowered
    try:
        with _stage("lowering"):
            kernels, aliases, constants, modules, objects = lower_graph(g, cache, batch=batch)
        lowered = kernels
        # the rest needs no object: done while LLVM compiles the modules still running
        with _stage("cost model"):
            costmodel.annotate(kernels)  # notes['predicted_us'], notes['tiling'] (usable cores)
        with _stage("memory planning"):
            placed: dict[str, tuple[str, int]] = {}
            in_place: list[str] = []
            if pm.ctx.fusion_enabled("concat_in_place"):   # producers write into the Concat
                kernels, placed, in_place = concat_in_place(g, kernels, constants)
            # liveness, reuse, offsets
            memory = plan_memory(g, kernels, aliases, constants, placed, in_place)
        if while_llvm is not None:
            while_llvm(g, kernels, constants, memory)
    except BaseException:
        batch.abandon()
        raise
    with _stage("code generation"):
        objects.update(compile_modules(modules, cache, batch))
    used = {k.symbol for k in kernels}
    for k in lowered:
        if k.symbol not in used:
            objects.pop(k.symbol, None)
    return Specialization(g, kernels, aliases, constants, objects, pm.records, pm.dumps,
                          time.perf_counter() - t0, cache.hits - h0, cache.misses - m0, memory,
                          values=dict(values or {}))


