"""Fused kernels: one node of domain 'cannc' stands for a group of ONNX nodes.

The group's nodes are kept in the node's `body` attribute (in order); the
node's inputs are the group's external inputs and its outputs the values the
group must write to memory. Each fused op lowers to ONE generated function:

- FusedMap: a chain of elementwise/broadcast ops as one vectorised loop nest
  (the ops' own `expr` functions composed; scalar constants become immediates);
- FusedGemm: a MatMul/Gemm whose elementwise consumers (bias, activation,
  residual add...) run in the GEMM's epilogue, in registers, before the store.
"""

from __future__ import annotations

from typing import Any, Sequence

import llvmlite.ir as ir
import numpy as np

from ...codegen import emit
from ...codegen.elementwise import TV, Expr, emit_map
from ...codegen.gemm import emit_gemm
from ..graph import Node
from ..registry import Category, OpDef, lookup, register
from ..types import TensorType
from .contraction import finish_contraction, plan_contraction

DOMAIN = "cannc"


class SubCtx:
    """What a body node's `expr` sees (the subset of LowerCtx that exprs use)."""

    def __init__(self, node: Node, types: dict[str, TensorType],
                 consts: dict[str, np.ndarray]) -> None:
        self.node = node
        self.in_types = [types.get(v) if v else None for v in node.inputs]
        self.out_types = [types[v] for v in node.outputs if v]
        self._consts = consts

    def attr(self, name: str, default: Any = None) -> Any:
        return self.node.attrs.get(name, default)

    @property
    def opset(self) -> int:
        return self.node.opset

    def const(self, i: int) -> np.ndarray | None:
        v = self.node.inputs[i] if i < len(self.node.inputs) else ""
        return self._consts.get(v) if v else None


def eval_body(E: Expr, body: Sequence[Node], env: dict[str, TV], types: dict[str, TensorType],
              consts: dict[str, np.ndarray]) -> dict[str, TV]:
    """Evaluate the body's expressions in order; env maps value names to typed values."""
    for n in body:
        op = lookup(n.op_type, n.domain)
        assert op is not None and "expr" in op.extra, n.op_type
        args = [env[v] if v else None for v in n.inputs]
        outs = op.extra["expr"](E, SubCtx(n, types, consts), args)
        for v, o in zip(n.outputs, outs):
            if v:
                env[v] = o
    return env


def _types(ctx: Any) -> dict[str, TensorType]:
    return ctx.attr("types")


def _scalar_consts(ctx: Any, skip: int = 0) -> dict[int, np.ndarray]:
    """External inputs (from index `skip`) that are size-1 constants: emitted as immediates."""
    out = {}
    for i, v in enumerate(ctx.node.inputs):
        c = ctx.const(i)
        if i >= skip and v and c is not None and c.size == 1:
            out[i] = c
    return out


def _immediate(E: Expr, c: np.ndarray) -> TV:
    return E.const(c.reshape(-1)[0].item(), c.dtype)


def _lower_fused_map(ctx: Any) -> None:
    body: list[Node] = ctx.attr("body")
    types = _types(ctx)
    consts = {v: ctx.const(i) for i, v in enumerate(ctx.node.inputs) if ctx.const(i) is not None}
    imm = _scalar_consts(ctx)
    for i in imm:
        ctx.drop_input(i)
    present = [i for i, v in enumerate(ctx.node.inputs) if v and i not in imm]
    operand_types = [ctx.in_types[i] for i in present]

    def expr(E: Expr, vals: Sequence[TV]) -> list[TV]:
        env = {ctx.node.inputs[i]: v for i, v in zip(present, vals)}
        env.update({ctx.node.inputs[i]: _immediate(E, c) for i, c in imm.items()})
        eval_body(E, body, env, types, consts)
        return [env[o] for o in ctx.node.outputs]

    emit_map(ctx, operand_types, ctx.out_types, expr, operand_slots=present)
    ctx.flops = sum(ctx.out_types[0].numel * lookup(n.op_type).extra.get("flops_per_elem", 1)
                    for n in body)


