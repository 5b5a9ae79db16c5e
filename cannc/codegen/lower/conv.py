"""Lowerings of Conv, ConvTranspose, MaxPool, AveragePool, LpPool (cannc/ir/ops/conv.py).

Every op is normalised to three spatial dimensions (1-D and 2-D get size-1
dims in front) and lowered to one of two native kernel families:

* ``codegen/conv.py``: the implicit GEMM (im2col per tile into the workspace,
  register-blocked 6x32 micro-kernel), for Conv and ConvTranspose; constant
  weights are packed into micro-kernel panels at compile time, runtime weights
  are packed per tile.
* ``codegen/winograd.py``: Winograd F(2x2, 3x3) for 3x3 stride-1 convs with constant
  weights where its cost model beats the implicit GEMM (``CANNC_WINOGRAD=0``: never).
* ``codegen/stemconv.py``: a network's first, strided conv over few input channels
  (3x3/2 and 7x7/2 over colour images, 4x4/4 patches), reading the input in place from
  its rows split into column phases (``CANNC_STEM_CONV=0``: never).
* ``codegen/pool.py``: sliding-window kernels vectorised along the output
  width, for the pools and the depthwise convolution (group == C).

Conv (and FusedConv), MaxPool, AveragePool and LpPool take the batch at run time
(``conv_tiling`` / ``pool_tiling``, codegen/ABI.md "Runtime dimensions"): their kernels
are planned for one image and a tile index carries the image, so a batch of N runs N
times one image's tiles with the same code. That holds for the Winograd path too: it is
chosen and planned on one image. ConvTranspose is emitted for its full shapes.
"""

from __future__ import annotations

from dataclasses import replace as dc_replace
from typing import Any

import llvmlite.ir as ir
import numpy as np

from ... import config
from ...artifact import Tiling
from ...ir.ops.conv import _auto_pad, _ints, _to3, window_pads
from ...native import emit
from ...native.emit import I64, for_range, i64
from ...native.target import host
from .. import stemconv, winograd
from ..amx import amx_usable
from ..amx_conv import (
    AmxConvPlan,
    amx_conv_supports,
    emit_amx_conv,
    pack_amx_conv_weights,
    plan_amx_conv,
)
from ..conv import (
    VB,
    ConvGeom,
    ConvTGeom,
    LowpTypes,
    Slots,
    abi_function,
    emit_conv,
    emit_conv_lowp,
    emit_convtranspose,
    lowp_mode,
    lowp_note,
    lowp_types,
    pack_convtranspose_weights,
    pack_lowp_weights,
    pack_weights,
    plan_conv,
    plan_convtranspose,
    plan_lowp,
    plan_workspace,
)
from ..elementwise import TV, Expr, load_tv, store_tv
from ..kernel import ConstRef, LowerCtx
from ..pool import WindowSpec, avg_counts_1d, emit_window, plan_window
from .base import register_lowering

SINGLE_CORE_FLOPS = 100_000   # below this a kernel runs on core 0 only (no split, no wait)


def _noop(ctx: LowerCtx) -> None:
    fn = abi_function(ctx.module, ctx.symbol)
    ir.IRBuilder(fn.append_basic_block("entry")).ret_void()
    ctx.num_tiles = 1
    ctx.single_core = True


# ---------------------------------------------------------------------------
# Conv
# ---------------------------------------------------------------------------

def _has_bias(ctx: LowerCtx) -> bool:
    return len(ctx.node.inputs) > 2 and bool(ctx.node.inputs[2])


def conv_geometry(ctx: LowerCtx) -> tuple[ConvGeom, bool]:
    """(geometry, depthwise?) of a Conv node."""
    return conv_geom_of(ctx.node, ctx.in_types, ctx.out_types)


def conv_geom_of(node: Any, ins: list[Any], outs: list[Any]) -> tuple[ConvGeom, bool]:
    """(geometry, depthwise?) of a Conv node with these input and output types."""
    x_t, w_t, y_t = ins[0], ins[1], outs[0]
    r = x_t.rank - 2
    N, C = int(x_t.shape[0]), int(x_t.shape[1])
    M = int(w_t.shape[0])
    G = int(node.attrs.get("group", 1))
    k = [int(v) for v in w_t.shape[2:]]
    s = _ints(node.attrs.get("strides"), r, 1)
    d = _ints(node.attrs.get("dilations"), r, 1)
    in_sp = [int(v) for v in x_t.shape[2:]]
    out_sp = [int(v) for v in y_t.shape[2:]]
    pb, _ = window_pads(node, in_sp, k, s, d, out_sp)
    geom = ConvGeom(N=N, C=C, M=M, G=G, isz=_to3(in_sp, 1), osz=_to3(out_sp, 1),
                    k=_to3(k, 1), s=_to3(s, 1), d=_to3(d, 1), pb=_to3(pb, 0),
                    bias=len(node.inputs) > 2 and bool(node.inputs[2]))
    depthwise = G == C and G > 1 and M % G == 0
    return geom, depthwise


