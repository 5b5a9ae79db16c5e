"""Lowerings of the fused ops of domain 'cannc' (cannc/ir/ops/fused.py).

Each fused node lowers to ONE generated function: FusedMap composes its body ops'
`expr` functions into one vectorised loop nest (scalar constants become
immediates); FusedGemm and FusedConv evaluate their elementwise epilogue in
registers before the store; FusedAttention is the flash-attention kernel;
FusedSoftmax runs the Softmax/LogSoftmax lowering reading its prologue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import llvmlite.ir as ir
import numpy as np

from ...artifact import Tiling
from ...ir.epilogue import conv_operand_pattern, matmul_operand_pattern, operand_pattern
from ...ir.graph import Node
from ...ir.ops import lookup
from ...ir.ops.fused import DOMAIN
from ...ir.registry import OpDef
from ...ir.types import TensorType
from ...native import emit
from ...schedule.costmodel import describe
from ..attention import (
    RT_DIMS,
    attention_num_tiles,
    attention_plan,
    attention_precision_note,
    attention_tiling,
    attention_typed_spec,
    attention_workspace_bytes,
    emit_attention,
)
from ..elementwise import TV, Expr, bf16_bits_to_f32, emit_map, is_bf16, map_tiling
from ..kernel import LowerCtx
from ..plans import attention_notes, attention_record
from ..reduce import load_raw
from .base import register_lowering, registered_lowering
from .contraction import (
    contraction_tuning,
    emit_contraction,
    finish_contraction,
    gemm_tiling,
    note_precision,
    plan_contraction,
    plan_dynamic,
)
from .conv import _lower_conv, conv_store_type, conv_tiling, epilogue_reads_first


def _flops_per_elem(op: OpDef | None) -> int:
    return op.flops_per_elem if op is not None else 1



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
        expr = op.expr if op is not None else None
        assert expr is not None, n.op_type
        args = [env[v] if v else None for v in n.inputs]
        outs = expr(E, SubCtx(n, types, consts), args)
        for v, o in zip(n.outputs, outs):
            if v:
                env[v] = o
    return env


def _types(ctx: LowerCtx) -> dict[str, TensorType]:
    return ctx.attr("types")


def _scalar_consts(ctx: LowerCtx, skip: int = 0) -> dict[int, np.ndarray]:
    """External inputs (from index `skip`) that are size-1 constants: emitted as immediates."""
    out = {}
    for i, v in enumerate(ctx.node.inputs):
        if i >= skip and v and ctx.is_const(i) and ctx.consts[i].size == 1:
            out[i] = ctx.const(i)
    return out


def _immediate(E: Expr, c: np.ndarray) -> TV:
    return E.const(c.reshape(-1)[0].item(), c.dtype)


def _lower_fused_map(ctx: LowerCtx) -> None:
    body: list[Node] = ctx.attr("body")
    types = _types(ctx)
    consts = ctx.const_map()
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

    emit_map(ctx, operand_types, ctx.out_types, expr, operand_slots=present,
             folded_types=[ctx.in_types[i] for i in imm])
    ctx.flops = sum(ctx.out_types[0].numel * _flops_per_elem(lookup(n.op_type, n.domain))
                    for n in body)


def _fused_map_tiling(node: Node, in_types: list, out_types: list) -> Any:
    """The map tiling over every present input (scalar constants, which the lowering
    folds into immediates, are fully broadcast: they never change the pattern's merges)."""
    types = [in_types[i] for i, v in enumerate(node.inputs) if v]
    numel = int(np.prod([int(d) for d in out_types[0].shape]))
    t = map_tiling(types, out_types)
    if t is None:
        return None
    flops = sum(numel * _flops_per_elem(lookup(n.op_type, n.domain))
                for n in node.attrs["body"])
    return dataclasses.replace(t, flops=flops)


def _operand_pattern(mm: Node, in_types: list, i: int, out_shape: tuple[int, ...],
                     batched: bool) -> str | None:
    """How epilogue operand i is indexed from the GEMM's (m, n) (a MatMul's in the GEMM's
    own coordinates: ir.epilogue.gemm_view)."""
    if mm.op_type == "MatMul":
        return matmul_operand_pattern(in_types[i], out_shape, tuple(in_types[0].shape),
                                      tuple(in_types[1].shape), batched)
    return operand_pattern(in_types[i], out_shape, batched)


def _fused_gemm_tiling(node: Node, in_types: list, out_types: list,
                       consts: tuple[bool, ...] | None = None) -> Any:
    """The GEMM's tiling (M and the batch count at run time) with the indexing pattern
    of every epilogue operand in the key; None where the GEMM or an operand is static."""
    body: list[Node] = node.attrs["body"]
    mm = body[0]
    ncon = len(mm.inputs)
    t = gemm_tiling(mm, in_types[:ncon], out_types[:1], epilogue=True,
                    consts=consts[:ncon] if consts is not None else None)
    if t is None:
        return None
    batched = t.key[1].batch > 1
    out_shape = tuple(out_types[0].shape)
    pats = []
    for i in range(ncon, len(node.inputs)):
        if node.inputs[i]:
            pat = _operand_pattern(mm, in_types, i, out_shape, batched)
            if pat is None:
                return None
            pats.append((i, pat))
    numel = int(np.prod(out_shape))
    flops = (t.flops or 0) + sum(numel * _flops_per_elem(lookup(n.op_type, n.domain))
                                 for n in body[1:])
    return dataclasses.replace(t, key=t.key + (("epilogue", tuple(pats)),), flops=flops)


def _lower_fused_gemm(ctx: LowerCtx) -> None:
    body: list[Node] = ctx.attr("body")
    types = _types(ctx)
    mm, epi = body[0], body[1:]
    ncon = len(mm.inputs)
    dyn = ctx.tiling is not None    # M and the batch count at run time
    spec = plan_dynamic(ctx, mm) if dyn else plan_contraction(ctx, mm)
    out_t = ctx.out_types[0]
    out_shape = tuple(out_t.shape)
    consts = ctx.const_map()
    imm = _scalar_consts(ctx, skip=ncon)
    for i in imm:
        ctx.drop_input(i)
    ext = [i for i in range(ncon, len(ctx.node.inputs))
           if ctx.node.inputs[i] and i not in imm]
    gemm_in = [i for i in range(ncon) if ctx.node.inputs[i] and i not in ctx.dropped]
    ngemm = len(gemm_in)
    patterns = [_operand_pattern(mm, ctx.in_types, i, out_shape, spec.batch > 1) for i in ext]
    assert all(p is not None for p in patterns), patterns
    N = spec.N
    mm_out = mm.outputs[0]
    final = ctx.node.outputs[0]
    nptr = ngemm + 1 + len(ext)      # the inner GEMM's pointers; then its runtime dims

    mm_dt = np.dtype(types[mm_out].dtype) if mm_out in types else np.dtype(np.float32)

    def epilogue(b: ir.IRBuilder, val: ir.Value, m: ir.Value, n: ir.Value) -> ir.Value:
        lanes = val.type.count if isinstance(val.type, ir.VectorType) else 1
        E = Expr(b, lanes)
        args = b.function.args[0]
        # the GEMM's float32 result as the expressions hold its type (bfloat16: as float,
        # not rounded; float16: half); the GEMM converts the result on store
        if mm_dt == np.float16:
            env = {mm_out: TV(b.fptrunc(val, ir.VectorType(ir.HalfType(), lanes)), mm_dt)}
        else:
            env = {mm_out: TV(val, mm_dt if is_bf16(mm_dt) else np.dtype(np.float32))}
        env.update({ctx.node.inputs[i]: _immediate(E, c) for i, c in imm.items()})
        if dyn:   # GEMM_DIMS[0]: M
            M = b.load(emit.gep(b, args, nptr, emit.I64), typ=emit.I64)
        else:
            M = emit.i64(spec.M)
        m_safe = b.select(b.icmp_signed("<", m, M), m, b.sub(M, emit.i64(1)))
        for k, (i, pat) in enumerate(zip(ext, patterns)):
            ptr = emit.load_arg(b, args, ngemm + 1 + k)
            dt = np.dtype(ctx.in_types[i].dtype)
            tv = _load_operand(b, E, ptr, dt, pat, m_safe, n, N, lanes)
            if is_bf16(dt):   # bits -> float, as expressions hold bfloat16
                tv = TV(bf16_bits_to_f32(b, tv.v), dt)
            env[ctx.node.inputs[i]] = tv
        eval_body(E, epi, env, types, consts)
        return env[final].v

    full = [k for k, pat in enumerate(patterns) if pat == "full"]

    def prefetch(b: ir.IRBuilder, args: ir.Value, m: ir.Value, n: ir.Value) -> None:
        """Prefetch the line of every full-shape operand (a residual) at (m, n): the
        GEMM's micro-tiles call it before their last K block (gemm.EPILOGUE_PREFETCH);
        a prefetch past an operand's end does not fault."""
        for k in full:
            ptr = emit.load_arg(b, args, ngemm + 1 + k)
            dt = np.dtype(ctx.in_types[ext[k]].dtype)
            addr = emit.gep(b, ptr, b.add(b.mul(m, emit.i64(N)), n), emit.llvm_type(dt))
            emit.call_intrinsic(b, "llvm.prefetch", [addr, emit.i32(0), emit.i32(3),
                                                     emit.i32(1)], ret_type=emit.VOID)

    if full:
        epilogue.prefetch = prefetch      # type: ignore[attr-defined]

    # measured by `cannc tune`, else None (a kernel for any M: the modelled plan)
    tun = None if dyn else contraction_tuning(spec, epilogue=True)
    inner = emit_contraction(ctx.module, "gemm_with_epilogue", spec, epilogue=epilogue,
                             tuning=tun, dims_slot=nptr if dyn else None)
    inner.linkage = "internal"
    fn, b = ctx.begin()
    ndims = len(ctx.tiling.dims) if dyn else 0     # GEMM_DIMS, or AMX_DIMS
    arr = b.alloca(emit.PTR, size=emit.i64(nptr + ndims))
    ptrs = [ctx.in_ptr(b, i) for i in gemm_in] + [ctx.out_ptr(b, 0)] + \
           [ctx.in_ptr(b, i) for i in ext]
    for k, p in enumerate(ptrs):
        b.store(p, b.gep(arr, [emit.i64(k)], source_etype=emit.PTR))
    for k in range(ndims):
        b.store(ctx.rt_dim(b, k), emit.gep(b, arr, nptr + k, emit.I64))
    b.call(inner, [arr, ctx.tile_begin, ctx.tile_end, ctx.workspace])
    b.ret_void()
    if dyn:
        note_precision(ctx, spec)
    if not dyn:
        finish_contraction(ctx, spec, tuning=tun, epilogue=True)
        ctx.flops += sum(out_t.numel * _flops_per_elem(lookup(n.op_type, n.domain))
                         for n in epi)
    ctx.notes["epilogue"] = "+".join(n.op_type for n in epi)


def _operand(b: ir.IRBuilder, ptr: ir.Value, off: ir.Value, dt: np.dtype, lanes: int,
             broadcast: bool, mask: ir.Value | None = None) -> TV:
    """An operand of a fused epilogue or prologue at ptr[off]: `lanes` elements (lanes off in
    `mask` are not read), or one element splat over the lanes when `broadcast`; bools
    become i1, as expressions hold them."""
    n = 1 if broadcast else lanes
    v = load_raw(b, ptr, off, dt, n, mask if n > 1 else None)
    if dt == np.bool_:
        v = b.icmp_unsigned("!=", v, emit.const_like(0, v.type))
    if n == 1 and lanes > 1:
        v = emit.splat(b, v, lanes)
    return TV(v, dt)


def _expr_operand(b: ir.IRBuilder, ptr: ir.Value, off: ir.Value, dt: np.dtype, lanes: int,
                  broadcast: bool, mask: ir.Value | None = None) -> TV:
    """`_operand` as expressions hold it: bfloat16 bits widened to float."""
    tv = _operand(b, ptr, off, dt, lanes, broadcast, mask)
    return TV(bf16_bits_to_f32(b, tv.v), dt) if is_bf16(dt) else tv


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


class _NodeView:
    """A LowerCtx seen as if it lowered `node` alone (the fused node's leading inputs)."""

    def __init__(self, ctx: LowerCtx, node: Node, out_type: TensorType) -> None:
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


def _lower_fused_conv(ctx: LowerCtx) -> None:
    body: list[Node] = ctx.attr("body")
    types = _types(ctx)
    conv, epi = body[0], body[1:]
    ncon = len(conv.inputs)
    conv_out = conv.outputs[0]
    out_shape = tuple(types[conv_out].shape)
    consts = ctx.const_map()
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
        # float32 registers (a bfloat16 value is held as float; float16 is widened)
        cdt = np.dtype(types[conv_out].dtype)
        env = {conv_out: TV(val, cdt if cdt.name == "bfloat16" else np.dtype(np.float32))}
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
            env[ctx.node.inputs[i]] = _widened(b, env[ctx.node.inputs[i]])
        eval_body(E, epi, env, types, consts)
        return env[final].v

    # (flops an element: kernels may apply a costly epilogue apart, conv.costly_epilogue)
    epilogue.cost = sum(_flops_per_elem(lookup(n.op_type, n.domain)) for n in epi)
    # the conv's own tiling key (any batch: the epilogue's indices are flat offsets into
    # the output, or channels of it, which do not depend on N)
    tkey = ctx.tiling.key[1] if ctx.tiling is not None else None
    conv_t = conv_store_type(conv, ctx.in_types[:ncon], types[conv_out], types[final])
    _lower_conv(_NodeView(ctx, conv, conv_t), epilogue=epilogue, y_slot=n_in, tkey=tkey,
                reads=patterns.count("full"))
    ctx.flops += sum(int(np.prod(out_shape)) * _flops_per_elem(lookup(n.op_type, n.domain))
                     for n in epi)
    ctx.notes["epilogue"] = "+".join(n.op_type for n in epi)


def _widened(b: ir.IRBuilder, x: TV) -> TV:
    """A narrow epilogue operand as float (bfloat16 bits held as float; float16 widened)."""
    if x.dtype.name == "bfloat16" and x.v.type != emit.F32 and \
            getattr(x.v.type, "element", None) != emit.F32:
        return TV(bf16_bits_to_f32(b, x.v), x.dtype)
    if x.dtype == np.float16:
        ft = ir.VectorType(emit.F32, x.lanes) if x.lanes > 1 else emit.F32
        return TV(b.fpext(x.v, ft), np.dtype(np.float32))
    return x


def _fused_conv_tiling(node: Node, in_types: list, out_types: list) -> Any:
    """The Conv's tiling (the batch at run time) with the epilogue's operand patterns in
    the key: a 'full' operand is indexed by the flat output offset and a 'channel' one by
    (offset / spatial) % M, the same code for every N."""
    body: list[Node] = node.attrs["body"]
    types = node.attrs["types"]
    conv, epi = body[0], body[1:]
    ncon = len(conv.inputs)
    out_t = conv_store_type(conv, in_types[:ncon], types[conv.outputs[0]],
                            types[node.outputs[0]])
    if out_t is None or not out_t.is_static:
        return None     # (as conv_tiling)
    out_shape = tuple(out_t.shape)
    pats = tuple(conv_operand_pattern(in_types[i], out_shape) if v else None
                 for i, v in enumerate(node.inputs) if i >= ncon)
    t = conv_tiling(conv, in_types[:ncon], [out_t], reads=pats.count("full"))
    if t is None:
        return None
    numel = int(np.prod(out_shape))
    flops = (t.flops or 0) + sum(numel * _flops_per_elem(lookup(n.op_type, n.domain))
                                 for n in epi)
    notes = t.notes
    final = types[node.outputs[0]]
    if epilogue_reads_first(t.key):
        # the output may take the buffer of a residual of its type that the kernel reads
        # nowhere else (not the conv's input as well: Add(conv(x), x)) (Kernel.overwrites)
        same = [ncon + j for j, p in enumerate(pats) if p == "full"
                and in_types[ncon + j].dtype == final.dtype
                and tuple(in_types[ncon + j].shape) == out_shape
                and list(node.inputs).count(node.inputs[ncon + j]) == 1]
        if same:
            notes = {**notes, "overwrites": same[0]}
    return dataclasses.replace(t, key=("fused_conv", t.key, pats), flops=flops, notes=notes)


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


# -- attention -----------------------------------------------------------------------


def _lower_fused_attention(ctx: LowerCtx) -> None:
    if ctx.tiling is not None:
        # shape-polymorphic: the code depends on the form in the key only; B, Sq, Sk and
        # the open strides are the RT_DIMS after the tensor pointers (ctx.rt_dim's slots)
        form = ctx.tiling.key[1]
        assert len(ctx.tiling.dims) == len(RT_DIMS) and not ctx.dropped
        emit_attention(ctx.module, ctx.symbol, form)
        return
    spec = attention_typed_spec(ctx.attr("spec"), ctx.in_types, ctx.out_types,
                                ctx.node.attrs.get("cannc_precision"))
    ctx.notes["precision"] = attention_precision_note(spec)
    emit_attention(ctx.module, ctx.symbol, spec)
    ctx.num_tiles = attention_num_tiles(spec)
    ctx.workspace_bytes = attention_workspace_bytes(spec)
    ctx.flops = 2 * spec.B * spec.H * spec.Sq * spec.Sk * (spec.D + spec.Dv)
    ctx.notes["attention"] = f"B{spec.B} H{spec.H} Sq{spec.Sq} Sk{spec.Sk} D{spec.D} " \
                             f"mask={spec.mask}"
    ctx.notes.update(attention_notes(spec))  # notes['plan'], notes['tiling']


def _fused_attention_tiling(node: Node, in_types: list, out_types: list) -> Any:
    """Host tiling: the kernel's form (heads, head dims, layouts, mask kind and the
    inner-loop strides that do not depend on B, Sq, Sk) is the key; B, Sq, Sk and the
    other strides are runtime dims (codegen.attention.attention_tiling)."""
    spec = attention_typed_spec(node.attrs["spec"], in_types, out_types,
                                node.attrs.get("cannc_precision"))
    t = attention_tiling(spec)
    plan = attention_plan(t.form)
    rec = attention_record(spec, dataclasses.replace(plan, nq=-(-spec.Sq // plan.MQ)))
    notes = {"attention": f"B{spec.B} H{spec.H} Sq{spec.Sq} Sk{spec.Sk} D{spec.D} "
                          f"mask={spec.mask}", "plan": rec, "tiling": describe(rec),
             "precision": attention_precision_note(t.form)}   # what the kernel runs
    return Tiling(key=("attention", t.form), dims=t.dims, num_tiles=t.num_tiles,
                  workspace_bytes=t.workspace_bytes,
                  flops=2 * spec.B * spec.H * spec.Sq * spec.Sk * (spec.D + spec.Dv),
                  notes=notes)


# -- elementwise prologue + Softmax / LogSoftmax -----------------------------------


class _ReductionView(_NodeView):
    """The reduction node alone, reading a virtual input 0 computed by the prologue."""

    def in_ptr(self, b: ir.IRBuilder, i: int) -> ir.Value:
        return ir.Constant(emit.PTR, None)


def _bcast_strides(shape: Sequence[int], rank: int) -> list[int]:
    """Element strides of a dense operand of `shape` broadcast to `rank` dims (0 where
    its extent is 1)."""
    oshape = [1] * (rank - len(shape)) + [int(d) for d in shape]
    st, acc = [0] * rank, 1
    for d in range(rank - 1, -1, -1):
        st[d] = 0 if oshape[d] == 1 else acc
        acc *= oshape[d]
    return st


def _fused_softmax_tiling(n: Node, ins: list, outs: list) -> Any:
    """The Softmax's own tiling (rows and row length at run time), then x's leading
    extents and, per input, its strides along them (0 where it broadcasts: a mask
    [B,1,1,S] at B=1 or B=8 is the same code). Whether an input is one element per
    row (broadcast along the softmax axis) is in the key."""
    sm = n.attrs["body"][-1]
    xt = n.attrs["types"][sm.inputs[0]]
    smdef = lookup(sm.op_type, sm.domain)
    low = registered_lowering(smdef) if smdef is not None else None
    t = low.tiling(sm, [xt], outs) if low is not None and low.tiling else None
    if t is None:
        return None
    shape = [int(d) for d in xt.shape]
    rank = len(shape)
    extra, per_row = list(shape[:-1]), []
    for it in ins:
        if it is None:
            extra += [0] * (rank - 1)
            per_row.append(False)
            continue
        if len(it.shape) > rank:
            return None
        st = _bcast_strides(it.shape, rank)
        extra += st[:-1]
        per_row.append(st[-1] == 0)
    numel = int(np.prod(shape))
    flops = (t.flops or 0) + sum(numel * _flops_per_elem(lookup(b.op_type, b.domain))
                                 for b in n.attrs["body"][:-1])
    return dataclasses.replace(t, key=("fused_softmax", rank, t.key, tuple(per_row)),
                               dims=t.dims + tuple(extra), flops=flops)


def _lower_fused_softmax(ctx: LowerCtx) -> None:
    body: list[Node] = ctx.attr("body")
    types = _types(ctx)
    pro, sm = body[:-1], body[-1]
    x_name = sm.inputs[0]
    xt = types[x_name]
    shape = tuple(int(d) for d in xt.shape)
    dense = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        dense[d] = dense[d + 1] * shape[d + 1]
    consts = ctx.const_map()
    imm = _scalar_consts(ctx)
    for i in imm:
        ctx.drop_input(i)
    ext = [i for i, v in enumerate(ctx.node.inputs) if v and i not in imm]
    strides = {i: _bcast_strides(ctx.in_types[i].shape, len(shape)) for i in ext}

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
            env[ctx.node.inputs[i]] = _expr_operand(b, ctx.in_ptr(b, i), base,
                                                    np.dtype(ctx.in_types[i].dtype), lanes,
                                                    st[-1] == 0, mask)
        eval_body(E, pro, env, types, consts)
        return env[x_name]

    def x_rows(eng: Any, b: ir.IRBuilder, row: ir.Value) -> Any:
        """Shape-polymorphic: each operand's offset at the start of the row, from the
        runtime extents and strides (see _fused_softmax_tiling), once per row."""
        rank, dims = len(shape), eng.dims
        first = len(dims) - (rank - 1) * (1 + len(ctx.node.inputs))
        per_row = ctx.tiling.key[3]
        idx: list[ir.Value] = [emit.i64(0)] * (rank - 1)
        rem = row
        for d in range(rank - 2, -1, -1):
            if d > 0:
                idx[d] = b.urem(rem, dims[first + d])
                rem = b.udiv(rem, dims[first + d])
            else:
                idx[d] = rem
        bases, ptrs = {}, {}
        for i in ext:
            st = first + (rank - 1) * (1 + i)
            off = emit.i64(0)
            for d in range(rank - 1):
                off = b.add(off, b.mul(idx[d], dims[st + d]))
            bases[i], ptrs[i] = off, ctx.in_ptr(b, i)

        def load(b: ir.IRBuilder, off: ir.Value, pos: ir.Value, lanes: int,
                 mask: ir.Value | None) -> TV:
            E = Expr(b, lanes)
            env = {ctx.node.inputs[i]: _immediate(E, c) for i, c in imm.items()}
            for i in ext:
                dt = np.dtype(ctx.in_types[i].dtype)
                env[ctx.node.inputs[i]] = (
                    _expr_operand(b, ptrs[i], bases[i], dt, lanes, True) if per_row[i] else
                    _expr_operand(b, ptrs[i], b.add(bases[i], pos), dt, lanes, False, mask))
            eval_body(E, pro, env, types, consts)
            return env[x_name]
        return load

    if ctx.tiling is not None:
        ctx.reduce_x_rows = x_rows
    else:
        ctx.reduce_x_source = x_source
    view = _ReductionView(ctx, sm, types[sm.outputs[0]])
    object.__setattr__(view, "in_types", [xt])
    low = registered_lowering(lookup(sm.op_type))
    assert low is not None, sm.op_type
    low.lower(view)
    ctx.flops += sum(int(np.prod(shape)) * _flops_per_elem(lookup(n.op_type, n.domain))
                     for n in pro)
    ctx.notes["prologue"] = "+".join(n.op_type for n in pro)


register_lowering("FusedMap", domain=DOMAIN, tiling=_fused_map_tiling)(_lower_fused_map)
register_lowering("FusedGemm", domain=DOMAIN, tiling=_fused_gemm_tiling,
                  tiling_consts=True)(_lower_fused_gemm)
register_lowering("FusedConv", domain=DOMAIN, tiling=_fused_conv_tiling)(_lower_fused_conv)
register_lowering("FusedAttention", domain=DOMAIN,
                  tiling=_fused_attention_tiling)(_lower_fused_attention)
register_lowering("FusedSoftmax", domain=DOMAIN,
                  tiling=_fused_softmax_tiling)(_lower_fused_softmax)
