"""Data-movement emitters: strided copies, fills and row helpers.

The core is the *piece*: a box of the output, walked in the output's order,
whose elements come from one input at `src_base + sum(idx_d * src_stride_d)`
(stride 0 broadcasts, a negative stride walks backwards) or from one fill value.
Transpose, Concat, Split, Slice, Expand, Tile, DepthToSpace and SpaceToDepth
are all lists of pieces; one kernel runs them all.

Data is moved as raw bits: an element is an integer of its byte size, so any
dtype (float16, bool, ...) takes the same path and NaN payloads survive.

Each piece is cut into *units* (a block of rows of its innermost dims); units
are the kernel's tiles, numbered piece after piece, so the cores split the
work and every tile writes its own part of the outputs. Two loop shapes:

- rows: the innermost output dim is copied as a row: vector loads and stores
  when its source stride is 1 (-1: loads reversed in registers, 0: a splat),
  scalar otherwise;
- blocks: when the innermost output dim is strided in the source but another
  dim is contiguous there (a transpose), k x k blocks are loaded as k vectors,
  transposed in registers with shuffles, and stored as k vectors.

Also here: `emit_rows` (walk an output as rows, tiled, for ops whose rows need
their own code: gathers, Trilu, OneHot, Resize), `emit_table_rows` (per-dim
source tables, each output row written in one pass: Pad in every mode), and
the runtime-index helpers (`load_index`, `safe_index`): an index outside
[-dim, dim) is flagged so kernels never read or write outside a tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import llvmlite.ir as ir
import numpy as np

from ..artifact import Tiling
from ..native import emit
from ..native.emit import I64, for_range, i64
from .elementwise import collapse
from .kernel import LowerCtx
from .vec import wide_registers

UNIT_ELEMS = 16384        # elements per tile for big copies
MIN_UNIT_ELEMS = 2048
SMALL_ELEMS = 4096        # below this, a kernel runs on one core
VECTOR_BYTES = 64

FillFn = Callable[[ir.IRBuilder], ir.Value]


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------

def itype(dtype: np.dtype | int) -> ir.IntType:
    """The integer type that holds the bits of one element."""
    size = dtype if isinstance(dtype, int) else np.dtype(dtype).itemsize
    return ir.IntType(size * 8)


def lanes_for(itemsize: int) -> int:
    return max(1, VECTOR_BYTES // itemsize)


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    st, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        st[d] = acc
        acc *= int(shape[d])
    return st


def prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bits_of(value: Any, dtype: np.dtype) -> int:
    """The bit pattern of `value` stored as `dtype`, as an unsigned int."""
    dt = np.dtype(dtype)
    arr = np.asarray(value).astype(dt).reshape(-1)[:1]
    return int(arr.view(np.dtype(f"u{dt.itemsize}"))[0])


def const_fill(value: Any, dtype: np.dtype) -> FillFn:
    bits = bits_of(value, dtype)
    ty = itype(dtype)
    return lambda b: ir.Constant(ty, bits)


def unit_target(total: int) -> int:
    """Elements per unit: enough units for the cores to share, not too many to decode."""
    return max(MIN_UNIT_ELEMS, min(UNIT_ELEMS, cdiv(total, 16)))


def imin(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    return b.select(b.icmp_signed("<", x, y), x, y)


def imax(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    return b.select(b.icmp_signed(">", x, y), x, y)


def as_val(v: ir.Value | int) -> ir.Value:
    return i64(v) if isinstance(v, int) else v


def add(b: ir.IRBuilder, x: ir.Value | int, y: ir.Value | int) -> ir.Value | int:
    """x + y, folded when both are Python ints (or one is 0)."""
    if isinstance(x, int) and isinstance(y, int):
        return x + y
    if isinstance(y, int) and y == 0:
        return x
    if isinstance(x, int) and x == 0:
        return y
    return b.add(as_val(x), as_val(y))


def mul(b: ir.IRBuilder, x: ir.Value | int, c: int) -> ir.Value | int:
    """x * c for a Python int c, folded where possible."""
    if isinstance(x, int):
        return x * c
    if c == 0:
        return 0
    if c == 1:
        return x
    return b.mul(x, i64(c))


def decode(b: ir.IRBuilder, u: ir.Value, radices: Sequence[int]) -> list[ir.Value]:
    """Digits of u in a mixed radix (most significant first); the first digit is not reduced."""
    digits: list[ir.Value] = [None] * len(radices)  # type: ignore[list-item]
    rem = u
    for d in range(len(radices) - 1, -1, -1):
        if d == 0:
            digits[d] = rem
        elif radices[d] == 1:
            digits[d] = i64(0)
        else:
            digits[d] = b.urem(rem, i64(radices[d]))
            rem = b.udiv(rem, i64(radices[d]))
    return digits


@contextmanager
def unit_range(ctx: LowerCtx, b: ir.IRBuilder, start: int, units: int,
               name: str = "u") -> Iterator[ir.Value]:
    """Loop over the kernel's tiles [start, start+units) that fall in this call's range;
    yields the unit index relative to start."""
    lo = imax(b, b.sub(ctx.tile_begin, i64(start)), i64(0))
    hi = imin(b, b.sub(ctx.tile_end, i64(start)), i64(units))
    with for_range(b, lo, hi, name=name) as u:
        yield u


# ---------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------

def _vload(b: ir.IRBuilder, ptr: ir.Value, off: ir.Value, vt: ir.VectorType) -> ir.Value:
    v = b.load(emit.gep(b, ptr, off, vt.element), typ=vt)
    v.align = max(1, vt.element.width // 8)
    return v


def _vstore(b: ir.IRBuilder, v: ir.Value, ptr: ir.Value, off: ir.Value) -> None:
    st = b.store(v, emit.gep(b, ptr, off, v.type.element))
    st.align = max(1, v.type.element.width // 8)


def _sload(b: ir.IRBuilder, ptr: ir.Value, off: ir.Value, ty: ir.Type) -> ir.Value:
    return b.load(emit.gep(b, ptr, off, ty), typ=ty)


def _sstore(b: ir.IRBuilder, v: ir.Value, ptr: ir.Value, off: ir.Value) -> None:
    b.store(v, emit.gep(b, ptr, off, v.type))


def _split_vec(b: ir.IRBuilder, n: ir.Value | int, w: int) -> ir.Value | int:
    """n rounded down to a multiple of w."""
    if isinstance(n, int):
        return n - n % w
    return b.and_(n, i64(~(w - 1))) if w & (w - 1) == 0 else b.mul(b.udiv(n, i64(w)), i64(w))


def copy_row(b: ir.IRBuilder, ety: ir.IntType, src: ir.Value, soff: ir.Value | int, sstride: int,
             dst: ir.Value, doff: ir.Value | int, dstride: int, n: ir.Value | int,
             name: str = "r") -> None:
    """dst[doff + j*dstride] = src[soff + j*sstride] for j < n."""
    if isinstance(n, int) and n <= 0:
        return
    soff, doff = as_val(soff), as_val(doff)
    w = lanes_for(ety.width // 8)
    if dstride == 1 and sstride in (1, -1, 0) and not (isinstance(n, int) and n < w):
        vt = ir.VectorType(ety, w)
        nv = _split_vec(b, n, w)
        splat = None
        if sstride == 0:
            splat = emit.splat(b, _sload(b, src, soff, ety), w)
        with for_range(b, 0, nv, step=w, name=f"{name}v") as j:
            if sstride == 1:
                v = _vload(b, src, b.add(soff, j), vt)
            elif sstride == -1:
                v = _vload(b, src, b.sub(soff, b.add(j, i64(w - 1))), vt)
                rev = ir.Constant(ir.VectorType(emit.I32, w), list(range(w - 1, -1, -1)))
                v = b.shuffle_vector(v, ir.Constant(vt, ir.Undefined), rev)
            else:
                v = splat
            _vstore(b, v, dst, b.add(doff, j))
        start: ir.Value | int = nv
    else:
        start = 0
    if isinstance(n, int) and isinstance(start, int) and start >= n:
        return
    if dstride == 1 and sstride == 1 and isinstance(n, int) and isinstance(start, int):
        # a static tail (a row shorter than a vector: a Slice of 10 of 14 columns) in
        # plain vectors of halving widths, 8 + 2 for 10, not 10 scalar copies
        k = w // 2
        while start < n:
            while k > n - start:
                k //= 2
            if k == 1:
                _sstore(b, _sload(b, src, b.add(soff, i64(start)), ety), dst,
                        b.add(doff, i64(start)))
            else:
                vt = ir.VectorType(ety, k)
                _vstore(b, _vload(b, src, b.add(soff, i64(start)), vt), dst,
                        b.add(doff, i64(start)))
            start += k
        return
    with for_range(b, as_val(start), as_val(n), name=f"{name}s") as j:
        v = _sload(b, src, as_val(add(b, soff, mul(b, j, sstride))), ety)
        _sstore(b, v, dst, as_val(add(b, doff, mul(b, j, dstride))))


def fill_row(b: ir.IRBuilder, value: ir.Value, dst: ir.Value, doff: ir.Value | int,
             dstride: int, n: ir.Value | int, name: str = "f") -> None:
    """dst[doff + j*dstride] = value for j < n."""
    if isinstance(n, int) and n <= 0:
        return
    doff = as_val(doff)
    ety = value.type
    w = lanes_for(ety.width // 8)
    start: ir.Value | int = 0
    if dstride == 1 and not (isinstance(n, int) and n < w):
        nv = _split_vec(b, n, w)
        v = emit.splat(b, value, w)
        with for_range(b, 0, nv, step=w, name=f"{name}v") as j:
            _vstore(b, v, dst, b.add(doff, j))
        start = nv
    if isinstance(n, int) and isinstance(start, int) and start >= n:
        return
    with for_range(b, as_val(start), as_val(n), name=f"{name}s") as j:
        _sstore(b, value, dst, as_val(add(b, doff, mul(b, j, dstride))))


# ---------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------

@dataclass
class Piece:
    """A box of output `dst` (shape in the output's loop order) and where it comes from."""

    shape: list[int]
    dst: int
    dst_strides: list[int]
    dst_base: int = 0
    src: int | None = None            # input index; None: every element is `fill`
    src_strides: list[int] | None = None
    src_base: int = 0
    fill: FillFn | None = None

    @property
    def numel(self) -> int:
        return prod(self.shape)


def _shuffle_transpose(b: ir.IRBuilder, rows: list[ir.Value], k: int) -> list[ir.Value]:
    """Transpose k vectors of k lanes (k a power of two) with log2(k) interleave stages."""
    h = k // 2
    lo = ir.Constant(ir.VectorType(emit.I32, k), [x for i in range(h) for x in (i, k + i)])
    hi = ir.Constant(ir.VectorType(emit.I32, k), [x for i in range(h) for x in (h + i, k + h + i)])
    s = 1
    while s < k:
        new: list[ir.Value] = [None] * k  # type: ignore[list-item]
        for i in range(h):
            a, c = rows[i], rows[i + h]
            new[2 * i] = b.shuffle_vector(a, c, lo)
            new[2 * i + 1] = b.shuffle_vector(a, c, hi)
        rows = new
        s *= 2
    return rows


class _Plan:
    """How one piece is cut into units and walked."""

    def __init__(self, piece: Piece, target: int, itemsize: int, keep_ones: bool = False) -> None:
        self.piece = piece
        self.itemsize = itemsize
        r = len(piece.shape)
        ss = list(piece.src_strides) if piece.src is not None else [0] * r
        shape, (ss, ds) = collapse(tuple(piece.shape), [ss, list(piece.dst_strides)],
                                     keep_ones=keep_ones)
        if len(shape) == 1:
            shape, ss, ds = [1] + shape, [0] + ss, [0] + ds
        self.shape, self.ss, self.ds = shape, ss, ds
        # blocks of k x k elements transposed in registers: rows of 16 with AVX-512
        # (vpermt2ps: a shuffle an instruction); with AVX2 rows of at most 32 bytes (one
        # ymm; 16-lane interleaves span two and took 2-3x as long). Zen 4 under
        # CANNC_ISA=avx2, float32, 1 core: [1,96,56,56] to NHWC 113.5 -> 48.1 us (AVX-512:
        # 41.9), back 94.7 -> 51.2, [1,128,12,64] perm (0,2,3,1) 40.1 -> 14.3
        self.k = min(16, lanes_for(itemsize) if wide_registers() else max(1, 32 // itemsize))
        self.mode = "rows"
        p = self._block_dim()
        if p is not None:
            self.mode = "blocks"
            self.p = p
            self.outer = [d for d in range(len(shape) - 1) if d != p]
            self.radices = [shape[d] for d in self.outer] + [cdiv(shape[p], self.k)]
            self.units = prod(self.radices)
            return
        n, m = shape[-1], shape[-2]
        w = lanes_for(itemsize)
        self.nch = n if n <= target else max(w, target // w * w)
        self.cn = cdiv(n, self.nch)
        self.rpm = max(1, min(m, target // min(n, self.nch)))
        self.cm = cdiv(m, self.rpm)
        self.radices = list(shape[:-2]) + [self.cm, self.cn]
        self.units = prod(self.radices)

    def _block_dim(self) -> int | None:
        if self.piece.src is None:
            return None
        ss, ds, shape, k = self.ss, self.ds, self.shape, self.k
        if ds[-1] != 1 or ss[-1] in (0, 1, -1) or shape[-1] < k or k < 2:
            return None
        for d in range(len(shape) - 2, -1, -1):
            if ss[d] == 1 and shape[d] >= k:
                return d
        return None

    # -- emission ------------------------------------------------------------------
    def emit_unit(self, b: ir.IRBuilder, u: ir.Value, src: ir.Value | None, dst: ir.Value,
                  fill: ir.Value | None) -> None:
        if self.mode == "blocks":
            self._emit_block_unit(b, u, src, dst)
        else:
            self._emit_row_unit(b, u, src, dst, fill)

    def _emit_row_unit(self, b: ir.IRBuilder, u: ir.Value, src: ir.Value | None, dst: ir.Value,
                       fill: ir.Value | None) -> None:
        pc, shape, ss, ds = self.piece, self.shape, self.ss, self.ds
        digits = decode(b, u, self.radices)
        jm, jn = digits[-2], digits[-1]
        sb: ir.Value | int = pc.src_base
        db: ir.Value | int = pc.dst_base
        for d, x in enumerate(digits[:-2]):
            sb = add(b, sb, mul(b, x, ss[d]))
            db = add(b, db, mul(b, x, ds[d]))
        m, n = shape[-2], shape[-1]
        if self.cm > 1:
            sb = add(b, sb, mul(b, jm, self.rpm * ss[-2]))
            db = add(b, db, mul(b, jm, self.rpm * ds[-2]))
        if self.cn > 1:
            sb = add(b, sb, mul(b, jn, self.nch * ss[-1]))
            db = add(b, db, mul(b, jn, self.nch * ds[-1]))
        if self.cm == 1:
            mc: ir.Value | int = m
        elif m % self.rpm == 0:
            mc = self.rpm
        else:
            mc = imin(b, i64(self.rpm), b.sub(i64(m), b.mul(jm, i64(self.rpm))))
        if self.cn == 1:
            nc: ir.Value | int = n
        elif n % self.nch == 0:
            nc = self.nch
        else:
            nc = imin(b, i64(self.nch), b.sub(i64(n), b.mul(jn, i64(self.nch))))
        ety = itype(self.itemsize)

        def row(r: ir.Value | int) -> None:
            so = add(b, sb, mul(b, r, ss[-2]))
            do = add(b, db, mul(b, r, ds[-2]))
            if src is None:
                assert fill is not None
                fill_row(b, fill, dst, do, ds[-1], nc)
            else:
                copy_row(b, ety, src, so, ss[-1], dst, do, ds[-1], nc)

        if isinstance(mc, int) and mc == 1:
            row(0)
        else:
            with for_range(b, 0, as_val(mc), name="row") as r:
                row(r)

    def _emit_block_unit(self, b: ir.IRBuilder, u: ir.Value, src: ir.Value, dst: ir.Value) -> None:
        pc, shape, ss, ds, k, p = self.piece, self.shape, self.ss, self.ds, self.k, self.p
        digits = decode(b, u, self.radices)
        sb: ir.Value | int = pc.src_base
        db: ir.Value | int = pc.dst_base
        for d, x in zip(self.outer, digits[:-1]):
            sb = add(b, sb, mul(b, x, ss[d]))
            db = add(b, db, mul(b, x, ds[d]))
        jb = digits[-1]
        sb = as_val(add(b, sb, mul(b, jb, k * ss[p])))
        db = as_val(add(b, db, mul(b, jb, k * ds[p])))
        P, N = shape[p], shape[-1]
        ssn, dsp = ss[-1], ds[p]
        ety = itype(self.itemsize)
        vt = ir.VectorType(ety, k)
        nfull = N - N % k

        def scalar_block(pcount: ir.Value | int, n0: int) -> None:
            with for_range(b, 0, as_val(pcount), name="bp") as pp:
                so = b.add(sb, pp)
                do = b.add(db, b.mul(pp, i64(dsp)))
                copy_row(b, ety, src, b.add(so, i64(n0 * ssn)), ssn, dst,
                         b.add(do, i64(n0)), 1, N - n0, name="bn")

        def full() -> None:
            with for_range(b, 0, nfull, step=k, name="bn") as n0:
                s0 = b.add(sb, b.mul(n0, i64(ssn)))
                rows = [_vload(b, src, b.add(s0, i64(j * ssn)), vt) for j in range(k)]
                cols = _shuffle_transpose(b, rows, k)
                d0 = b.add(db, n0)
                for pp in range(k):
                    _vstore(b, cols[pp], dst, b.add(d0, i64(pp * dsp)))
            if nfull < N:
                scalar_block(k, nfull)

        if P % k == 0:
            full()
            return
        pcount = b.sub(i64(P), b.mul(jb, i64(k)))
        is_full = b.icmp_signed(">=", pcount, i64(k))
        with b.if_else(is_full) as (then, other):
            with then:
                full()
            with other:
                scalar_block(pcount, 0)


def emit_pieces(ctx: LowerCtx, pieces: Sequence[Piece], itemsize: int,
                begin: tuple[ir.Function, ir.IRBuilder] | None = None) -> None:
    """The whole kernel: every piece, cut into units that are the kernel's tiles.
    With ``ctx.tiling`` (made by ``pieces_tiling`` from the same pieces) the extents,
    strides and bases are runtime dims."""
    if ctx.tiling is not None:
        _emit_pieces_runtime(ctx, pieces, itemsize, begin)
        return
    live = [p for p in pieces if p.numel > 0]
    total = sum(p.numel for p in live)
    target = unit_target(total)
    plans = [_Plan(p, target, itemsize) for p in live]
    fn, b = begin if begin is not None else ctx.begin()
    in_ptrs: dict[int, ir.Value] = {}
    out_ptrs: dict[int, ir.Value] = {}
    fills: dict[int, ir.Value] = {}
    for i, pl in enumerate(plans):
        pc = pl.piece
        if pc.src is not None and pc.src not in in_ptrs:
            in_ptrs[pc.src] = ctx.in_ptr(b, pc.src)
        if pc.dst not in out_ptrs:
            out_ptrs[pc.dst] = ctx.out_ptr(b, pc.dst)
        if pc.src is None:
            assert pc.fill is not None
            fills[i] = pc.fill(b)
    start = 0
    for i, pl in enumerate(plans):
        pc = pl.piece
        with unit_range(ctx, b, start, pl.units, name=f"u{i}") as u:
            pl.emit_unit(b, u, in_ptrs.get(pc.src) if pc.src is not None else None,
                         out_ptrs[pc.dst], fills.get(i))
        start += pl.units
    b.ret_void()
    ctx.num_tiles = max(1, start)
    ctx.single_core = total < SMALL_ELEMS
    ctx.notes["pieces"] = [f"{pl.mode}:{pl.shape}" for pl in plans]


# ---------------------------------------------------------------------------
# shape-polymorphic pieces (ABI.md "Runtime dimensions"): the key is each
# piece's merged rank, its input and output, and the kind of its innermost
# strides (1, -1, 0 or other); extents, strides, bases and the unit split are
# runtime dims. Pieces that need the in-register block transpose stay static.
# ---------------------------------------------------------------------------

_PIECE_FIXED = 6      # dims per piece besides its shape and strides
# From this many runtime pieces of one form (merged rank and innermost stride kinds) on,
# one loop walks a table of them, read at run time, instead of a loop nest per piece: a
# Concat of n inputs was n copies of the nest, and DenseNet-121's 58 concats of 2-25
# inputs (a module per arity, up to 100 KB of IR and 0.9 s of LLVM) took ~10 s of its
# cold compile.
LOOP_PIECES = 3
_LOOP_FIXED = 3       # before each piece's dims in the table: its first unit, input, output


def _stride_kind(x: int) -> int | str:
    return x if x in (0, 1, -1) else "x"


def _piece_dims(pl: _Plan) -> list[int]:
    p = pl.piece
    return [pl.units, p.src_base, p.dst_base, pl.rpm, pl.cm, pl.nch, *pl.shape, *pl.ss, *pl.ds]


def pieces_tiling(pieces: Sequence[Piece], itemsize: int) -> Any:
    """The host tiling of a list of copy pieces, or None (fills, block transposes,
    empty outputs: the static kernel)."""
    live = [p for p in pieces if p.numel > 0]
    if not live or any(p.src is None for p in live):
        return None
    total = sum(p.numel for p in live)
    target = unit_target(total)
    plans = [_Plan(p, target, itemsize, keep_ones=True) for p in live]
    if any(pl.mode != "rows" for pl in plans):
        return None
    forms = [(len(pl.shape), _stride_kind(pl.ss[-1]), _stride_kind(pl.ds[-1])) for pl in plans]
    units = sum(pl.units for pl in plans)
    if len(plans) >= LOOP_PIECES and len(set(forms)) == 1:
        dims, first = [len(plans)], 0
        for pl in plans:
            dims += [first, pl.piece.src, pl.piece.dst, *_piece_dims(pl)]
            first += pl.units
        key: tuple = ("piece_loop", forms[0])
        note = f"{len(plans)} runtime, one loop"
    else:
        dims = [d for pl in plans for d in _piece_dims(pl)]
        key = ("pieces", tuple((r, pl.piece.src, pl.piece.dst, sk, dk)
                               for pl, (r, sk, dk) in zip(plans, forms)))
        note = f"{len(plans)} runtime"
    return Tiling(key=key, dims=tuple(int(d) for d in dims), num_tiles=max(1, units),
                  single_core=total < SMALL_ELEMS, notes={"pieces": note})


def _emit_pieces_runtime(ctx: LowerCtx, pieces: Sequence[Piece], itemsize: int,
                         begin: tuple[ir.Function, ir.IRBuilder] | None) -> None:
    fn, b = begin if begin is not None else ctx.begin()
    ety = itype(itemsize)
    if ctx.tiling.key[0] == "piece_loop":
        r, sk, dk = ctx.tiling.key[1]
        per = _LOOP_FIXED + _PIECE_FIXED + 3 * r
        n_in = len(ctx.node.inputs)
        with for_range(b, 0, ctx.rt_dim(b, 0), name="piece") as p:
            at = b.add(i64(1), b.mul(p, i64(per)))
            dim = [ctx.rt_dim_at(b, b.add(at, i64(j))) for j in range(per)]
            first, src, dst = dim[:_LOOP_FIXED]
            _emit_runtime_piece(ctx, b, dim[_LOOP_FIXED:], r, sk, dk, ety, first,
                                ctx.tensor_ptr_at(b, src),
                                ctx.tensor_ptr_at(b, b.add(dst, i64(n_in))), "p")
        b.ret_void()
        return
    live = [p for p in pieces if p.numel > 0]
    in_ptrs: dict[int, ir.Value] = {}
    out_ptrs: dict[int, ir.Value] = {}
    for pc in live:
        if pc.src not in in_ptrs:
            in_ptrs[pc.src] = ctx.in_ptr(b, pc.src)
        if pc.dst not in out_ptrs:
            out_ptrs[pc.dst] = ctx.out_ptr(b, pc.dst)
    at = 0
    first: ir.Value = i64(0)
    for i, (r, src, dst, sk, dk) in enumerate(ctx.tiling.key[1]):
        dim = [ctx.rt_dim(b, at + j) for j in range(_PIECE_FIXED + 3 * r)]
        at += _PIECE_FIXED + 3 * r
        _emit_runtime_piece(ctx, b, dim, r, sk, dk, ety, first, in_ptrs[src], out_ptrs[dst],
                            str(i))
        first = b.add(first, dim[0])
    b.ret_void()


def _emit_runtime_piece(ctx: LowerCtx, b: ir.IRBuilder, dim: list[ir.Value], r: int,
                        sk: int | str, dk: int | str, ety: ir.IntType, first: ir.Value,
                        src: ir.Value, dst: ir.Value, name: str) -> None:
    """The units of one runtime piece that fall in this call's tiles: ``dim`` its dims
    (units, bases, row and column blocking, shape, strides: pieces_tiling), ``first``
    the kernel's tile number of its first unit."""
    units, sbase, dbase, rpm, cm, nch = dim[:_PIECE_FIXED]
    shape = dim[_PIECE_FIXED:_PIECE_FIXED + r]
    ss = dim[_PIECE_FIXED + r:_PIECE_FIXED + 2 * r]
    ds = dim[_PIECE_FIXED + 2 * r:]
    m, n = shape[-2], shape[-1]
    cn = b.udiv(b.add(n, b.sub(nch, i64(1))), nch)
    lo = imax(b, b.sub(ctx.tile_begin, first), i64(0))
    hi = imin(b, b.sub(ctx.tile_end, first), units)
    with for_range(b, lo, hi, name=f"u{name}") as u:
        # digits of u over (shape[:-2]..., cm, cn), most significant first
        radices = shape[:-2] + [cm, cn]
        digits: list[ir.Value] = [None] * len(radices)  # type: ignore[list-item]
        rem = u
        for d in range(len(radices) - 1, 0, -1):
            digits[d] = b.urem(rem, radices[d])
            rem = b.udiv(rem, radices[d])
        digits[0] = rem
        jm, jn = digits[-2], digits[-1]
        sb, db = sbase, dbase
        for d in range(r - 2):
            sb = b.add(sb, b.mul(digits[d], ss[d]))
            db = b.add(db, b.mul(digits[d], ds[d]))
        m0, n0 = b.mul(jm, rpm), b.mul(jn, nch)
        sb = b.add(b.add(sb, b.mul(m0, ss[-2])), b.mul(n0, ss[-1]))
        db = b.add(b.add(db, b.mul(m0, ds[-2])), b.mul(n0, ds[-1]))
        mc = imin(b, rpm, b.sub(m, m0))
        nc = imin(b, nch, b.sub(n, n0))
        with for_range(b, 0, mc, name=f"row{name}") as row:
            so = b.add(sb, b.mul(row, ss[-2]))
            do = b.add(db, b.mul(row, ds[-2]))
            if dk == 1 and sk != "x":
                copy_row(b, ety, src, so, sk, dst, do, 1, nc, name=f"c{name}")
            else:
                with for_range(b, 0, nc, name=f"e{name}") as j:
                    v = _sload(b, src, b.add(so, b.mul(j, ss[-1])), ety)
                    _sstore(b, v, dst, b.add(do, b.mul(j, ds[-1])))


# ---------------------------------------------------------------------------
# piece builders
# ---------------------------------------------------------------------------

def transpose_piece(src_shape: Sequence[int], perm: Sequence[int], src: int = 0, dst: int = 0,
                    src_base: int = 0, src_strides: Sequence[int] | None = None) -> Piece:
    """out = transpose(in, perm) as one piece."""
    st = list(src_strides) if src_strides is not None else contiguous_strides(src_shape)
    shape = [int(src_shape[p]) for p in perm]
    return Piece(shape=shape, dst=dst, dst_strides=contiguous_strides(shape),
                 src=src, src_strides=[st[p] for p in perm], src_base=src_base)


def broadcast_strides(shape: Sequence[int], out_shape: Sequence[int]) -> list[int]:
    """Element strides of a contiguous tensor of `shape` broadcast to `out_shape`."""
    r = len(out_shape)
    shape = [1] * (r - len(shape)) + [int(d) for d in shape]
    st = contiguous_strides(shape)
    return [0 if shape[d] == 1 and out_shape[d] != 1 else st[d] for d in range(r)]


def affine_runs(table: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """Split an index table into maximal runs where it is affine:
    (out_start, length, src_start, step); src_start -1 with step 0 marks a fill run."""
    runs: list[tuple[int, int, int, int]] = []
    n = len(table)
    i = 0
    while i < n:
        v = int(table[i])
        if v < 0:
            j = i + 1
            while j < n and table[j] < 0:
                j += 1
            runs.append((i, j - i, -1, 0))
            i = j
            continue
        if i + 1 < n and table[i + 1] >= 0:
            step = int(table[i + 1]) - v
            j = i + 2
            while j < n and table[j] >= 0 and int(table[j]) - int(table[j - 1]) == step:
                j += 1
        else:
            step, j = 1, i + 1
        runs.append((i, j - i, v, step))
        i = j
    return runs


# body(b, row_digits, row, col0, ncols): emits one row's columns [col0, col0 + ncols)
RowBody = Callable[[ir.IRBuilder, list[ir.Value], ir.Value, ir.Value, ir.Value], None]


def emit_rows(ctx: LowerCtx, b: ir.IRBuilder, outer: Sequence[int], inner: int, body: RowBody,
              start: int = 0, target: int | None = None, itemsize: int = 4) -> int:
    """Walk an output seen as rows (`outer` dims, flattened) of `inner` elements, in the
    tiles of this call: units are groups of rows (or column chunks of long rows).
    body(b, row_digits, row, col0, ncols) emits one row's columns [col0, col0+ncols).
    Returns the number of units (tiles) used, numbered from `start`."""
    outer = [int(d) for d in outer] or [1]
    rows = prod(outer)
    if rows == 0 or inner == 0:
        return 0
    if target is None:
        target = unit_target(rows * inner)
    w = lanes_for(itemsize)
    nch = inner if inner <= target else max(w, target // w * w)
    cn = cdiv(inner, nch)
    rpu = max(1, min(rows, target // min(inner, nch)))
    gu = cdiv(rows, rpu)
    units = gu * cn
    with unit_range(ctx, b, start, units, name="ru") as u:
        if cn > 1:
            jn = b.urem(u, i64(cn))
            g = b.udiv(u, i64(cn))
            col0: ir.Value | int = b.mul(jn, i64(nch))
            ncols: ir.Value | int = nch if inner % nch == 0 else \
                imin(b, i64(nch), b.sub(i64(inner), col0))
        else:
            g, col0, ncols = u, 0, inner
        r0 = b.mul(g, i64(rpu))
        r1 = imin(b, b.add(r0, i64(rpu)), i64(rows)) if rows % rpu else b.add(r0, i64(rpu))
        with for_range(b, r0, r1, name="row") as r:
            body(b, decode(b, r, outer), r, col0, ncols)
    return units


def const_table(module: ir.Module, name: str, values: Sequence[Any] | np.ndarray,
                ty: ir.Type) -> ir.GlobalVariable:
    """A constant global array (internal) holding `values` as `ty`."""
    vals = np.asarray(values).reshape(-1)
    arr_ty = ir.ArrayType(ty, len(vals))
    g = ir.GlobalVariable(module, arr_ty, name=module.get_unique_name(name))
    g.global_constant = True
    g.linkage = "internal"
    conv = int if isinstance(ty, ir.IntType) else float
    g.initializer = ir.Constant(arr_ty, [conv(v) for v in vals])
    g.align = 64
    return g


def table_load(b: ir.IRBuilder, g: ir.GlobalVariable, i: ir.Value, ty: ir.Type,
               align: int | None = None) -> ir.Value:
    """Element i of table g as ty (a vector type: the elements from i on, `align` the
    alignment the load may assume)."""
    ld = b.load(b.gep(g, [i64(0), i], source_etype=g.value_type), typ=ty)
    if align is not None:
        ld.align = align
    return ld


def emit_table_rows(ctx: LowerCtx, in_shape: Sequence[int], tables: Sequence[np.ndarray],
                    itemsize: int, fill: FillFn | None = None, src: int = 0, dst: int = 0) -> None:
    """The whole kernel for out[o] = in[t_0[o_0], ..., t_{r-1}[o_{r-1}]] (any t_d[o_d] < 0:
    the fill value), written row by row in output order: the outer dims' tables give the
    source row (constant globals unless the identity), the innermost table is cut at compile
    time into affine runs, each a vector copy, a reversed copy, a broadcast or a fill.
    Used by Pad, where writing each output row in one pass matters (the borders are narrow)."""
    out_shape = [len(t) for t in tables]
    total = prod(out_shape)
    fn, b = ctx.begin()
    if total == 0:
        b.ret_void()
        ctx.num_tiles, ctx.single_core = 1, True
        return
    ist = contiguous_strides(in_shape)
    ety = itype(itemsize)
    x, y = ctx.in_ptr(b, src), ctx.out_ptr(b, dst)
    fv = fill(b) if fill is not None else None
    r = len(tables)
    outer = [np.asarray(t, dtype=np.int64) for t in tables[:-1]]
    inner = np.asarray(tables[-1], dtype=np.int64)
    n = len(inner)
    globs: list[ir.GlobalVariable | None] = []
    for d, t in enumerate(outer):
        if np.array_equal(t, np.arange(len(t))):
            globs.append(None)
        else:
            globs.append(const_table(ctx.module, f"rows{d}", np.where(t >= 0, t * ist[d], -1), I64))
    can_fill = any((t < 0).any() for t in outer)
    runs = affine_runs(inner)

    def body(b: ir.IRBuilder, dg: list[ir.Value], row: ir.Value, c0: Any, nc: Any) -> None:
        soff: ir.Value = i64(0)
        ok: ir.Value | None = None
        for d in range(r - 1):
            if globs[d] is None:
                soff = b.add(soff, b.mul(dg[d], i64(ist[d])))
                continue
            t = table_load(b, globs[d], dg[d], I64)
            if (outer[d] < 0).any():
                okd = b.icmp_signed(">=", t, i64(0))
                ok = okd if ok is None else b.and_(ok, okd)
            soff = b.add(soff, t)
        doff = b.mul(row, i64(n))

        def segments() -> None:
            for o0, ln, s0, step in runs:
                d0 = b.add(doff, i64(o0))
                if s0 < 0:
                    assert fv is not None
                    fill_row(b, fv, y, d0, 1, ln)
                else:
                    copy_row(b, ety, x, b.add(soff, i64(s0 * ist[-1])), step * ist[-1], y, d0, 1,
                             ln)

        if can_fill and ok is not None:
            assert fv is not None
            with b.if_else(ok) as (then, other):
                with then:
                    segments()
                with other:
                    fill_row(b, fv, y, doff, 1, n)
        else:
            segments()

    units = emit_rows(ctx, b, out_shape[:-1], n, body, target=max(n, unit_target(total)),
                      itemsize=itemsize)
    b.ret_void()
    ctx.num_tiles = max(1, units)
    ctx.single_core = total < SMALL_ELEMS


# ---------------------------------------------------------------------------
# index helpers for the data-dependent ops
# ---------------------------------------------------------------------------

def load_index(b: ir.IRBuilder, ptr: ir.Value, off: ir.Value | int, dtype: np.dtype) -> ir.Value:
    """Element `off` of an index tensor as i64 (floats truncate toward zero)."""
    dt = np.dtype(dtype)
    ty = emit.llvm_type(dt)
    v = b.load(emit.gep(b, ptr, as_val(off), ty), typ=ty)
    if emit.is_float(dt):
        full = f"llvm.fptosi.sat.i64.{emit._mangle(ty)}"
        f = b.module.globals.get(full)
        if f is None:
            f = ir.Function(b.module, ir.FunctionType(I64, [ty]), name=full)
        return b.call(f, [v])
    if dt == np.bool_ or dt.kind == "u":
        return b.zext(v, I64) if ty.width < 64 else v
    return b.sext(v, I64) if ty.width < 64 else v


def normalize_index(b: ir.IRBuilder, k: ir.Value, dim: int) -> tuple[ir.Value, ir.Value]:
    """(index with negatives wrapped, in-range flag): valid indices are [-dim, dim)."""
    k = b.select(b.icmp_signed("<", k, i64(0)), b.add(k, i64(dim)), k)
    ok = b.icmp_unsigned("<", k, i64(dim))
    return k, ok


def safe_index(b: ir.IRBuilder, k: ir.Value, dim: int) -> tuple[ir.Value, ir.Value]:
    """(index usable for a load: wrapped and 0 when out of range, in-range flag)."""
    k, ok = normalize_index(b, k, dim)
    return b.select(ok, k, i64(0)), ok


__all__ = [
    "Piece", "emit_pieces", "pieces_tiling", "transpose_piece", "broadcast_strides", "affine_runs",
    "emit_rows", "emit_table_rows", "const_table", "table_load", "copy_row", "fill_row",
    "unit_range", "decode", "itype", "lanes_for", "contiguous_strides", "prod", "cdiv",
    "bits_of", "const_fill", "unit_target", "add", "mul", "as_val", "imin", "imax",
    "load_index", "normalize_index", "safe_index", "SMALL_ELEMS",
]
