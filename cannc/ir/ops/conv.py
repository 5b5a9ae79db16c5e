"""Convolution and pooling: Conv, ConvTranspose, MaxPool, AveragePool, LpPool.

Every op is normalised to three spatial dimensions (1-D and 2-D get size-1
dims in front) and lowered to one of two native kernel families:

* ``codegen/conv.py``: the implicit GEMM (im2col per tile into the workspace,
  register-blocked 6x32 micro-kernel), for Conv and ConvTranspose; constant
  weights are packed into micro-kernel panels at compile time, runtime weights
  are packed per tile.
* ``codegen/pool.py``: sliding-window kernels vectorised along the output
  width, for the pools and the depthwise convolution (group == C).

Attribute semantics follow onnxruntime (pads from auto_pad, the average-pool
divisor with count_include_pad and ceil_mode); output shapes come from ONNX's
shape inference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...codegen.conv import (ConvGeom, ConvTGeom, Slots, abi_function, emit_conv,
                             emit_convtranspose, pack_convtranspose_weights, pack_weights,
                             plan_conv, plan_convtranspose)
from ...codegen.pool import WindowSpec, avg_counts_1d, emit_window, plan_window
from ...codegen.kernel import ConstRef
from ..registry import Category, OpDef, register

F32 = frozenset({"float32"})
SINGLE_CORE_FLOPS = 100_000   # below this a kernel runs on core 0 only (no split, no wait)


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


def _noop(ctx: Any) -> None:
    fn = abi_function(ctx.module, ctx.symbol)
    import llvmlite.ir as ir
    ir.IRBuilder(fn.append_basic_block("entry")).ret_void()
    ctx.num_tiles = 1
    ctx.single_core = True


# ---------------------------------------------------------------------------
# Conv
# ---------------------------------------------------------------------------

def _has_bias(ctx: Any) -> bool:
    return len(ctx.node.inputs) > 2 and bool(ctx.node.inputs[2])


def conv_geometry(ctx: Any) -> tuple[ConvGeom, bool]:
    """(geometry, depthwise?) of a Conv node."""
    x_t, w_t, y_t = ctx.in_types[0], ctx.in_types[1], ctx.out_types[0]
    r = x_t.rank - 2
    N, C = int(x_t.shape[0]), int(x_t.shape[1])
    M = int(w_t.shape[0])
    G = int(ctx.attr("group", 1))
    k = [int(v) for v in w_t.shape[2:]]
    s = _ints(ctx.attr("strides"), r, 1)
    d = _ints(ctx.attr("dilations"), r, 1)
    in_sp = [int(v) for v in x_t.shape[2:]]
    out_sp = [int(v) for v in y_t.shape[2:]]
    pb, _ = window_pads(ctx.node, in_sp, k, s, d, out_sp)
    geom = ConvGeom(N=N, C=C, M=M, G=G, isz=_to3(in_sp, 1), osz=_to3(out_sp, 1),
                    k=_to3(k, 1), s=_to3(s, 1), d=_to3(d, 1), pb=_to3(pb, 0),
                    bias=_has_bias(ctx))
    depthwise = G == C and G > 1 and M % G == 0
    return geom, depthwise


def _lower_conv(ctx: Any, epilogue: Any = None, y_slot: int | None = None) -> None:
    """Lower a Conv; a fused kernel passes its epilogue (codegen.conv.Epilogue) and the
    argument slot of the output."""
    if ctx.out_types[0].numel == 0:
        return _noop(ctx)
    geom, depthwise = conv_geometry(ctx)
    if y_slot is None:
        y_slot = len(ctx.node.inputs)
    slots = Slots(x=0, w=1, b=2 if geom.bias else -1, y=y_slot)
    ctx.flops = geom.flops
    ctx.single_core = geom.flops < SINGLE_CORE_FLOPS
    if depthwise:
        spec = WindowSpec(kind="dw", N=geom.N, C=geom.C, M=geom.M, isz=geom.isz, osz=geom.osz,
                          k=geom.k, s=geom.s, d=geom.d, pb=geom.pb, bias=geom.bias)
        plan = plan_window(spec)
        emit_window(ctx.module, ctx.symbol, spec, plan, slots, epilogue=epilogue)
        ctx.num_tiles = plan.num_tiles
        ctx.notes["path"] = f"depthwise R{plan.R}xV{plan.V}"
        return
    w = ctx.const(1)
    plan = plan_conv(geom, const_weights=w is not None)
    if w is not None:
        ctx.replace_const(1, _pack_conv_weights, geom, plan, ConstRef(1), False)
    emit_conv(ctx.module, ctx.symbol, geom, plan, slots, a_prepacked=w is not None,
              epilogue=epilogue)
    ctx.num_tiles = plan.num_tiles
    ctx.workspace_bytes = plan.ws_bytes
    ctx.notes["path"] = (("direct-gemm" if plan.direct else "im2col-gemm")
                         + ("-swapped" if plan.swap else "")
                         + f" MR{plan.MR} KC{plan.KC}x{plan.nkb} P{plan.P}x{plan.PB}"
                         + f" CH{plan.CH}x{plan.MB}")


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


register(OpDef(name="Conv", category=Category.CONTRACTION, lower=_lower_conv, dtypes=F32,
               check=_check_conv,
               doc="implicit GEMM (im2col tiles + 6x32 micro-kernel); depthwise: direct"))


# ---------------------------------------------------------------------------
# ConvTranspose: a stride-1 convolution over the virtually up-sampled input
# ---------------------------------------------------------------------------

def convtranspose_geometry(ctx: Any) -> ConvGeom:
    x_t, w_t, y_t = ctx.in_types[0], ctx.in_types[1], ctx.out_types[0]
    r = x_t.rank - 2
    N, C = int(x_t.shape[0]), int(x_t.shape[1])
    G = int(ctx.attr("group", 1))
    Mg = int(w_t.shape[1])
    k = [int(v) for v in w_t.shape[2:]]
    s = _ints(ctx.attr("strides"), r, 1)
    d = _ints(ctx.attr("dilations"), r, 1)
    in_sp = [int(v) for v in x_t.shape[2:]]
    out_sp = [int(v) for v in y_t.shape[2:]]
    adj = _ints(ctx.attr("output_padding"), r, 0)
    ap = _auto_pad(ctx.node)
    has_out_shape = ctx.attr("output_shape") is not None
    pads = _ints(ctx.attr("pads"), 2 * r, 0)
    head = []
    for i in range(r):
        if has_out_shape or ap in ("SAME_UPPER", "SAME_LOWER"):
            total = max(0, (in_sp[i] - 1) * s[i] + adj[i] + (k[i] - 1) * d[i] + 1 - out_sp[i])
            # as onnxruntime: SAME_UPPER pads the head by total//2, the others by the rest
            head.append(total // 2 if ap == "SAME_UPPER" else total - total // 2)
        elif ap == "VALID":
            head.append(0)
        else:
            head.append(pads[i])
    pbc = [d[i] * (k[i] - 1) - head[i] for i in range(r)]
    return ConvGeom(N=N, C=C, M=Mg * G, G=G, isz=_to3(in_sp, 1), osz=_to3(out_sp, 1),
                    k=_to3(k, 1), s=(1, 1, 1), d=_to3(d, 1), pb=_to3(pbc, 0),
                    u=_to3(s, 1), bias=_has_bias(ctx))


def _pack_conv_weights(geom: Any, plan: Any, w: np.ndarray, transposed: bool) -> np.ndarray:
    if transposed:
        return pack_weights(geom, plan, w.reshape(geom.C, geom.Mg, *geom.k),
                            transposed_layout=True)
    return pack_weights(geom, plan, w.reshape(geom.M, geom.Cg, *geom.k))


def _lower_convtranspose(ctx: Any) -> None:
    if ctx.out_types[0].numel == 0:
        return _noop(ctx)
    geom = convtranspose_geometry(ctx)
    slots = Slots(x=0, w=1, b=2 if geom.bias else -1, y=len(ctx.node.inputs))
    w = ctx.const(1)
    if w is not None:
        # GEMM (W^T X) into the workspace + col2im: no work on inserted zeros
        tg = ConvTGeom(N=geom.N, C=geom.C, M=geom.M, G=geom.G, isz=geom.isz, osz=geom.osz,
                       k=geom.k, s=geom.u, d=geom.d,
                       pb=tuple(geom.d[i] * (geom.k[i] - 1) - geom.pb[i] for i in range(3)),
                       bias=geom.bias)
        tplan = plan_convtranspose(tg)
        ctx.replace_const(1, pack_convtranspose_weights, tg, tplan, ConstRef(1))
        emit_convtranspose(ctx.module, ctx.symbol, tg, tplan, slots)
        ctx.num_tiles = tplan.num_tiles
        ctx.workspace_bytes = tplan.ws_bytes
        ctx.flops = tg.flops
        ctx.single_core = tg.flops < SINGLE_CORE_FLOPS
        ctx.notes["path"] = f"gemm+col2im MR{tplan.MR} CH{tplan.CHB}x{tplan.MB} CB{tplan.CB}x{tplan.nkb}"
        return
    plan = plan_conv(geom, const_weights=False)
    if w is not None:
        ctx.replace_const(1, _pack_conv_weights, geom, plan, ConstRef(1), True)
    emit_conv(ctx.module, ctx.symbol, geom, plan, slots, a_prepacked=w is not None,
              transposed_layout=True)
    ctx.num_tiles = plan.num_tiles
    ctx.workspace_bytes = plan.ws_bytes
    ctx.single_core = geom.flops < SINGLE_CORE_FLOPS
    # useful work (the up-sampled formulation also multiplies the inserted zeros)
    ctx.flops = 2 * geom.N * geom.C * int(np.prod(geom.isz)) * geom.Mg * geom.KK
    ctx.notes["path"] = f"fractionally-strided implicit-gemm MR{plan.MR} KC{plan.KC}x{plan.nkb}"


register(OpDef(name="ConvTranspose", category=Category.CONTRACTION, lower=_lower_convtranspose,
               dtypes=F32, check=_check_conv,
               doc="stride-1 implicit GEMM over the zero-upsampled input (flipped kernel)"))


# ---------------------------------------------------------------------------
# pools
# ---------------------------------------------------------------------------

def pool_geometry(ctx: Any) -> tuple[dict, list[int], list[int]]:
    x_t, y_t = ctx.in_types[0], ctx.out_types[0]
    r = x_t.rank - 2
    k = [int(v) for v in ctx.attr("kernel_shape")]
    s = _ints(ctx.attr("strides"), r, 1)
    d = _ints(ctx.attr("dilations"), r, 1)
    in_sp = [int(v) for v in x_t.shape[2:]]
    out_sp = [int(v) for v in y_t.shape[2:]]
    pb, pe = window_pads(ctx.node, in_sp, k, s, d, out_sp)
    g = dict(N=int(x_t.shape[0]), C=int(x_t.shape[1]), M=int(x_t.shape[1]),
             isz=_to3(in_sp, 1), osz=_to3(out_sp, 1), k=_to3(k, 1), s=_to3(s, 1),
             d=_to3(d, 1), pb=_to3(pb, 0))
    return g, pb, pe


def _lower_pool(ctx: Any) -> None:
    if ctx.out_types[0].numel == 0:
        return _noop(ctx)
    op = ctx.node.op_type
    g, pb, pe = pool_geometry(ctx)
    extra: dict = {}
    if op == "MaxPool":
        kind = "max"
    elif op == "LpPool":
        kind = "lp"
        extra["p"] = int(ctx.attr("p", 2))
    else:
        kind = "avg"
        inc = bool(ctx.attr("count_include_pad", 0))
        pb3, pe3 = _to3(pb, 0), _to3(pe, 0)
        per_axis = [avg_counts_1d(g["isz"][a], g["osz"][a], g["k"][a], g["s"][a], g["d"][a],
                                  pb3[a], pe3[a], inc) for a in range(3)]
        extra["count_rows"] = tuple(float(a * b) for a in per_axis[0] for b in per_axis[1])
        extra["count_cols"] = tuple(float(c) for c in per_axis[2])
    spec = WindowSpec(kind=kind, **g, **extra)
    plan = plan_window(spec)
    emit_window(ctx.module, ctx.symbol, spec, plan, Slots(x=0, w=-1, b=-1, y=len(ctx.node.inputs)))
    ctx.num_tiles = plan.num_tiles
    ctx.single_core = ctx.out_types[0].numel * spec.KK < SINGLE_CORE_FLOPS // 4
    ctx.flops = ctx.out_types[0].numel * spec.KK
    ctx.notes["path"] = f"window {kind} R{plan.R}xV{plan.V}"


def _check_pool(node: Any, ins: list[Any], outs: list[Any]) -> str | None:
    reason = _spatial_rank_check(ins, node.op_type)
    if reason:
        return reason
    if node.attrs.get("kernel_shape") is None:
        return f"{node.op_type} without kernel_shape"
    if node.op_type == "MaxPool":
        if len(node.outputs) > 1 and node.outputs[1]:
            return "MaxPool's Indices output is not supported"
        for t in ins[:1] + outs[:1]:
            if t is not None and np.dtype(t.dtype) != np.float32:
                return f"dtype {np.dtype(t.dtype).name} not supported (supported: float32)"
    if node.op_type == "LpPool" and int(node.attrs.get("p", 2)) < 1:
        return f"LpPool with p={node.attrs.get('p')} (p >= 1 is supported)"
    return None


for _name, _doc in (("MaxPool", "window max, vectorised along the output width"),
                    ("AveragePool", "window sum / divisor table (count_include_pad, ceil_mode)"),
                    ("LpPool", "(window sum of |x|^p)^(1/p)")):
    register(OpDef(name=_name, category=Category.OPAQUE, lower=_lower_pool,
                   dtypes=None if _name == "MaxPool" else F32,
                   check=_check_pool, doc=_doc))
