"""The ONNX Attention op (opset 23+), computed by the fused flash-attention kernel.

``Y = softmax(Q Kᵀ * scale + bias) V`` per (batch, query head), where ``bias``
combines the optional ``attn_mask`` (bool: False -> -inf; float: added), the
causal frontier (``is_causal``: query i sees key j iff ``j <= i + offset``,
``offset`` = past length, or ``nonpad_kv_seqlen[b] - Sq``), the opset-24
``nonpad_kv_seqlen`` key padding and the opset-25 sliding window. A query row
whose keys are *all* disallowed is a zero row (the spec's fully-masked-row
guard), not NaN.

What reaches the lowering has no past state: the ``legalize_attention`` pass
(passes/legalize.py) concatenates ``past_key`` / ``past_value`` before K / V with
Concat nodes (which also produce ``present_key`` / ``present_value``; the past
length is kept in the attribute ``cannc_past_len``). So K/V may be 4-D here while
Q is 3-D. Q, K, V, a float mask and Y may each be float32, float16 or bfloat16: the
kernel converts on load and store; it multiplies in bf16 (vdpbf16ps, float32
accumulation) for bfloat16 operands or the node attribute ``cannc_precision="bf16"``
where the CPU makes that faster, else in float32; the softmax is always float32 (at
least as exact as any ``softmax_precision``).

The lowering is in codegen/lower/attention.py.

Not supported (the fused kernel lacks them; the node is reported unsupported):
``softcap``, the ``qk_matmul_output`` output, ``softmax_precision`` narrower than
float32, float64 inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..graph import Node
from ..registry import Category, OpDef, register
from ..types import TensorType

Q_IN, K_IN, V_IN, MASK_IN, PAST_K_IN, PAST_V_IN, NONPAD_IN = range(7)
PAST_LEN_ATTR = "cannc_past_len"     # set by legalize_attention when it folded past_key in
_LEGAL_DTYPES = ("float32", "float16", "bfloat16")   # what the kernel takes


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
        return f"dtype {dt.name} (float32, float16 or bfloat16)"
    sp = n.attrs.get("softmax_precision")
    from onnx import TensorProto  # here: `import cannc` does not import onnx

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
    mask: str | None   # None | 'bool' | a float dtype name ('float32', 'bfloat16'...)
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
        if np.dtype(t.dtype).name not in _LEGAL_DTYPES:
            return f"{nm} is {np.dtype(t.dtype).name} (float32, float16 or bfloat16)"
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
    # the reference scales Q and K by sqrt(scale) rounded to the input type
    half = float(np.asarray(math.sqrt(scale)).astype(np.dtype(qt.dtype)).astype(np.float64)) \
        if scale >= 0 else float("nan")
    scale_eff = half * half

    mask, m, W = None, (0, 0, 0, 0), Sk
    mt = ins[MASK_IN] if len(ins) > MASK_IN else None
    if _in(n, MASK_IN) and mt is not None:
        mdt = np.dtype(mt.dtype)
        if mdt == np.bool_:
            mask = "bool"
        elif mdt.name in _LEGAL_DTYPES:
            mask = mdt.name
        else:
            return f"attn_mask of dtype {mdt.name} (bool, float32, float16 or bfloat16)"
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


def _infer(n: Node, ins: list) -> list:
    """Output types where ONNX's inference gives none (present_* requested without a
    past): Y, present_key, present_value, qk_matmul_output."""
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


register(OpDef(name="Attention", category=Category.OPAQUE, min_opset=23,
               check=_check, infer=_infer,
               doc="scaled dot-product attention (MHA/GQA/MQA, masks, causal, KV cache via "
                   "legalize_attention) on the fused flash-attention kernel"))
