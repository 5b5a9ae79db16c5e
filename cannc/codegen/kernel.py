"""A kernel: one generated native function that computes a group of IR nodes.

`LowerCtx` is what an op's lowering receives: the node(s), their concrete
types, the constant inputs, and the LLVM module to fill with one function that
follows the kernel ABI (see ABI.md). `Kernel` is the record the rest of the
compiler keeps: the symbol, the values it reads and writes, its tiles, its
workspace and its cost figures.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import llvmlite.ir as ir
import numpy as np

from ..ir.graph import Node
from ..ir.types import TensorType
from . import emit
from .target import new_module

ENTRY = "__cannc_kernel__"


@dataclass
class Kernel:
    symbol: str
    nodes: list[str]
    op_types: list[str]
    inputs: list[str]            # value names, '' for absent optional inputs
    outputs: list[str]
    num_tiles: int
    workspace_bytes: int
    single_core: bool
    flops: int
    bytes_read: int
    bytes_written: int
    module_ir: str = field(repr=False, default="")
    notes: dict[str, Any] = field(default_factory=dict)
    inplace: bool = False        # an output may share the buffer of a same-shaped input


class LowerCtx:
    """Everything a lowering may read, and the few things it sets.

    Reads: node, in_types, out_types, consts (ndarray or None per input),
    module, symbol. Sets: num_tiles, workspace_bytes, single_core, flops, and
    may replace a constant input with a transformed constant (e.g. prepacked
    weights) through `replace_const`.
    """

    def __init__(self, node: Node, in_types: list[TensorType | None],
                 out_types: list[TensorType], consts: list[np.ndarray | None]) -> None:
        self.node = node
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
        self.dropped: set[int] = set()
        self.notes: dict[str, Any] = {}

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
        return self.consts[i] if i < len(self.consts) else None

    def replace_const(self, i: int, value: np.ndarray) -> None:
        """Feed input i with a transformed constant (e.g. weights packed for the GEMM)."""
        self.new_consts[i] = np.array(value, order="C", copy=True)


def finish(ctx: LowerCtx) -> tuple[str, str]:
    """Internalise helpers, name the entry by content hash; returns (symbol, module IR)."""
    emit.internalise(ctx.module, ENTRY)
    text = str(ctx.module)
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    symbol = f"cannc_k_{digest}"
    return symbol, text.replace(f'@"{ENTRY}"', f'@"{symbol}"')
