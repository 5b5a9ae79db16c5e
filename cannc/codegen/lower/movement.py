"""Lowerings of the data-movement ops (cannc/ir/ops/movement.py).

Transpose, Concat, Split, Slice, Expand, Tile, DepthToSpace and SpaceToDepth
become lists of strided-copy pieces (codegen/movement.py) run by one kernel;
Pad (every mode) becomes per-dim source tables written row by row. Gather,
GatherElements, GatherND, ScatterElements, ScatterND, OneHot and Trilu read
indices (or k) at run time, every index checked in native code. Resize
(nearest, linear, cubic) builds per-dim source tables at compile time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llvmlite.ir as ir
import numpy as np

from ...artifact import Tiling
from ...errors import UnsupportedOpError
from ...ir.graph import Node
from ...ir.ops.movement import _resize_attrs
from ...native import emit
from ...native.emit import I64, for_range, i64
from ...native.target import host
from ..kernel import LowerCtx
from ..movement import (
    SMALL_ELEMS,
    UNIT_ELEMS,
    Piece,
    add,
    as_val,
    bits_of,
    broadcast_strides,
    cdiv,
    const_fill,
    const_table,
    contiguous_strides,
    copy_row,
    decode,
    emit_pieces,
    emit_rows,
    emit_table_rows,
    fill_row,
    imax,
    imin,
    itype,
    lanes_for,
    load_index,
    normalize_index,
    pieces_tiling,
    prod,
    safe_index,
    table_load,
    transpose_piece,
    unit_target,
)
from .base import register_lowering

# ---------------------------------------------------------------------------
# common
# ---------------------------------------------------------------------------

def _shape(t: Any) -> list[int]:
    return [int(d) for d in t.shape]


def _isz(ctx: LowerCtx) -> int:
    return np.dtype(ctx.out_types[0].dtype).itemsize


def _axis(a: int, rank: int) -> int:
    return a + rank if a < 0 else a


def _need_const(ctx: LowerCtx, i: int, what: str) -> np.ndarray | None:
    """Input i as a constant (None when the optional input is absent)."""
    if i >= len(ctx.node.inputs) or not ctx.node.inputs[i]:
        return None
    c = ctx.const(i)
    if c is None:
        n = ctx.node
        raise UnsupportedOpError([(n.name, n.op_type, n.domain, n.opset,
                                   f"{what} must be constant (it decides the output shape)")])
    return np.asarray(c)


def _present(ctx: LowerCtx, i: int) -> bool:
    return i < len(ctx.node.inputs) and bool(ctx.node.inputs[i])


def _load_bits(ctx: LowerCtx, i: int, dtype: np.dtype, index: int = 0):
    """A fill: element `index` of input i, read at run time as raw bits."""
    def fill(b: ir.IRBuilder) -> ir.Value:
        ty = itype(dtype)
        return b.load(emit.gep(b, ctx.in_ptr(b, i), index, ty), typ=ty)
    return fill


def _input_fill(ctx: LowerCtx, i: int, dtype: np.dtype, index: int = 0, default: Any = 0):
    """Fill value from optional input i: constant bits, runtime load, or the default."""
    if not _present(ctx, i):
        return const_fill(default, dtype)
    c = ctx.const(i)
    if c is not None:
        return const_fill(np.asarray(c).reshape(-1)[index], dtype)
    return _load_bits(ctx, i, dtype, index)


def _empty_kernel(ctx: LowerCtx) -> None:
    fn, b = ctx.begin()
    b.ret_void()
    ctx.num_tiles = 1
    ctx.single_core = True


PieceBuilder = Any  # (node, in_types, out_types) -> list[Piece]


def _piece_op(build: PieceBuilder) -> tuple[Any, Any]:
    """(lowering, tiling function) of an op that is a list of copy pieces built from its
    shapes and attributes alone: shape-polymorphic through codegen.movement.pieces_tiling."""
    def lower(ctx: LowerCtx) -> None:
        emit_pieces(ctx, build(ctx.node, ctx.in_types, ctx.out_types), _isz(ctx))

    def tiling(node: Node, ins: list[Any], outs: list[Any]) -> Any:
        return pieces_tiling(build(node, ins, outs), np.dtype(outs[0].dtype).itemsize)

    return lower, tiling


def _finish_rows(ctx: LowerCtx, b: ir.IRBuilder, units: int, elems: int) -> None:
    """Close a row-walking kernel: its tiles are emit_rows' units; tiny ones run on one core."""
    b.ret_void()
    ctx.num_tiles = max(1, units)
    ctx.single_core = elems < SMALL_ELEMS


# ---------------------------------------------------------------------------
# Transpose, Concat, Split, Slice, Expand, Tile, DepthToSpace, SpaceToDepth
# ---------------------------------------------------------------------------

def _transpose_pieces(n: Node, ins: list[Any], outs: list[Any]) -> list[Piece]:
    shp = _shape(ins[0])
    r = len(shp)
    perm = n.attrs.get("perm")
    perm = [int(p) % r for p in perm] if perm else list(range(r - 1, -1, -1))
    return [transpose_piece(shp, perm)]


_lower_transpose, _transpose_tiling = _piece_op(_transpose_pieces)


def _concat_pieces(n: Node, ins: list[Any], outs: list[Any]) -> list[Piece]:
    out = _shape(outs[0])
    ax = _axis(int(n.attrs.get("axis", 0)), len(out))
    ost = contiguous_strides(out)
    pieces, off = [], 0
    for i, t in enumerate(ins):
        if t is None:
            continue
        s = _shape(t)
        pieces.append(Piece(shape=s, dst=0, dst_strides=ost, dst_base=off * ost[ax],
                            src=i, src_strides=contiguous_strides(s)))
        off += s[ax]
    return pieces


_lower_concat, _concat_tiling = _piece_op(_concat_pieces)


def _split_pieces(n: Node, ins: list[Any], outs: list[Any]) -> list[Piece]:
    shp = _shape(ins[0])
    ax = _axis(int(n.attrs.get("axis", 0)), len(shp))
    ist = contiguous_strides(shp)
    pieces, off = [], 0
    # the outputs' inferred shapes carry the split sizes of every opset version
    for j, t in enumerate(outs):
        s = _shape(t)
        pieces.append(Piece(shape=s, dst=j, dst_strides=contiguous_strides(s),
                            src=0, src_strides=ist, src_base=off * ist[ax]))
        off += s[ax]
    return pieces


_lower_split, _split_tiling = _piece_op(_split_pieces)


