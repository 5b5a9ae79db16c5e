"""Lowerings of the ops with their own small loop nests (cannc/ir/ops/misc.py).

- TopK: one row (a 1-D slice along the axis) per tile; an insertion into the
  k best seen so far, written straight into the outputs (ties keep the lower
  index first, like onnxruntime and the reference). k must be known when the
  kernel is built (a constant, or a value the session specialises on).
- Einsum: a direct loop nest over the output elements (tiles) and the summed
  letters, any number of operands, repeated letters (diagonals), ellipses
  with broadcasting; accumulates in float32 for 16-bit floats.
- CumProd: a running product along the axis (exclusive / reverse).
- LRN: per element, the sum of squares over a window of channels.
- RotaryEmbedding: one (batch, head, position) row per tile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llvmlite.ir as ir
import numpy as np

from ...errors import UnsupportedOpError
from ...ir.graph import Node
from ...ir.ops.misc import parse_einsum
from ...native import emit
from ...native.emit import I64, for_range, i64
from ..elementwise import TV, Expr, load_tv, store_tv
from ..kernel import LowerCtx
from ..movement import load_index
from .base import register_lowering


def _unsupported(n: Node, why: str) -> UnsupportedOpError:
    return UnsupportedOpError([(n.name, n.op_type, n.domain, n.opset, why)])


def _shape(t: Any) -> list[int]:
    return [int(d) for d in t.shape]


def _prod(xs: Sequence[int]) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


def _empty(ctx: LowerCtx) -> None:
    ctx.num_tiles, ctx.single_core = 1, True
    _, b = ctx.begin()
    b.ret_void()


# ---------------------------------------------------------------------------
# TopK
# ---------------------------------------------------------------------------

@register_lowering("TopK")
def _lower_topk(ctx: LowerCtx) -> None:
    n = ctx.node
    xt = ctx.in_types[0]
    shp = _shape(xt)
    r = len(shp)
    axis = int(ctx.attr("axis", -1))
    axis = axis + r if axis < 0 else axis
    k = int(_shape(ctx.out_types[0])[axis])
    largest = bool(int(ctx.attr("largest", 1)))
    D = shp[axis]
    outer, inner = _prod(shp[:axis]), _prod(shp[axis + 1:])
    dt = np.dtype(xt.dtype)
    rows = outer * inner
    if rows == 0 or k == 0:
        return _empty(ctx)
    if n.opset >= 10:
        ctx.drop_input(1)  # k is known: the output shape carries it
    ctx.num_tiles = rows
    ctx.single_core = rows * D < 4096
    ctx.flops = rows * D * max(1, k // 2)
    fn, b = ctx.begin()
    x = ctx.in_ptr(b, 0)
    vals, idxs = ctx.out_ptr(b, 0), ctx.out_ptr(b, 1)
    E = Expr(b, 1)
    ety = E.ty(dt)
    cnt_p = b.alloca(I64, name="cnt")
    pos_p = b.alloca(I64, name="pos")

    def better(a: TV, c: TV) -> ir.Value:
        return E.cmp(">" if largest else "<", a, c).v

    with for_range(b, ctx.tile_begin, ctx.tile_end, name="row") as t:
        o = b.udiv(t, i64(inner))
        i = b.urem(t, i64(inner))
        xbase = b.add(b.mul(o, i64(D * inner)), i)
        obase = b.add(b.mul(o, i64(k * inner)), i)
        b.store(i64(0), cnt_p)
        with for_range(b, 0, D, name="j") as j:
            v = load_tv(b, x, b.add(xbase, b.mul(j, i64(inner))), dt, 1, False)
            cnt = b.load(cnt_p, typ=I64)
            full = b.icmp_signed(">=", cnt, i64(k))
            last = load_tv(b, vals, b.add(obase, i64((k - 1) * inner)), dt, 1, False)
            take = b.or_(b.not_(full), better(v, last))
            with b.if_then(take):
                b.store(b.select(full, i64(k - 1), cnt), pos_p)
                # shift worse entries one place back, then insert
                fnb = b.function
                cond_bb = fnb.append_basic_block("ins.cond")
                body_bb = fnb.append_basic_block("ins.body")
                done_bb = fnb.append_basic_block("ins.done")
                b.branch(cond_bb)
                b.position_at_end(cond_bb)
                pos = b.load(pos_p, typ=I64)
                has_prev = b.icmp_signed(">", pos, i64(0))
                prev_off = b.add(obase, b.mul(b.sub(pos, i64(1)), i64(inner)))
                # load the previous entry only when it exists (pos > 0)
                safe_prev = b.select(has_prev, prev_off, obase)
                pv = load_tv(b, vals, safe_prev, dt, 1, False)
                move = b.and_(has_prev, better(v, pv))
                b.cbranch(move, body_bb, done_bb)
                b.position_at_end(body_bb)
                cur_off = b.add(obase, b.mul(pos, i64(inner)))
                store_tv(b, vals, cur_off, pv, dt)
                pi = b.load(emit.gep(b, idxs, prev_off, I64), typ=I64)
                b.store(pi, emit.gep(b, idxs, cur_off, I64))
                b.store(b.sub(pos, i64(1)), pos_p)
                b.branch(cond_bb)
                b.position_at_end(done_bb)
                pos = b.load(pos_p, typ=I64)
                off = b.add(obase, b.mul(pos, i64(inner)))
                store_tv(b, vals, off, v, dt)
                b.store(j, emit.gep(b, idxs, off, I64))
                nc = b.add(cnt, i64(1))
                b.store(b.select(full, cnt, nc), cnt_p)
    del ety
    b.ret_void()


# ---------------------------------------------------------------------------
# Einsum
# ---------------------------------------------------------------------------

@register_lowering("Einsum")
def _lower_einsum(ctx: LowerCtx) -> None:
    eq = ctx.attr("equation")
    eq = eq.decode() if isinstance(eq, bytes) else eq
    ins = list(ctx.in_types)
    terms, out = parse_einsum(eq, [len(t.shape) for t in ins])
    sizes: dict[str, int] = {}
    for t, ty in zip(terms, ins):
        for c, d in zip(t, _shape(ty)):
            if d != 1 or c not in sizes:
                sizes[c] = max(sizes.get(c, 1), d) if d != 1 else sizes.get(c, 1)
    odt = np.dtype(ctx.out_types[0].dtype)
    acc = np.dtype(np.float32) if odt.name in ("float16", "bfloat16") else odt
    out_shape = [sizes[c] for c in out]
    summed = [c for c in dict.fromkeys("".join(terms)) if c not in out]
    total = _prod(out_shape)
    if total == 0:
        return _empty(ctx)
    # element strides of each operand per letter (repeated letters add: a diagonal;
    # size-1 dims broadcast: stride 0)
    strides = []
    for t, ty in zip(terms, ins):
        shp = _shape(ty)
        st = [0] * len(shp)
        a = 1
        for d in range(len(shp) - 1, -1, -1):
            st[d] = a if shp[d] != 1 else 0
            a *= shp[d]
        per: dict[str, int] = {}
        for c, s in zip(t, st):
            per[c] = per.get(c, 0) + s
        strides.append(per)
    red = _prod([sizes[c] for c in summed])
    per_tile = max(1, min(total, 4096 // max(1, red)))
    ctx.num_tiles = -(-total // per_tile)
    ctx.single_core = total * red < 16384
    ctx.flops = 2 * total * red * len(ins)
    fn, b = ctx.begin()
    ptrs = [ctx.in_ptr(b, i) for i in range(len(ins))]
    y = ctx.out_ptr(b, 0)
    E = Expr(b, 1)
    acc_p = b.alloca(E.ty(acc))

    with for_range(b, ctx.tile_begin, ctx.tile_end, name="tile") as t:
        lo = b.mul(t, i64(per_tile))
        hi = b.mul(b.add(t, i64(1)), i64(per_tile))
        hi = b.select(b.icmp_signed("<", hi, i64(total)), hi, i64(total))
        with for_range(b, lo, hi, name="o") as o:
            idx: dict[str, ir.Value] = {}
            rem = o
            for d in range(len(out) - 1, -1, -1):
                idx[out[d]] = b.urem(rem, i64(out_shape[d])) if d else rem
                rem = b.udiv(rem, i64(out_shape[d])) if d else rem
            b.store(E.const(0, acc).v, acc_p)

            def nest(level: int) -> None:
                if level < len(summed):
                    c = summed[level]
                    with for_range(b, 0, sizes[c], name=f"s{c}") as v:
                        idx[c] = v
                        nest(level + 1)
                    return
                prod = None
                for k, (p, ty) in enumerate(zip(ptrs, ins)):
                    off = i64(0)
                    for c, s in strides[k].items():
                        if s:
                            off = b.add(off, b.mul(idx[c], i64(s)))
                    v = E.cast(load_tv(b, p, off, ty.dtype, 1, False), acc)
                    prod = v if prod is None else E.mul(prod, v)
                assert prod is not None
                b.store(E.add(TV(b.load(acc_p, typ=E.ty(acc)), acc), prod).v, acc_p)

            nest(0)
            store_tv(b, y, o, E.cast(TV(b.load(acc_p, typ=E.ty(acc)), acc), odt), odt)
    b.ret_void()


# ---------------------------------------------------------------------------
# CumProd
# ---------------------------------------------------------------------------

@register_lowering("CumProd")
def _lower_cumprod(ctx: LowerCtx) -> None:
    c = ctx.const(1)
    n = ctx.node
    if c is None:
        raise _unsupported(n, "the axis is a runtime input (must be constant)")
    xt = ctx.in_types[0]
    shp = _shape(xt)
    r = max(len(shp), 1)
    axis = int(np.asarray(c).reshape(-1)[0])
    axis = axis + r if axis < 0 else axis
    shp = shp or [1]
    D = shp[axis]
    outer, inner = _prod(shp[:axis]), _prod(shp[axis + 1:])
    rows = outer * inner
    if rows == 0 or D == 0:
        return _empty(ctx)
    excl, rev = bool(int(ctx.attr("exclusive", 0))), bool(int(ctx.attr("reverse", 0)))
    dt = np.dtype(xt.dtype)
    ctx.drop_input(1)
    ctx.num_tiles = rows
    ctx.single_core = rows * D < 8192
    ctx.flops = rows * D
    fn, b = ctx.begin()
    x, y = ctx.in_ptr(b, 0), ctx.out_ptr(b, 0)
    E = Expr(b, 1)
    acc_p = b.alloca(E.ty(dt))
    with for_range(b, ctx.tile_begin, ctx.tile_end, name="row") as t:
        o, i = b.udiv(t, i64(inner)), b.urem(t, i64(inner))
        base = b.add(b.mul(o, i64(D * inner)), i)
        b.store(E.const(1, dt).v, acc_p)
        with for_range(b, 0, D, name="j") as j:
            jj = b.sub(i64(D - 1), j) if rev else j
            off = b.add(base, b.mul(jj, i64(inner)))
            v = load_tv(b, x, off, dt, 1, False)
            cur = TV(b.load(acc_p, typ=E.ty(dt)), dt)
            nxt = E.mul(cur, v)
            store_tv(b, y, off, cur if excl else nxt, dt)
            b.store(nxt.v, acc_p)
    b.ret_void()


# ---------------------------------------------------------------------------
# LRN
# ---------------------------------------------------------------------------

@register_lowering("LRN")
def _lower_lrn(ctx: LowerCtx) -> None:
    xt = ctx.in_types[0]
    shp = _shape(xt)
    N, C = shp[0], shp[1]
    S = _prod(shp[2:])
    size = int(ctx.attr("size"))
    alpha, beta = float(ctx.attr("alpha", 1e-4)), float(ctx.attr("beta", 0.75))
    bias = float(ctx.attr("bias", 1.0))
    lo_w, hi_w = (size - 1) // 2, size - 1 - (size - 1) // 2
    dt = np.dtype(xt.dtype)
    cdt = np.dtype(np.float32) if dt.itemsize < 4 else dt
    total = N * C * S
    if total == 0:
        return _empty(ctx)
    rows = N * C
    ctx.num_tiles = rows
    ctx.single_core = total * size < 16384
    ctx.flops = total * (2 * size + 10)
    fn, b = ctx.begin()
    x, y = ctx.in_ptr(b, 0), ctx.out_ptr(b, 0)
    E = Expr(b, 1)
    acc_p = b.alloca(E.ty(cdt))
    with for_range(b, ctx.tile_begin, ctx.tile_end, name="row") as t:
        nn, c = b.udiv(t, i64(C)), b.urem(t, i64(C))
        c0 = b.sub(c, i64(lo_w))
        c0 = b.select(b.icmp_signed("<", c0, i64(0)), i64(0), c0)
        c1 = b.add(c, i64(hi_w + 1))
        c1 = b.select(b.icmp_signed(">", c1, i64(C)), i64(C), c1)
        with for_range(b, 0, S, name="s") as s:
            b.store(E.const(0.0, cdt).v, acc_p)
            with for_range(b, c0, c1, name="w") as cc:
                v = E.cast(load_tv(b, x, b.add(b.mul(b.add(b.mul(nn, i64(C)), cc), i64(S)), s),
                                   dt, 1, False), cdt)
                b.store(E.fma(v, v, TV(b.load(acc_p, typ=E.ty(cdt)), cdt)).v, acc_p)
            sq = TV(b.load(acc_p, typ=E.ty(cdt)), cdt)
            base = E.fma(sq, E.const(alpha / size, cdt), E.const(bias, cdt))
            den = E.call("llvm.pow", base, E.const(beta, cdt))
            off = b.add(b.mul(t, i64(S)), s)
            xv = E.cast(load_tv(b, x, off, dt, 1, False), cdt)
            store_tv(b, y, off, E.cast(E.div(xv, den), dt), dt)
    b.ret_void()


# ---------------------------------------------------------------------------
# RotaryEmbedding
# ---------------------------------------------------------------------------

@register_lowering("RotaryEmbedding")
def _lower_rope(ctx: LowerCtx) -> None:
    n = ctx.node
    xt = ctx.in_types[0]
    shp = _shape(xt)
    if len(shp) == 4:
        B, NH, S, HD = shp
    else:
        B, S, hidden = shp
        NH = int(ctx.attr("num_heads"))
        HD = hidden // NH
    rot = int(ctx.attr("rotary_embedding_dim", 0)) or HD
    half = rot // 2
    inter = bool(int(ctx.attr("interleaved", 0)))
    has_ids = len(n.inputs) > 3 and bool(n.inputs[3])
    cache_rows = int(ctx.in_types[1].shape[0])
    dt = np.dtype(xt.dtype)
    cdt = np.dtype(np.float32) if dt.itemsize < 4 else dt
    rows = B * NH * S
    if rows == 0:
        return _empty(ctx)
    ctx.num_tiles = rows
    ctx.single_core = rows * HD < 8192
    ctx.flops = rows * rot * 3
    fn, b = ctx.begin()
    x, cos, sin = ctx.in_ptr(b, 0), ctx.in_ptr(b, 1), ctx.in_ptr(b, 2)
    ids = ctx.in_ptr(b, 3) if has_ids else None
    y = ctx.out_ptr(b, 0)
    E = Expr(b, 1)
    with for_range(b, ctx.tile_begin, ctx.tile_end, name="row") as t:
        # t enumerates (b, h, s) for 4-D inputs, (b, s, h) for 3-D ones
        if len(shp) == 4:
            bs = b.udiv(t, i64(NH * S))
            s = b.urem(t, i64(S))
        else:
            bs = b.udiv(t, i64(S * NH))
            s = b.urem(b.udiv(t, i64(NH)), i64(S))
        base = b.mul(t, i64(HD))
        if ids is not None:
            pos = load_index(b, ids, b.add(b.mul(bs, i64(S)), s), ctx.in_types[3].dtype)
            pos = b.select(b.icmp_signed("<", pos, i64(0)), i64(0), pos)
            pos = b.select(b.icmp_signed(">=", pos, i64(cache_rows)), i64(cache_rows - 1), pos)
            crow = b.mul(pos, i64(half))
        else:
            crow = b.mul(b.add(b.mul(bs, i64(S)), s), i64(half))
        with for_range(b, 0, half, name="i") as i:
            c = E.cast(load_tv(b, cos, b.add(crow, i), ctx.in_types[1].dtype, 1, False), cdt)
            sn = E.cast(load_tv(b, sin, b.add(crow, i), ctx.in_types[2].dtype, 1, False), cdt)
            if inter:
                o1 = b.add(base, b.mul(i, i64(2)))
                o2 = b.add(o1, i64(1))
            else:
                o1 = b.add(base, i)
                o2 = b.add(o1, i64(half))
            x1 = E.cast(load_tv(b, x, o1, dt, 1, False), cdt)
            x2 = E.cast(load_tv(b, x, o2, dt, 1, False), cdt)
            store_tv(b, y, o1, E.cast(E.sub(E.mul(x1, c), E.mul(x2, sn)), dt), dt)
            store_tv(b, y, o2, E.cast(E.add(E.mul(x2, c), E.mul(x1, sn)), dt), dt)
        if rot < HD:
            with for_range(b, rot, HD, name="p") as i:
                off = b.add(base, i)
                store_tv(b, y, off, load_tv(b, x, off, dt, 1, False), dt)
    b.ret_void()