register(OpDef(name="FusedMap", domain=DOMAIN, category=Category.BROADCAST,
               lower=_lower_fused_map, doc="elementwise/broadcast chain in one loop nest"))


# -- GEMM + epilogue ---------------------------------------------------------------


def operand_pattern(t: TensorType, out_shape: tuple[int, ...], batched: bool) -> str | None:
    """How an epilogue operand is indexed from the GEMM's (m, n): 'scalar' (offset 0),
    'row' (n), 'col' (m), 'full' (m*N + n); None when it is none of these."""
    shape = tuple(t.shape)
    r = len(out_shape)
    shape = (1,) * (r - len(shape)) + shape
    if all(d == 1 for d in shape):
        return "scalar"
    if all(d == 1 for d in shape[:-1]) and shape[-1] == out_shape[-1]:
        return "row"
    if batched:
        return None
    if shape == tuple(out_shape):
        return "full"
    if shape[-1] == 1 and shape[:-1] == tuple(out_shape[:-1]):
        return "col"
    return None


def _lower_fused_gemm(ctx: Any) -> None:
    body: list[Node] = ctx.attr("body")
    types = _types(ctx)
    mm, epi = body[0], body[1:]
    ncon = len(mm.inputs)
    spec = plan_contraction(ctx, mm)
    out_t = ctx.out_types[0]
    out_shape = tuple(out_t.shape)
    consts = {v: ctx.const(i) for i, v in enumerate(ctx.node.inputs) if ctx.const(i) is not None}
    imm = _scalar_consts(ctx, skip=ncon)
    for i in imm:
        ctx.drop_input(i)
    ext = [i for i in range(ncon, len(ctx.node.inputs))
           if ctx.node.inputs[i] and i not in imm]
    gemm_in = [i for i in range(ncon) if ctx.node.inputs[i] and i not in ctx.dropped]
    ngemm = len(gemm_in)
    patterns = [operand_pattern(ctx.in_types[i], out_shape, spec.batch > 1) for i in ext]
    assert all(p is not None for p in patterns), patterns
    M, N = spec.M, spec.N
    mm_out = mm.outputs[0]
    final = ctx.node.outputs[0]

    def epilogue(b: ir.IRBuilder, val: ir.Value, m: ir.Value, n: ir.Value) -> ir.Value:
        lanes = val.type.count if isinstance(val.type, ir.VectorType) else 1
        E = Expr(b, lanes)
        args = b.function.args[0]
        env = {mm_out: TV(val, np.dtype(np.float32))}
        env.update({ctx.node.inputs[i]: _immediate(E, c) for i, c in imm.items()})
        m_safe = b.select(b.icmp_signed("<", m, emit.i64(M)), m, emit.i64(M - 1))
        for k, (i, pat) in enumerate(zip(ext, patterns)):
            ptr = emit.load_arg(b, args, ngemm + 1 + k)
            dt = np.dtype(ctx.in_types[i].dtype)
            env[ctx.node.inputs[i]] = _load_operand(b, E, ptr, dt, pat, m_safe, n, N, lanes)
        eval_body(E, epi, env, types, consts)
        return env[final].v

    inner = emit_gemm(ctx.module, "gemm_with_epilogue", spec, epilogue=epilogue)
    inner.linkage = "internal"
    fn, b = ctx.begin()
    nptr = ngemm + 1 + len(ext)
    arr = b.alloca(emit.PTR, size=emit.i64(nptr))
    ptrs = [ctx.in_ptr(b, i) for i in gemm_in] + [ctx.out_ptr(b, 0)] + \
           [ctx.in_ptr(b, i) for i in ext]
    for k, p in enumerate(ptrs):
        b.store(p, b.gep(arr, [emit.i64(k)], source_etype=emit.PTR))
    b.call(inner, [arr, ctx.tile_begin, ctx.tile_end, ctx.workspace])
    b.ret_void()
    finish_contraction(ctx, spec)
    ctx.flops += sum(out_t.numel * lookup(n.op_type).extra.get("flops_per_elem", 1) for n in epi)
    ctx.notes["epilogue"] = "+".join(n.op_type for n in epi)