def _slice_params(n: Node, consts: Sequence[np.ndarray | None], rank: int
                  ) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """(starts, ends, axes, steps) of a Slice from its attributes (opset < 10) or its
    constant inputs `consts` (None where starts or ends is not a constant)."""
    if n.opset < 10:
        starts = list(n.attrs["starts"])
        ends = list(n.attrs["ends"])
        axes = n.attrs.get("axes")
        axes = list(axes) if axes is not None else list(range(len(starts)))
        steps = [1] * len(starts)
    else:
        present = [i < len(n.inputs) and bool(n.inputs[i]) for i in range(5)]
        got = [np.asarray(consts[i]).reshape(-1) if present[i] and consts[i] is not None
               else None for i in range(5)]
        if any(present[i] and got[i] is None for i in (1, 2, 3, 4)) or not all(present[1:3]):
            return None
        starts = [int(v) for v in got[1]]
        ends = [int(v) for v in got[2]]
        axes = [int(v) for v in got[3]] if present[3] else list(range(len(starts)))
        steps = [int(v) for v in got[4]] if present[4] else [1] * len(starts)
    return starts, ends, [_axis(int(a), rank) for a in axes], steps


def _slice_piece(n: Node, ins: list[Any], outs: list[Any],
                 consts: Sequence[np.ndarray | None]) -> Piece | None:
    """The one copy piece of a Slice (None where its parameters are not constants)."""
    shp, out = _shape(ins[0]), _shape(outs[0])
    r = len(shp)
    params = _slice_params(n, consts, r)
    if params is None:
        return None
    first, step = [0] * r, [1] * r
    for st, en, ax, sp in zip(*params):
        lo, hi, sp = slice(st, en, sp).indices(shp[ax])
        assert len(range(lo, hi, sp)) == out[ax], (shp, out, st, en, ax, sp)
        first[ax], step[ax] = lo, sp
    ist = contiguous_strides(shp)
    return Piece(shape=out, dst=0, dst_strides=contiguous_strides(out), src=0,
                 src_strides=[step[d] * ist[d] for d in range(r)],
                 src_base=sum(first[d] * ist[d] for d in range(r)))


def _slice_tiling(n: Node, ins: list[Any], outs: list[Any],
                  values: Sequence[np.ndarray | None] = ()) -> Any:
    """Shape-polymorphic where the parameters are constants: the piece's extents,
    strides and start are runtime dims, so a new input shape needs no code."""
    if prod(_shape(outs[0])) == 0:
        return None
    piece = _slice_piece(n, ins, outs, list(values) + [None] * (len(n.inputs) - len(values)))
    if piece is None or min(piece.src_strides, default=0) < 0:
        return None     # (a reversed axis: runtime dims are unsigned; the static kernel)
    return pieces_tiling([piece], np.dtype(outs[0].dtype).itemsize)


def _lower_slice(ctx: LowerCtx) -> None:
    if prod(_shape(ctx.out_types[0])) == 0:
        return _empty_kernel(ctx)
    n = ctx.node
    if ctx.tiling is not None:
        # the parameters are runtime dims: read, not folded into the code (no key)
        consts: list[np.ndarray | None] = list(ctx.consts)
    else:
        consts = [None] * len(n.inputs)
        for i in range(1, len(n.inputs)):
            if n.inputs[i]:
                consts[i] = _need_const(ctx, i, ("starts", "ends", "axes", "steps")[i - 1])
    piece = _slice_piece(n, ctx.in_types, ctx.out_types, consts)
    assert piece is not None
    emit_pieces(ctx, [piece], _isz(ctx))


def _expand_pieces(n: Node, ins: list[Any], outs: list[Any]) -> list[Piece]:
    out = _shape(outs[0])
    return [Piece(shape=out, dst=0, dst_strides=contiguous_strides(out), src=0,
                  src_strides=broadcast_strides(_shape(ins[0]), out))]


_lower_expand, _expand_tiling = _piece_op(_expand_pieces)


def _tile_pieces(n: Node, ins: list[Any], outs: list[Any]) -> list[Piece]:
    shp = _shape(ins[0])
    out = _shape(outs[0])
    ist, ost = contiguous_strides(shp), contiguous_strides(out)
    shape, ss, ds = [], [], []
    for d in range(len(shp)):
        rep = out[d] // shp[d] if shp[d] else 0
        shape += [rep, shp[d]]
        ss += [0, ist[d]]
        ds += [ost[d] * shp[d], ost[d]]
    return [Piece(shape=shape, dst=0, dst_strides=ds, src=0, src_strides=ss)]


_lower_tile, _tile_tiling = _piece_op(_tile_pieces)


def _depth_to_space_pieces(nd: Node, ins: list[Any], outs: list[Any]) -> list[Piece]:
    n, c, h, w = _shape(ins[0])
    bs = int(nd.attrs["blocksize"])
    cc = c // (bs * bs)
    if nd.opset >= 11 and nd.attrs.get("mode", "DCR") == "CRD":
        view, perm = [n, cc, bs, bs, h, w], [0, 1, 4, 2, 5, 3]
    else:
        view, perm = [n, bs, bs, cc, h, w], [0, 3, 4, 1, 5, 2]
    return [transpose_piece(view, perm)]


