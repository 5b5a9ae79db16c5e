"""Shared loop nests for reductions, normalisations and scans.

The input is viewed, after dropping size-1 dims and merging neighbours of the
same kind, as alternating groups of kept and reduced dims (`Layout`). Two
shapes of loop nest cover every case:

* row mode: the innermost (contiguous) group is reduced. One tile iteration
  handles whole rows; each pass runs over the row with <W x T> loads (U
  independent partial accumulators, a constant-mask tail), and ends with a
  horizontal reduction to scalars. Softmax/LayerNorm over the hidden dim,
  GlobalAveragePool on NCHW, reductions over trailing axes.
* column mode: the innermost group is kept. Vectors run along the kept inner
  block (each lane is its own output), the reduced groups are loops around the
  vector body, so the statistics stay in per-lane vectors. Reductions over an
  outer/middle axis, Softmax over a non-last axis.

An op is a list of `Pass`es over the same reduction domain (statistics, e.g.
max then sum-of-exp) that may also store elementwise outputs (map passes), and
a `finish` hook that stores per-output statistics (the reduced outputs). The
engine threads the statistics from pass to pass: scalars in row mode (splat in
the vector bodies), per-lane vectors in column mode.

Shape-polymorphic kernels (codegen/ABI.md "Runtime dimensions"): a layout's
extents may be `RtDim`s, read from the kernel's runtime dimensions. In row mode
the rows are walked in runs of RPT_DIM rows per tile, a runtime row length by a
loop of unrolled vectors, a loop of single vectors and one masked vector; in
column mode a tile is a block of COL_BLOCK inner elements of one outer index.
`poly_layout` and `row_tiling`/`col_tiling` are the host side.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import llvmlite.ir as ir
import numpy as np

from ..artifact import Tiling
from ..native import emit
from ..native.emit import I1, I32, for_range, i64, llvm_type
from . import vmath
from .elementwise import TV, Expr, bf16_bits_to_f32, f32_to_bf16_bits, is_bf16
from .kernel import LowerCtx

BOOL = np.dtype(np.bool_)
I32DT = np.dtype(np.int32)
I64DT = np.dtype(np.int64)
UNROLL = 4                    # independent vector accumulators per pass
ROW_TILE_ELEMS = 4096         # row mode: aim for tiles of about this many elements
MIN_TILES = 8                 # enough tiles for the cores to balance
SINGLE_CORE_ELEMS = 8192      # below this the kernel runs on one core


# ---------------------------------------------------------------------------
# dtypes and small IR helpers
# ---------------------------------------------------------------------------

def compute_dtype(dtype: np.dtype, wide: bool = False) -> np.dtype:
    """The dtype arithmetic happens in: half types widen to float32, float32 to
    float64 when `wide` (long sums), integers stay as they are."""
    dt = np.dtype(dtype)
    if dt.kind == "f" or dt.name == "bfloat16":
        if dt.itemsize < 4:
            return np.dtype(np.float64) if wide else np.dtype(np.float32)
        if dt == np.float32 and wide:
            return np.dtype(np.float64)
        return dt
    return dt


def lanes_for(*dtypes: np.dtype) -> int:
    widest = max(np.dtype(d).itemsize for d in dtypes)
    return 8 if widest >= 8 else 16


def ident_value(dtype: np.dtype, what: str) -> float | int:
    """'max' identity = lowest value, 'min' identity = highest value."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return -math.inf if what == "max" else math.inf
    info = np.iinfo(dt)
    return int(info.min) if what == "max" else int(info.max)


def const_mask(lanes: int, n: int) -> ir.Constant:
    return ir.Constant(ir.VectorType(I1, lanes), [1 if i < n else 0 for i in range(lanes)])


def rt_mask(b: ir.IRBuilder, lanes: int, n: ir.Value) -> ir.Value:
    """Lanes [0, n) on, for a runtime n (an i64 in [0, lanes))."""
    return b.icmp_signed("<", iota(lanes), emit.splat(b, b.trunc(n, I32), lanes))


@dataclass(frozen=True)
class RtDim:
    """A layout extent read at run time: dim ``index`` of the kernel's Tiling."""

    index: int


Ext = int | RtDim | ir.Value     # an extent: static, a runtime dim, or its loaded value


def as_i64(x: int | ir.Value) -> ir.Value:
    return i64(x) if isinstance(x, int) else x


def load_raw(b: ir.IRBuilder, ptr: ir.Value, off: ir.Value, dtype: np.dtype, lanes: int,
             mask: ir.Value | None = None) -> ir.Value:
    """Load `lanes` elements (1: a scalar) of dtype at ptr[off]; masked lanes read as 0."""
    dt = np.dtype(dtype)
    et = llvm_type(dt)
    p = emit.gep(b, ptr, off, et)
    if lanes == 1:
        v = b.load(p, typ=et)
        v.align = dt.itemsize
        return v
    vt = ir.VectorType(et, lanes)
    if mask is None:
        v = b.load(p, typ=vt)
        v.align = dt.itemsize
        return v
    return emit.masked_load(b, p, mask, ir.Constant(vt, None), dt.itemsize)


def store_raw(b: ir.IRBuilder, ptr: ir.Value, off: ir.Value, value: ir.Value,
              dtype: np.dtype, mask: ir.Value | None = None) -> None:
    dt = np.dtype(dtype)
    et = llvm_type(dt)
    p = emit.gep(b, ptr, off, et)
    if mask is None or not isinstance(value.type, ir.VectorType):
        st = b.store(value, p)
        st.align = dt.itemsize
        return
    emit.masked_store(b, value, p, mask, dt.itemsize)


def load_tv(b: ir.IRBuilder, ptr: ir.Value, off: ir.Value, dtype: np.dtype, lanes: int,
            cdt: np.dtype, mask: ir.Value | None = None) -> TV:
    """Load and convert to the compute dtype."""
    raw = load_raw(b, ptr, off, dtype, lanes, mask)
    if is_bf16(dtype):  # bfloat16 bits -> the float that expressions hold
        raw = bf16_bits_to_f32(b, raw)
    return Expr(b, lanes).cast(TV(raw, np.dtype(dtype)), cdt)


def store_tv(b: ir.IRBuilder, ptr: ir.Value, off: ir.Value, x: TV, dtype: np.dtype,
             mask: ir.Value | None = None) -> None:
    y = Expr(b, x.lanes).cast(x, dtype)
    v = f32_to_bf16_bits(b, y.v) if is_bf16(dtype) else y.v
    store_raw(b, ptr, off, v, dtype, mask)


def splat_tv(b: ir.IRBuilder, x: TV, lanes: int) -> TV:
    if x.lanes == lanes:
        return x
    return TV(emit.splat(b, x.v, lanes), x.dtype)


def iota(lanes: int, dtype: np.dtype = I32DT) -> ir.Constant:
    return ir.Constant(ir.VectorType(llvm_type(dtype), lanes), list(range(lanes)))


def entry_alloca(b: ir.IRBuilder, ty: ir.Type) -> ir.Value:
    """An alloca in the entry block (so that SROA turns it into SSA values)."""
    cur = b.block
    b.position_at_start(b.function.entry_basic_block)
    a = b.alloca(ty)
    b.position_at_end(cur)
    return a


