"""Lowering of the ONNX Attention op (cannc/ir/ops/attention_op.py) onto the fused
flash-attention kernel (codegen/attention.py).

Layouts: 3-D operands ``[B, S, heads*d]`` and 4-D ``[B, heads, S, d]`` are
both read in place, through the element strides of AttnSpec (ir/ops/fused.py);
grouped-query attention (``kv_num_heads < q_num_heads``) reads KV head
``h // (Hq/Hkv)`` for query head h (the interleaved repeat of the reference).

The kernel function (codegen/ABI.md) calls ``emit_attention``'s inner kernel,
specialised for ONE (b, h) head, once per head with the head's pointers
(decoding GQA, Sq = 1: once per KV head, its G query heads being G rows):

* fine mode (no mask, or a constant mask without fully-masked rows): tiles =
  the inner kernel's query blocks of every head, so even a single head splits
  over the cores;
* head mode (tiles = heads), when rows may be fully masked at run time: after
  the head's attention the rows without an allowed key are zeroed (the kernel
  itself gives NaN there). The mask is read in place by the kernel when it can
  express it (bool -> ``where`` with fill -inf, float -> ``add``, causal with
  offset ``Sk - Sq`` after dropping the keys no query can see); otherwise (runtime
  ``nonpad_kv_seqlen``, sliding window, causal offsets the kernel cannot take)
  the head's additive bias is first built into the workspace, in chunks of
  query rows, together with the per-row flags of the guard.

Keys past a mask's last dimension are masked (the reference pads the mask with
-inf/False): they are simply not visited. One difference from the reference
remains at masked positions whose score is NaN or +inf (NaN/inf inputs): a bool
mask selects -inf there (``where``) where the reference adds -inf (NaN).
"""

from __future__ import annotations

import dataclasses

import llvmlite.ir as ir
import numpy as np

from ...ir.attnspec import AttnSpec
from ...ir.ops.attention_op import K_IN, MASK_IN, NONPAD_IN, Q_IN, V_IN, Plan, analyse
from ...native import emit
from ...native.emit import F32, I8, I64, PTR, for_range, i64
from ..attention import (
    PRECISION_ATTR,
    attention_num_tiles,
    attention_precision_note,
    attention_typed_spec,
    attention_workspace_bytes,
    emit_attention,
)
from ..kernel import LowerCtx
from .base import register_lowering

NEG_INF = float("-inf")
BIAS_CHUNK_BYTES = 1 << 20           # per-core bias buffer of the general path (rows chunked)


def _const_mask_has_empty_rows(p: Plan, mask: np.ndarray) -> bool:
    """Compile-time: does a constant mask leave some row without any allowed key?"""
    a = np.asarray(mask)
    a = a.reshape((1,) * (4 - a.ndim) + a.shape)
    allowed = (a if a.dtype == np.bool_ else a != -np.inf)[..., :p.sk_eff]
    allowed = np.broadcast_to(allowed, allowed.shape[:2] + (p.Sq, p.sk_eff))
    if p.kernel_causal:
        i = np.arange(p.Sq).reshape(-1, 1)
        j = np.arange(p.sk_eff).reshape(1, -1)
        allowed = allowed & (j <= i + p.past)
    return not bool(allowed.any(axis=-1).all())


# ---------------------------------------------------------------------------
# lowering
# ---------------------------------------------------------------------------


def _spec(p: Plan, Sq: int, bias: bool, ctx: LowerCtx) -> AttnSpec:
    """The inner kernel's spec, typed like the node's operands (the bias of the general
    path is float32 in the workspace)."""
    spec = _spec32(p, Sq, bias)
    ins = list(ctx.in_types[:3]) + ([ctx.in_types[MASK_IN]] if p.mask and not bias else [])
    typed = attention_typed_spec(spec, ins, ctx.out_types, ctx.node.attrs.get(PRECISION_ATTR))
    return typed if not bias else dataclasses.replace(typed, mask_dtype="float32")


def _spec32(p: Plan, Sq: int, bias: bool) -> AttnSpec:
    if bias:
        mode, mdt, ms = "add", "float32", (0, 0, p.sk_eff, 1)
    elif p.mask is None:
        mode, mdt, ms = "none", "float32", (0, 0, 0, 0)
    else:
        mode = "where" if p.mask == "bool" else "add"
        mdt, ms = p.mask, (0, 0, p.m_r, p.m[3])
    return AttnSpec(B=1, H=1, Sq=Sq, Sk=p.sk_eff, D=p.D, Dv=p.Dv,
                    q_strides=(0, 0, p.q_r, p.q[3]), k_strides=(0, 0, p.k[2], p.k[3]),
                    v_strides=(0, 0, p.v[2], p.v[3]), o_strides=(0, 0, p.o_r, p.o[3]),
                    scale=p.scale, mask=mode, mask_strides=ms, mask_dtype=mdt,
                    fill=NEG_INF, causal=p.kernel_causal and not bias and not p.merge)