# tests: force the mode of bf16 convs instead of the CPU's: "dp" | "f32" (vector kernels),
# "amx" (AMX, its cost model choosing direct or im2col), "amx-direct", "amx-im2col"
FORCE_LOWP_MODE: str | None = None


def _use_amx(geom: ConvGeom, types: LowpTypes) -> bool:
    """bf16 convs run on AMX tiles where the host has them (and the OS grants them):
    ~5x the fp32 FMA rate; else the vdpbf16ps / widened-fp32 modes (``lowp_mode``)."""
    forced = FORCE_LOWP_MODE if types.prec == "bf16" else None
    if forced is not None and not forced.startswith("amx"):
        return False
    if amx_conv_supports(geom, types) is not None:
        return False
    return forced is not None or amx_usable() is None


def _vec_lowp_plan(geom: ConvGeom, types: LowpTypes, const_weights: bool) -> Any:
    mode = lowp_mode(types.prec, host().has("avx512bf16"), host().has("amx-bf16"))
    if FORCE_LOWP_MODE in ("dp", "f32") and types.prec == "bf16":
        mode = FORCE_LOWP_MODE
    return plan_lowp(geom, mode, const_weights)


def lowp_plan_of(geom: ConvGeom, types: LowpTypes, const_weights: bool) -> Any:
    """The plan of a reduced-precision conv: an AmxConvPlan (constant weights only:
    they are prepacked in the A-tile layout) or a LowpPlan."""
    if const_weights and _use_amx(geom, types):
        direct = {"amx-direct": True, "amx-im2col": False}.get(FORCE_LOWP_MODE or "")
        return plan_amx_conv(geom, direct=direct)
    return _vec_lowp_plan(geom, types, const_weights)


def _lowp_note(plan: Any, types: LowpTypes) -> str:
    if isinstance(plan, AmxConvPlan):
        return "bf16 AMX"
    return lowp_note(plan, types.prec, host().has("avx512bf16"))


def _lowp_path(plan: Any) -> str:
    if isinstance(plan, AmxConvPlan):
        kind = "direct" if plan.direct else "im2col-kwpairs" if plan.kwpairs else "im2col"
        return (f"amx-conv {kind} K{2 * plan.KUp} "
                f"P{plan.P}x{plan.PB} "
                f"CH{plan.CH}x{plan.MB}")
    return (f"lowp-gemm {plan.mode} MR{plan.MR}x{plan.NR} P{plan.P}x{plan.PB} "
            f"CH{plan.CH}x{plan.MB}")


def _lowp_ws(one: ConvGeom, plan: Any, types: LowpTypes) -> int:
    """The workspace of conv_tiling's reduced-precision kernel, whose weights may be
    constant or not (the tiling function cannot tell)."""
    if isinstance(plan, AmxConvPlan):
        return max(plan.ws_bytes, _vec_lowp_plan(one, types, False).ws_bytes)
    return plan_lowp(one, plan.mode, const_weights=False).ws_bytes