def _operand(b: ir.IRBuilder, ptr: ir.Value, off: ir.Value, dt: np.dtype, lanes: int,
             broadcast: bool, mask: ir.Value | None = None) -> TV:
    """An operand of a fused epilogue or prologue at ptr[off]: `lanes` elements (lanes off in
    `mask` are not read), or one element splat over the lanes when `broadcast`; bools
    become i1, as expressions hold them."""
    from ...codegen.reduce import load_raw

    n = 1 if broadcast else lanes
    v = load_raw(b, ptr, off, dt, n, mask if n > 1 else None)
    if dt == np.bool_:
        v = b.icmp_unsigned("!=", v, emit.const_like(0, v.type))
    if n == 1 and lanes > 1:
        v = emit.splat(b, v, lanes)
    return TV(v, dt)


def _load_operand(b: ir.IRBuilder, E: Expr, ptr: ir.Value, dt: np.dtype, pat: str,
                  m: ir.Value, n: ir.Value, N: int, lanes: int) -> TV:
    if pat == "scalar" or pat == "col":
        return _operand(b, ptr, emit.i64(0) if pat == "scalar" else m, dt, lanes, True)
    off = n if pat == "row" else b.add(b.mul(m, emit.i64(N)), n)
    mask = None
    if lanes > 1:
        # lanes past N are not read (the GEMM discards their results)
        idx = ir.Constant(ir.VectorType(emit.I64, lanes), list(range(lanes)))
        cols = b.add(emit.splat(b, n, lanes), idx)
        mask = b.icmp_signed("<", cols, emit.splat(b, emit.i64(N), lanes))
    return _operand(b, ptr, off, dt, lanes, False, mask)


register(OpDef(name="FusedGemm", domain=DOMAIN, category=Category.CONTRACTION,
               lower=_lower_fused_gemm, doc="GEMM with an elementwise epilogue"))


# -- Conv + epilogue -----------------------------------------------------------------


def conv_operand_pattern(t: TensorType, out_shape: tuple[int, ...]) -> str | None:
    """How an epilogue operand of a Conv output [N, M, *spatial] is indexed: 'scalar',
    'channel' (one value per output channel) or 'full'; None otherwise."""
    shape = tuple(t.shape)
    r = len(out_shape)
    shape = (1,) * (r - len(shape)) + shape
    if all(d == 1 for d in shape):
        return "scalar"
    if shape == tuple(out_shape):
        return "full"
    if r >= 2 and shape[1] == out_shape[1] and all(
            d == 1 for i, d in enumerate(shape) if i != 1):
        return "channel"
    return None


class _NodeView:
    """A LowerCtx seen as if it lowered `node` alone (the fused node's leading inputs)."""

    def __init__(self, ctx: Any, node: Node, out_type: TensorType) -> None:
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "in_types", ctx.in_types[:len(node.inputs)])
        object.__setattr__(self, "out_types", [out_type])

    def attr(self, name: str, default: Any = None) -> Any:
        return self.node.attrs.get(name, default)

    @property
    def opset(self) -> int:
        return self.node.opset

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._ctx, name, value)