def imin(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    return b.select(b.icmp_signed("<", x, y), x, y)


def add(b: ir.IRBuilder, x: ir.Value, y: ir.Value | int) -> ir.Value:
    if isinstance(y, int):
        if y == 0:
            return x
        y = i64(y)
    if isinstance(x, ir.Constant) and isinstance(y, ir.Constant):
        return i64(int(x.constant) + int(y.constant))
    return b.add(x, y)


def mul(b: ir.IRBuilder, x: ir.Value, c: int | ir.Value) -> ir.Value:
    if not isinstance(c, int):       # a runtime extent
        if isinstance(x, ir.Constant) and int(x.constant) in (0, 1):
            return c if int(x.constant) else i64(0)
        return b.mul(x, c)
    if c == 1:
        return x
    if c == 0:
        return i64(0)
    if isinstance(x, ir.Constant):
        return i64(int(x.constant) * c)
    return b.mul(x, i64(c))


def decompose(b: ir.IRBuilder, flat: ir.Value, groups: Sequence[tuple[Any, Any]]) -> ir.Value:
    """Offset sum(idx_d * stride_d) of the row-major multi-index `flat` over (size, stride)s."""
    off: ir.Value = i64(0)
    rem = flat
    for d in range(len(groups) - 1, -1, -1):
        size, stride = groups[d]
        if d > 0:
            idx = b.urem(rem, as_i64(size))
            rem = b.udiv(rem, as_i64(size))
        else:
            idx = rem
        off = add(b, off, mul(b, idx, stride))
    return off


@contextmanager
def nest(b: ir.IRBuilder, groups: Sequence[tuple[Any, Any]], base: ir.Value
         ) -> Iterator[tuple[ir.Value, list[ir.Value]]]:
    """Loops over (size, stride) groups; yields (offset, loop indices)."""
    with ExitStack() as es:
        off, idxs = base, []
        for k, (size, stride) in enumerate(groups):
            i = es.enter_context(for_range(b, 0, size, name=f"r{k}"))
            idxs.append(i)
            off = add(b, off, mul(b, i, stride))
        yield off, idxs


def hreduce(b: ir.IRBuilder, acc: tuple[TV, ...], merge: Callable) -> tuple[TV, ...]:
    """Reduce the lanes of each vector in acc (a tuple reduced jointly) to scalars."""
    n = acc[0].lanes
    while n > 2:
        h = n // 2
        lo_m = ir.Constant(ir.VectorType(I32, h), list(range(h)))
        hi_m = ir.Constant(ir.VectorType(I32, h), list(range(h, n)))
        lo = tuple(TV(b.shuffle_vector(a.v, ir.Constant(a.v.type, ir.Undefined), lo_m), a.dtype)
                   for a in acc)
        hi = tuple(TV(b.shuffle_vector(a.v, ir.Constant(a.v.type, ir.Undefined), hi_m), a.dtype)
                   for a in acc)
        acc = merge(Expr(b, h), lo, hi)
        n = h
    if n == 1:
        return tuple(TV(b.extract_element(a.v, ir.Constant(I32, 0)), a.dtype) for a in acc)
    lo = tuple(TV(b.extract_element(a.v, ir.Constant(I32, 0)), a.dtype) for a in acc)
    hi = tuple(TV(b.extract_element(a.v, ir.Constant(I32, 1)), a.dtype) for a in acc)
    return merge(Expr(b, 1), lo, hi)


# ---------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------

@dataclass
class Layout:
    """The input as kept and reduced groups of (size, element stride), outer to inner.

    row mode: the innermost group is reduced (stride 1); one output per kept index.
    column mode: the innermost group is kept (stride 1), vectorised over.
    """

    kept: list[tuple[int, int]]
    red: list[tuple[int, int]]
    row: bool

    @property
    def rows(self) -> int:
        return int(np.prod([s for s, _ in self.kept])) if self.kept else 1

    @property
    def rlen(self) -> int:
        return int(np.prod([s for s, _ in self.red])) if self.red else 1

    @property
    def total(self) -> int:
        return self.rows * self.rlen


def make_layout(shape: Sequence[int], axes: Sequence[int]) -> Layout:
    shape = [int(d) for d in shape]
    axes_set = {a % len(shape) for a in axes} if shape else set()
    strides, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= shape[d]
    dims = [[shape[d], strides[d], d in axes_set] for d in range(len(shape)) if shape[d] != 1]
    merged: list[list[Any]] = []
    for s, st, r in dims:
        if merged and merged[-1][2] == r:
            merged[-1][0] *= s
            merged[-1][1] = st
        else:
            merged.append([s, st, r])
    if not merged:
        return Layout(kept=[(1, 1)], red=[], row=False)
    kept = [(s, st) for s, st, r in merged if not r]
    red = [(s, st) for s, st, r in merged if r]
    return Layout(kept=kept, red=red, row=merged[-1][2])


def row_layout(rows: Ext, rlen: int) -> Layout:
    """rows x contiguous rows of rlen (row mode even when rlen is 1)."""
    return Layout(kept=[(rows, rlen)], red=[(rlen, 1)], row=True)


# ---------------------------------------------------------------------------
# shape-polymorphic kernels: runtime layouts and the host tiling
# ---------------------------------------------------------------------------

# the runtime dims a Tiling starts with: row mode (rows, rows per tile), column mode
# (outer extent, blocks per inner extent); then poly_layout's (the reduced length, the
# groups' sizes and strides)
ROWS_DIM, RPT_DIM, RLEN_DIM = 0, 1, 2
OUTER_DIM, NBLK_DIM = 0, 1
COL_BLOCK = 256               # column mode: inner elements per tile (a chunk multiple)


def row_tiling(key: tuple, rows: int, rlen: int, npasses: int, flops_per_elem: int,
               extra: Sequence[int] = ()) -> Tiling:
    """The host tiling of a row-mode kernel over `rows` rows of `rlen` elements (as the
    static kernel tiles them): dims (rows, rows per tile, *extra)."""
    rpt = max(1, min(-(-rows // MIN_TILES), ROW_TILE_ELEMS // max(1, rlen)))
    total = rows * rlen
    return Tiling(key=key, dims=(rows, rpt, *extra), num_tiles=max(1, -(-rows // rpt)),
                  single_core=total * max(1, npasses) < SINGLE_CORE_ELEMS,
                  flops=total * max(1, flops_per_elem))


def col_tiling(key: tuple, outer: int, inner: int, rlen: int, npasses: int,
               flops_per_elem: int, extra: Sequence[int] = ()) -> Tiling:
    """The host tiling of a column-mode kernel: `outer` x blocks of COL_BLOCK of the
    `inner` kept elements, each reducing `rlen` elements per lane: dims (outer, blocks
    per inner, *extra)."""
    nblk = max(1, -(-inner // COL_BLOCK))
    total = outer * inner * rlen
    return Tiling(key=key, dims=(outer, nblk, *extra), num_tiles=max(1, outer * nblk),
                  single_core=total * max(1, npasses) < SINGLE_CORE_ELEMS,
                  flops=total * max(1, flops_per_elem))


def poly_tiling(key: tuple, shape: Sequence[int], plan: tuple[tuple, Layout, tuple[int, ...]],
                npasses: int, flops_per_elem: int) -> Tiling:
    """row_tiling or col_tiling for a `poly_layout` plan of `shape`."""
    struct, lay, extra = plan
    rlen = extra[0]
    total = int(np.prod(shape))
    if lay.row:
        return row_tiling(key, total // rlen, rlen, npasses, flops_per_elem, extra)
    inner = extra[-1]                 # the size of the last (kept) group
    return col_tiling(key, total // (rlen * inner), inner, rlen, npasses, flops_per_elem,
                      extra)


def poly_layout(shape: Sequence[int], axes: Sequence[int]
                ) -> tuple[tuple, Layout, tuple[int, ...]] | None:
    """A layout with runtime extents. The axes are merged into alternating kept and
    reduced groups by kind only (size-1 dims stay, so the structure does not depend on
    the sizes). Returns (the structure: (reduced, axes) per group, for the Tiling key;
    a Layout of RtDims; the dims after the mode's two: the reduced length, then each
    group's size and stride, the innermost stride being 1); None when nothing is
    reduced."""
    shape = [int(d) for d in shape]
    rank = len(shape)
    red_axes = {a % rank for a in axes} if rank else set()
    if rank == 0 or not red_axes:
        return None
    groups: list[list[Any]] = []           # [reduced, size, stride, axes]
    for d in range(rank):
        r = d in red_axes
        stride = int(np.prod(shape[d + 1:])) if d + 1 < rank else 1
        if groups and groups[-1][0] == r:
            groups[-1][1] *= shape[d]
            groups[-1][2] = stride
            groups[-1][3] += 1
        else:
            groups.append([r, shape[d], stride, 1])
    rlen = int(np.prod([g[1] for g in groups if g[0]]))
    dims: list[int] = [rlen]
    kept: list[tuple[Ext, Ext]] = []
    red: list[tuple[Ext, Ext]] = []
    for k, (r, size, stride, _) in enumerate(groups):
        ext_size: Ext = RtDim(RLEN_DIM + len(dims))
        dims.append(size)
        ext_stride: Ext = 1
        if k < len(groups) - 1:
            ext_stride = RtDim(RLEN_DIM + len(dims))
            dims.append(stride)
        (red if r else kept).append((ext_size, ext_stride))
    struct = tuple((g[0], g[3]) for g in groups)
    return struct, Layout(kept=kept, red=red, row=groups[-1][0]), tuple(dims)


# ---------------------------------------------------------------------------
# passes and the engine
# ---------------------------------------------------------------------------

Acc = tuple  # tuple[TV, ...]


@dataclass
class Pass:
    """One sweep over a reduction domain.

    init(E) -> the accumulators' identity (None: a map pass without accumulators)
    step(E, acc, body) -> the new accumulators (map passes return ()), may store outputs
    merge(E, a, b) -> two partial accumulators combined (lanes, unrolled slots)
    post(E, acc, stats) -> the statistic this pass contributes (a scalar TV in row
        mode, a per-lane vector in column mode)
    src: -1 reads input `x_slot`; j >= 0 reads output j (e.g. a pass re-reading what
        an earlier pass stored)
    split: row mode only: iterate the row as these (size, stride) groups instead
        (map passes that need, e.g., a channel index inside a row)
    """

    init: Callable[[Expr], Acc] | None
    step: Callable[[Expr, Acc, Body], Acc]
    merge: Callable[[Expr, Acc, Acc], Acc] | None = None
    post: Callable[[Expr, Acc, list], TV] | None = None
    src: int = -1
    split: list[tuple[int, int]] | None = None


class Body:
    """What a pass step sees for one vector of the reduction domain."""

    def __init__(self, eng: Engine, E: Expr, x: TV, mask: ir.Value | None, off: ir.Value,
                 pos: ir.Value, jpos: ir.Value, ridx: list[ir.Value], row: ir.Value,
                 stats: list[TV], slot: int) -> None:
        self.eng = eng
        self.E = E
        self.x = x
        self.mask_v = mask
        self.off = off          # element offset in the input (= in same-layout outputs)
        self.pos = pos          # row mode: offset from the row's start
        self.jpos = jpos        # row mode: offset inside the innermost (split) group
        self.ridx = ridx        # indices of the looped reduced groups
        self.row = row          # row mode: the row; column mode: the outer kept index
        self._stats = stats
        self.slot = slot

    @property
    def b(self) -> ir.IRBuilder:
        return self.E.b

    @property
    def mask(self) -> TV | None:
        return None if self.mask_v is None else TV(self.mask_v, BOOL)

    def stat(self, i: int) -> TV:
        return splat_tv(self.b, self._stats[i], self.E.lanes)

    def sel(self, v: TV, ident: float | int) -> TV:
        """v with the masked-off lanes set to ident."""
        if self.mask_v is None:
            return v
        return self.E.select(self.mask, v, self.E.const(ident, v.dtype))

    def idx(self) -> TV:
        """int32 index of each lane along the (flattened) reduced dims."""
        eng, b, E = self.eng, self.b, self.E
        if eng.layout.row:
            base = b.trunc(self.pos, I32)
            return TV(b.add(emit.splat(b, base, E.lanes), iota(E.lanes)), I32DT)
        flat: ir.Value = i64(0)
        for i, (size, _) in zip(self.ridx, eng.layout.red):
            flat = add(b, mul(b, flat, size), i)
        return TV(emit.splat(b, b.trunc(flat, I32), E.lanes), I32DT)

    def store(self, j: int, v: TV) -> None:
        """Store v to output j (same layout as the input) at this position."""
        eng = self.eng
        store_tv(self.b, eng.out_ptrs[j], self.off, v, eng.out_dtype(j), self.mask_v)

    def load(self, slot: int, off: ir.Value, broadcast: bool = False) -> TV:
        """Input `slot` at element offset `off` (a vector, or one element splat)."""
        eng = self.eng
        dt = eng.in_dtype(slot)
        if broadcast:
            return splat_tv(self.b, load_tv(self.b, eng.in_ptrs[slot], off, dt, 1, eng.cdt),
                            self.E.lanes)
        return load_tv(self.b, eng.in_ptrs[slot], off, dt, self.E.lanes, eng.cdt, self.mask_v)


class Finish:
    """What the finish hook sees: where the reduced outputs of this row/vector go."""

    def __init__(self, eng: Engine, E: Expr, out_off: ir.Value, mask: ir.Value | None,
                 row: ir.Value, stats: list[TV]) -> None:
        self.eng = eng
        self.E = E
        self.out_off = out_off
        self.mask_v = mask
        self.row = row
        self.stats = stats

    def store(self, j: int, v: TV) -> None:
        eng = self.eng
        if eng.out_ptrs[j] is None:
            return
        store_tv(self.E.b, eng.out_ptrs[j], self.out_off, v, eng.out_dtype(j), self.mask_v)


FinishFn = Callable[[Expr, list, Finish], None]
RowValsFn = Callable[[Expr, ir.Value, "Engine"], list]


class Engine:
    """Emits the whole kernel for a layout and a list of passes into a LowerCtx."""

    def __init__(self, ctx: LowerCtx, layout: Layout, x_dtype: np.dtype, cdt: np.dtype,
                 x_slot: int = 0, lanes: int | None = None) -> None:
        self.ctx = ctx
        self.layout = layout
        self.x_dtype = np.dtype(x_dtype)
        self.cdt = np.dtype(cdt)
        self.x_slot = x_slot
        self.lanes = lanes or lanes_for(self.x_dtype)
        self.in_ptrs: list[ir.Value | None] = []
        self.out_ptrs: list[ir.Value | None] = []
        # a fused prologue: computes the input vector at element offset `off` instead of
        # loading it (elementwise producers fused into the reduction, see ops/fused.py)
        self.x_source: Callable[[ir.IRBuilder, ir.Value, int, ir.Value | None], TV] | None = \
            getattr(ctx, "reduce_x_source", None)
        # the same per row (row mode): x_rows(eng, b, row) sets up the row once and returns
        # a loader(b, off, pos, lanes, mask) of the vector at offset pos inside the row
        self.x_rows: Callable[..., Callable[..., TV]] | None = getattr(ctx, "reduce_x_rows",
                                                                        None)
        self._row_loader: Callable[..., TV] | None = None
        self.dims: list[ir.Value] = []        # the runtime dims, loaded on entry

    def load_x(self, b: ir.IRBuilder, src_ptr: ir.Value, off: ir.Value, lanes: int,
               mask: ir.Value | None, pos: ir.Value | None = None) -> TV:
        if self._row_loader is not None:
            return self._row_loader(b, off, pos, lanes, mask)
        if self.x_source is not None:
            return self.x_source(b, off, lanes, mask)
        return load_tv(b, src_ptr, off, self.x_dtype, lanes, self.cdt, mask)

    def ext(self, x: Ext) -> int | ir.Value:
        """An extent as emitted code uses it: an int, or the loaded runtime dim."""
        return self.dims[x.index] if isinstance(x, RtDim) else x

    @property
    def polymorphic(self) -> bool:
        return getattr(self.ctx, "tiling", None) is not None

    # -- types of the node's inputs/outputs by position --------------------------
    def in_dtype(self, i: int) -> np.dtype:
        return np.dtype(self.ctx.in_types[i].dtype)

    def out_dtype(self, j: int) -> np.dtype:
        return np.dtype(out_type(self.ctx, j).dtype)

    # -- the kernel ---------------------------------------------------------------
    def emit(self, passes: list[Pass], finish: FinishFn | None = None,
             rowvals: RowValsFn | None = None, flops_per_elem: int = 1) -> None:
        ctx, lay = self.ctx, self.layout
        self.passes, self.finish, self.rowvals = passes, finish, rowvals
        fn, b = ctx.begin()
        self.b = b
        node = ctx.node
        self.in_ptrs = [ctx.in_ptr(b, i) if v else None for i, v in enumerate(node.inputs)]
        self.out_ptrs = [ctx.out_ptr(b, j) if v else None for j, v in enumerate(node.outputs)]
        if self.polymorphic:
            # runtime extents; tiles, cores and flops come from the Tiling
            t = ctx.tiling
            self.dims = [ctx.rt_dim(b, i) for i in range(len(t.dims))]
            self.layout = lay = Layout(kept=[(self.ext(s), self.ext(st)) for s, st in lay.kept],
                                       red=[(self.ext(s), self.ext(st)) for s, st in lay.red],
                                       row=lay.row)
            ctx.num_tiles, ctx.single_core, ctx.flops = t.num_tiles, t.single_core, t.flops or 0
        else:
            total = lay.total
            ctx.single_core = total * max(1, len(passes)) < SINGLE_CORE_ELEMS
            ctx.flops = total * max(1, flops_per_elem)
        if lay.row:
            self._emit_rows()
        else:
            assert rowvals is None, "per-row values need row mode"
            self._emit_cols()
        b.ret_void()

    # -- row mode ---------------------------------------------------------------------
    def _emit_rows(self) -> None:
        b, lay, ctx = self.b, self.layout, self.ctx
        if self.polymorphic:
            # runs of rpt rows per tile, the last run cut at the row count
            rows, rpt_v = self.dims[ROWS_DIM], self.dims[RPT_DIM]
            with for_range(b, ctx.tile_begin, ctx.tile_end, name="tile") as t:
                r0 = b.mul(t, rpt_v)
                with for_range(b, r0, imin(b, b.add(r0, rpt_v), rows), name="row") as r:
                    self._row(r)
            return
        rows, rlen = lay.rows, lay.rlen
        rpt = max(1, min(-(-rows // MIN_TILES), ROW_TILE_ELEMS // max(1, rlen)))
        ntiles = max(1, -(-rows // rpt))
        ctx.num_tiles = ntiles
        with for_range(b, ctx.tile_begin, ctx.tile_end, name="tile") as t:
            if rpt == 1:
                self._row(t)
            else:
                r0 = b.mul(t, i64(rpt))
                r1 = imin(b, b.add(r0, i64(rpt)), i64(rows))
                with for_range(b, r0, r1, name="row") as r:
                    self._row(r)

    def _row(self, row: ir.Value) -> None:
        b, lay = self.b, self.layout
        base = decompose(b, row, lay.kept) if lay.kept else i64(0)
        if self.x_rows is not None:
            self._row_loader = self.x_rows(self, b, row)
        stats: list[Any] = []
        if self.rowvals is not None:
            stats.extend(self.rowvals(Expr(b, 1), row, self))
        for p in self.passes:
            s = self._row_pass(p, base, row, stats)
            if s is not None:
                stats.append(s)
        if self.finish is not None:
            E1 = Expr(b, 1)
            self.finish(E1, stats, Finish(self, E1, row, None, row, stats))

    def _row_pass(self, p: Pass, base: ir.Value, row: ir.Value, stats: list) -> TV | None:
        b, lanes = self.b, self.lanes
        E = Expr(b, lanes)
        groups = p.split if p.split is not None else self.layout.red
        inner_n = groups[-1][0]
        assert groups[-1][1] == 1
        nslots = max(1, min(UNROLL, -(-inner_n // lanes))) if isinstance(inner_n, int) else UNROLL
        slots = None
        if p.init is not None:
            init = p.init(E)
            slots = [[entry_alloca(b, a.v.type) for a in init] for _ in range(nslots)]
            dts = [a.dtype for a in init]
            for s in slots:
                for a, v in zip(s, init):
                    b.store(v.v, a)
        src_ptr = self.in_ptrs[self.x_slot] if p.src < 0 else self.out_ptrs[p.src]
        src_dt = self.x_dtype if p.src < 0 else self.out_dtype(p.src)

        with nest(b, groups[:-1], base) as (roff, ridx):
            rel = b.sub(roff, base) if groups[:-1] else i64(0)

            def body(j: ir.Value, slot: int, mask: ir.Value | None) -> None:
                off = add(b, roff, j)
                pos = add(b, rel, j)
                x = self.load_x(b, src_ptr, off, lanes, mask, pos) if p.src < 0 else \
                    load_tv(b, src_ptr, off, src_dt, lanes, self.cdt, mask)
                bd = Body(self, E, x, mask, off, pos, j, ridx, row, stats, slot)
                if slots is None:
                    p.step(E, (), bd)
                    return
                acc = tuple(TV(b.load(a, typ=a.allocated_type), dt)
                            for a, dt in zip(slots[slot], dts))
                new = p.step(E, acc, bd)
                for a, v in zip(slots[slot], new):
                    b.store(v.v, a)

            vloop(b, inner_n, lanes, nslots, body)
        if slots is None:
            return None
        accs = [tuple(TV(b.load(a, typ=a.allocated_type), dt) for a, dt in zip(s, dts))
                for s in slots]
        assert p.merge is not None and p.post is not None
        while len(accs) > 1:
            nxt = [p.merge(E, accs[i], accs[i + 1]) for i in range(0, len(accs) - 1, 2)]
            if len(accs) % 2:
                nxt.append(accs[-1])
            accs = nxt
        h = hreduce(b, accs[0], p.merge)
        return p.post(Expr(b, 1), h, stats)

    # -- column mode ----------------------------------------------------------------
    def _emit_cols(self) -> None:
        b, lay, ctx, lanes = self.b, self.layout, self.ctx, self.lanes
        if self.polymorphic:
            self._emit_cols_rt()
            return
        inner = lay.kept[-1][0]
        outer_groups = lay.kept[:-1]
        outer = int(np.prod([s for s, _ in outer_groups])) if outer_groups else 1
        chunk = lanes * UNROLL
        nblk = 1
        if outer < MIN_TILES and inner > chunk:
            nblk = min(-(-inner // chunk), -(-MIN_TILES // outer))
        blk = -(-inner // nblk)
        blk = -(-blk // lanes) * lanes
        nblk = -(-inner // blk)
        last = inner - (nblk - 1) * blk
        ctx.num_tiles = max(1, outer * nblk)
        self.col_inner = inner
        with for_range(b, ctx.tile_begin, ctx.tile_end, name="tile") as t:
            o = b.udiv(t, i64(nblk)) if nblk > 1 else t
            in_base = decompose(b, o, outer_groups) if outer_groups else i64(0)
            out_base = mul(b, o, inner)
            if nblk == 1:
                self._col_block(o, in_base, out_base, i64(0), inner)
            else:
                k = b.urem(t, i64(nblk))
                j0 = b.mul(k, i64(blk))
                if last == blk:
                    self._col_block(o, in_base, out_base, j0, blk)
                else:
                    with b.if_else(b.icmp_unsigned("==", k, i64(nblk - 1))) as (then, other):
                        with then:
                            self._col_block(o, in_base, out_base, j0, last)
                        with other:
                            self._col_block(o, in_base, out_base, j0, blk)

    def _emit_cols_rt(self) -> None:
        """Runtime extents: tile t is block t % nblk (COL_BLOCK inner elements, the last
        one cut) of the outer index t / nblk; full chunks, then masked single vectors."""
        b, lay, ctx, lanes = self.b, self.layout, self.ctx, self.lanes
        inner = lay.kept[-1][0]
        outer_groups = lay.kept[:-1]
        nblk = self.dims[NBLK_DIM]
        chunk = lanes * UNROLL
        with for_range(b, ctx.tile_begin, ctx.tile_end, name="tile") as t:
            o = b.udiv(t, nblk)
            in_base = decompose(b, o, outer_groups) if outer_groups else i64(0)
            out_base = mul(b, o, inner)
            j0 = b.mul(b.urem(t, nblk), i64(COL_BLOCK))
            n = imin(b, i64(COL_BLOCK), b.sub(as_i64(inner), j0))
            nmain = b.mul(b.udiv(n, i64(chunk)), i64(chunk))
            with for_range(b, 0, nmain, step=chunk, name="chunk") as c:
                self._col_chunk(o, in_base, out_base, b.add(j0, c), [None] * UNROLL)
            with for_range(b, nmain, n, step=lanes, name="v1") as j:
                m = rt_mask(b, lanes, imin(b, b.sub(n, j), i64(lanes)))
                self._col_chunk(o, in_base, out_base, b.add(j0, j), [m])

    def _col_block(self, o: ir.Value, in_base: ir.Value, out_base: ir.Value, j0: ir.Value,
                   n: int) -> None:
        b, lanes = self.b, self.lanes
        chunk = lanes * UNROLL
        nfull = n // chunk
        if nfull == 1:
            self._col_chunk(o, in_base, out_base, j0, [None] * UNROLL)
        elif nfull > 1:
            with for_range(b, 0, nfull, name="chunk") as c:
                self._col_chunk(o, in_base, out_base, add(b, j0, b.mul(c, i64(chunk))),
                                [None] * UNROLL)
        rem = n - nfull * chunk
        if rem:
            masks: list[ir.Value | None] = [None] * (rem // lanes)
            if rem % lanes:
                masks.append(const_mask(lanes, rem % lanes))
            self._col_chunk(o, in_base, out_base, add(b, j0, nfull * chunk), masks)

    def _col_chunk(self, o: ir.Value, in_base: ir.Value, out_base: ir.Value, j: ir.Value,
                   masks: list[ir.Value | None]) -> None:
        b, lanes, lay = self.b, self.lanes, self.layout
        E = Expr(b, lanes)
        nv = len(masks)
        stats: list[list[Any]] = [[] for _ in range(nv)]
        for p in self.passes:
            slots = None
            if p.init is not None:
                init = p.init(E)
                dts = [a.dtype for a in init]
                slots = [[entry_alloca(b, a.v.type) for a in init] for _ in range(nv)]
                for s in slots:
                    for a, v in zip(s, init):
                        b.store(v.v, a)
            src_ptr = self.in_ptrs[self.x_slot] if p.src < 0 else self.out_ptrs[p.src]
            src_dt = self.x_dtype if p.src < 0 else self.out_dtype(p.src)
            with nest(b, lay.red, add(b, in_base, j)) as (roff, ridx):
                for k in range(nv):
                    off = add(b, roff, k * lanes)
                    x = self.load_x(b, src_ptr, off, lanes, masks[k]) if p.src < 0 else \
                        load_tv(b, src_ptr, off, src_dt, lanes, self.cdt, masks[k])
                    kpos = add(b, j, k * lanes)
                    bd = Body(self, E, x, masks[k], off, kpos, kpos, ridx, o, stats[k], k)
                    if slots is None:
                        p.step(E, (), bd)
                        continue
                    acc = tuple(TV(b.load(a, typ=a.allocated_type), dt)
                                for a, dt in zip(slots[k], dts))
                    new = p.step(E, acc, bd)
                    for a, v in zip(slots[k], new):
                        b.store(v.v, a)
            if slots is not None:
                assert p.post is not None
                for k in range(nv):
                    acc = tuple(TV(b.load(a, typ=a.allocated_type), dt)
                                for a, dt in zip(slots[k], dts))
                    stats[k].append(p.post(E, acc, stats[k]))
        if self.finish is not None:
            for k in range(nv):
                out_off = add(b, out_base, add(b, j, k * lanes))
                self.finish(E, stats[k], Finish(self, E, out_off, masks[k], o, stats[k]))


def vloop(b: ir.IRBuilder, n: int | ir.Value, lanes: int, nslots: int,
          body: Callable[[ir.Value, int, ir.Value | None], None]) -> None:
    """Cover [0, n) contiguous elements with vectors: a loop of nslots vectors per
    iteration, then the static remainder (full vectors, then one masked vector).
    A runtime n: the same loop, a loop of single vectors, one masked vector if any."""
    chunk = lanes * nslots
    if not isinstance(n, int):
        nmain = b.mul(b.udiv(n, i64(chunk)), i64(chunk))
        with for_range(b, 0, nmain, step=chunk, name="v") as j:
            for k in range(nslots):
                body(add(b, j, k * lanes), k, None)
        nvec = b.and_(n, i64(-lanes))
        with for_range(b, nmain, nvec, step=lanes, name="v1") as j:
            body(j, 0, None)
        rem = b.sub(n, nvec)
        with b.if_then(b.icmp_signed(">", rem, i64(0))):
            body(nvec, 0, rt_mask(b, lanes, rem))
        return
    nfull = n // chunk
    if nfull == 1:
        for k in range(nslots):
            body(i64(k * lanes), k, None)
    elif nfull > 1:
        with for_range(b, 0, nfull * chunk, step=chunk, name="v") as j:
            for k in range(nslots):
                body(add(b, j, k * lanes), k, None)
    pos = nfull * chunk
    rem = n - pos
    k = 0
    while rem >= lanes:
        body(i64(pos), k, None)
        pos += lanes
        rem -= lanes
        k += 1
    if rem:
        body(i64(pos), k % nslots, const_mask(lanes, rem))


def out_type(ctx: LowerCtx, j: int) -> Any:
    """The TensorType of the node's output j (ctx.out_types skips absent outputs)."""
    k = sum(1 for v in ctx.node.outputs[:j] if v)
    return ctx.out_types[k]


# ---------------------------------------------------------------------------
# pass building blocks
# ---------------------------------------------------------------------------

def _add(E: Expr, a: Acc, c: Acc) -> Acc:
    return (E.add(a[0], c[0]),)


def _mul(E: Expr, a: Acc, c: Acc) -> Acc:
    return (E.mul(a[0], c[0]),)


def _max(E: Expr, a: Acc, c: Acc) -> Acc:
    return (E.max(a[0], c[0]),)


def _min(E: Expr, a: Acc, c: Acc) -> Acc:
    return (E.min(a[0], c[0]),)


def _fmax(E: Expr, a: Acc, c: Acc) -> Acc:
    """max that may drop NaNs (one vmaxps): for the shift of softmax/logsumexp, where a
    NaN poisons the row through exp anyway."""
    return (E.select(E.cmp(">", c[0], a[0]), c[0], a[0]),)


def fold_pass(cdt: np.dtype, op: str, pre: Callable[[Expr, TV, Body], TV] | None = None,
              post: Callable[[Expr, TV, list], TV] | None = None,
              store: Callable[[Expr, TV, Body], None] | None = None, src: int = -1) -> Pass:
    """A pass accumulating pre(x) with op in {'add', 'mul', 'max', 'min', 'fmax'}
    ('max'/'min' propagate NaN, 'fmax' may drop it)."""
    cdt = np.dtype(cdt)
    ident = {"add": 0, "mul": 1, "max": ident_value(cdt, "max"),
             "fmax": ident_value(cdt, "max"), "min": ident_value(cdt, "min")}[op]
    merge = {"add": _add, "mul": _mul, "max": _max, "min": _min, "fmax": _fmax}[op]

    def step(E: Expr, acc: Acc, bd: Body) -> Acc:
        v = pre(E, bd.x, bd) if pre is not None else bd.x
        if store is not None:
            store(E, v, bd)
        v = bd.sel(v, ident)
        return merge(E, acc, (v,))

    return Pass(init=lambda E: (E.const(ident, cdt),), step=step, merge=merge,
                post=(lambda E, acc, st: post(E, acc[0], st)) if post else
                (lambda E, acc, st: acc[0]), src=src)


def map_pass(fn: Callable[[Expr, TV, Body], None], src: int = -1,
             split: list[tuple[int, int]] | None = None) -> Pass:
    def step(E: Expr, acc: Acc, bd: Body) -> Acc:
        fn(E, bd.x, bd)
        return ()
    return Pass(init=None, step=step, src=src, split=split)


def arg_pass(cdt: np.dtype, want_max: bool, last: bool,
             post: Callable[[Expr, Acc, list], TV] | None = None) -> Pass:
    """Arg-max/min: accumulators (best value, its int32 index); ties go to the first
    (or, with last, the last) index. NaN propagates as in numpy.argmax/argmin: a NaN is
    better than any number (the index of the first NaN, or of the last with `last`), as
    ReduceMax/Max give NaN for a group holding one."""
    cdt = np.dtype(cdt)
    ident = ident_value(cdt, "max" if want_max else "min")
    better = ">" if want_max else "<"
    is_f = cdt.kind == "f"

    def beats(E: Expr, x: TV, best: TV) -> TV:
        c = E.cmp(better, x, best)          # ordered: false when either is NaN
        if is_f:
            c = E.or_(c, E.and_(E.isnan(x), E.not_(E.isnan(best))))
        return c

    def equal(E: Expr, x: TV, best: TV) -> TV:
        c = E.cmp("==", x, best)
        if is_f:
            c = E.or_(c, E.and_(E.isnan(x), E.isnan(best)))
        return c

    def step(E: Expr, acc: Acc, bd: Body) -> Acc:
        best, bi = acc
        x = bd.x
        c = beats(E, x, best)
        if last:
            c = E.or_(c, equal(E, x, best))
        if bd.mask_v is not None:
            c = E.and_(c, bd.mask)
        return (E.select(c, x, best), E.select(c, bd.idx(), bi))

    def merge(E: Expr, a: Acc, c: Acc) -> Acc:
        tie_idx = E.cmp(">" if last else "<", c[1], a[1])
        take = E.or_(beats(E, c[0], a[0]), E.and_(equal(E, c[0], a[0]), tie_idx))
        return (E.select(take, c[0], a[0]), E.select(take, c[1], a[1]))

    return Pass(init=lambda E: (E.const(ident, cdt), E.const(0, I32DT)), step=step,
                merge=merge, post=post or (lambda E, acc, st: acc[1]))


# ---------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------

REDUCE_KINDS = ("sum", "mean", "max", "min", "prod", "l1", "l2", "logsum", "logsumexp",
                "sumsquare")


def reduce_passes(kind: str, cdt: np.dtype, n: int | RtDim,
                  eng: Engine | None = None) -> list[Pass]:
    """The passes of Reduce<kind> over n elements (a runtime n: a dim of `eng`); the
    last pass's stat is the result."""
    cdt = np.dtype(cdt)
    is_f = cdt.kind == "f"

    def mean(E: Expr, s: TV, st: list) -> TV:
        if isinstance(n, RtDim):     # the tiling makes n >= 1
            assert eng is not None
            return E.div(s, E.cast(splat_tv(E.b, TV(eng.ext(n), I64DT), E.lanes), cdt))
        if is_f:
            return E.div(s, E.const(float(n), cdt))
        return E.div(s, E.const(max(n, 1), cdt))

    if kind == "sum":
        return [fold_pass(cdt, "add")]
    if kind == "mean":
        return [fold_pass(cdt, "add", post=mean)]
    if kind == "max":
        return [fold_pass(cdt, "max")]
    if kind == "min":
        return [fold_pass(cdt, "min")]
    if kind == "prod":
        return [fold_pass(cdt, "mul")]
    if kind == "l1":
        return [fold_pass(cdt, "add", pre=lambda E, x, bd: E.abs(x))]
    if kind == "sumsquare":
        return [fold_pass(cdt, "add", pre=lambda E, x, bd: E.mul(x, x))]
    if kind == "l2":
        return [fold_pass(cdt, "add", pre=lambda E, x, bd: E.mul(x, x),
                          post=lambda E, s, st: E.call("llvm.sqrt", s))]
    if kind == "logsum":
        return [fold_pass(cdt, "add", post=lambda E, s, st: TV(vmath.log(E.b, s.v), s.dtype))]
    if kind == "logsumexp":
        def pre(E: Expr, x: TV, bd: Body) -> TV:
            m = bd.stat(0)
            # a row of -inf: exp(x - m) would be NaN; use 0 so the result is -inf
            m = E.select(E.cmp("==", m, E.const(-math.inf, cdt)), E.const(0.0, cdt), m)
            return TV(vmath.exp(E.b, E.sub(x, m).v), cdt)

        def post(E: Expr, s: TV, st: list) -> TV:
            m = splat_tv(E.b, st[0], E.lanes)
            m = E.select(E.cmp("==", m, E.const(-math.inf, cdt)), E.const(0.0, cdt), m)
            return E.add(TV(vmath.log(E.b, s.v), cdt), m)

        return [fold_pass(cdt, "fmax"), fold_pass(cdt, "add", pre=pre, post=post)]
    raise ValueError(kind)


def reduce_wide(kind: str, dtype: np.dtype, n: int, row: bool) -> bool:
    """Accumulate a float32 sum of n elements in float64."""
    if np.dtype(dtype) == np.float32 and kind in ("sum", "mean", "l1", "l2", "sumsquare",
                                                   "logsum"):
        return n > (1 << 16) if row else n > 2048
    return False


def emit_reduce(ctx: LowerCtx, kind: str, axes: Sequence[int]) -> None:
    """Reduce<kind> of input 0 over axes into output 0 (its shape fixes keepdims).
    With a Tiling (see `poly_layout`), the extents are runtime dims."""
    xt = ctx.in_types[0]
    xdt = np.dtype(xt.dtype)
    n: int | RtDim
    if getattr(ctx, "tiling", None) is not None:
        plan = poly_layout(xt.shape, axes)
        assert plan is not None
        lay = plan[1]
        n = RtDim(RLEN_DIM)
        # the precision bucket is in the Tiling key
        wide = reduce_wide(kind, xdt, plan[2][0], lay.row)
    else:
        lay = make_layout(xt.shape, axes)
        n = lay.rlen
        wide = reduce_wide(kind, xdt, n, lay.row)
    cdt = compute_dtype(xdt, wide)
    eng = Engine(ctx, lay, xdt, cdt)
    passes = reduce_passes(kind, cdt, n, eng)

    def finish(E: Expr, stats: list, f: Finish) -> None:
        f.store(0, stats[-1])

    eng.emit(passes, finish, flops_per_elem=len(passes) * (10 if kind == "logsumexp" else 1))


def emit_argreduce(ctx: LowerCtx, axis: int, want_max: bool, last: bool) -> None:
    xt = ctx.in_types[0]
    xdt = np.dtype(xt.dtype)
    cdt = compute_dtype(xdt)
    lay = make_layout(xt.shape, [axis])
    eng = Engine(ctx, lay, xdt, cdt)
    p = arg_pass(cdt, want_max, last)

    def finish(E: Expr, stats: list, f: Finish) -> None:
        f.store(0, stats[-1])

    if not lay.red:
        # the axis has size 1: every index is 0
        p = Pass(init=lambda E: (E.const(0, I32DT),), step=lambda E, acc, bd: acc,
                 merge=lambda E, a, c: a, post=lambda E, acc, st: acc[0])
    eng.emit([p], finish)


# ---------------------------------------------------------------------------
# softmax family
# ---------------------------------------------------------------------------

def emit_softmax(ctx: LowerCtx, lay: Layout, kind: str) -> None:
    """kind: 'softmax' | 'logsoftmax' | 'hardmax' over the reduced groups of lay."""
    xt = ctx.in_types[0]
    xdt = np.dtype(xt.dtype)
    cdt = compute_dtype(xdt)
    eng = Engine(ctx, lay, xdt, cdt)
    if kind == "hardmax":
        one_hot = map_pass(lambda E, x, bd: bd.store(
            0, E.cast(E.cmp("==", bd.idx(), bd.stat(0)), cdt)))
        passes = [arg_pass(cdt, True, False), one_hot]
        eng.emit(passes, flops_per_elem=2)
        return

    def exp_shift(E: Expr, x: TV, bd: Body) -> TV:
        return TV(vmath.exp(E.b, E.sub(x, bd.stat(0)).v), cdt)

    if kind == "softmax":
        passes = [fold_pass(cdt, "fmax"),
                  fold_pass(cdt, "add", pre=exp_shift,
                            store=lambda E, e, bd: bd.store(0, e),
                            post=lambda E, s, st: E.div(E.const(1.0, cdt), s)),
                  map_pass(lambda E, y, bd: bd.store(0, E.mul(y, bd.stat(1))), src=0)]
    else:
        # (x - max) - log(sum): subtracting max + log(sum) at once loses digits when the
        # row sits far from 0 (e.g. a row masked with -1e4)
        passes = [fold_pass(cdt, "fmax"),
                  fold_pass(cdt, "add", pre=exp_shift,
                            post=lambda E, s, st: TV(vmath.log(E.b, s.v), cdt)),
                  map_pass(lambda E, x, bd: bd.store(0, E.sub(E.sub(x, bd.stat(0)),
                                                              bd.stat(1))))]
    eng.emit(passes, flops_per_elem=15)


# ---------------------------------------------------------------------------
# normalisations
# ---------------------------------------------------------------------------

def norm_passes(cdt: np.dtype, n: int, eps: float, first_stat: int) -> list[Pass]:
    """mean (stat first_stat) and rstd (stat first_stat + 1)."""
    cdt = np.dtype(cdt)
    inv_n = 1.0 / max(n, 1)

    def dev2(E: Expr, x: TV, bd: Body) -> TV:
        d = E.sub(x, bd.stat(first_stat))
        return E.mul(d, d)

    def var_post(E: Expr, s: TV, st: list) -> TV:
        var = E.mul(s, E.const(inv_n, cdt))
        return E.div(E.const(1.0, cdt), E.call("llvm.sqrt", E.add(var, E.const(eps, cdt))))

    return [fold_pass(cdt, "add", post=lambda E, s, st: E.mul(s, E.const(inv_n, cdt))),
            fold_pass(cdt, "add", pre=dev2, post=var_post)]


@dataclass
class Param:
    """How a scale/bias is indexed inside a normalised row.

    'scalar': one value; 'row': one value per row, at row % nrows (InstanceNorm, or
    GroupNorm 18 per group); 'elem': a vector at the row offset (period = row length)
    or at the offset inside the innermost split group (period < row length: a
    parameter broadcast over leading normalised dims); 'seg': one value per channel,
    a row holding seg_div channels of group row % nrows (GroupNorm 21).
    """

    slot: int
    kind: str
    period: int = 0
    nrows: int = 0
    seg_div: int = 1


def layer_norm(ctx: LowerCtx, rows: int, rlen: int, eps: float, scale: Param | None,
               bias: Param | None, mean_out: int | None = None, rstd_out: int | None = None,
               rms: bool = False, split: list[tuple[int, int]] | None = None) -> None:
    """Normalise contiguous rows: y = (x - mean) * rstd * scale + bias (rms: x * rstd * scale).
    Scale/bias are indexed as their Param says."""
    xt = ctx.in_types[0]
    xdt = np.dtype(xt.dtype)
    cdt = compute_dtype(xdt)
    lay = row_layout(rows, rlen)
    eng = Engine(ctx, lay, xdt, cdt)
    inv_n = 1.0 / max(rlen, 1)
    params = [p for p in (scale, bias) if p is not None]

    def rowvals(E1: Expr, row: ir.Value, eng: Engine) -> list:
        vals = []
        for p in params:
            if p.kind == "scalar":
                vals.append(load_tv(E1.b, eng.in_ptrs[p.slot], i64(0), eng.in_dtype(p.slot), 1,
                                    cdt))
            elif p.kind == "row":
                vals.append(load_tv(E1.b, eng.in_ptrs[p.slot], E1.b.urem(row, i64(p.nrows)),
                                    eng.in_dtype(p.slot), 1, cdt))
        return vals

    nrv = sum(1 for p in params if p.kind in ("scalar", "row"))

    if rms:
        def ms_post(E: Expr, s: TV, st: list) -> TV:
            var = E.mul(s, E.const(inv_n, cdt))
            return E.div(E.const(1.0, cdt), E.call("llvm.sqrt", E.add(var, E.const(eps, cdt))))
        passes = [fold_pass(cdt, "add", pre=lambda E, x, bd: E.mul(x, x), post=ms_post)]
        i_rstd = nrv
        i_mean = None
    else:
        passes = norm_passes(cdt, rlen, eps, nrv)
        i_mean, i_rstd = nrv, nrv + 1

    def param_value(E: Expr, p: Param, bd: Body, k: int) -> TV:
        if p.kind in ("scalar", "row"):
            return bd.stat(k)
        if p.kind == "elem":
            off = bd.pos if p.period >= rlen else bd.jpos
            return bd.load(p.slot, off)
        # 'seg': one value per channel; a row holds seg_div channels of the same group
        b = E.b
        g0 = b.mul(b.urem(bd.row, i64(p.nrows)), i64(p.seg_div))
        if bd.ridx:          # the row is split per channel: one value per segment
            return bd.load(p.slot, b.add(g0, bd.ridx[0]), broadcast=True)
        return bd.load(p.slot, b.add(g0, bd.pos))     # one element per channel

    def out(E: Expr, x: TV, bd: Body) -> None:
        y = E.sub(x, bd.stat(i_mean)) if i_mean is not None else x
        k = 0
        sv = bv = None
        if scale is not None:
            sv = param_value(E, scale, bd, k)
            k += scale.kind in ("scalar", "row")
        if bias is not None:
            bv = param_value(E, bias, bd, k)
        r = bd.stat(i_rstd)
        if sv is not None:
            y = E.mul(E.mul(y, r), sv)
        else:
            y = E.mul(y, r)
        if bv is not None:
            y = E.add(y, bv)
        bd.store(0, y)

    passes.append(map_pass(out, split=split))

    def finish(E: Expr, stats: list, f: Finish) -> None:
        if mean_out is not None and i_mean is not None:
            f.store(mean_out, stats[i_mean])
        if rstd_out is not None:
            f.store(rstd_out, stats[i_rstd])

    eng.emit(passes, finish, rowvals=rowvals if nrv else None, flops_per_elem=8)


def emit_lp_norm(ctx: LowerCtx, axis: int, p: int) -> None:
    xt = ctx.in_types[0]
    xdt = np.dtype(xt.dtype)
    cdt = compute_dtype(xdt)
    lay = make_layout(xt.shape, [axis])
    eng = Engine(ctx, lay, xdt, cdt)
    if p == 1:
        pn = fold_pass(cdt, "add", pre=lambda E, x, bd: E.abs(x))
    else:
        pn = fold_pass(cdt, "add", pre=lambda E, x, bd: E.mul(x, x),
                       post=lambda E, s, st: E.call("llvm.sqrt", s))

    def out(E: Expr, x: TV, bd: Body) -> None:
        nrm = bd.stat(0)
        zero = E.const(0.0, cdt)
        is0 = E.cmp("==", nrm, zero)
        safe = E.select(is0, E.const(1.0, cdt), nrm)
        bd.store(0, E.select(is0, zero, E.div(x, safe)))

    if not lay.red:
        # the axis has size 1: the norm is |x|
        def out1(E: Expr, x: TV, bd: Body) -> None:
            a = E.abs(x)
            zero = E.const(0.0, cdt)
            is0 = E.cmp("==", a, zero)
            bd.store(0, E.select(is0, zero, E.div(x, E.select(is0, E.const(1.0, cdt), a))))
        eng.emit([map_pass(out1)])
        return
    eng.emit([pn, map_pass(out)], flops_per_elem=4)


def emit_mvn(ctx: LowerCtx, axes: Sequence[int], eps: float = 1e-9) -> None:
    """MeanVarianceNormalization: (x - mean) / (sqrt(var) + eps) over axes."""
    xt = ctx.in_types[0]
    xdt = np.dtype(xt.dtype)
    cdt = compute_dtype(xdt)
    lay = make_layout(xt.shape, axes)
    eng = Engine(ctx, lay, xdt, cdt)
    n = lay.rlen
    inv_n = 1.0 / max(n, 1)

    def dev2(E: Expr, x: TV, bd: Body) -> TV:
        d = E.sub(x, bd.stat(0))
        return E.mul(d, d)

    def std_inv(E: Expr, s: TV, st: list) -> TV:
        std = E.call("llvm.sqrt", E.mul(s, E.const(inv_n, cdt)))
        return E.div(E.const(1.0, cdt), E.add(std, E.const(eps, cdt)))

    passes = [fold_pass(cdt, "add", post=lambda E, s, st: E.mul(s, E.const(inv_n, cdt))),
              fold_pass(cdt, "add", pre=dev2, post=std_inv),
              map_pass(lambda E, x, bd: bd.store(0, E.mul(E.sub(x, bd.stat(0)), bd.stat(1))))]
    eng.emit(passes, flops_per_elem=6)


# ---------------------------------------------------------------------------
# cumulative sum
# ---------------------------------------------------------------------------

def _shift_lanes(b: ir.IRBuilder, v: ir.Value, k: int, up: bool) -> ir.Value:
    """up: lane i gets lane i-k (0 below); else lane i gets lane i+k (0 above)."""
    n = v.type.count
    zero = ir.Constant(v.type, None)
    # shuffle_vector(v, zero): indices < n pick v, >= n pick zero
    if up:
        idx = [n if i - k < 0 else i - k for i in range(n)]
    else:
        idx = [i + k if i + k < n else n for i in range(n)]
    return b.shuffle_vector(v, zero, ir.Constant(ir.VectorType(I32, n), idx))


def emit_cumsum(ctx: LowerCtx, axis: int, exclusive: bool, reverse: bool) -> None:
    xt = ctx.in_types[0]
    shape = [int(d) for d in xt.shape]
    xdt = np.dtype(xt.dtype)
    cdt = compute_dtype(xdt)
    lanes = lanes_for(xdt, cdt)
    outer = int(np.prod(shape[:axis])) if axis else 1
    n = shape[axis] if shape else 1
    inner = int(np.prod(shape[axis + 1:])) if axis + 1 < len(shape) else 1
    if n == 1 or not shape:
        inner, n, outer = inner * n, 1, outer
    fn, b = ctx.begin()
    x_ptr = ctx.in_ptr(b, 0)
    y_ptr = ctx.out_ptr(b, 0)
    total = outer * n * inner
    ctx.single_core = total < SINGLE_CORE_ELEMS
    ctx.flops = total
    E = Expr(b, lanes)
    zero = E.const(0, cdt)

    if inner == 1 and n > 1:
        # scan along contiguous rows: in-register prefix sums plus a running carry
        rpt = max(1, min(-(-outer // MIN_TILES), ROW_TILE_ELEMS // n))
        ctx.num_tiles = max(1, -(-outer // rpt))
        carry_a = entry_alloca(b, E.ty(cdt))

        def row(r: ir.Value) -> None:
            base = b.mul(r, i64(n))
            b.store(zero.v, carry_a)
            nfull = n // lanes
            rem = n % lanes

            def vec(pos: ir.Value, mask: ir.Value | None) -> None:
                off = b.add(base, pos)
                x = load_tv(b, x_ptr, off, xdt, lanes, cdt, mask)
                s = x.v
                k = 1
                while k < lanes:
                    s = E.add(TV(s, cdt), TV(_shift_lanes(b, s, k, not reverse), cdt)).v
                    k *= 2
                carry = TV(b.load(carry_a, typ=carry_a.allocated_type), cdt)
                local = TV(s, cdt)
                if exclusive:
                    y = E.add(TV(_shift_lanes(b, s, 1, not reverse), cdt), carry)
                else:
                    y = E.add(local, carry)
                store_tv(b, y_ptr, off, y, xdt, mask)
                edge = ir.Constant(I32, 0 if reverse else lanes - 1)
                tot = b.extract_element(E.add(local, carry).v, edge)
                b.store(emit.splat(b, tot, lanes), carry_a)

            if reverse:
                # full vectors from the end, then the head [0, rem) masked
                if nfull:
                    with for_range(b, 0, nfull, name="v") as c:
                        pos = b.sub(i64(n - lanes), b.mul(c, i64(lanes)))
                        vec(pos, None)
                if rem:
                    vec(i64(0), const_mask(lanes, rem))
            else:
                if nfull:
                    with for_range(b, 0, nfull * lanes, step=lanes, name="v") as j:
                        vec(j, None)
                if rem:
                    vec(i64(nfull * lanes), const_mask(lanes, rem))

        with for_range(b, ctx.tile_begin, ctx.tile_end, name="tile") as t:
            if rpt == 1:
                row(t)
            else:
                r0 = b.mul(t, i64(rpt))
                r1 = imin(b, b.add(r0, i64(rpt)), i64(outer))
                with for_range(b, r0, r1, name="row") as r:
                    row(r)
        b.ret_void()
        return

    # scan over an outer/middle axis: a streaming map row after row of the inner block,
    # y[r] = y[r - 1] + x[r] (exclusive: y[r - 1] + x[r - 1]), y of the first row = x (0)
    blk_elems = 2048
    nblk = max(1, -(-inner // blk_elems))
    if outer * nblk < MIN_TILES and inner > lanes * UNROLL:
        nblk = min(-(-inner // (lanes * UNROLL)), -(-MIN_TILES // outer))
    per_blk = -(-inner // nblk)
    blk = -(-per_blk // lanes) * lanes
    nblk = -(-inner // blk)
    last = inner - (nblk - 1) * blk
    ctx.num_tiles = max(1, outer * nblk)
    step_r = -inner if reverse else inner

    def block(base: ir.Value, j0: ir.Value, L: int) -> None:
        first = b.add(base, b.add(j0, i64((n - 1) * inner if reverse else 0)))

        def row0(j: ir.Value, slot: int, mask: ir.Value | None) -> None:
            off = b.add(first, j)
            if exclusive:
                store_tv(b, y_ptr, off, zero, xdt, mask)
            else:
                store_tv(b, y_ptr, off, load_tv(b, x_ptr, off, xdt, lanes, cdt, mask), xdt, mask)

        vloop(b, L, lanes, UNROLL, row0)
        with for_range(b, 1, n, name="s") as s:
            cur = b.add(first, b.mul(s, i64(step_r)))
            prev = b.sub(cur, i64(step_r))

            def rowk(j: ir.Value, slot: int, mask: ir.Value | None) -> None:
                o_prev = b.add(prev, j)
                acc = load_tv(b, y_ptr, o_prev, xdt, lanes, cdt, mask)
                x = load_tv(b, x_ptr, o_prev if exclusive else b.add(cur, j), xdt, lanes, cdt,
                            mask)
                store_tv(b, y_ptr, b.add(cur, j), E.add(acc, x), xdt, mask)

            vloop(b, L, lanes, UNROLL, rowk)

    with for_range(b, ctx.tile_begin, ctx.tile_end, name="tile") as t:
        o = b.udiv(t, i64(nblk)) if nblk > 1 else t
        base = b.mul(o, i64(n * inner))
        if nblk == 1:
            block(base, i64(0), inner)
        else:
            k = b.urem(t, i64(nblk))
            j0 = b.mul(k, i64(blk))
            if last == blk:
                block(base, j0, blk)
            else:
                with b.if_else(b.icmp_unsigned("==", k, i64(nblk - 1))) as (then, other):
                    with then:
                        block(base, j0, last)
                    with other:
                        block(base, j0, blk)
    b.ret_void()
