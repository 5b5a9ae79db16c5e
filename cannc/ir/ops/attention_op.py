"""The ONNX Attention op (opset 23+), lowered onto the fused flash-attention kernel.

``Y = softmax(Q Kᵀ * scale + bias) V`` per (batch, query head), where ``bias``
combines the optional ``attn_mask`` (bool: False -> -inf; float: added), the
causal frontier (``is_causal``: query i sees key j iff ``j <= i + offset``,
``offset`` = past length, or ``nonpad_kv_seqlen[b] - Sq``), the opset-24
``nonpad_kv_seqlen`` key padding and the opset-25 sliding window. A query row
whose keys are *all* disallowed is a zero row (the spec's fully-masked-row
guard), not NaN.

What reaches this lowering is float32 with no past state: the
``legalize_attention`` pass (passes/legalize.py) concatenates ``past_key`` /
``past_value`` before K / V with Concat nodes (which also produce
``present_key`` / ``present_value``; the past length is kept in the attribute
``cannc_past_len``) and wraps float16/bfloat16 nodes in Casts to float32. So
K/V may be 4-D here while Q is 3-D.

Layouts: 3-D operands ``[B, S, heads*d]`` and 4-D ``[B, heads, S, d]`` are
both read in place, through the element strides of codegen.attention.AttnSpec;
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

Not supported (the fused kernel lacks them; the node is reported unsupported):
``softcap``, the ``qk_matmul_output`` output, ``softmax_precision`` narrower than
float32, float64 inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import llvmlite.ir as ir
import numpy as np
from onnx import TensorProto

from ...native import emit
from ...native.emit import F32, I8, I64, PTR, for_range, i64
from ..graph import Node
from ..registry import Category, OpDef, register

Q_IN, K_IN, V_IN, MASK_IN, PAST_K_IN, PAST_V_IN, NONPAD_IN = range(7)
PAST_LEN_ATTR = "cannc_past_len"     # set by legalize_attention when it folded past_key in

NEG_INF = float("-inf")
BIAS_CHUNK_BYTES = 1 << 20           # per-core bias buffer of the general path (rows chunked)
_LEGAL_DTYPES = ("float32", "float16", "bfloat16")   # what legalize_attention can take


def _in(n: Node, i: int) -> str:
    return n.inputs[i] if i < len(n.inputs) else ""


def _out(n: Node, j: int) -> str:
    return n.outputs[j] if j < len(n.outputs) else ""


def feature_problem(n: Node, q_dtype: Any) -> str | None:
    """Attention features the fused kernel cannot compute (a reason), else None."""
    if float(n.attrs.get("softcap", 0.0) or 0.0) != 0.0:
        return ("softcap: codegen/attention.py has no score transform (tanh soft-capping) "
                "between QKᵀ and the mask")
    if _out(n, 3):
        mode = int(n.attrs.get("qk_matmul_output_mode", 0))
        return (f"the qk_matmul_output output (mode {mode}): the fused kernel never "
                "materialises the score matrix")
    dt = np.dtype(q_dtype)
    if dt.name not in _LEGAL_DTYPES:
        return f"dtype {dt.name} (float32, or float16/bfloat16 computed in float32)"
    sp = n.attrs.get("softmax_precision")
    if sp is not None and int(sp) not in (TensorProto.FLOAT, TensorProto.DOUBLE):
        # the kernel's softmax is float32: as exact as asked for float16/bfloat16 graphs
        # (whose reference rounds the softmax to T1), not narrower than float32
        allowed = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
        if allowed.get(dt.name) != int(sp):
            return (f"softmax_precision={TensorProto.DataType.Name(int(sp))}: the fused "
                    "kernel's softmax is float32")
    return None


# ---------------------------------------------------------------------------
# analysis: shapes, strides and which of the kernel's features express the bias
# ---------------------------------------------------------------------------


@dataclass
class Plan:
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int            # keys in K / V (past included)
    D: int
    Dv: int
    q: tuple           # element strides (b, h, s, d) of each operand
    k: tuple
    v: tuple
    o: tuple
    scale: float
    mask: str | None   # None | 'bool' | 'float32'
    m: tuple           # mask strides (b, h, i, j), 0 = broadcast
    W: int             # mask width (keys past it are masked)
    causal: bool
    past: int
    nonpad: bool
    left: int          # sliding window (-1: unbounded)
    right: int
    sk_eff: int        # keys the kernel visits (the others are masked for every row)
    kernel_causal: bool
    use_bias: bool     # the bias is built in the workspace (general path)
    merge: bool = False  # decoding GQA (Sq = 1): the G query heads of a KV head are the rows

    @property
    def G(self) -> int:
        return self.Hq // self.Hkv

    # the kernel's view: `heads` calls of `rows` query rows (element strides q_r, o_r, m_r)
    @property
    def heads(self) -> int:
        return self.B * (self.Hkv if self.merge else self.Hq)

    @property
    def rows(self) -> int:
        return self.G if self.merge else self.Sq

    @property
    def q_r(self) -> int:
        return self.q[1] if self.merge else self.q[2]

    @property
    def o_r(self) -> int:
        return self.o[1] if self.merge else self.o[2]

    @property
    def m_r(self) -> int:
        return self.m[1] if self.merge else self.m[2]


def _strides(shape: tuple, heads: int) -> tuple[tuple[int, int, int, int], int, int]:
    """(b, h, s, d) strides, sequence length and head size of a 3-D or 4-D operand."""
    if len(shape) == 4:
        _, H, S, d = shape
        return (H * S * d, S * d, d, 1), S, d
    _, S, hd = shape
    d = hd // heads
    return (S * hd, d, hd, 1), S, d


def analyse(n: Node, ins: list) -> Plan | str:
    """The plan of node n for its input types, or the reason it cannot be lowered."""
    qt, kt, vt = ins[Q_IN], ins[K_IN], ins[V_IN]
    if qt is None or kt is None or vt is None:
        return "Q, K and V are required"
    for nm, t in (("Q", qt), ("K", kt), ("V", vt)):
        if np.dtype(t.dtype) != np.float32:
            return (f"{nm} is {np.dtype(t.dtype).name}: float16/bfloat16 Attention is cast to "
                    "float32 by the legalize_attention pass; only float32 reaches the kernel")
        if len(t.shape) not in (3, 4):
            return f"{nm} of rank {len(t.shape)} (3 or 4)"
    if _in(n, PAST_K_IN) or _in(n, PAST_V_IN) or _out(n, 1) or _out(n, 2):
        return ("past_key/past_value and present_key/present_value are handled by the "
                "legalize_attention pass, which could not take this node (both past inputs "
                "are needed, shaped [batch, kv_num_heads, past, head_size], and not together "
                "with nonpad_kv_seqlen)")
    qs, ks, vs = (tuple(int(d) for d in t.shape) for t in (qt, kt, vt))
    if (len(qs) == 3 or len(ks) == 3) and not (n.attrs.get("q_num_heads")
                                               and n.attrs.get("kv_num_heads")):
        return "3-D inputs need q_num_heads and kv_num_heads"
    Hq = qs[1] if len(qs) == 4 else int(n.attrs["q_num_heads"])
    Hkv = ks[1] if len(ks) == 4 else int(n.attrs["kv_num_heads"])
    if len(vs) == 4 and vs[1] != Hkv:
        return f"K has {Hkv} heads, V {vs[1]}"
    if Hq < 1 or Hkv < 1 or Hq % Hkv:
        return f"q_num_heads {Hq} is not a multiple of kv_num_heads {Hkv}"
    for nm, s, h in (("Q", qs, Hq), ("K", ks, Hkv), ("V", vs, Hkv)):
        if len(s) == 3 and s[2] % h:
            return f"{nm}'s hidden size {s[2]} is not a multiple of its {h} heads"
    q, Sq, D = _strides(qs, Hq)
    k, Sk, Dk = _strides(ks, Hkv)
    v, Skv, Dv = _strides(vs, Hkv)
    B = qs[0]
    if ks[0] != B or vs[0] != B:
        return "Q, K and V have different batch sizes"
    if Dk != D:
        return f"Q's head size {D} differs from K's {Dk}"
    if Skv != Sk:
        return f"K has {Sk} keys, V {Skv}"
    if min(B, Sq, Sk, D, Dv) < 1:
        return "an empty dimension"
    if len(qs) == 4:
        o = (Hq * Sq * Dv, Sq * Dv, Dv, 1)
    else:
        o = (Sq * Hq * Dv, Dv, Hq * Dv, 1)
    scale = n.attrs.get("scale")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    # the reference scales Q and K by sqrt(scale) rounded to the input type (float32 here)
    half = float(np.float32(math.sqrt(scale))) if scale >= 0 else float("nan")
    scale_eff = half * half

    mask, m, W = None, (0, 0, 0, 0), Sk
    mt = ins[MASK_IN] if len(ins) > MASK_IN else None
    if _in(n, MASK_IN) and mt is not None:
        mdt = np.dtype(mt.dtype)
        if mdt == np.bool_:
            mask = "bool"
        elif mdt == np.float32:
            mask = "float32"
        else:
            return f"attn_mask of dtype {mdt.name} (bool or float32)"
        ms = tuple(int(d) for d in mt.shape)
        if not 1 <= len(ms) <= 4:
            return f"attn_mask of rank {len(ms)}"
        W = ms[-1]
        if W > Sk or W < 1:
            return f"attn_mask has {W} keys, K/V {Sk}"
        full = (B, Hq, Sq)
        ms4 = (1,) * (4 - len(ms)) + ms
        for a, f in zip(ms4[:3], full):
            if a not in (1, f):
                return f"attn_mask shape {list(ms)} does not broadcast to {[B, Hq, Sq, Sk]}"
        dense = [0, 0, 0, 1]
        acc = 1
        for d in range(3, -1, -1):
            dense[d] = acc
            acc *= ms4[d]
        m = tuple(0 if (ms4[d] == 1 and d < 3) else dense[d] for d in range(4))
    nonpad = bool(_in(n, NONPAD_IN))
    if nonpad:
        nt = ins[NONPAD_IN]
        if nt is None or np.dtype(nt.dtype) != np.int64 or tuple(nt.shape) != (B,):
            return "nonpad_kv_seqlen must be int64 [batch]"
    causal = bool(int(n.attrs.get("is_causal", 0)))
    past = int(n.attrs.get(PAST_LEN_ATTR, 0))
    left = int(n.attrs.get("left_window_size", -1))
    right = int(n.attrs.get("right_window_size", -1))
    if left < -1 or right < -1:
        return "window sizes must be -1 or >= 0"
    sk_eff = min(Sk, W)
    use_bias = nonpad or left >= 0 or right >= 0
    kernel_causal = False
    if causal and not use_bias:
        # keys past Sq - 1 + past are seen by no query: dropped, the kernel's bottom-right
        # causal offset (keys - Sq) is then exactly the spec's offset (past)
        if sk_eff >= Sq + past:
            sk_eff = Sq + past
            kernel_causal = True
        else:
            use_bias = True
    # one query per head (decoding) with grouped KV heads: the G query heads sharing a KV
    # head are G rows of one kernel call (K packed once per KV head, not per query head).
    # Causal is then a no-op: the single query sees every key left after the truncation.
    merge = Sq == 1 and Hq > Hkv and not use_bias
    return Plan(merge=merge, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, Dv=Dv, q=q, k=k, v=v, o=o,
                scale=scale_eff, mask=mask, m=m, W=W, causal=causal, past=past,
                nonpad=nonpad, left=left, right=right, sk_eff=sk_eff,
                kernel_causal=kernel_causal, use_bias=use_bias)


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


def _infer(n: Node, ins: list) -> list:
    """Output types where ONNX's inference gives none (present_* requested without a
    past): Y, present_key, present_value, qk_matmul_output."""
    from ..types import TensorType

    qt, kt, vt = ins[Q_IN], ins[K_IN], ins[V_IN]
    qs, ks, vs = (tuple(int(d) for d in t.shape) for t in (qt, kt, vt))
    Hq = qs[1] if len(qs) == 4 else int(n.attrs["q_num_heads"])
    Hkv = ks[1] if len(ks) == 4 else int(n.attrs["kv_num_heads"])
    _, Sq, _ = _strides(qs, Hq)
    _, S, D = _strides(ks, Hkv)
    _, _, Dv = _strides(vs, Hkv)
    pk = ins[PAST_K_IN] if len(ins) > PAST_K_IN else None
    T = S + (int(pk.shape[2]) if pk is not None else 0)
    B, dt = qs[0], qt.dtype
    y = (B, Hq, Sq, Dv) if len(qs) == 4 else (B, Sq, Hq * Dv)
    shapes = [y, (B, Hkv, T, D), (B, Hkv, T, Dv), (B, Hq, Sq, T)]
    return [TensorType(dt, s) if _out(n, j) else None for j, s in enumerate(shapes)]


def _check(n: Node, ins: list, outs: list) -> str | None:
    if ins and ins[0] is not None:
        why = feature_problem(n, ins[0].dtype)
        if why:
            return why
    p = analyse(n, ins)
    return p if isinstance(p, str) else None


# ---------------------------------------------------------------------------
# lowering
# ---------------------------------------------------------------------------


def _spec(p: Plan, Sq: int, bias: bool):
    from ...codegen.attention import AttnSpec

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

    def __init__(self, ctx: Any, p: Plan) -> None:
        self.ctx, self.p = ctx, p
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

        def at(ptr, st, h, ty=F32):
            return self.gep(ptr, b.add(self.mul(bi, st[0]), self.mul(h, st[1])), ty)

        q = at(self.Q, p.q, hi)
        k = at(self.K, p.k, kvh)
        v = at(self.V, p.v, kvh)
        o = at(self.O, p.o, hi)
        m = None
        if self.M is not None:
            m = at(self.M, p.m, hi, I8 if p.mask == "bool" else F32)
        return q, k, v, m, o, bi

    def call(self, inner, ptrs, t0, t1):
        b = self.b
        for i, ptr in enumerate(ptrs):
            b.store(ptr, b.gep(self.arr, [i64(i)], source_etype=PTR))
        b.call(inner, [self.arr, t0, t1, self.ctx.workspace])

    def zero_row(self, o, i):
        """O[i, :] = 0 (rows without any allowed key)."""
        p, b = self.p, self.b
        row = self.gep(o, self.mul(i, p.o_r))
        with for_range(b, 0, p.Dv, name="zr") as e:
            b.store(ir.Constant(F32, 0.0), self.gep(row, self.mul(e, p.o[3])))

    def mask_allows(self, m, i, j):
        """i1: the user mask allows key j of row i (bool True / float != -inf)."""
        p, b = self.p, self.b
        off = b.add(self.mul(i, p.m_r), self.mul(j, p.m[3]))
        if p.mask == "bool":
            x = b.load(self.gep(m, off, I8), typ=I8)
            return b.icmp_unsigned("!=", x, ir.Constant(I8, 0))
        x = b.load(self.gep(m, off), typ=F32)
        return b.fcmp_unordered("!=", x, ir.Constant(F32, NEG_INF))

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
                        val = b.load(self.gep(m, moff), typ=F32)
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


def _lower_attention(ctx: Any) -> None:
    from ...codegen.attention import attention_num_tiles, attention_workspace_bytes, emit_attention

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
        spec = _spec(p, p.rows, bias=False)
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
    specs = [(_spec(p, R, bias=True), nfull, 0)]
    if tail:
        specs.append((_spec(p, tail, bias=True), 1, nfull * R))
    inners = []
    ws_inner = 0
    for k, (spec, count, start) in enumerate(specs):
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
                qc = E.gep(q, E.mul(i0, p.q[2]))
                oc = E.gep(o, E.mul(i0, p.o[2]))
                E.call(inner, [qc, k, v, bias, oc], i64(0), i64(nq))
                with for_range(b, 0, rows, name="gz") as r:
                    f = b.load(E.gep(flags, r, I8), typ=I8)
                    with b.if_then(b.icmp_unsigned("==", f, ir.Constant(I8, 0))):
                        E.zero_row(oc, r)
    b.ret_void()


register(OpDef(name="Attention", category=Category.OPAQUE, min_opset=23,
               lower=_lower_attention, check=_check, extra={"infer": _infer},
               doc="scaled dot-product attention (MHA/GQA/MQA, masks, causal, KV cache via "
                   "legalize_attention) on the fused flash-attention kernel"))