def _lower_fused_conv(ctx: Any) -> None:
    from .conv import _lower_conv

    body: list[Node] = ctx.attr("body")
    types = _types(ctx)
    conv, epi = body[0], body[1:]
    ncon = len(conv.inputs)
    conv_out = conv.outputs[0]
    out_shape = tuple(types[conv_out].shape)
    consts = {v: ctx.const(i) for i, v in enumerate(ctx.node.inputs) if ctx.const(i) is not None}
    imm = _scalar_consts(ctx, skip=ncon)
    for i in imm:
        ctx.drop_input(i)
    ext = [i for i in range(ncon, len(ctx.node.inputs)) if ctx.node.inputs[i] and i not in imm]
    patterns = [conv_operand_pattern(ctx.in_types[i], out_shape) for i in ext]
    assert all(p is not None for p in patterns), patterns
    M = out_shape[1]
    SP = int(np.prod(out_shape[2:])) if len(out_shape) > 2 else 1
    final = ctx.node.outputs[0]
    n_in = len(ctx.node.inputs) - len(ctx.dropped)
    slot_of = {i: i - sum(1 for d in ctx.dropped if d < i) for i in ext}

    def epilogue(b: ir.IRBuilder, val: ir.Value, offset: ir.Value, stride: int,
                 mask: ir.Value) -> ir.Value:
        lanes = val.type.count
        E = Expr(b, lanes)
        args = b.function.args[0]
        env = {conv_out: TV(val, np.dtype(np.float32))}
        env.update({ctx.node.inputs[i]: _immediate(E, c) for i, c in imm.items()})
        lane = ir.Constant(ir.VectorType(emit.I64, lanes), [k * stride for k in range(lanes)])
        idx = b.add(emit.splat(b, offset, lanes), lane)
        for i, pat in zip(ext, patterns):
            ptr = emit.load_arg(b, args, slot_of[i])
            dt = np.dtype(ctx.in_types[i].dtype)
            if pat == "scalar":
                env[ctx.node.inputs[i]] = _operand(b, ptr, emit.i64(0), dt, lanes, True)
            elif pat == "full" and stride == 1:       # consecutive lanes: a masked load
                env[ctx.node.inputs[i]] = _operand(b, ptr, offset, dt, lanes, False, mask)
            else:
                at = idx if pat == "full" else b.urem(
                    b.udiv(idx, emit.splat(b, emit.i64(SP), lanes)),
                    emit.splat(b, emit.i64(M), lanes))
                env[ctx.node.inputs[i]] = _gather(b, ptr, at, mask, dt, lanes)
        eval_body(E, epi, env, types, consts)
        return env[final].v

    _lower_conv(_NodeView(ctx, conv, types[conv_out]), epilogue=epilogue, y_slot=n_in)
    ctx.flops += sum(int(np.prod(out_shape)) * lookup(n.op_type).extra.get("flops_per_elem", 1)
                     for n in epi)
    ctx.notes["epilogue"] = "+".join(n.op_type for n in epi)


def _gather(b: ir.IRBuilder, ptr: ir.Value, idx: ir.Value, mask: ir.Value, dt: np.dtype,
            lanes: int) -> TV:
    """The masked lanes of ptr[idx] for a <lanes x i64> index vector."""
    et = emit.llvm_type(dt)
    vt = ir.VectorType(et, lanes)
    mt = ir.VectorType(emit.I1, lanes)
    pv = ir.VectorType(emit.PTR, lanes)
    # a vector of addresses (llvmlite's gep does not type vector GEPs)
    base = emit.splat(b, b.ptrtoint(ptr, emit.I64), lanes)
    off = b.mul(idx, emit.splat(b, emit.i64(dt.itemsize), lanes))
    ptrs = b.inttoptr(b.add(base, off), pv)
    name = f"llvm.masked.gather.{emit._mangle(vt)}.v{lanes}p0"
    fn = b.module.globals.get(name) or ir.Function(
        b.module, ir.FunctionType(vt, [pv, emit.I32, mt, vt]), name=name)
    v = b.call(fn, [ptrs, ir.Constant(emit.I32, dt.itemsize), mask, ir.Constant(vt, ir.Undefined)])
    if dt == np.bool_:
        v = b.icmp_unsigned("!=", v, emit.const_like(0, vt))
    return TV(v, dt)


register(OpDef(name="FusedConv", domain=DOMAIN, category=Category.CONTRACTION,
               lower=_lower_fused_conv, doc="convolution with an elementwise epilogue"))


# -- attention -----------------------------------------------------------------------


