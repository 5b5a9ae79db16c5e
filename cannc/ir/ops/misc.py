"""Ops with their own small loop nests: TopK, Einsum, CumProd, LRN, RotaryEmbedding.

What they are (schemas and checks); how each loop nest is emitted is in
codegen/lower/misc.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..graph import Node
from ..registry import Amp, Category, OpDef, register

FLOATS = frozenset({"float32", "float64", "float16", "bfloat16"})
INTS = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})
NUMERIC = FLOATS | INTS


def _input_dtypes(allowed: frozenset[str], slots: Sequence[int] = (0,)):
    def check(n: Node, ins: list, outs: list) -> str | None:
        for i in slots:
            t = ins[i] if i < len(ins) else None
            if t is not None and np.dtype(t.dtype).name not in allowed:
                return f"input {i} dtype {np.dtype(t.dtype).name} not supported " \
                       f"(supported: {', '.join(sorted(allowed))})"
        return None
    return check


# ---------------------------------------------------------------------------
# TopK
# ---------------------------------------------------------------------------

def _topk_check(n: Node, ins: list, outs: list) -> str | None:
    r = _input_dtypes(NUMERIC)(n, ins, outs)
    if r:
        return r
    if any(not o for o in n.outputs[:2]) and len(n.outputs) < 2:
        return "TopK needs both outputs"
    return None


register(OpDef(name="TopK", category=Category.OPAQUE, check=_topk_check, value_inputs=(1,),
               doc="one row per tile; insertion into the k best (stable ties)"))


# ---------------------------------------------------------------------------
# Einsum
# ---------------------------------------------------------------------------

def parse_einsum(eq: str, ranks: Sequence[int]) -> tuple[list[str], str] | str:
    """Operand subscripts and output subscript with '...' expanded into capital letters."""
    eq = eq.replace(" ", "")
    if "->" in eq:
        lhs, out = eq.split("->")
        explicit = True
    else:
        lhs, out, explicit = eq, "", False
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        return f"equation has {len(terms)} operands, node has {len(ranks)}"
    ell_rank = 0
    for t, r in zip(terms, ranks):
        if "..." in t:
            ell_rank = max(ell_rank, r - (len(t) - 3))
    ell = "".join(chr(ord("A") + i) for i in range(ell_rank))
    full = []
    for t, r in zip(terms, ranks):
        if "..." in t:
            k = r - (len(t) - 3)
            t = t.replace("...", ell[ell_rank - k:] if k else "")
        if len(t) != r:
            return f"subscripts '{t}' do not match an operand of rank {r}"
        full.append(t)
    if explicit:
        out = out.replace("...", ell)
    else:
        counts: dict[str, int] = {}
        for t in full:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        out = ell + "".join(sorted(c for c, m in counts.items() if m == 1 and c not in ell))
    return full, out


def _einsum_check(n: Node, ins: list, outs: list) -> str | None:
    r = _input_dtypes(NUMERIC, range(len(ins)))(n, ins, outs)
    if r:
        return r
    eq = n.attrs.get("equation", "")
    eq = eq.decode() if isinstance(eq, bytes) else eq
    p = parse_einsum(eq, [len(t.shape) for t in ins])
    return p if isinstance(p, str) else None


register(OpDef(name="Einsum", category=Category.CONTRACTION, min_opset=12,
               amp=Amp.DENY,    # a loop nest: nothing to gain from narrow products
               check=_einsum_check, doc="direct loop nest (diagonals, ellipses, broadcasting)"))


register(OpDef(name="CumProd", category=Category.OPAQUE, min_opset=26,
               check=_input_dtypes(NUMERIC), value_inputs=(1,),
               doc="running product along the axis"))


def _lrn_check(n: Node, ins: list, outs: list) -> str | None:
    r = _input_dtypes(FLOATS)(n, ins, outs)
    if r:
        return r
    if len(ins[0].shape) < 3:
        return "the input must have rank >= 3 (N, C, D1, ...)"
    return None


def lrn_window(size: int) -> tuple[int, int]:
    """Channels below and above c in LRN's window: [c - floor((size-1)/2), c + ceil(...)]."""
    return (size - 1) // 2, size - 1 - (size - 1) // 2


def _lrn_reference(n: Node, inputs: list[Any]) -> list[np.ndarray]:
    """y = x / (bias + alpha/size * sum of x^2 over the window) ^ beta, as onnxruntime."""
    x = np.asarray(inputs[0])
    size = int(n.attrs["size"])
    alpha, beta = float(n.attrs.get("alpha", 1e-4)), float(n.attrs.get("beta", 0.75))
    bias = float(n.attrs.get("bias", 1.0))
    ct = np.float32 if x.dtype.itemsize < 4 else x.dtype.type
    xc = x.astype(ct)
    sq = xc * xc
    lo, hi = lrn_window(size)
    C = x.shape[1]
    acc = np.zeros_like(sq)
    for c in range(C):
        acc[:, c] = sq[:, max(0, c - lo):min(C, c + hi + 1)].sum(axis=1)
    den = (acc * ct(alpha / size) + ct(bias)) ** ct(beta)
    return [(xc / den).astype(x.dtype)]


register(OpDef(name="LRN", category=Category.OPAQUE, check=_lrn_check, reference=_lrn_reference,
               doc="window of channels; one (n, c) plane per tile"))


def _rope_check(n: Node, ins: list, outs: list) -> str | None:
    r = _input_dtypes(FLOATS, (0, 1, 2))(n, ins, outs)
    if r:
        return r
    x = ins[0]
    if len(x.shape) not in (3, 4):
        return f"input of rank {len(x.shape)} (3 or 4 supported)"
    if len(x.shape) == 3 and not int(n.attrs.get("num_heads", 0)):
        return "a 3-D input needs num_heads"
    return None


register(OpDef(name="RotaryEmbedding", category=Category.OPAQUE, min_opset=23,
               check=_rope_check,
               doc="one (batch, head, position) row per tile; runtime position ids"))