def _rup(a: int, b: int) -> int:
    return -(-a // b) * b


class _Emitter:
    """The kernel function around the inner attention kernel(s)."""

    def __init__(self, ctx: LowerCtx, p: Plan) -> None:
        self.ctx, self.p = ctx, p
        # element types of Q, K, V, the mask and Y (narrow floats: the kernel converts)
        self.ety = [emit.llvm_type(t.dtype) for t in ctx.in_types[:3]]
        self.m_dt = np.dtype(ctx.in_types[MASK_IN].dtype) if p.mask else None
        self.m_ety = emit.llvm_type(self.m_dt) if p.mask else None
        self.o_dt = np.dtype(ctx.out_types[0].dtype)
        self.o_ety = emit.llvm_type(self.o_dt)
        self.fn, self.b = ctx.begin()
        b = self.b
        self.arr = b.alloca(PTR, size=i64(5), name="inner_args")
        self.any_slot = b.alloca(emit.I1, name="row_any")
        self.Q = ctx.in_ptr(b, Q_IN)
        self.K = ctx.in_ptr(b, K_IN)
        self.V = ctx.in_ptr(b, V_IN)
        self.M = ctx.in_ptr(b, MASK_IN) if p.mask else None
        self.NP = ctx.in_ptr(b, NONPAD_IN) if p.nonpad else None
        self.O = ctx.out_ptr(b, 0)

    # -- small helpers --------------------------------------------------------
    def gep(self, ptr, idx, ty=F32):
        if isinstance(idx, int):
            idx = i64(idx)
        return self.b.gep(ptr, [idx], source_etype=ty)

    def mul(self, x, c: int):
        return i64(0) if c == 0 else x if c == 1 else self.b.mul(x, i64(c))

    def smin(self, x, y):
        return self.b.select(self.b.icmp_signed("<", x, y), x, y)

    def smax(self, x, y):
        return self.b.select(self.b.icmp_signed(">", x, y), x, y)

    def head_ptrs(self, hd):
        """Q, K, V, mask and O pointers of kernel head hd (b * Hq + h, or b * Hkv + kv
        head when merged: its first query head); and b."""
        p, b = self.p, self.b
        if p.merge:
            bi = b.udiv(hd, i64(p.Hkv)) if p.Hkv > 1 else hd
            kvh = b.urem(hd, i64(p.Hkv)) if p.Hkv > 1 else i64(0)
            hi = self.mul(kvh, p.G)
        else:
            bi = b.udiv(hd, i64(p.Hq)) if p.Hq > 1 else hd
            hi = b.urem(hd, i64(p.Hq)) if p.Hq > 1 else i64(0)
            kvh = b.udiv(hi, i64(p.G)) if p.G > 1 else hi

        def at(ptr, st, h, ty):
            return self.gep(ptr, b.add(self.mul(bi, st[0]), self.mul(h, st[1])), ty)

        q = at(self.Q, p.q, hi, self.ety[0])
        k = at(self.K, p.k, kvh, self.ety[1])
        v = at(self.V, p.v, kvh, self.ety[2])
        o = at(self.O, p.o, hi, self.o_ety)
        m = None
        if self.M is not None:
            m = at(self.M, p.m, hi, self.m_ety)
        return q, k, v, m, o, bi

    def call(self, inner, ptrs, t0, t1):
        b = self.b
        for i, ptr in enumerate(ptrs):
            b.store(ptr, b.gep(self.arr, [i64(i)], source_etype=PTR))
        b.call(inner, [self.arr, t0, t1, self.ctx.workspace])

    def zero_row(self, o, i):
        """O[i, :] = 0 (rows without any allowed key)."""
        p, b = self.p, self.b
        row = self.gep(o, self.mul(i, p.o_r), self.o_ety)
        zero = ir.Constant(self.o_ety, 0 if isinstance(self.o_ety, ir.IntType) else 0.0)
        with for_range(b, 0, p.Dv, name="zr") as e:
            b.store(zero, self.gep(row, self.mul(e, p.o[3]), self.o_ety))

    def mask_allows(self, m, i, j):
        """i1: the user mask allows key j of row i (bool True / float != -inf)."""
        p, b = self.p, self.b
        off = b.add(self.mul(i, p.m_r), self.mul(j, p.m[3]))
        if p.mask == "bool":
            x = b.load(self.gep(m, off, I8), typ=I8)
            return b.icmp_unsigned("!=", x, ir.Constant(I8, 0))
        x = self.load_mask_f(self.gep(m, off, self.m_ety))
        return b.fcmp_unordered("!=", x, ir.Constant(F32, NEG_INF))

    def load_mask_f(self, ptr):
        """A float mask element at ptr, as float32."""
        b = self.b
        if self.m_dt == np.float32:
            return b.load(ptr, typ=F32)
        if self.m_dt == np.float16:
            return b.fpext(b.load(ptr, typ=ir.HalfType()), F32)
        x = b.zext(b.load(ptr, typ=ir.IntType(16)), emit.I32)
        return b.bitcast(b.shl(x, ir.Constant(emit.I32, 16)), F32)

    # -- the guard of the direct path: scan the row for one allowed key ------------
    def guard_rows(self, m, o):
        p, b = self.p, self.b
        with for_range(b, 0, p.rows, name="gr") as i:
            lim = i64(p.sk_eff)
            if p.kernel_causal and not p.merge:
                lim = self.smin(lim, b.add(i, i64(p.past + 1)))
            pre = b.block
            fn = b.function
            hdr = fn.append_basic_block("scan.h")
            body = fn.append_basic_block("scan.b")
            nxt = fn.append_basic_block("scan.n")
            empty = fn.append_basic_block("scan.empty")
            done = fn.append_basic_block("scan.done")
            b.branch(hdr)
            b.position_at_end(hdr)
            j = b.phi(I64, name="j")
            j.add_incoming(i64(0), pre)
            b.cbranch(b.icmp_signed("<", j, lim), body, empty)
            b.position_at_end(body)
            b.cbranch(self.mask_allows(m, i, j), done, nxt)
            b.position_at_end(nxt)
            j.add_incoming(b.add(j, i64(1)), nxt)
            b.branch(hdr)
            b.position_at_end(empty)
            self.zero_row(o, i)
            b.branch(done)
            b.position_at_end(done)

    # -- the general path: the additive bias of rows [i0, i0 + rows) ---------------
    def build_bias(self, m, bi, i0, rows: int, bias, flags):
        """bias[r][j] (r < rows, j < sk_eff) = the combined additive bias of row i0 + r;
        flags[r] = 1 if the row allows some key."""
        p, b = self.p, self.b
        ninf = ir.Constant(F32, NEG_INF)
        if p.nonpad:
            nb = b.load(self.gep(self.NP, bi, I64), typ=I64)
            off = b.sub(nb, i64(p.Sq))        # the bottom-right offset of this batch
        else:
            nb, off = None, i64(p.past)
        with for_range(b, 0, rows, name="br") as r:
            i = b.add(i0, r)
            b.store(ir.Constant(emit.I1, 0), self.any_slot)
            brow = self.gep(bias, self.mul(r, p.sk_eff))
            ioff = b.add(i, off)
            with for_range(b, 0, p.sk_eff, name="bj") as j:
                ok = ir.Constant(emit.I1, 1)
                val = ir.Constant(F32, 0.0)
                if m is not None:
                    if p.mask == "bool":
                        ok = self.mask_allows(m, i, j)
                    else:
                        moff = b.add(self.mul(i, p.m[2]), self.mul(j, p.m[3]))
                        val = self.load_mask_f(self.gep(m, moff, self.m_ety))
                if p.causal:
                    ok = b.and_(ok, b.icmp_signed("<=", j, ioff))
                if p.left >= 0 or p.right >= 0:
                    diff = b.sub(ioff, j)
                    if p.left >= 0:
                        ok = b.and_(ok, b.icmp_signed("<=", diff, i64(p.left)))
                    if p.right >= 0:
                        ok = b.and_(ok, b.icmp_signed("<=", b.neg(diff), i64(p.right)))
                if nb is not None:
                    ok = b.and_(ok, b.icmp_signed("<", j, nb))
                x = b.select(ok, val, ninf)
                b.store(x, self.gep(brow, j))
                seen = b.fcmp_unordered("!=", x, ninf)
                b.store(b.or_(b.load(self.any_slot, typ=emit.I1), seen), self.any_slot)
            b.store(b.zext(b.load(self.any_slot, typ=emit.I1), I8), self.gep(flags, r, I8))


def _lower_attention(ctx: LowerCtx) -> None:
    p = analyse(ctx.node, ctx.in_types)
    assert not isinstance(p, str), p
    guard = False
    if p.use_bias:
        guard = True
    elif p.mask is not None:
        c = ctx.const(MASK_IN)
        guard = c is None or _const_mask_has_empty_rows(p, c)
    heads = p.heads
    ctx.flops = 2 * p.B * p.Hq * p.Sq * p.sk_eff * (p.D + p.Dv)
    ctx.single_core = ctx.flops < (1 << 16)
    ctx.notes["attention"] = (f"B{p.B} Hq{p.Hq} Hkv{p.Hkv} Sq{p.Sq} Sk{p.sk_eff}/{p.Sk} "
                              f"D{p.D} Dv{p.Dv} mask={p.mask} causal={int(p.causal)} "
                              f"{'bias' if p.use_bias else 'direct'}"
                              f"{' merged-gqa' if p.merge else ''}"
                              f"{' guard' if guard else ''}")
    E = _Emitter(ctx, p)
    b = E.b
    tb, te = ctx.tile_begin, ctx.tile_end

    if not p.use_bias:
        spec = _spec(p, p.rows, bias=False, ctx=ctx)
        ctx.notes["precision"] = attention_precision_note(spec)
        inner = emit_attention(ctx.module, "attention_head", spec)
        nq = attention_num_tiles(spec)
        ctx.workspace_bytes = attention_workspace_bytes(spec)
        if not guard:
            # fine mode: every head's query blocks are tiles
            ctx.num_tiles = heads * nq
            h0 = b.udiv(tb, i64(nq))
            h1 = b.udiv(b.add(te, i64(nq - 1)), i64(nq))
            with for_range(b, h0, h1, name="head") as hd:
                q, k, v, m, o, _ = E.head_ptrs(hd)
                first = b.mul(hd, i64(nq))
                lo = E.smax(b.sub(tb, first), i64(0))
                hi = E.smin(b.sub(te, first), i64(nq))
                ptrs = [q, k, v] + ([m] if m is not None else []) + [o]
                E.call(inner, ptrs, lo, hi)
        else:
            ctx.num_tiles = heads
            with for_range(b, tb, te, name="head") as hd:
                q, k, v, m, o, _ = E.head_ptrs(hd)
                E.call(inner, [q, k, v, m, o], i64(0), i64(nq))
                E.guard_rows(m, o)
        b.ret_void()
        return

    # general path: the bias of a chunk of query rows is built in the workspace
    R = max(1, min(p.Sq, BIAS_CHUNK_BYTES // (4 * p.sk_eff)))
    nfull, tail = divmod(p.Sq, R)
    specs = [(_spec(p, R, bias=True, ctx=ctx), nfull, 0)]
    if tail:
        specs.append((_spec(p, tail, bias=True, ctx=ctx), 1, nfull * R))
    ctx.notes["precision"] = attention_precision_note(specs[0][0])
    inners = []
    ws_inner = 0
    for k, (spec, _count, _start) in enumerate(specs):
        inners.append(emit_attention(ctx.module, f"attention_rows{k}", spec))
        ws_inner = max(ws_inner, attention_workspace_bytes(spec))
    bias_off = _rup(ws_inner, 64)
    flags_off = bias_off + _rup(R * p.sk_eff * 4, 64)
    ctx.workspace_bytes = flags_off + _rup(R, 64)
    ctx.num_tiles = heads
    bias = E.gep(ctx.workspace, bias_off, I8)
    flags = E.gep(ctx.workspace, flags_off, I8)
    with for_range(b, tb, te, name="head") as hd:
        q, k, v, m, o, bi = E.head_ptrs(hd)
        for (spec, count, start), inner in zip(specs, inners):
            rows = spec.Sq
            nq = attention_num_tiles(spec)
            with for_range(b, 0, count, name="chunk") as c:
                i0 = b.add(i64(start), b.mul(c, i64(R)))
                E.build_bias(m, bi, i0, rows, bias, flags)
                qc = E.gep(q, E.mul(i0, p.q[2]), E.ety[0])
                oc = E.gep(o, E.mul(i0, p.o[2]), E.o_ety)
                E.call(inner, [qc, k, v, bias, oc], i64(0), i64(nq))
                with for_range(b, 0, rows, name="gz") as r:
                    f = b.load(E.gep(flags, r, I8), typ=I8)
                    with b.if_then(b.icmp_unsigned("==", f, ir.Constant(I8, 0))):
                        E.zero_row(oc, r)
    b.ret_void()


register_lowering("Attention")(_lower_attention)