def _lower_fused_attention(ctx: Any) -> None:
    from ...codegen.attention import (attention_num_tiles, attention_workspace_bytes,
                                      emit_attention)

    spec = ctx.attr("spec")
    emit_attention(ctx.module, ctx.symbol, spec)
    ctx.num_tiles = attention_num_tiles(spec)
    ctx.workspace_bytes = attention_workspace_bytes(spec)
    ctx.flops = 2 * spec.B * spec.H * spec.Sq * spec.Sk * (spec.D + spec.Dv)
    ctx.notes["attention"] = f"B{spec.B} H{spec.H} Sq{spec.Sq} Sk{spec.Sk} D{spec.D} " \
                             f"mask={spec.mask}"


register(OpDef(name="FusedAttention", domain=DOMAIN, category=Category.OPAQUE,
               lower=_lower_fused_attention,
               doc="scaled dot-product attention, tiled with an online softmax"))


# -- elementwise prologue + Softmax / LogSoftmax -----------------------------------


class _ReductionView(_NodeView):
    """The reduction node alone, reading a virtual input 0 computed by the prologue."""

    def in_ptr(self, b: ir.IRBuilder, i: int) -> ir.Value:
        return ir.Constant(emit.PTR, None)


def _lower_fused_softmax(ctx: Any) -> None:
    body: list[Node] = ctx.attr("body")
    types = _types(ctx)
    pro, sm = body[:-1], body[-1]
    x_name = sm.inputs[0]
    xt = types[x_name]
    shape = tuple(int(d) for d in xt.shape)
    dense = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        dense[d] = dense[d + 1] * shape[d + 1]
    consts = {v: ctx.const(i) for i, v in enumerate(ctx.node.inputs) if ctx.const(i) is not None}
    imm = _scalar_consts(ctx)
    for i in imm:
        ctx.drop_input(i)
    ext = [i for i, v in enumerate(ctx.node.inputs) if v and i not in imm]
    strides = {}
    for i in ext:
        t = ctx.in_types[i]
        oshape = (1,) * (len(shape) - len(t.shape)) + tuple(int(d) for d in t.shape)
        st, acc = [0] * len(shape), 1
        for d in range(len(shape) - 1, -1, -1):
            st[d] = 0 if oshape[d] == 1 else acc
            acc *= oshape[d]
        strides[i] = st

    def x_source(b: ir.IRBuilder, off: ir.Value, lanes: int, mask: ir.Value | None) -> TV:
        E = Expr(b, lanes)
        env = {ctx.node.inputs[i]: _immediate(E, c) for i, c in imm.items()}
        for i in ext:
            st = strides[i]
            base = emit.i64(0)
            for d in range(len(shape)):
                if st[d] == 0:
                    continue
                idx = b.urem(b.udiv(off, emit.i64(dense[d])), emit.i64(shape[d]))
                base = b.add(base, b.mul(idx, emit.i64(st[d])))
            # broadcast along the vector (last stride 0): one element, splat
            env[ctx.node.inputs[i]] = _operand(b, ctx.in_ptr(b, i), base,
                                               np.dtype(ctx.in_types[i].dtype), lanes,
                                               st[-1] == 0, mask)
        eval_body(E, pro, env, types, consts)
        return env[x_name]

    ctx.reduce_x_source = x_source
    view = _ReductionView(ctx, sm, types[sm.outputs[0]])
    object.__setattr__(view, "in_types", [xt])
    lookup(sm.op_type).lower(view)
    ctx.flops += sum(int(np.prod(shape)) * lookup(n.op_type).extra.get("flops_per_elem", 1)
                     for n in pro)
    ctx.notes["prologue"] = "+".join(n.op_type for n in pro)


register(OpDef(name="FusedSoftmax", domain=DOMAIN, category=Category.REDUCTION,
               lower=_lower_fused_softmax,
               doc="Softmax/LogSoftmax reading an elementwise prologue (scale, mask...)"))
