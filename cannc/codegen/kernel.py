"""A kernel: one generated native function that computes a group of IR nodes.

`LowerCtx` is what an op's lowering receives: the node(s), their concrete
types, the constant inputs, and the LLVM module to fill with one function that
follows the kernel ABI (see ABI.md). `Kernel` is the record the rest of the
compiler keeps: the symbol, the values it reads and writes, its tiles, its
workspace and its cost figures.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llvmlite.ir as ir
import numpy as np

from ..artifact import Tiling
from ..ir.graph import Node
from ..ir.registry import OpDef
from ..ir.types import TensorType
from ..native import emit
from ..native.target import new_module
from ..runtime.memory import is_device_ready

ENTRY = "__cannc_kernel__"


@dataclass(frozen=True)
class ConstRef:
    """In a constant recipe: the value of constant input ``index``."""
    index: int


class ConstMap:
    """value name -> constant, marking a constant read only when it is looked up."""

    def __init__(self, ctx: LowerCtx) -> None:
        self._ctx = ctx
        self._index = {v: i for i, v in enumerate(ctx.node.inputs) if v and ctx.is_const(i)}

    def get(self, v: str, default: Any = None) -> Any:
        i = self._index.get(v)
        return self._ctx.const(i) if i is not None else default

    def __getitem__(self, v: str) -> np.ndarray:
        return self._ctx.const(self._index[v])

    def __contains__(self, v: object) -> bool:
        return v in self._index

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def apply_recipe(fn: Callable[..., np.ndarray], args: tuple,
                 consts: list[np.ndarray | None]) -> np.ndarray:
    vals = [consts[a.index] if isinstance(a, ConstRef) else a for a in args]
    v = np.asarray(fn(*vals))
    if is_device_ready(v):                      # fresh memory of its own (packed weights)
        pass
    elif v.base is not None or not v.flags.c_contiguous or any(v is x for x in vals):
        v = np.array(v, order="C", copy=True)   # never a view of (or the) source constant
    v.setflags(write=False)                     # shared between specialisations
    return v


class LowerCtx:
    """Everything a lowering may read, and the few things it sets.

    Reads: node, opdef (the node's op definition), in_types, out_types, consts
    (ndarray or None per input), module, symbol, tiling. Sets: num_tiles,
    workspace_bytes, single_core, flops, and may replace a constant input with a
    transformed constant (e.g. prepacked weights) through `replace_const`.

    A fused Softmax (codegen/lower/fused.py) hands the reduction lowering its
    prologue through `reduce_x_source` (static shapes) or `reduce_x_rows` (a
    kernel for any shape): see codegen/reduce.py.
    """

    def __init__(self, node: Node, in_types: list[TensorType | None],
                 out_types: list[TensorType], consts: list[np.ndarray | None]) -> None:
        self.node = node
        self.opdef: OpDef | None = None       # set by the compiler
        self.in_types = in_types
        self.out_types = out_types
        self.consts = consts
        self.module = new_module("kernel")
        self.symbol = ENTRY
        self.num_tiles = 1
        self.workspace_bytes = 0
        self.single_core = False
        self.flops = 0
        self.new_consts: dict[int, np.ndarray] = {}
        self.recipes: dict[int, tuple[Callable[..., np.ndarray], tuple]] = {}
        self.dropped: set[int] = set()
        self.notes: dict[str, Any] = {}
        self.tiling: Tiling | None = None     # set by the compiler for tiling op families
        self.const_reads: set[int] = set()
        # the x of a fused Softmax's reduction, computed by its prologue
        self.reduce_x_source: Callable[..., Any] | None = None
        self.reduce_x_rows: Callable[..., Any] | None = None

    # -- the ABI function --------------------------------------------------
    def begin(self) -> tuple[ir.Function, ir.IRBuilder]:
        fnty = ir.FunctionType(emit.VOID, [emit.PTR, emit.I64, emit.I64, emit.PTR])
        fn = ir.Function(self.module, fnty, name=self.symbol)
        for a, n in zip(fn.args, ("args", "tile_begin", "tile_end", "workspace")):
            a.name = n
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        self._fn = fn
        return fn, b

    @property
    def args(self) -> ir.Value:
        return self._fn.args[0]

    @property
    def tile_begin(self) -> ir.Value:
        return self._fn.args[1]

    @property
    def tile_end(self) -> ir.Value:
        return self._fn.args[2]

    @property
    def workspace(self) -> ir.Value:
        return self._fn.args[3]

    def in_ptr(self, b: ir.IRBuilder, i: int) -> ir.Value:
        assert i not in self.dropped, f"input {i} was dropped"
        return emit.load_arg(b, self.args, i - sum(1 for d in self.dropped if d < i))

    def out_ptr(self, b: ir.IRBuilder, j: int) -> ir.Value:
        return emit.load_arg(b, self.args, len(self.node.inputs) - len(self.dropped) + j)

    def rt_dim(self, b: ir.IRBuilder, i: int) -> ir.Value:
        """Runtime dimension ``i`` of ``ctx.tiling.dims`` (an i64), read from the
        argument array after the tensor pointers."""
        assert self.tiling is not None and 0 <= i < len(self.tiling.dims), \
            f"runtime dim {i} is not declared by the tiling function"
        slot = emit.gep(b, self.args, self._n_ptrs + i, emit.I64)
        return b.load(slot, typ=emit.I64)

    def rt_dim_at(self, b: ir.IRBuilder, i: ir.Value) -> ir.Value:
        """Runtime dimension at a runtime index ``i`` (a loop over a table the tiling
        function laid out in ``dims``; the table's layout keeps ``i`` in range)."""
        assert self.tiling is not None
        return b.load(emit.gep(b, self.args, b.add(i, emit.i64(self._n_ptrs)), emit.I64),
                      typ=emit.I64)

    @property
    def _n_ptrs(self) -> int:
        """Tensor pointers in the argument array (the runtime dims follow them)."""
        return len(self.node.inputs) - len(self.dropped) + len(self.node.outputs)

    def tensor_ptr_at(self, b: ir.IRBuilder, slot: ir.Value) -> ir.Value:
        """The tensor pointer in argument slot ``slot``, a runtime index (the inputs'
        slots come first, then the outputs'; no input dropped)."""
        assert not self.dropped
        return b.load(emit.gep(b, self.args, slot, emit.PTR), typ=emit.PTR)

    def drop_input(self, i: int) -> None:
        """The kernel does not read input i: it gets no slot in the argument array
        (call before emitting code that uses argument indices)."""
        self.dropped.add(i)

    def attr(self, name: str, default: Any = None) -> Any:
        return self.node.attrs.get(name, default)

    @property
    def opset(self) -> int:
        return self.node.opset

    def const(self, i: int) -> np.ndarray | None:
        if i < len(self.consts) and self.consts[i] is not None:
            self.const_reads.add(i)
            return self.consts[i]
        return None

    def is_const(self, i: int) -> bool:
        """Whether input i is a compile-time constant (without reading its value:
        a value read may be folded into the code, so it joins the kernel's key)."""
        return i < len(self.consts) and self.consts[i] is not None

    def const_map(self) -> ConstMap:
        """The constant inputs by value name, read (and keyed) only when looked up."""
        return ConstMap(self)

    def replace_const(self, i: int, fn: Callable[..., np.ndarray], *args: Any) -> None:
        """Feed input i with ``fn(*args)``, a transformed constant (e.g. weights
        packed for the GEMM). ``fn`` is a module-level function and ``args`` are
        picklable, with ``ConstRef(j)`` standing for constant input j: the
        transformation is a recipe the compiler can replay on other weights of
        the same kernel without lowering it again (see compiler.lower_node)."""
        self.recipes[i] = (fn, args)
        self.new_consts[i] = apply_recipe(fn, args, self.consts)


def finish(ctx: LowerCtx) -> tuple[str, str]:
    """Internalise helpers, name the entry by content hash; returns (symbol, module IR)."""
    emit.internalise(ctx.module, ENTRY)
    text = str(ctx.module)
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    symbol = f"cannc_k_{digest}"
    return symbol, text.replace(f'@"{ENTRY}"', f'@"{symbol}"')
