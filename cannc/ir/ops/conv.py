"""Convolution and pooling: Conv, ConvTranspose, MaxPool, AveragePool, LpPool.

Their lowerings (codegen/lower/conv.py) normalise every op to three spatial
dimensions and use the implicit GEMM or Winograd (codegen/conv.py,
codegen/winograd.py) for the convolutions and the sliding-window kernels
(codegen/pool.py) for the pools and the depthwise convolution.

Attribute semantics follow onnxruntime (pads from auto_pad, the average-pool
divisor with count_include_pad and ceil_mode); output shapes come from ONNX's
shape inference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..epilogue import conv_operand
from ..registry import Amp, Category, Fusion, OpDef, register

F32 = frozenset({"float32"})
LOWP = frozenset({"float32", "bfloat16", "float16"})   # float32 or narrow operands


# ---------------------------------------------------------------------------
# attribute helpers
# ---------------------------------------------------------------------------

def _ints(v: Any, r: int, default: int) -> list[int]:
    if v is None:
        return [default] * r
    return [int(x) for x in v]


def _to3(vals: list[int], fill: int) -> tuple:
    return tuple([fill] * (3 - len(vals)) + list(vals))


def _auto_pad(node: Any) -> str:
    ap = node.attrs.get("auto_pad", "NOTSET")
    if isinstance(ap, bytes):
        ap = ap.decode()
    return ap or "NOTSET"


def window_pads(node: Any, in_sp: list[int], k: list[int], s: list[int], d: list[int],
                out_sp: list[int]) -> tuple[list[int], list[int]]:
    """(begin, end) pads of a Conv/pool, as onnxruntime derives them."""
    r = len(in_sp)
    ap = _auto_pad(node)
    if ap in ("SAME_UPPER", "SAME_LOWER"):
        pb, pe = [], []
        for i in range(r):
            total = max(0, (out_sp[i] - 1) * s[i] + (k[i] - 1) * d[i] + 1 - in_sp[i])
            head = total // 2 if ap == "SAME_UPPER" else total - total // 2
            pb.append(head)
            pe.append(total - head)
        return pb, pe
    if ap == "VALID":
        return [0] * r, [0] * r
    pads = _ints(node.attrs.get("pads"), 2 * r, 0)
    return pads[:r], pads[r:]


def _spatial_rank_check(in_types: list[Any], what: str) -> str | None:
    x = in_types[0]
    if x is None or not x.is_static:
        return None
    if not 3 <= x.rank <= 5:
        return f"{what} over {x.rank - 2} spatial dimensions (1 to 3 are supported)"
    return None


def _check_conv(node: Any, ins: list[Any], outs: list[Any]) -> str | None:
    reason = _spatial_rank_check(ins, node.op_type)
    if reason:
        return reason
    x, w = ins[0], ins[1]
    g = int(node.attrs.get("group", 1))
    if x is not None and w is not None and x.is_static and w.is_static and g > 0:
        c = int(x.shape[1])
        m = int(w.shape[0]) if node.op_type == "Conv" else int(w.shape[1]) * g
        if c % g or m % g:
            return f"channels ({c} in, {m} out) not divisible by group={g}"
    return None


def _conv_epilogue_result(node, ins, out, result) -> str | None:
    """A float32 Conv's kernels store float32: an epilogue that ends in another dtype (a
    Cast to float16 fused in) is left out; the reduced-precision kernels (a narrow operand
    or ``cannc_precision``) store whatever dtype the epilogue ends in. (Fuzz seed
    20263412: a Conv+Tanh+Cast(float16)+Sin kernel stored float32 into the float16
    buffer.)"""
    if np.dtype(result.dtype) == np.dtype(out.dtype):
        return None
    narrow = [t for t in list(ins) + [out] if t is not None
              and np.dtype(t.dtype).name != "float32"]
    if narrow or node.attrs.get("cannc_precision") is not None:
        return None
    return (f"the epilogue ends in {np.dtype(result.dtype).name}; a float32 Conv's "
            "kernels store float32")


register(OpDef(name="Conv", category=Category.CONTRACTION, dtypes=LOWP,
               check=_check_conv,
               epilogue=Fusion(rule="conv_epilogue", fused_op="FusedConv", operand=conv_operand,
                               dtypes=LOWP, result=_conv_epilogue_result),
               doc="implicit GEMM (im2col tiles + 6x32 micro-kernel); depthwise: direct"))


register(OpDef(name="ConvTranspose", category=Category.CONTRACTION,
               dtypes=F32, check=_check_conv,
               doc="stride-1 implicit GEMM over the zero-upsampled input (flipped kernel)"))


def _check_pool(node: Any, ins: list[Any], outs: list[Any]) -> str | None:
    reason = _spatial_rank_check(ins, node.op_type)
    if reason:
        return reason
    if node.attrs.get("kernel_shape") is None:
        return f"{node.op_type} without kernel_shape"
    if node.op_type == "MaxPool":
        for t in ins[:1] + outs[:1]:
            if t is not None and np.dtype(t.dtype).name not in LOWP:
                return (f"dtype {np.dtype(t.dtype).name} not supported "
                        f"(supported: {', '.join(sorted(LOWP))})")
    if node.op_type == "LpPool" and int(node.attrs.get("p", 2)) < 1:
        return f"LpPool with p={node.attrs.get('p')} (p >= 1 is supported)"
    return None


def only_batch_empty(node: Any, ins: list[Any]) -> str | None:
    """A pool (windowed or global) reads a window in every channel and spatial position:
    only the batch may be empty. ONNX's inference passes a (1, 3, 0, 4) input; onnxruntime
    rejects it at run time ("Only N can be zero") and numpy's mean of nothing is NaN."""
    x = ins[0] if ins else None
    if x is None or not x.is_static or x.rank < 3:
        return None
    empty = [i for i, d in enumerate(x.shape) if i > 0 and int(d) == 0]
    if empty:
        return (f"dimension {empty[0]} of its input is 0; only the batch "
                "(dimension 0) of a pool's input may be empty")
    return None