def _space_to_depth_pieces(nd: Node, ins: list[Any], outs: list[Any]) -> list[Piece]:
    n, c, h, w = _shape(ins[0])
    bs = int(nd.attrs["blocksize"])
    view = [n, c, h // bs, bs, w // bs, bs]
    crd = nd.opset >= 28 and nd.attrs.get("mode", "DCR") == "CRD"
    perm = [0, 1, 3, 5, 2, 4] if crd else [0, 3, 5, 1, 2, 4]
    return [transpose_piece(view, perm)]


_lower_depth_to_space, _d2s_tiling = _piece_op(_depth_to_space_pieces)
_lower_space_to_depth, _s2d_tiling = _piece_op(_space_to_depth_pieces)


def _pad_params(ctx: LowerCtx, rank: int) -> tuple[list[int], list[int]]:
    """(pad_begin, pad_end) per dim of the input."""
    if ctx.opset < 11:
        raw = [int(v) for v in ctx.attr("pads", ctx.attr("paddings", []))]
        axes = list(range(rank))
    else:
        raw = [int(v) for v in _need_const(ctx, 1, "pads").reshape(-1)]
        a = _need_const(ctx, 3, "axes") if ctx.opset >= 18 else None
        axes = [_axis(int(v), rank) for v in a.reshape(-1)] if a is not None else list(range(rank))
    k = len(axes)
    pb, pe = [0] * rank, [0] * rank
    for i, ax in enumerate(axes):
        pb[ax], pe[ax] = raw[i], raw[k + i]
    return pb, pe


def _lower_pad(ctx: LowerCtx) -> None:
    shp = _shape(ctx.in_types[0])
    out = _shape(ctx.out_types[0])
    dt = np.dtype(ctx.out_types[0].dtype)
    if prod(out) == 0:
        return _empty_kernel(ctx)
    r = len(shp)
    pb, pe = _pad_params(ctx, r)
    mode = ctx.attr("mode", "constant")
    if ctx.opset < 11:
        fill = const_fill(ctx.attr("value", 0.0), dt)
    else:
        fill = _input_fill(ctx, 2, dt)
    # per dim: the output index -> input index table (-1: the constant)
    tables = []
    for d in range(r):
        crop_lo, crop_hi = max(0, -pb[d]), max(0, -pe[d])
        src = np.arange(crop_lo, shp[d] - crop_hi, dtype=np.int64)
        widths = (max(0, pb[d]), max(0, pe[d]))
        if mode == "constant":
            t = np.concatenate([np.full(widths[0], -1, np.int64), src,
                                np.full(widths[1], -1, np.int64)])
        else:
            if src.size == 0 and widths != (0, 0):
                n = ctx.node
                raise UnsupportedOpError([(n.name, n.op_type, n.domain, n.opset,
                                           f"{mode} padding of an empty dim")])
            t = np.pad(src, widths, mode=mode) if widths != (0, 0) else src
        assert len(t) == out[d], (shp, out, pb, pe)
        tables.append(t)
    # one pass over the output, row by row: left border, interior, right border
    emit_table_rows(ctx, shp, tables, dt.itemsize, fill if mode == "constant" else None)


# ---------------------------------------------------------------------------
# Gather, GatherElements, GatherND
# ---------------------------------------------------------------------------

def _zero(ety: ir.Type) -> ir.Constant:
    return ir.Constant(ety, 0)


def _lower_gather(ctx: LowerCtx) -> None:
    dsh = _shape(ctx.in_types[0])
    idt = np.dtype(ctx.in_types[1].dtype)
    ish = _shape(ctx.in_types[1])
    out = _shape(ctx.out_types[0])
    isz = _isz(ctx)
    if prod(out) == 0:
        return _empty_kernel(ctx)
    if ctx.tiling is not None:
        return _lower_gather_runtime(ctx)
    ax = _axis(int(ctx.attr("axis", 0)), len(dsh))
    outer, dim, inner, nidx = prod(dsh[:ax]), dsh[ax], prod(dsh[ax + 1:]), prod(ish)
    ety = itype(isz)
    fn, b = ctx.begin()
    data, idx, dst = ctx.in_ptr(b, 0), ctx.in_ptr(b, 1), ctx.out_ptr(b, 0)

    if inner == 1:
        # element gather: rows of data, one column per index
        def body(b: ir.IRBuilder, dg: list, r: ir.Value, c0: Any, nc: Any) -> None:
            o = r
            with for_range(b, 0, as_val(nc), name="g") as j:
                c = as_val(add(b, j, c0))
                k, ok = safe_index(b, load_index(b, idx, c, idt), dim)
                v = b.load(emit.gep(b, data, b.add(b.mul(o, i64(dim)), k), ety), typ=ety)
                v = b.select(ok, v, _zero(ety))
                b.store(v, emit.gep(b, dst, b.add(b.mul(o, i64(nidx)), c), ety))
        units = emit_rows(ctx, b, [outer], nidx, body, itemsize=isz)
    else:
        def body(b: ir.IRBuilder, dg: list, r: ir.Value, c0: Any, nc: Any) -> None:
            o, i = dg
            k, ok = normalize_index(b, load_index(b, idx, i, idt), dim)
            doff = as_val(add(b, b.mul(r, i64(inner)), c0))
            with b.if_else(ok) as (then, other):
                with then:
                    soff = as_val(add(b, b.mul(b.add(b.mul(o, i64(dim)), k), i64(inner)), c0))
                    copy_row(b, ety, data, soff, 1, dst, doff, 1, nc)
                with other:
                    fill_row(b, _zero(ety), dst, doff, 1, nc)
        units = emit_rows(ctx, b, [outer, nidx], inner, body, itemsize=isz)
    _finish_rows(ctx, b, units, prod(out))


def _gather_geometry(n: Node, ins: list[Any]) -> tuple[int, int, int, int]:
    """(outer, dim, inner, number of indices) of a Gather."""
    dsh, ish = _shape(ins[0]), _shape(ins[1])
    ax = _axis(int(n.attrs.get("axis", 0)), len(dsh))
    return prod(dsh[:ax]), dsh[ax], prod(dsh[ax + 1:]), prod(ish)


def _gather_chunk(inner: int, itemsize: int) -> int:
    """Columns per unit of a gathered row (static: it follows the row width)."""
    w = lanes_for(itemsize)
    return inner if inner <= UNIT_ELEMS else UNIT_ELEMS // w * w


SMALL_ELEMENT_GATHER = 1 << 16


def _gather_tiling(n: Node, ins: list[Any], outs: list[Any]) -> Any:
    """Row gathers (embeddings: [B,S] ids into a [V,H] table; one position along an axis:
    a pooler's x[:, 0]) are shape-polymorphic: the row width is static, the number of
    rows, the indexed extent and the unit size are runtime dims."""
    outer, dim, inner, nidx = _gather_geometry(n, ins)
    total = outer * nidx * inner
    # element gathers (one column per index) take the row path only while small
    # (index tables derived from shapes, e.g. a mask's position lookup): big ones
    # keep the static per-element loop
    if total == 0 or (inner == 1 and total > SMALL_ELEMENT_GATHER):
        return None
    isz = np.dtype(outs[0].dtype).itemsize
    nch = _gather_chunk(inner, isz)
    rows = outer * nidx
    rpu = max(1, min(rows, unit_target(total) // min(inner, nch)))
    units = cdiv(rows, rpu) * cdiv(inner, nch)
    return Tiling(key=("gather_rows", inner, nch), dims=(dim, nidx, rpu, rows),
                  num_tiles=units, single_core=total < SMALL_ELEMS)


def _lower_gather_runtime(ctx: LowerCtx) -> None:
    idt = np.dtype(ctx.in_types[1].dtype)
    isz = _isz(ctx)
    _, _, inner, _ = _gather_geometry(ctx.node, ctx.in_types)
    assert ctx.tiling.key == ("gather_rows", inner, _gather_chunk(inner, isz)), ctx.tiling.key
    nch = _gather_chunk(inner, isz)
    cn = cdiv(inner, nch)
    ety = itype(isz)
    fn, b = ctx.begin()
    data, idx, dst = ctx.in_ptr(b, 0), ctx.in_ptr(b, 1), ctx.out_ptr(b, 0)
    dim, nidx, rpu, rows = (ctx.rt_dim(b, i) for i in range(4))
    with for_range(b, ctx.tile_begin, ctx.tile_end, name="ru") as u:
        if cn > 1:
            g = b.udiv(u, i64(cn))
            col0: ir.Value | int = b.mul(b.urem(u, i64(cn)), i64(nch))
            ncols: ir.Value | int = nch if inner % nch == 0 else \
                imin(b, i64(nch), b.sub(i64(inner), col0))
        else:
            g, col0, ncols = u, 0, inner
        r0 = b.mul(g, rpu)
        r1 = imin(b, b.add(r0, rpu), rows)
        with for_range(b, r0, r1, name="row") as r:
            o = b.udiv(r, nidx)
            i = b.sub(r, b.mul(o, nidx))
            k = load_index(b, idx, i, idt)
            k = b.select(b.icmp_signed("<", k, i64(0)), b.add(k, dim), k)
            ok = b.icmp_unsigned("<", k, dim)
            doff = as_val(add(b, b.mul(r, i64(inner)), col0))
            with b.if_else(ok) as (then, other):
                with then:
                    soff = as_val(add(b, b.mul(b.add(b.mul(o, dim), k), i64(inner)), col0))
                    copy_row(b, ety, data, soff, 1, dst, doff, 1, ncols)
                with other:
                    fill_row(b, _zero(ety), dst, doff, 1, ncols)
    b.ret_void()


def _lower_gather_elements(ctx: LowerCtx) -> None:
    dsh = _shape(ctx.in_types[0])
    idt = np.dtype(ctx.in_types[1].dtype)
    ish = _shape(ctx.in_types[1])
    isz = _isz(ctx)
    if prod(ish) == 0:
        return _empty_kernel(ctx)
    r = len(dsh)
    ax = _axis(int(ctx.attr("axis", 0)), r)
    dst_st = contiguous_strides(dsh)
    ety = itype(isz)
    dim = dsh[ax]
    fn, b = ctx.begin()
    data, idx, dst = ctx.in_ptr(b, 0), ctx.in_ptr(b, 1), ctx.out_ptr(b, 0)
    inner = ish[-1] if r else 1
    outer = ish[:-1]

    def body(b: ir.IRBuilder, dg: list, row: ir.Value, c0: Any, nc: Any) -> None:
        base = i64(0)
        for d, x in enumerate(dg[: len(outer)] if outer else []):
            if d != ax:
                base = b.add(base, b.mul(x, i64(dst_st[d])))
        with for_range(b, 0, as_val(nc), name="g") as j:
            c = as_val(add(b, j, c0))
            o = b.add(b.mul(row, i64(inner)), c)
            k, ok = safe_index(b, load_index(b, idx, o, idt), dim)
            off = b.add(base, b.mul(k, i64(dst_st[ax])))
            if ax != r - 1:
                off = b.add(off, b.mul(c, i64(dst_st[r - 1])))
            v = b.load(emit.gep(b, data, off, ety), typ=ety)
            b.store(b.select(ok, v, _zero(ety)), emit.gep(b, dst, o, ety))

    units = emit_rows(ctx, b, outer, inner, body, itemsize=isz)
    _finish_rows(ctx, b, units, prod(ish))


def _nd_offset(b: ir.IRBuilder, idx: ir.Value, ioff: ir.Value, idt: np.dtype, q: int,
               dims: Sequence[int], strides: Sequence[int]) -> tuple[ir.Value, ir.Value]:
    """Offset of an index tuple idx[ioff : ioff+q] into dims, and whether all are in range."""
    off, ok = i64(0), ir.Constant(emit.I1, 1)
    for j in range(q):
        k, okj = normalize_index(b, load_index(b, idx, b.add(ioff, i64(j)), idt), dims[j])
        off = b.add(off, b.mul(k, i64(strides[j])))
        ok = b.and_(ok, okj)
    return off, ok


def _lower_gather_nd(ctx: LowerCtx) -> None:
    dsh = _shape(ctx.in_types[0])
    idt = np.dtype(ctx.in_types[1].dtype)
    ish = _shape(ctx.in_types[1])
    out = _shape(ctx.out_types[0])
    isz = _isz(ctx)
    if prod(out) == 0:
        return _empty_kernel(ctx)
    bd = int(ctx.attr("batch_dims", 0)) if ctx.opset >= 12 else 0
    q = ish[-1]
    nb, m = prod(ish[:bd]), prod(ish[bd:-1])
    sl = prod(dsh[bd + q:])
    bstride = prod(dsh[bd:])
    dst_st = contiguous_strides(dsh)
    ety = itype(isz)
    fn, b = ctx.begin()
    data, idx, dst = ctx.in_ptr(b, 0), ctx.in_ptr(b, 1), ctx.out_ptr(b, 0)

    def body(b: ir.IRBuilder, dg: list, r: ir.Value, c0: Any, nc: Any) -> None:
        bi = dg[0]
        off, ok = _nd_offset(b, idx, b.mul(r, i64(q)), idt, q, dsh[bd:bd + q], dst_st[bd:bd + q])
        off = b.add(off, b.mul(bi, i64(bstride)))
        c0v = as_val(c0)
        doff = b.add(b.mul(r, i64(sl)), c0v)
        if sl == 1:
            v = b.load(emit.gep(b, data, b.select(ok, off, i64(0)), ety), typ=ety)
            b.store(b.select(ok, v, _zero(ety)), emit.gep(b, dst, doff, ety))
            return
        with b.if_else(ok) as (then, other):
            with then:
                copy_row(b, ety, data, b.add(off, c0v), 1, dst, doff, 1, nc)
            with other:
                fill_row(b, _zero(ety), dst, doff, 1, nc)

    units = emit_rows(ctx, b, [nb, m], sl, body, itemsize=isz)
    _finish_rows(ctx, b, units, prod(out))


# ---------------------------------------------------------------------------
# ScatterElements, ScatterND: copy the data, then apply the updates in order.
# Tiles own disjoint ranges of output rows; each tile applies the updates that
# land in its range, so duplicates keep their order and cores never race.
# ---------------------------------------------------------------------------

def _reduce(b: ir.IRBuilder, how: str, old: ir.Value, new: ir.Value, dt: np.dtype) -> ir.Value:
    if how == "none":
        return new
    f = emit.is_float(dt)
    if how == "add":
        return b.fadd(old, new) if f else b.add(old, new)
    if how == "mul":
        return b.fmul(old, new) if f else b.mul(old, new)
    if f:
        return emit.intrinsic(b, "llvm.maxnum" if how == "max" else "llvm.minnum", [old, new])
    cmp = b.icmp_signed if emit.is_signed(dt) else b.icmp_unsigned
    keep_new = cmp(">" if how == "max" else "<", new, old)
    return b.select(keep_new, new, old)


def _scatter_tiles(ctx: LowerCtx, rows: int, row_elems: int) -> tuple[int, int]:
    total = rows * row_elems
    tiles = 1 if total < SMALL_ELEMS else min(rows, 2)
    return max(1, tiles), cdiv(rows, max(1, tiles))


def _scatter_begin(ctx: LowerCtx, rows: int, row_elems: int):
    """Copy this tile's rows of data to the output; returns (b, data, out, r0, r1)."""
    tiles, per = _scatter_tiles(ctx, rows, row_elems)
    ctx.num_tiles = tiles
    ctx.single_core = tiles == 1
    fn, b = ctx.begin()
    data, dst = ctx.in_ptr(b, 0), ctx.out_ptr(b, 0)
    t0 = ctx.tile_begin
    t1 = ctx.tile_end
    r0 = imin(b, b.mul(t0, i64(per)), i64(rows))
    r1 = imin(b, b.mul(t1, i64(per)), i64(rows))
    ety = itype(_isz(ctx))
    off = b.mul(r0, i64(row_elems))
    copy_row(b, ety, data, off, 1, dst, off, 1, b.mul(b.sub(r1, r0), i64(row_elems)))
    return b, dst, r0, r1


def _lower_scatter_elements(ctx: LowerCtx) -> None:
    dsh = _shape(ctx.in_types[0])
    idt = np.dtype(ctx.in_types[1].dtype)
    ish = _shape(ctx.in_types[1])
    dt = np.dtype(ctx.out_types[0].dtype)
    r = len(dsh)
    if prod(dsh) == 0:
        return _empty_kernel(ctx)
    ax = _axis(int(ctx.attr("axis", 0)), r)
    how = ctx.attr("reduction", "none") if ctx.opset >= 16 else "none"
    st = contiguous_strides(dsh)
    # tiles own ranges of the data's first dim (whole rows of everything after it)
    b, dst, r0, r1 = _scatter_begin(ctx, dsh[0], prod(dsh[1:]))
    idx, upd = ctx.in_ptr(b, 1), ctx.in_ptr(b, 2)
    ty = emit.llvm_type(dt)
    lo, hi = b.mul(r0, i64(st[0])), b.mul(r1, i64(st[0]))
    nu = prod(ish)
    with for_range(b, i64(0), i64(nu), name="s") as u:
        dg = [x for x in _decode_static(b, u, ish)]
        k, ok = normalize_index(b, load_index(b, idx, u, idt), dsh[ax])
        off = b.mul(k, i64(st[ax]))
        for d in range(r):
            if d != ax:
                off = b.add(off, b.mul(dg[d], i64(st[d])))
        ok = b.and_(ok, b.and_(b.icmp_signed(">=", off, lo), b.icmp_signed("<", off, hi)))
        with b.if_then(ok):
            p = emit.gep(b, dst, off, ty)
            new = b.load(emit.gep(b, upd, u, ty), typ=ty)
            val = new if how == "none" else _reduce(b, how, b.load(p, typ=ty), new, dt)
            b.store(val, p)
    b.ret_void()


def _decode_static(b: ir.IRBuilder, u: ir.Value, shape: Sequence[int]) -> list[ir.Value]:
    return decode(b, u, [int(d) for d in shape] or [1])


def _lower_scatter_nd(ctx: LowerCtx) -> None:
    dsh = _shape(ctx.in_types[0])
    idt = np.dtype(ctx.in_types[1].dtype)
    ish = _shape(ctx.in_types[1])
    dt = np.dtype(ctx.out_types[0].dtype)
    if prod(dsh) == 0:
        return _empty_kernel(ctx)
    how = ctx.attr("reduction", "none") if ctx.opset >= 16 else "none"
    q = ish[-1]
    rows_shape = dsh[:q]
    sl = prod(dsh[q:])
    rst = contiguous_strides(rows_shape)
    b, dst, r0, r1 = _scatter_begin(ctx, prod(rows_shape), sl)
    idx, upd = ctx.in_ptr(b, 1), ctx.in_ptr(b, 2)
    ty = emit.llvm_type(dt)
    nu = prod(ish[:-1])
    with for_range(b, i64(0), i64(nu), name="s") as u:
        row, ok = _nd_offset(b, idx, b.mul(u, i64(q)), idt, q, rows_shape, rst)
        ok = b.and_(ok, b.and_(b.icmp_signed(">=", row, r0), b.icmp_signed("<", row, r1)))
        with b.if_then(ok):
            dbase = b.mul(row, i64(sl))
            ubase = b.mul(u, i64(sl))
            with for_range(b, i64(0), i64(sl), name="e") as e:
                p = emit.gep(b, dst, b.add(dbase, e), ty)
                new = b.load(emit.gep(b, upd, b.add(ubase, e), ty), typ=ty)
                val = new if how == "none" else _reduce(b, how, b.load(p, typ=ty), new, dt)
                b.store(val, p)
    b.ret_void()


# ---------------------------------------------------------------------------
# OneHot, Trilu
# ---------------------------------------------------------------------------

def _lower_onehot(ctx: LowerCtx) -> None:
    ish = _shape(ctx.in_types[0])
    idt = np.dtype(ctx.in_types[0].dtype)
    out = _shape(ctx.out_types[0])
    dt = np.dtype(ctx.out_types[0].dtype)
    if prod(out) == 0:
        return _empty_kernel(ctx)
    ax = _axis(int(ctx.attr("axis", -1)), len(out))
    depth = out[ax]
    outer, inner = prod(ish[:ax]), prod(ish[ax:])
    ety = itype(dt)
    fn, b = ctx.begin()
    idx, dst = ctx.in_ptr(b, 0), ctx.out_ptr(b, 0)
    off_v = _input_fill(ctx, 2, dt, 0)(b)
    on_v = _input_fill(ctx, 2, dt, 1)(b)

    def body(b: ir.IRBuilder, dg: list, r: ir.Value, c0: Any, nc: Any) -> None:
        o, d = dg
        with for_range(b, 0, as_val(nc), name="h") as j:
            c = as_val(add(b, j, c0))
            k = load_index(b, idx, b.add(b.mul(o, i64(inner)), c), idt)
            k = b.select(b.icmp_signed("<", k, i64(0)), b.add(k, i64(depth)), k)
            v = b.select(b.icmp_signed("==", k, d), on_v, off_v)
            b.store(v, emit.gep(b, dst, b.add(b.mul(r, i64(inner)), c), ety))

    units = emit_rows(ctx, b, [outer, depth], inner, body, itemsize=dt.itemsize)
    _finish_rows(ctx, b, units, prod(out))


def _lower_trilu(ctx: LowerCtx) -> None:
    shp = _shape(ctx.in_types[0])
    dt = np.dtype(ctx.out_types[0].dtype)
    if prod(shp) == 0:
        return _empty_kernel(ctx)
    m, n = shp[-2], shp[-1]
    upper = int(ctx.attr("upper", 1))
    ety = itype(dt)
    fn, b = ctx.begin()
    x, dst = ctx.in_ptr(b, 0), ctx.out_ptr(b, 0)
    if _present(ctx, 1):
        c = ctx.const(1)
        if c is not None:
            k: ir.Value = i64(int(np.asarray(c).reshape(-1)[0]))
        else:
            k = load_index(b, ctx.in_ptr(b, 1), 0, np.dtype(ctx.in_types[1].dtype))
    else:
        k = i64(0)
    lim = m + n + 1
    k = imin(b, imax(b, k, i64(-lim)), i64(lim))

    def body(b: ir.IRBuilder, dg: list, r: ir.Value, c0: Any, nc: Any) -> None:
        i = dg[-1]
        cut = b.add(i, k) if upper else b.add(b.add(i, k), i64(1))
        cut = imin(b, imax(b, cut, i64(0)), i64(n))
        base = b.mul(r, i64(n))
        # upper keeps [cut, n); lower keeps [0, cut)
        if upper:
            fill_row(b, _zero(ety), dst, base, 1, cut)
            copy_row(b, ety, x, b.add(base, cut), 1, dst, b.add(base, cut), 1, b.sub(i64(n), cut))
        else:
            copy_row(b, ety, x, base, 1, dst, base, 1, cut)
            fill_row(b, _zero(ety), dst, b.add(base, cut), 1, b.sub(i64(n), cut))

    units = emit_rows(ctx, b, [prod(shp[:-2]), m], n, body, itemsize=dt.itemsize,
                      target=_no_col_split(m * prod(shp[:-2]), n))
    _finish_rows(ctx, b, units, prod(shp))


def _no_col_split(rows: int, n: int) -> int:
    """A unit target that never cuts a row (for bodies that handle whole rows)."""
    return max(n, unit_target(rows * n))


def _lower_bitcast(ctx: LowerCtx) -> None:
    out = _shape(ctx.out_types[0])
    if prod(out) == 0:
        return _empty_kernel(ctx)
    piece = Piece(shape=out, dst=0, dst_strides=contiguous_strides(out), src=0,
                  src_strides=contiguous_strides(out))
    emit_pieces(ctx, [piece], _isz(ctx))


def _lower_eyelike(ctx: LowerCtx) -> None:
    out = _shape(ctx.out_types[0])
    dt = np.dtype(ctx.out_types[0].dtype)
    if prod(out) == 0:
        return _empty_kernel(ctx)
    rows, cols = out
    k = int(ctx.attr("k", 0))
    ety = itype(dt)
    zero, one = const_fill(0, dt), const_fill(1, dt)
    ctx.drop_input(0)  # only the input's shape matters
    fn, b = ctx.begin()
    dst = ctx.out_ptr(b, 0)

    def body(b: ir.IRBuilder, dg: list, r: ir.Value, c0: Any, nc: Any) -> None:
        base = b.mul(r, i64(cols))
        fill_row(b, zero(b), dst, as_val(add(b, base, c0)), 1, nc)
        c = b.add(r, i64(k))
        lo = as_val(c0)
        ok = b.and_(b.icmp_signed(">=", c, lo), b.icmp_signed("<", c, b.add(lo, as_val(nc))))
        with b.if_then(ok):
            b.store(one(b), emit.gep(b, dst, b.add(base, c), ety))

    units = emit_rows(ctx, b, [rows], cols, body, itemsize=dt.itemsize)
    _finish_rows(ctx, b, units, prod(out))


def _lower_constant_of_shape(ctx: LowerCtx) -> None:
    """A result too large to fold (the constant folder's limit): filled at run time."""
    out = _shape(ctx.out_types[0])
    dt = np.dtype(ctx.out_types[0].dtype)
    total = prod(out)
    if total == 0:
        return _empty_kernel(ctx)
    v = ctx.attr("value")
    value = np.asarray(v).reshape(-1)[0] if v is not None else 0.0
    fill = const_fill(value, dt)
    ctx.drop_input(0)  # the shape is the output's
    fn, b = ctx.begin()
    dst = ctx.out_ptr(b, 0)

    def body(b: ir.IRBuilder, dg: list, r: ir.Value, c0: Any, nc: Any) -> None:
        fill_row(b, fill(b), dst, add(b, b.mul(r, i64(total)), c0), 1, nc)

    units = emit_rows(ctx, b, [1], total, body, itemsize=dt.itemsize)
    _finish_rows(ctx, b, units, total)


# ---------------------------------------------------------------------------
# Resize / Upsample: separable per-dim source tables built at compile time
# (nearest: one tap per dim; linear: two weighted taps per scaled dim), then a
# row walk that reads the tables from constant globals.
# ---------------------------------------------------------------------------

def _resize_scales(ctx: LowerCtx, shp: list[int],
                   out: list[int]) -> tuple[list[float], list[float]]:
    """(scale per dim, roi as [starts..., ends...] per dim) as ORT computes them (float32)."""
    r = len(shp)
    n = ctx.node
    if n.op_type == "Upsample" and n.opset < 9:
        return [float(s) for s in n.attrs["scales"]], [0.0] * r + [1.0] * r
    axes = [_axis(int(a), r) for a in n.attrs.get("axes", range(r))] if ctx.opset >= 18 \
        else list(range(r))
    scales_i, sizes_i, roi_i = (1, None, None) if (n.op_type == "Upsample" or ctx.opset < 11) \
        else (2, 3, 1)
    sc = _need_const(ctx, scales_i, "scales")
    sz = _need_const(ctx, sizes_i, "sizes") if sizes_i is not None else None
    roi = _need_const(ctx, roi_i, "roi") if roi_i is not None else None
    scale = [1.0] * r
    if sc is not None and sc.size:
        for a, s in zip(axes, sc.reshape(-1)):
            scale[a] = float(np.float32(s))
    elif sz is not None:
        # the requested sizes (with a keep_aspect_ratio_policy they differ from the output)
        szv = [int(v) for v in sz.reshape(-1)]
        ratios = [np.float32(szv[i]) / np.float32(shp[a]) for i, a in enumerate(axes)]
        policy = n.attrs.get("keep_aspect_ratio_policy", "stretch")
        if policy == "not_larger":
            ratios = [min(ratios)] * len(axes)
        elif policy == "not_smaller":
            ratios = [max(ratios)] * len(axes)
        for a, s in zip(axes, ratios):
            scale[a] = float(np.float32(s))
    full_roi = [0.0] * r + [1.0] * r
    if roi is not None and roi.size:
        rv = [float(v) for v in roi.reshape(-1)]
        k = len(rv) // 2
        for i, a in enumerate(axes[:k] if len(axes) >= k else range(k)):
            full_roi[a], full_roi[r + a] = rv[i], rv[k + i]
    return scale, full_roi


def _resize_coords(coord: str, out_len: int, in_len: int, scale: float,
                   roi: tuple[float, float]) -> np.ndarray:
    """Source coordinate of every output index (float32, like onnxruntime)."""
    f = np.float32
    x = np.arange(out_len, dtype=f)
    s = f(scale)
    if coord == "half_pixel":
        return (x + f(0.5)) / s - f(0.5)
    if coord == "half_pixel_symmetric":
        adj = f(out_len) / (s * f(in_len))
        center = f(in_len) / f(2)
        offset = center * (f(1) - adj)
        return offset + (x + f(0.5)) / s - f(0.5)
    if coord == "pytorch_half_pixel":
        return (x + f(0.5)) / s - f(0.5) if out_len > 1 else np.zeros(out_len, f)
    if coord == "tf_half_pixel_for_nn":
        return (x + f(0.5)) / s
    if coord == "align_corners":
        return np.zeros(out_len, f) if out_len == 1 else x * f(in_len - 1) / f(out_len - 1)
    if coord == "asymmetric":
        return x / s
    if coord == "tf_crop_and_resize":
        r0, r1 = f(roi[0]), f(roi[1])
        if out_len > 1:
            return r0 * f(in_len - 1) + x * (r1 - r0) * f(in_len - 1) / f(out_len - 1)
        return np.full(out_len, f(0.5) * (r0 + r1) * f(in_len - 1), f)
    raise ValueError(coord)


def _nearest_index(xo: np.ndarray, how: str, scale: float) -> np.ndarray:
    if how == "simple":
        v = np.ceil(xo) if scale < 1 else np.trunc(xo)
    elif how == "round_prefer_floor":
        half_away = np.where(xo >= 0, np.floor(xo + 0.5), np.ceil(xo - 0.5))
        v = np.where(xo == np.trunc(xo) + np.float32(0.5), np.floor(xo), half_away)
    elif how == "round_prefer_ceil":
        v = np.where(xo >= 0, np.floor(xo + 0.5), np.ceil(xo - 0.5))
    elif how == "floor":
        v = np.floor(xo)
    else:
        v = np.ceil(xo)
    return v.astype(np.int64)


def _cubic_taps(xo: np.ndarray, n_in: int, A: float,
                exclude_outside: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Four taps (x0-1 .. x0+2, edge-clamped) with Keys' cubic weights of coefficient A;
    exclude_outside drops the taps outside the input and renormalises."""
    x = xo.astype(np.float64)
    x0 = np.floor(x)
    t = x - x0
    w = [((A * (t + 1) - 5 * A) * (t + 1) + 8 * A) * (t + 1) - 4 * A,
         ((A + 2) * t - (A + 3)) * t * t + 1,
         ((A + 2) * (1 - t) - (A + 3)) * (1 - t) * (1 - t) + 1,
         ((A * (2 - t) - 5 * A) * (2 - t) + 8 * A) * (2 - t) - 4 * A]
    idx = [x0.astype(np.int64) + k for k in (-1, 0, 1, 2)]
    if exclude_outside:
        w = [np.where((i >= 0) & (i < n_in), wk, 0.0) for i, wk in zip(idx, w)]
        tot = sum(w)
        w = [wk / np.where(tot == 0, 1.0, tot) for wk in w]
    return [(np.clip(i, 0, n_in - 1), wk.astype(np.float32)) for i, wk in zip(idx, w)]


def _resize_taps(ctx: LowerCtx) -> tuple[list[list[tuple[np.ndarray, np.ndarray | None]]],
                                    list[np.ndarray | None]]:
    """Per dim: taps [(source index table, weight table or None)] and an
    in-range mask (None: always in range)."""
    shp = _shape(ctx.in_types[0])
    out = _shape(ctx.out_types[0])
    mode, coord, nearest = _resize_attrs(ctx.node)
    scale, roi = _resize_scales(ctx, shp, out)
    r = len(shp)
    taps, masks = [], []
    for d in range(r):
        n_in, n_out = shp[d], out[d]
        if scale[d] == 1.0 and n_in == n_out and coord != "tf_crop_and_resize":
            # onnxruntime leaves unscaled dims alone (whatever the coordinate mode)
            taps.append([(np.arange(n_out, dtype=np.int64), None)])
            masks.append(None)
            continue
        xo = _resize_coords(coord, n_out, n_in, scale[d], (roi[d], roi[r + d]))
        mask = None
        if coord == "tf_crop_and_resize":
            m = (xo >= 0) & (xo <= np.float32(n_in - 1))
            mask = None if m.all() else m
        if mode == "nearest":
            idx = np.clip(_nearest_index(xo, nearest, scale[d]), 0, n_in - 1)
            taps.append([(idx, None)])
        elif mode == "cubic":
            taps.append(_cubic_taps(xo, n_in, float(ctx.attr("cubic_coeff_a", -0.75)),
                                    bool(int(ctx.attr("exclude_outside", 0)))))
        else:
            xc = np.clip(xo, np.float32(0), np.float32(n_in - 1)).astype(np.float32)
            x1 = np.minimum(xc.astype(np.int64), n_in - 1)
            x2 = np.minimum(x1 + 1, n_in - 1)
            dx1 = np.abs(xc - x1.astype(np.float32))
            dx2 = np.abs(xc - x2.astype(np.float32))
            same = x1 == x2
            dx1 = np.where(same, np.float32(0.5), dx1)
            dx2 = np.where(same, np.float32(0.5), dx2)
            if (same | (dx1 == 0)).all():
                taps.append([(x1, None)])       # every output sits on a source point
            else:
                taps.append([(x1, dx2.astype(np.float32)), (x2, dx1.astype(np.float32))])
        masks.append(mask)
    return taps, masks


def _lower_resize(ctx: LowerCtx) -> None:
    shp = _shape(ctx.in_types[0])
    out = _shape(ctx.out_types[0])
    dt = np.dtype(ctx.out_types[0].dtype)
    if prod(out) == 0:
        return _empty_kernel(ctx)
    taps, masks = _resize_taps(ctx)
    r = len(shp)
    ist = contiguous_strides(shp)
    linear = any(w is not None for t in taps for _, w in t)
    ety = itype(dt) if not linear else emit.llvm_type(dt)
    fty = ety if linear else None
    extra = ctx.attr("extrapolation_value", 0.0)
    fn, b = ctx.begin()
    x, dst = ctx.in_ptr(b, 0), ctx.out_ptr(b, 0)
    m = ctx.module
    # constant tables (indices pre-multiplied by the input strides)
    tabs: list[list[tuple[Any, Any]]] = []
    for d in range(r):
        row = []
        for t, (idx, w) in enumerate(taps[d]):
            ident = w is None and np.array_equal(idx, np.arange(len(idx)))
            it = None if ident else const_table(m, f"rs_i{d}_{t}", idx * ist[d], I64)
            wt = None if w is None else const_table(m, f"rs_w{d}_{t}", w.astype(dt), fty)
            row.append((it, wt))
        tabs.append(row)
    mtabs = [None if mk is None else const_table(m, f"rs_m{d}", mk.astype(np.int8), emit.I8)
             for d, mk in enumerate(masks)]
    ext_bits = ir.Constant(ety, bits_of(extra, dt)) if not linear else \
        ir.Constant(ety, float(np.asarray(extra).astype(dt)))

    def dim_taps(b: ir.IRBuilder, d: int, i: ir.Value) -> list[tuple[ir.Value, ir.Value | None]]:
        res = []
        for _t, (it, wt) in enumerate(tabs[d]):
            off = b.mul(i, i64(ist[d])) if it is None else table_load(b, it, i, I64)
            w = None if wt is None else table_load(b, wt, i, fty)
            res.append((off, w))
        return res

    def in_range(b: ir.IRBuilder, d: int, i: ir.Value) -> ir.Value | None:
        if mtabs[d] is None:
            return None
        return b.icmp_unsigned("!=", table_load(b, mtabs[d], i, emit.I8), ir.Constant(emit.I8, 0))

    # the innermost dim a vector of outputs at a time, where each tap's sources for a block
    # of outputs lie within a vector of the source row (upsampling): one (masked) vector
    # load of the row from the block's first source, lanes permuted by a table of
    # offsets (vpermps), weighted. Scalar loads cost a 1x21x14x14 -> 224x224 bilinear
    # upsampling (DeepLabV3's last op) ~5 cycles an output on Zen 4, a gather ~3.
    vw = 16 if host().has("avx512f") else 8 if host().has("avx2") else 0
    perm = {16: "llvm.x86.avx512.permvar.sf.512", 8: "llvm.x86.avx2.permps"}.get(vw)
    nin, nout = shp[-1], out[-1]
    nblk = cdiv(nout, max(vw, 1))
    vtabs: list[tuple[Any, Any, Any]] = []
    if dt.itemsize == 4 and all(mk is None for mk in masks) and perm is not None:
        for t, (idx, w) in enumerate(taps[r - 1]):
            idx = np.concatenate([idx, np.full(nblk * vw - nout, idx[-1])]).reshape(nblk, vw)
            base = idx.min(axis=1)
            rel = idx - base[:, None]
            if rel.max() >= vw:
                vtabs = []
                break
            wt = None if w is None else const_table(
                m, f"rs_vw{t}", np.concatenate([w.astype(dt), np.zeros(nblk * vw - nout + vw,
                                                                          dt)]), fty)
            vtabs.append((const_table(m, f"rs_vb{t}", base, I64),
                          const_table(m, f"rs_vr{t}", rel.reshape(-1).astype(np.int32),
                                      emit.I32), wt))
    vec = bool(vtabs)                      # (the innermost dim is contiguous: stride 1)
    if vec:
        fvt = ir.VectorType(ir.FloatType(), vw)
        vty = ir.VectorType(ety, vw)
        ity = ir.VectorType(I64, vw)
        i32v = ir.VectorType(emit.I32, vw)
        iota = ir.Constant(ity, list(range(vw)))

        def vec_row(b: ir.IRBuilder, combos: list, base: ir.Value, c0v: ir.Value,
                    nc: ir.Value) -> None:
            ncv = emit.splat(b, b.add(c0v, nc), vw)
            with for_range(b, c0v, b.add(c0v, nc), step=vw, name="xv") as c:
                mask = b.icmp_signed("<", b.add(emit.splat(b, c, vw), iota), ncv)
                blk = b.udiv(c, i64(vw))
                inner = []
                for bt, rt, wt in vtabs:
                    src0 = table_load(b, bt, blk, I64)
                    inrow = b.icmp_signed("<", iota, emit.splat(b, b.sub(i64(nin), src0), vw))
                    inner.append((src0, table_load(b, rt, c, i32v, align=4), inrow,
                                  None if wt is None else table_load(b, wt, c, vty, align=4)))
                acc = None
                for off, w in combos:           # the scalar loop's order of the sums
                    for src0, rel, inrow, wv in inner:
                        win = emit.masked_load(b, emit.gep(b, x, b.add(off, src0), ety), inrow,
                                               ir.Constant(vty, None))
                        if vty != fvt:
                            win = b.bitcast(win, fvt)
                        v = emit.call_intrinsic(b, perm, [win, rel], fvt, overload=())
                        if vty != fvt:
                            v = b.bitcast(v, vty)
                        if w is not None or wv is not None:
                            ww = wv if w is None else (emit.splat(b, w, vw) if wv is None
                                                       else b.fmul(emit.splat(b, w, vw), wv))
                            v = b.fmul(v, ww)
                        acc = v if acc is None else b.fadd(acc, v)
                emit.masked_store(b, acc, emit.gep(b, dst, b.add(base, c), ety), mask)

    def body(b: ir.IRBuilder, dg: list, row: ir.Value, c0: Any, nc: Any) -> None:
        # combine the outer dims' taps: [(offset, weight)]
        combos: list[tuple[ir.Value, ir.Value | None]] = [(i64(0), None)]
        ok = None
        for d in range(r - 1):
            nxt = []
            for off, w in combos:
                for o2, w2 in dim_taps(b, d, dg[d]):
                    ww = w2 if w is None else (w if w2 is None else b.fmul(w, w2))
                    nxt.append((b.add(off, o2), ww))
            combos = nxt
            f = in_range(b, d, dg[d])
            if f is not None:
                ok = f if ok is None else b.and_(ok, f)
        base = b.mul(row, i64(out[-1]))
        c0v = as_val(c0)
        if vec:
            return vec_row(b, combos, base, c0v, as_val(nc))
        with for_range(b, 0, as_val(nc), name="x") as j:
            c = b.add(j, c0v)
            inner = dim_taps(b, r - 1, c)
            acc = None
            for off, w in combos:
                for o2, w2 in inner:
                    v = b.load(emit.gep(b, x, b.add(off, o2), ety), typ=ety)
                    ww = w2 if w is None else (w if w2 is None else b.fmul(w, w2))
                    if ww is not None:
                        v = b.fmul(v, ww)
                    acc = v if acc is None else b.fadd(acc, v)
            f = in_range(b, r - 1, c)
            okj = ok if f is None else (f if ok is None else b.and_(ok, f))
            if okj is not None:
                acc = b.select(okj, acc, ext_bits)
            b.store(acc, emit.gep(b, dst, b.add(base, c), ety))

    units = emit_rows(ctx, b, out[:-1], out[-1], body, itemsize=dt.itemsize)
    _finish_rows(ctx, b, units, prod(out))
    ctx.flops = prod(out) * (2 * sum(len(t) for t in taps) if linear else 0)


register_lowering("Transpose", tiling=_transpose_tiling)(_lower_transpose)
register_lowering("Concat", tiling=_concat_tiling)(_lower_concat)
register_lowering("Split", tiling=_split_tiling)(_lower_split)
register_lowering("Slice", tiling=_slice_tiling, tiling_values=True)(_lower_slice)
register_lowering("Expand", tiling=_expand_tiling)(_lower_expand)
register_lowering("Tile", tiling=_tile_tiling)(_lower_tile)
register_lowering("DepthToSpace", tiling=_d2s_tiling)(_lower_depth_to_space)
register_lowering("SpaceToDepth", tiling=_s2d_tiling)(_lower_space_to_depth)
register_lowering("Pad")(_lower_pad)
register_lowering("Gather", tiling=_gather_tiling)(_lower_gather)
register_lowering("GatherElements")(_lower_gather_elements)
register_lowering("GatherND")(_lower_gather_nd)
register_lowering("ScatterElements")(_lower_scatter_elements)
register_lowering("Scatter")(_lower_scatter_elements)
register_lowering("ScatterND")(_lower_scatter_nd)
register_lowering("OneHot")(_lower_onehot)
register_lowering("BitCast")(_lower_bitcast)
register_lowering("EyeLike")(_lower_eyelike)
register_lowering("ConstantOfShape")(_lower_constant_of_shape)
register_lowering("Trilu")(_lower_trilu)
register_lowering("Resize")(_lower_resize)
register_lowering("Upsample")(_lower_resize)