def _emit_lowp(ctx: LowerCtx, geom: ConvGeom, plan: Any, types: LowpTypes, slots: Slots,
               epilogue: Any) -> None:
    const_w = ctx.is_const(1)
    if isinstance(plan, AmxConvPlan) and const_w:
        ctx.replace_const(1, pack_amx_conv_weights, geom, plan, ConstRef(1))
        emit_amx_conv(ctx.module, ctx.symbol, geom, plan, types, slots, epilogue=epilogue)
    elif isinstance(plan, AmxConvPlan):
        # runtime weights (conv_tiling planned AMX not knowing): the vector kernel,
        # packing them per tile, in the AMX kernel's tile grid
        inner_plan = _vec_lowp_plan(geom, types, False)
        inner = emit_conv_lowp(ctx.module, "conv_lowp", geom, inner_plan, types, slots,
                               const_weights=False, epilogue=epilogue)
        outer = plan.num_tiles // geom.N
        _emit_regrid(ctx.module, ctx.symbol, inner, outer, inner_plan.num_tiles // geom.N)
        ctx.num_tiles = plan.num_tiles
        ctx.workspace_bytes = inner_plan.ws_bytes
        ctx.notes["path"] = _lowp_path(inner_plan) + f" in {outer} tiles/image"
        ctx.notes["precision"] = _lowp_note(inner_plan, types)
        return
    else:
        if not const_w:
            plan = plan_lowp(geom, plan.mode, const_weights=False)
        else:
            ctx.replace_const(1, pack_lowp_weights, geom, plan, ConstRef(1), types.narrow)
        emit_conv_lowp(ctx.module, ctx.symbol, geom, plan, types, slots, const_weights=const_w,
                       epilogue=epilogue)
    ctx.num_tiles = plan.num_tiles
    ctx.workspace_bytes = plan.ws_bytes
    ctx.notes["path"] = _lowp_path(plan)
    ctx.notes["precision"] = _lowp_note(plan, types)


def conv_store_type(node: Any, ins: list[Any], conv_t: Any, final_t: Any) -> Any:
    """The output type a FusedConv's conv kernel is lowered with: a reduced-precision conv
    stores its epilogue's result (float32 registers) as the FUSED output's dtype (e.g. a
    Cast to bfloat16 or float32 folded into it), so its type is the conv's with that dtype;
    the float32 kernels store float32."""
    if final_t.dtype == conv_t.dtype or lowp_types(node, ins, [conv_t]) is None:
        return conv_t
    return dc_replace(conv_t, dtype=final_t.dtype)


def _dts(ins: list[Any], outs: list[Any]) -> tuple:
    """(X, W, bias, Y) dtype names of a Conv (the window kernel's WindowSpec.dts)."""
    b = np.dtype(ins[2].dtype).name if len(ins) > 2 and ins[2] is not None else "float32"
    return (np.dtype(ins[0].dtype).name, np.dtype(ins[1].dtype).name, b,
            np.dtype(outs[0].dtype).name)


def _dw_spec(geom: ConvGeom, dts: tuple) -> WindowSpec:
    return WindowSpec(kind="dw", N=geom.N, C=geom.C, M=geom.M, isz=geom.isz, osz=geom.osz,
                      k=geom.k, s=geom.s, d=geom.d, pb=geom.pb, bias=geom.bias, dts=dts)


def _dw_note(spec: WindowSpec) -> str | None:
    if spec.dts == ("float32",) * 4:
        return None
    return "depthwise: " + "/".join(sorted({d for d in spec.dts if d != "float32"})) + \
        " storage, fp32 FMA"


def _gemm_path(plan: Any) -> str:
    kind = "direct" if plan.direct else "panels" if getattr(plan, "panels", False) else "im2col"
    return (kind + "-gemm" + ("-swapped" if plan.swap else "")
            + ("-rows" if getattr(plan, "rows_outer", False) else "")
            + f" MR{plan.MR} KC{plan.KC}x{plan.nkb} P{plan.P}x{plan.PB} CH{plan.CH}x{plan.MB}")


def _winograd_path(p: Any) -> str:
    return f"winograd F({p.m},3) MR{p.MR} PT{p.PT}x{p.PB} CH{p.CH}x{p.MB} CB{p.CB}x{p.nkb}"


def _static_types(ts: list[Any]) -> bool:
    return all(t is not None and t.is_static and t.numel > 0 for t in ts)


def conv_tiling(node: Any, ins: list[Any], outs: list[Any], reads: int = 0) -> Tiling | None:
    """The host tiling function of Conv (codegen/ABI.md "Runtime dimensions"): the batch
    N is the runtime dimension. The tile grid is planned for ONE image (``plan_conv`` /
    ``plan_window`` at N=1) and the kernel's tile ``t`` is tile ``t % T1`` of image
    ``t // T1``, the per-image offsets being static strides; so the code depends on the
    geometry without N and on that plan (the key), and a batch of N runs N*T1 tiles
    (no runtime dims are read). The Winograd path is planned on one image too, but chosen
    for the batch (its weights, larger than the direct ones, stream once a call: where
    they tip the choice, batch 1 and batch 8 run different kernels); its key also holds
    the implicit-GEMM plan, which a Conv with runtime weights (that the tiling function
    cannot tell apart) runs in the Winograd kernel's tile grid. ``reads``: tensors of the
    output's shape a fused epilogue reads (plan_conv)."""
    if len(ins) < 2 or not _static_types([ins[0], ins[1], outs[0]]) or not 3 <= ins[0].rank <= 5:
        return None
    geom, depthwise = conv_geom_of(node, ins, outs)
    one = dc_replace(geom, N=1)
    notes: dict[str, Any] = {}
    if depthwise:
        spec = _dw_spec(one, _dts(ins, outs))
        wplan = plan_window(spec)
        key: tuple = ("conv", "dw", spec, wplan)
        tiles, ws = wplan.num_tiles, wplan.ws_bytes
        notes["path"] = window_path("depthwise", wplan)
        if _dw_note(spec):
            notes["precision"] = _dw_note(spec)
    elif (types := lowp_types(node, ins, outs)) is not None:
        lplan = lowp_plan_of(one, types, True)
        key = ("conv", "lowp", one, (lplan, types))
        tiles = lplan.num_tiles
        ws = _lowp_ws(one, lplan, types)
        if not isinstance(lplan, AmxConvPlan):
            # (AMX: from the lowering, which runs runtime weights on the vector kernel)
            notes["path"] = _lowp_path(lplan)
            notes["precision"] = _lowp_note(lplan, types)
    elif (splan := stemconv.choose(one, config.STEM_CONV)) is not None:
        key = ("conv", "stem", one, splan)
        tiles, ws = splan.num_tiles, splan.ws_bytes
        notes["path"] = stemconv.stem_path(splan)
    elif (wplan := winograd.choose(one, config.WINOGRAD, batch=geom.N)) is not None:
        gplan = plan_conv(one, const_weights=True)
        key = ("conv", "winograd", one, (wplan, gplan))
        tiles = wplan.num_tiles
        ws = max(wplan.ws_bytes, plan_workspace(gplan, const_weights=False).ws_bytes)
        # the path note comes from the lowering (Winograd or, for runtime weights, not)
        notes["gemm_flops"] = winograd.winograd_gemm_flops(geom, wplan)
    else:
        plan = plan_conv(one, const_weights=True, reads=reads)
        key = ("conv", "gemm", one, plan)
        # the tiling function does not know whether W is a constant (prepacked) or not
        # (packed per tile into the workspace): the workspace of the latter serves both
        tiles, ws = plan.num_tiles, plan_workspace(plan, const_weights=False).ws_bytes
        notes["path"] = _gemm_path(plan)
    return Tiling(key=key, dims=(), num_tiles=geom.N * tiles, workspace_bytes=ws,
                  single_core=geom.flops < SINGLE_CORE_FLOPS, flops=geom.flops, notes=notes)


def epilogue_reads_first(tkey: tuple) -> bool:
    """Whether the output of the Conv kernel of conv_tiling's key should take the buffer
    of a residual of its shape that a fused epilogue reads (Kernel.overwrites): its lines
    are then read and written once, not read in one buffer and fetched for writing in
    another. The kernel must read the operand at an output offset only just before it
    writes the output there: the GEMM paths of one K block (several store partial sums
    in Y first). Sapphire Rapids guest, 1x1 conv + Add + Relu alone, 1 core: 128->512 at
    28x28 0.716 -> 0.659 ms, 64->256 at 56x56 0.690 -> 0.647; in ResNet-50 x0.90 / x0.91
    (1 / 2 cores). The swapped orientation (256->1024 at 14x14) is as safe, but in
    ResNet-50 it was x0.93 on 1 core and x1.05-1.09 on 2, so it keeps its own buffer."""
    return tkey[0] == "conv" and tkey[1] == "gemm" and tkey[3].nkb == 1 and not tkey[3].swap


def _lower_conv(ctx: LowerCtx, epilogue: Any = None, y_slot: int | None = None,
                tkey: tuple | None = None, reads: int = 0) -> None:
    """Lower a Conv; a fused kernel passes its epilogue (codegen.conv.Epilogue), the
    argument slot of the output, the key of the conv's tiling (conv_tiling) and the
    number of tensors of the output's shape the epilogue reads (plan_conv)."""
    if tkey is None and ctx.tiling is not None:
        tkey = ctx.tiling.key
    if tkey is not None:
        return _lower_conv_any_batch(ctx, tkey, epilogue, y_slot)
    if ctx.out_types[0].numel == 0:
        return _noop(ctx)
    geom, depthwise = conv_geometry(ctx)
    if y_slot is None:
        y_slot = len(ctx.node.inputs)
    slots = Slots(x=0, w=1, b=2 if geom.bias else -1, y=y_slot)
    ctx.flops = geom.flops
    ctx.single_core = geom.flops < SINGLE_CORE_FLOPS
    if depthwise:
        spec = _dw_spec(geom, _dts(ctx.in_types, ctx.out_types))
        plan = plan_window(spec)
        emit_window(ctx.module, ctx.symbol, spec, plan, slots, epilogue=epilogue)
        ctx.num_tiles, ctx.workspace_bytes = plan.num_tiles, plan.ws_bytes
        ctx.notes["path"] = window_path("depthwise", plan)
        if _dw_note(spec):
            ctx.notes["precision"] = _dw_note(spec)
        return
    types = lowp_types(ctx.node, ctx.in_types, ctx.out_types)
    if types is not None:
        return _emit_lowp(ctx, geom, lowp_plan_of(geom, types, ctx.is_const(1)), types, slots,
                          epilogue)
    splan = stemconv.choose(geom, config.STEM_CONV)
    if splan is not None:
        return _emit_stem(ctx, geom, splan, slots, epilogue)
    w = ctx.const(1)
    wplan = winograd.choose(geom, config.WINOGRAD) if w is not None else None
    if wplan is not None:
        # flops stay the direct-conv count (comparable GFLOP/s); the GEMMs do fewer
        ctx.replace_const(1, winograd.pack_winograd_weights, geom, wplan, ConstRef(1))
        winograd.emit_winograd(ctx.module, ctx.symbol, geom, wplan, slots, epilogue=epilogue)
        ctx.num_tiles = wplan.num_tiles
        ctx.workspace_bytes = wplan.ws_bytes
        ctx.notes["path"] = _winograd_path(wplan)
        ctx.notes["gemm_flops"] = winograd.winograd_gemm_flops(geom, wplan)
        return
    plan = plan_conv(geom, const_weights=w is not None, reads=reads)
    if w is not None:
        ctx.replace_const(1, _pack_conv_weights, geom, plan, ConstRef(1), False)
    emit_conv(ctx.module, ctx.symbol, geom, plan, slots, a_prepacked=w is not None,
              epilogue=epilogue)
    ctx.num_tiles = plan.num_tiles
    ctx.workspace_bytes = plan.ws_bytes
    ctx.notes["path"] = _gemm_path(plan)


def _lower_conv_any_batch(ctx: LowerCtx, tkey: tuple, epilogue: Any, y_slot: int | None) -> None:
    """The Conv kernel of conv_tiling's key: the geometry and plan of ONE image (the tile
    index carries the image), so it serves every batch size."""
    _, kind, geom, plan = tkey  # geom: a ConvGeom ('gemm', 'winograd') or WindowSpec ('dw'), N=1
    one = dc_replace(conv_geometry(ctx)[0], N=1)
    assert (_dw_spec(one, _dts(ctx.in_types, ctx.out_types)) if kind == "dw" else one) == geom, \
        (geom, one)
    if y_slot is None:
        y_slot = len(ctx.node.inputs)
    slots = Slots(x=0, w=1, b=2 if geom.bias else -1, y=y_slot)
    if kind == "dw":
        emit_window(ctx.module, ctx.symbol, geom, plan, slots, epilogue=epilogue)
        ctx.num_tiles, ctx.workspace_bytes = plan.num_tiles, plan.ws_bytes
        ctx.notes["path"] = window_path("depthwise", plan)
        if _dw_note(geom):
            ctx.notes["precision"] = _dw_note(geom)
        return
    if kind == "lowp":
        return _emit_lowp(ctx, geom, plan[0], plan[1], slots, epilogue)
    if kind == "stem":
        return _emit_stem(ctx, geom, plan, slots, epilogue)
    const_w = ctx.is_const(1)
    if kind == "winograd":
        wplan, plan = plan
        if const_w:
            ctx.replace_const(1, winograd.pack_winograd_weights, geom, wplan, ConstRef(1))
            winograd.emit_winograd(ctx.module, ctx.symbol, geom, wplan, slots, epilogue=epilogue)
            ctx.num_tiles, ctx.workspace_bytes = wplan.num_tiles, wplan.ws_bytes
            ctx.notes["path"] = _winograd_path(wplan)
            return
        # runtime weights (no Winograd transform): the implicit GEMM, in Winograd's grid
        plan = plan_workspace(plan, const_weights=False)
        inner = emit_conv(ctx.module, "conv_gemm", geom, plan, slots, a_prepacked=False,
                          epilogue=epilogue)
        _emit_regrid(ctx.module, ctx.symbol, inner, wplan.num_tiles, plan.num_tiles)
        ctx.num_tiles, ctx.workspace_bytes = wplan.num_tiles, plan.ws_bytes
        ctx.notes["path"] = _gemm_path(plan) + f" in {wplan.num_tiles} tiles/image"
        return
    if const_w:
        ctx.replace_const(1, _pack_conv_weights, geom, plan, ConstRef(1), False)
    else:
        plan = plan_workspace(plan, const_weights=False)
    emit_conv(ctx.module, ctx.symbol, geom, plan, slots, a_prepacked=const_w, epilogue=epilogue)
    ctx.num_tiles = plan.num_tiles
    ctx.workspace_bytes = plan.ws_bytes
    ctx.notes["path"] = _gemm_path(plan)


def _emit_stem(ctx: LowerCtx, geom: ConvGeom, plan: Any, slots: Slots, epilogue: Any) -> None:
    """The stem kernel (codegen/stemconv.py): it reads the weights as they are, constant
    or not."""
    stemconv.emit_stem(ctx.module, ctx.symbol, geom, plan, slots, epilogue=epilogue)
    ctx.num_tiles, ctx.workspace_bytes = plan.num_tiles, plan.ws_bytes
    ctx.notes["path"] = stemconv.stem_path(plan)


def _emit_regrid(module: Any, name: str, inner: Any, outer_tiles: int, inner_tiles: int) -> None:
    """ABI kernel ``name`` of ``outer_tiles`` tiles per image that runs the kernel ``inner``
    of ``inner_tiles`` tiles per image (both: tile t is a tile of image t // tiles): outer
    tile j of an image runs its inner tiles [j*I/O, (j+1)*I/O)."""
    fn = abi_function(module, name)
    v = VB(module, fn)
    b = v.b
    args, tb, te, ws = fn.args
    with v.loop(tb, te, 1, "t") as t:
        img, j = v.divmod_c(t, outer_tiles)
        base = b.mul(img, i64(inner_tiles))
        lo = b.udiv(b.mul(j, i64(inner_tiles)), i64(outer_tiles))
        hi = b.udiv(b.mul(b.add(j, i64(1)), i64(inner_tiles)), i64(outer_tiles))
        b.call(inner, [args, b.add(base, lo), b.add(base, hi), ws])
    b.ret_void()


# ---------------------------------------------------------------------------
# ConvTranspose: a stride-1 convolution over the virtually up-sampled input
# ---------------------------------------------------------------------------

def convtranspose_geometry(ctx: LowerCtx) -> ConvGeom:
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


def _lower_convtranspose(ctx: LowerCtx) -> None:
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
        ctx.notes["path"] = (f"gemm+col2im MR{tplan.MR} CH{tplan.CHB}x{tplan.MB} "
                             f"CB{tplan.CB}x{tplan.nkb}")
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


# ---------------------------------------------------------------------------
# pools
# ---------------------------------------------------------------------------

def pool_geometry(ctx: LowerCtx) -> tuple[dict, list[int], list[int]]:
    return pool_geom_of(ctx.node, ctx.in_types[0], ctx.out_types[0])


def pool_geom_of(node: Any, x_t: Any, y_t: Any) -> tuple[dict, list[int], list[int]]:
    r = x_t.rank - 2
    k = [int(v) for v in node.attrs["kernel_shape"]]
    s = _ints(node.attrs.get("strides"), r, 1)
    d = _ints(node.attrs.get("dilations"), r, 1)
    in_sp = [int(v) for v in x_t.shape[2:]]
    out_sp = [int(v) for v in y_t.shape[2:]]
    pb, pe = window_pads(node, in_sp, k, s, d, out_sp)
    g = dict(N=int(x_t.shape[0]), C=int(x_t.shape[1]), M=int(x_t.shape[1]),
             isz=_to3(in_sp, 1), osz=_to3(out_sp, 1), k=_to3(k, 1), s=_to3(s, 1),
             d=_to3(d, 1), pb=_to3(pb, 0))
    return g, pb, pe


def pool_spec(node: Any, x_t: Any, y_t: Any) -> WindowSpec:
    """The window kernel of a MaxPool / AveragePool / LpPool node with these types."""
    op = node.op_type
    g, pb, pe = pool_geom_of(node, x_t, y_t)
    extra: dict = {}
    if op == "MaxPool":
        kind = "max"
    elif op == "LpPool":
        kind = "lp"
        extra["p"] = int(node.attrs.get("p", 2))
    else:
        kind = "avg"
        inc = bool(node.attrs.get("count_include_pad", 0))
        pb3, pe3 = _to3(pb, 0), _to3(pe, 0)
        per_axis = [avg_counts_1d(g["isz"][a], g["osz"][a], g["k"][a], g["s"][a], g["d"][a],
                                  pb3[a], pe3[a], inc) for a in range(3)]
        extra["count_rows"] = tuple(float(a * b) for a in per_axis[0] for b in per_axis[1])
        extra["count_cols"] = tuple(float(c) for c in per_axis[2])
    dts = (np.dtype(x_t.dtype).name, "float32", "float32", np.dtype(y_t.dtype).name)
    return WindowSpec(kind=kind, **g, **extra, dts=dts)


def window_path(what: str, plan: Any) -> str:
    """The path note of a window kernel: R rows x V vectors a step, '+pad' when the
    tile's rows are copied padded (pool.PaddedRows); 'flat V' when the plane is computed
    as one row of V vectors (pool.FlatPlane)."""
    if plan.flat is not None:
        return f"{what} flat V{plan.V}"
    return f"{what} R{plan.R}xV{plan.V}" + ("+pad" if plan.padded else "") + \
        ("+s2" if plan.s2 else "")


def _has_indices(node: Any) -> bool:
    return node.op_type == "MaxPool" and len(node.outputs) > 1 and bool(node.outputs[1])


def pool_tiling(node: Any, ins: list[Any], outs: list[Any]) -> Tiling | None:
    """The host tiling function of the pools: as conv_tiling, the batch N is runtime; the
    window kernel of ONE image (its spec and plan at N=1) is the key and a batch of N
    runs N times its tiles (the tile index carries the image)."""
    if not _static_types([ins[0], outs[0]]) or not 3 <= ins[0].rank <= 5 \
            or _has_indices(node):
        return None
    spec = pool_spec(node, ins[0], outs[0])
    one = dc_replace(spec, N=1)
    plan = plan_window(one)
    work = outs[0].numel * spec.KK
    return Tiling(key=("window", one, plan), dims=(), num_tiles=spec.N * plan.num_tiles,
                  workspace_bytes=plan.ws_bytes,
                  single_core=work < SINGLE_CORE_FLOPS // 4, flops=work,
                  notes={"path": window_path(f"window {spec.kind}", plan)}
                  | ({"precision": f"{spec.dts[0]} storage, fp32 compute"}
                     if spec.dts[0] != "float32" else {}))


def _lower_maxpool_indices(ctx: LowerCtx) -> None:
    """MaxPool with its Indices output: per plane (n, c), per output position, a scalar
    walk of the window keeping the max and the flat index of its first occurrence
    (``((n*C + c)*D + d)*H + h)*W + w``; with storage_order=1 the spatial part is
    column-major, the first spatial dim fastest), as onnxruntime. Padding is never
    taken; NaN propagates (the first NaN's value and index), as in the value-only kernel."""
    g, _, _ = pool_geometry(ctx)
    xdt = np.dtype(ctx.in_types[0].dtype)
    D, H, W = g["isz"]
    OD, OH, OW = g["osz"]
    KD, KH, KW = g["k"]
    planes = g["N"] * g["C"]
    col_major = int(ctx.attr("storage_order", 0)) == 1
    ctx.num_tiles = planes
    ctx.flops = planes * OD * OH * OW * KD * KH * KW
    ctx.single_core = ctx.flops < SINGLE_CORE_FLOPS // 4
    ctx.notes["path"] = "window max+argmax (scalar)"
    fn, b = ctx.begin()
    x, y, yi = ctx.in_ptr(b, 0), ctx.out_ptr(b, 0), ctx.out_ptr(b, 1)
    E = Expr(b, 1)
    cdt = np.dtype(np.float32) if xdt.itemsize < 4 else xdt
    best_p = b.alloca(E.ty(cdt), name="best")
    idx_p = b.alloca(I64, name="idx")
    have_p = b.alloca(ir.IntType(1), name="have")
    inf = E.const(-np.inf, cdt)
    with for_range(b, ctx.tile_begin, ctx.tile_end, name="plane") as pl:
        xbase = b.mul(pl, i64(D * H * W))
        with for_range(b, 0, OD * OH * OW, name="o") as o:
            od = b.udiv(o, i64(OH * OW))
            oh = b.urem(b.udiv(o, i64(OW)), i64(OH))
            ow = b.urem(o, i64(OW))
            b.store(inf.v, best_p)
            b.store(i64(0), idx_p)
            b.store(ir.Constant(ir.IntType(1), 0), have_p)
            for kd in range(KD):
                idd = b.add(b.mul(od, i64(g["s"][0])), i64(kd * g["d"][0] - g["pb"][0]))
                for kh in range(KH):
                    ihh = b.add(b.mul(oh, i64(g["s"][1])), i64(kh * g["d"][1] - g["pb"][1]))
                    with for_range(b, 0, KW, name="kw") as kw:
                        iww = b.add(b.mul(ow, i64(g["s"][2])),
                                    b.sub(b.mul(kw, i64(g["d"][2])), i64(g["pb"][2])))
                        inside = b.and_(b.and_(b.icmp_unsigned("<", idd, i64(D)),
                                               b.icmp_unsigned("<", ihh, i64(H))),
                                        b.icmp_unsigned("<", iww, i64(W)))
                        with b.if_then(inside):
                            sp = b.add(b.mul(b.add(b.mul(idd, i64(H)), ihh), i64(W)), iww)
                            v = E.cast(load_tv(b, x, b.add(xbase, sp), xdt, 1, False), cdt)
                            best = TV(b.load(best_p, typ=E.ty(cdt)), cdt)
                            have = b.load(have_p, typ=ir.IntType(1))
                            beats = b.or_(E.cmp(">", v, best).v,
                                          b.and_(E.isnan(v).v, b.not_(E.isnan(best).v)))
                            take = b.or_(b.not_(have), beats)
                            if col_major:
                                sp = b.add(b.add(idd, b.mul(ihh, i64(D))), b.mul(iww, i64(D * H)))
                            b.store(b.select(take, v.v, best.v), best_p)
                            b.store(b.select(take, b.add(xbase, sp), b.load(idx_p, typ=I64)),
                                    idx_p)
                            b.store(ir.Constant(ir.IntType(1), 1), have_p)
            out = b.add(b.mul(pl, i64(OD * OH * OW)), o)
            best = TV(b.load(best_p, typ=E.ty(cdt)), cdt)
            store_tv(b, y, out, E.cast(best, xdt) if cdt != xdt else best, xdt)
            b.store(b.load(idx_p, typ=I64), emit.gep(b, yi, out, I64))
    b.ret_void()


def _lower_pool(ctx: LowerCtx) -> None:
    if _has_indices(ctx.node):
        if ctx.out_types[0].numel == 0:
            return _noop(ctx)
        return _lower_maxpool_indices(ctx)
    if ctx.tiling is not None:      # pool_tiling: one image's spec and plan, any batch
        _, spec, plan = ctx.tiling.key
        assert dc_replace(pool_spec(ctx.node, ctx.in_types[0], ctx.out_types[0]), N=1) == spec
    elif ctx.out_types[0].numel == 0:
        return _noop(ctx)
    else:
        spec = pool_spec(ctx.node, ctx.in_types[0], ctx.out_types[0])
        plan = plan_window(spec)
    emit_window(ctx.module, ctx.symbol, spec, plan, Slots(x=0, w=-1, b=-1, y=len(ctx.node.inputs)))
    ctx.num_tiles, ctx.workspace_bytes = plan.num_tiles, plan.ws_bytes
    ctx.single_core = ctx.out_types[0].numel * spec.KK < SINGLE_CORE_FLOPS // 4
    ctx.flops = ctx.out_types[0].numel * spec.KK
    ctx.notes["path"] = window_path(f"window {spec.kind}", plan)
    if spec.dts[0] != "float32":
        ctx.notes["precision"] = f"{spec.dts[0]} storage, fp32 compute"


register_lowering("Conv", tiling=conv_tiling)(_lower_conv)
register_lowering("ConvTranspose")(_lower_convtranspose)
for _name in ("MaxPool", "AveragePool", "LpPool"):
    register_lowering(_name, tiling=pool_tiling)(_lower_pool)