def pool_out_size(node: Any, in_sp: list[int], k: list[int], s: list[int],
                  d: list[int]) -> list[int]:
    """A pool's output spatial size (auto_pad, pads, ceil_mode), as ONNX infers it."""
    ap = _auto_pad(node)
    r = len(in_sp)
    ek = [(k[i] - 1) * d[i] + 1 for i in range(r)]
    if ap in ("SAME_UPPER", "SAME_LOWER"):
        return [-(-in_sp[i] // s[i]) for i in range(r)]
    pads = [0] * (2 * r) if ap == "VALID" else _ints(node.attrs.get("pads"), 2 * r, 0)
    ceil = int(node.attrs.get("ceil_mode", 0))
    out = []
    for i in range(r):
        span = in_sp[i] + pads[i] + pads[r + i] - ek[i]
        o = (-(-span // s[i]) if ceil else span // s[i]) + 1
        if ceil and (o - 1) * s[i] >= in_sp[i] + pads[i]:
            o -= 1          # the last window must start inside the input or its head pad
        out.append(o)
    return out


def maxpool_reference(node: Any, inputs: list[Any]) -> list[np.ndarray]:
    """NumPy MaxPool (the constant folder's and the tests' reference): Y and, when asked,
    Indices, the flat index into X of each window's first max (spatially column-major
    with storage_order=1), as onnxruntime; padding is never taken and NaN propagates
    (the first NaN), as in cannc's kernels."""
    x = np.asarray(inputs[0])
    r = x.ndim - 2
    k = [int(v) for v in node.attrs["kernel_shape"]]
    s = _ints(node.attrs.get("strides"), r, 1)
    d = _ints(node.attrs.get("dilations"), r, 1)
    in_sp = list(x.shape[2:])
    out_sp = pool_out_size(node, in_sp, k, s, d)
    pb, _ = window_pads(node, in_sp, k, s, d, out_sp)
    planes = x.reshape(x.shape[0] * x.shape[1], -1)
    cdt = np.float32 if x.dtype.itemsize < 4 else x.dtype
    y = np.full((planes.shape[0], int(np.prod(out_sp))), -np.inf, cdt)
    idx = np.zeros(y.shape, np.int64)
    have = np.zeros(y.shape, bool)
    col = int(node.attrs.get("storage_order", 0)) == 1
    rm = np.cumprod([1] + in_sp[::-1][:-1])[::-1]        # row-major spatial strides
    cm = np.cumprod([1] + in_sp[:-1])                    # column-major
    outs = np.stack(np.meshgrid(*[np.arange(o) for o in out_sp], indexing="ij"), -1)
    outs = outs.reshape(-1, r)
    for tap in np.ndindex(*k):
        pos = outs * np.array(s) + np.array(tap) * np.array(d) - np.array(pb)
        ok = np.all((pos >= 0) & (pos < np.array(in_sp)), axis=1)
        flat = np.where(ok, (np.clip(pos, 0, None) * rm).sum(1), 0)
        v = planes[:, flat].astype(cdt)
        beats = (v > y) | (np.isnan(v) & ~np.isnan(y))
        take = ok[None, :] & (~have | beats)
        y = np.where(take, v, y)
        idx = np.where(take, (pos * (cm if col else rm)).sum(1)[None, :], idx)
        have |= ok[None, :]
    idx += (np.arange(planes.shape[0]) * planes.shape[1])[:, None]
    shape = tuple(x.shape[:2]) + tuple(out_sp)
    res = [y.astype(x.dtype).reshape(shape)]
    if len(node.outputs) > 1 and node.outputs[1]:
        res.append(idx.reshape(shape))
    return res


for _name, _doc in (("MaxPool", "window max, vectorised along the output width"),
                    ("AveragePool", "window sum / divisor table (count_include_pad, ceil_mode)"),
                    ("LpPool", "(window sum of |x|^p)^(1/p)")):
    register(OpDef(name=_name, category=Category.OPAQUE,
                   dtypes=None if _name == "MaxPool" else LOWP,
                   # window ops between narrow convolutions stay narrow (f32 registers)
                   amp=Amp.DENY if _name == "LpPool" else Amp.FOLLOW,
                   reference=maxpool_reference if _name == "MaxPool" else None,
                   check=_check_pool, shape_check=only_batch_empty, doc=_doc))
