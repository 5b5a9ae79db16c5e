"""The recurrent layers' kernel (RNN, GRU, LSTM; cannc/ir/ops/rnn.py).

One kernel per node. Every (direction, batch entry) is an independent recurrence,
so it is one tile: the tile walks the time steps in order, keeping the hidden
(and cell) state in the core's workspace, computing the gate pre-activations as
dot products over the input and the previous hidden state, and writing Y, Y_h
and Y_c. Steps past a batch entry's sequence length write zeros to Y and leave
the state as it was (the ONNX semantics).
"""

from __future__ import annotations

from collections.abc import Callable

import llvmlite.ir as ir
import numpy as np

from ...ir.ops import rnn as spec
from ...native import emit
from ...native.emit import F32, I64, for_range, i64
from .. import vmath
from ..kernel import LowerCtx
from .base import register_lowering


def _act(b: ir.IRBuilder, name: str) -> Callable[[ir.Value], ir.Value]:
    if name == "Sigmoid":
        return lambda x: vmath.sigmoid(b, x)
    if name == "Tanh":
        return lambda x: vmath.tanh(b, x)
    return lambda x: emit.intrinsic(b, "llvm.maxnum", [x, ir.Constant(F32, 0.0)])


def _lower_rnn(ctx: LowerCtx) -> None:
    n = ctx.node
    kind = n.op_type
    G = spec.GATES[kind]
    xt = ctx.in_types[0]
    layout = int(ctx.attr("layout", 0)) if ctx.opset >= 14 else 0
    S, B, I = ([int(d) for d in xt.shape] if layout == 0
               else [int(xt.shape[1]), int(xt.shape[0]), int(xt.shape[2])])
    D = spec.ndirs(n)
    H = int(ctx.attr("hidden_size", int(ctx.in_types[1].shape[1]) // G))
    direction = spec.direction(n)
    acts = spec.acts(n)
    per_dir = len(spec.DEFAULT_ACTS[kind])
    clip = ctx.attr("clip", None)
    lbr = int(ctx.attr("linear_before_reset", 0)) if kind == "GRU" else 0
    has_b, has_len, has_h0 = spec.present(n, 3), spec.present(n, 4), spec.present(n, 5)
    has_c0 = kind == "LSTM" and spec.present(n, 6)
    has_p = kind == "LSTM" and spec.present(n, 7)
    outs = [bool(o) for o in n.outputs] + [False] * 3
    ctx.num_tiles = max(1, D * B)
    ctx.single_core = True  # tiny recurrences: one core, no hand-off cost
    ctx.workspace_bytes = 4 * (9 * H + 4)
    ctx.flops = 2 * S * D * B * G * H * (I + H)
    fn, b = ctx.begin()
    x, w, r = ctx.in_ptr(b, 0), ctx.in_ptr(b, 1), ctx.in_ptr(b, 2)
    bias = ctx.in_ptr(b, 3) if has_b else None
    lens = ctx.in_ptr(b, 4) if has_len else None
    h0 = ctx.in_ptr(b, 5) if has_h0 else None
    c0 = ctx.in_ptr(b, 6) if has_c0 else None
    peep = ctx.in_ptr(b, 7) if has_p else None
    y = ctx.out_ptr(b, 0) if outs[0] else None
    yh = ctx.out_ptr(b, 1) if outs[1] else None
    yc = ctx.out_ptr(b, 2) if kind == "LSTM" and outs[2] else None
    ws = ctx.workspace
    h_buf = emit.gep(b, ws, 0, F32)
    c_buf = emit.gep(b, ws, H, F32)
    hn_buf = emit.gep(b, ws, 2 * H, F32)
    g_buf = emit.gep(b, ws, 3 * H, F32)       # G*H gate pre-activations (<= 4H)
    rh_buf = emit.gep(b, ws, 7 * H, F32)      # GRU: r (.) h, or Ht-1*Rh + Rbh
    acc_p = b.alloca(F32)

    def ld(p: ir.Value, off: ir.Value | int) -> ir.Value:
        return b.load(emit.gep(b, p, off if isinstance(off, ir.Value) else i64(off), F32), typ=F32)

    def st(v: ir.Value, p: ir.Value, off: ir.Value | int) -> None:
        b.store(v, emit.gep(b, p, off if isinstance(off, ir.Value) else i64(off), F32))

    def clipped(v: ir.Value) -> ir.Value:
        if clip is None:
            return v
        c = float(clip)
        v = emit.intrinsic(b, "llvm.minnum", [v, ir.Constant(F32, c)])
        return emit.intrinsic(b, "llvm.maxnum", [v, ir.Constant(F32, -c)])

    def x_off(t: ir.Value, bi: ir.Value) -> ir.Value:
        row = b.add(b.mul(t, i64(B)), bi) if layout == 0 else b.add(b.mul(bi, i64(S)), t)
        return b.mul(row, i64(I))

    def y_off(t: ir.Value, d: ir.Value, bi: ir.Value) -> ir.Value:
        if layout == 0:
            row = b.add(b.mul(b.add(b.mul(t, i64(D)), d), i64(B)), bi)
        else:
            row = b.add(b.mul(b.add(b.mul(bi, i64(S)), t), i64(D)), d)
        return b.mul(row, i64(H))

    def state_off(d: ir.Value, bi: ir.Value) -> ir.Value:
        row = b.add(b.mul(d, i64(B)), bi) if layout == 0 else b.add(b.mul(bi, i64(D)), d)
        return b.mul(row, i64(H))

    def dot(mat: ir.Value, mat_off: ir.Value, vec: ir.Value, vec_off: ir.Value, k_len: int,
            name: str) -> None:
        """acc += sum_k mat[mat_off + k] * vec[vec_off + k]"""
        with for_range(b, 0, k_len, name=name) as k:
            a = b.load(acc_p, typ=F32)
            m = ld(mat, b.add(mat_off, k))
            v = ld(vec, b.add(vec_off, k))
            b.store(emit.intrinsic(b, "llvm.fma", [m, v, a]), acc_p)

    def dir_acts(d_is_rev: ir.Value, k: int) -> Callable[[ir.Value], ir.Value]:
        fwd_f = _act(b, acts[k])
        if D == 1:
            return fwd_f
        rev_f = _act(b, acts[per_dir + k])
        return lambda v: b.select(d_is_rev, rev_f(v), fwd_f(v))

    with for_range(b, ctx.tile_begin, ctx.tile_end, name="tile") as tile:
        d = b.udiv(tile, i64(B))
        bi = b.urem(tile, i64(B))
        rev = b.icmp_unsigned("==", d, i64(1)) if D == 2 else \
            ir.Constant(emit.I1, 1 if direction == "reverse" else 0)
        f_act, g_act = dir_acts(rev, 0), dir_acts(rev, 1) if per_dir > 1 else None
        h_act = dir_acts(rev, 2) if per_dir > 2 else None
        so = state_off(d, bi)
        with for_range(b, 0, H, name="init") as j:
            st(ld(h0, b.add(so, j)) if h0 is not None else ir.Constant(F32, 0.0), h_buf, j)
            st(ld(c0, b.add(so, j)) if c0 is not None else ir.Constant(F32, 0.0), c_buf, j)
        if lens is not None:
            ldt = np.dtype(ctx.in_types[4].dtype)
            lt = emit.llvm_type(ldt)
            L = b.load(emit.gep(b, lens, bi, lt), typ=lt)
            L = b.sext(L, I64) if lt.width < 64 else L
            L = b.select(b.icmp_signed(">", L, i64(S)), i64(S), L)
            L = b.select(b.icmp_signed("<", L, i64(0)), i64(0), L)
        else:
            L = i64(S)
        if y is not None and lens is not None:
            with for_range(b, L, i64(S), name="pad") as t:
                yo = y_off(t, d, bi)
                with for_range(b, 0, H, name="z") as j:
                    st(ir.Constant(F32, 0.0), y, b.add(yo, j))
        w_base = b.mul(d, i64(G * H * I))
        r_base = b.mul(d, i64(G * H * H))
        b_base = b.mul(d, i64(2 * G * H))
        with for_range(b, 0, L, name="step") as step:
            t = b.select(rev, b.sub(b.sub(L, i64(1)), step), step)
            xo = x_off(t, bi)

            def gate(g: int, j: ir.Value, with_rec: bool = True) -> ir.Value:
                """pre-activation of gate g, unit j: x.W + (h.R) + Wb (+ Rb)"""
                row = b.add(i64(g * H), j)
                init = ir.Constant(F32, 0.0)
                if bias is not None:
                    init = ld(bias, b.add(b_base, row))
                    if with_rec:
                        init = b.fadd(init, ld(bias, b.add(b_base, b.add(row, i64(G * H)))))
                b.store(init, acc_p)
                dot(w, b.add(w_base, b.mul(row, i64(I))), x, xo, I, "kx")
                if with_rec:
                    dot(r, b.add(r_base, b.mul(row, i64(H))), h_buf, i64(0), H, "kh")
                return b.load(acc_p, typ=F32)

            if kind == "RNN":
                with for_range(b, 0, H, name="j") as j:
                    st(f_act(clipped(gate(0, j))), hn_buf, j)
            elif kind == "LSTM":
                # gate order i, o, f, c
                with for_range(b, 0, H, name="j") as j:
                    for g in range(4):
                        st(gate(g, j), g_buf, b.add(i64(g * H), j))
                with for_range(b, 0, H, name="j2") as j:
                    cp = ld(c_buf, j)

                    def pre(g: int, cell: ir.Value) -> ir.Value:
                        v = ld(g_buf, b.add(i64(g * H), j))
                        if peep is not None and g in (0, 1, 2):
                            pk = {0: 0, 1: 1, 2: 2}[g]
                            pv = ld(peep, b.add(b.mul(d, i64(3 * H)), b.add(i64(pk * H), j)))
                            v = emit.intrinsic(b, "llvm.fma", [pv, cell, v])
                        return clipped(v)

                    it = f_act(pre(0, cp))
                    ft = f_act(pre(2, cp))
                    ct = g_act(pre(3, cp))
                    cn = b.fadd(b.fmul(ft, cp), b.fmul(it, ct))
                    ot = f_act(pre(1, cn))
                    st(cn, c_buf, j)
                    st(b.fmul(ot, h_act(cn)), hn_buf, j)
            else:  # GRU: gate order z, r, h
                with for_range(b, 0, H, name="j") as j:
                    st(f_act(clipped(gate(0, j))), g_buf, j)
                    st(f_act(clipped(gate(1, j))), g_buf, b.add(i64(H), j))
                rh_row = b.add(r_base, i64(2 * H * H))
                with for_range(b, 0, H, name="j2") as j:
                    rj = ld(g_buf, b.add(i64(H), j))
                    if lbr:
                        # rt (.) (Ht-1 Rh^T + Rbh)
                        b.store(ld(bias, b.add(b.add(b_base, i64(5 * H)), j))
                                if bias is not None else ir.Constant(F32, 0.0), acc_p)
                        dot(r, b.add(rh_row, b.mul(j, i64(H))), h_buf, i64(0), H, "kr")
                        st(b.fmul(rj, b.load(acc_p, typ=F32)), rh_buf, j)
                    else:
                        st(b.fmul(rj, ld(h_buf, j)), rh_buf, j)
                with for_range(b, 0, H, name="j3") as j:
                    # x.Wh + Wbh (+ Rbh when the reset applies before the product)
                    pre = gate(2, j, with_rec=False)
                    if lbr:
                        pre = b.fadd(pre, ld(rh_buf, j))
                    else:
                        if bias is not None:
                            pre = b.fadd(pre, ld(bias, b.add(b.add(b_base, i64(5 * H)), j)))
                        b.store(pre, acc_p)
                        dot(r, b.add(rh_row, b.mul(j, i64(H))), rh_buf, i64(0), H, "kq")
                        pre = b.load(acc_p, typ=F32)
                    ht = g_act(clipped(pre))
                    z = ld(g_buf, j)
                    hp = ld(h_buf, j)
                    one = ir.Constant(F32, 1.0)
                    st(b.fadd(b.fmul(b.fsub(one, z), ht), b.fmul(z, hp)), hn_buf, j)
            yo = y_off(t, d, bi) if y is not None else None
            with for_range(b, 0, H, name="cp") as j:
                v = ld(hn_buf, j)
                st(v, h_buf, j)
                if yo is not None:
                    st(v, y, b.add(yo, j))
        with for_range(b, 0, H, name="fin") as j:
            if yh is not None:
                st(ld(h_buf, j), yh, b.add(so, j))
            if yc is not None:
                st(ld(c_buf, j), yc, b.add(so, j))
    b.ret_void()


for _name in ("RNN", "GRU", "LSTM"):
    register_lowering(_name)(_lower_rnn)
