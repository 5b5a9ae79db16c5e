"""What compilation produces and the runtime consumes.

The compiler (cannc.compiler) fills these records; the runtime (cannc.runtime)
reads them and never imports the compiler. A `Kernel` is one generated native
function with its launch description; `Tiling` is the host tiling of a
shape-polymorphic kernel for one set of shapes; a `Specialization` is a whole
graph compiled for one set of input shapes: its kernels in launch order, the
constants they read, their object code and the memory plan (`MemoryPlan`,
made by cannc.compiler.planning: where every intermediate lives in the arena).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .ir.graph import Graph


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
    object_key: str = ""                 # the object cache key of its code
    signature: str = ""                  # its lowering-memo key (codegen/memo.py)
    dims: tuple[int, ...] = ()           # runtime dimensions (ABI.md), after the pointers
    # lowered through a tiling function: other sizes run the same code (a conv's batch
    # only changes its tile count, so it may read no dims at all)
    shape_polymorphic: bool = False
    notes: dict[str, Any] = field(default_factory=dict)
    inplace: bool = False        # an output may share the buffer of a same-shaped input
    # an input (value name) whose buffer the output may take: the kernel reads each of its
    # elements once, before it writes the output's element at the same offset, and reads
    # no other (a conv's residual, read by the epilogue of its only K block)
    overwrites: str = ""
    # the library modules its code calls (native.target.library_needs): (symbol, object
    # key); their objects are in the specialisation's objects under their symbols
    needs: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Tiling:
    """The host tiling of a shape-polymorphic kernel for one set of shapes (the
    CANN tiling-function pattern; see ABI.md "Runtime dimensions").

    ``key`` is everything about the shapes that the generated code depends on
    (rank, broadcast pattern, the static extents such as a GEMM's N and K); it
    never holds a runtime dimension. ``dims`` are the values the kernel reads at
    run time with ``ctx.rt_dim(b, i)``. The rest is what the runtime needs for
    these shapes."""

    key: tuple
    dims: tuple[int, ...]
    num_tiles: int
    workspace_bytes: int = 0
    single_core: bool = False
    flops: int | None = None
    notes: dict[str, Any] = field(default_factory=dict, compare=False)


ALIGN = 64   # every buffer of the arena (and every weight and workspace) starts here


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class MemoryPlan:
    """Where the intermediates of a specialisation live: one device arena per execution
    context, each buffer at an ALIGN-aligned offset; buffers whose lifetimes are disjoint
    share memory, and an elementwise output may take over its dying input's buffer."""

    offsets: dict[str, int]       # storage root -> its offset in the arena
    storage: dict[str, str]       # value -> the value whose buffer it uses (in place)
    arena_bytes: int
    naive_bytes: int              # every intermediate in its own buffer
    lower_bound_bytes: int        # the most bytes live at once
    # value -> (the storage root whose buffer holds it, byte offset in that buffer): the
    # pieces of a Concat written in place, and such Concats inside larger ones
    placed: dict[str, tuple[str, int]] = field(default_factory=dict)
    in_place: tuple[str, ...] = ()   # the Concat nodes whose pieces are written in place

    def root(self, v: str) -> str:
        """The storage root of an (alias-resolved) value."""
        return self.storage.get(v, v)

    def locate(self, v: str) -> tuple[str, int]:
        """The storage root (an `offsets` key) holding an alias-resolved value, and the
        value's byte offset in it."""
        r = self.root(v)
        return self.placed.get(r, (r, 0))


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
    memory: MemoryPlan
    # inputs specialised on their values (value-deciding inputs, now constants of `graph`)
    values: dict[str, np.ndarray] = field(default_factory=dict)
