"""Lowerings of MatMul and Gemm (cannc/ir/ops/contraction.py): the packed GEMM generator.

float32, bfloat16 and float16 MatMul/Gemm go onto codegen/gemm.py; constant B is packed
once at compile time. A bf16/fp16-typed node, or one with ``attrs["cannc_precision"]``
("bf16" / "fp16": each of A, B, bias and the output float32 or that type, see
`gemm_types`), multiplies in that precision with float32 accumulation (vdpbf16ps where
the CPU has it, else widened to fp32 in registers); the epilogue runs in float32 and
the output is converted on store. ``kernel.notes["precision"]`` says how it ran.
Other dtypes (float64, int32/64, uint32/64), mixed bf16/fp16 operands, empty operands
and the integer contractions (MatMulInteger, QLinearMatMul in lower/quant.py)
use `emit_matmul_nest`: a loop nest vectorised along N (one output row per
tile, accumulators in registers), computing in an accumulator dtype (float32
for the 16-bit floats, like onnxruntime's and NumPy's half dot products).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any

import llvmlite.ir as ir
import numpy as np

from ...artifact import Tiling
from ...ir.epilogue import matmul_dims as _matmul_dims
from ...ir.epilogue import matmul_shape
from ...ir.graph import Node
from ...ir.types import TensorType, dtype_name
from ...native import emit
from ...native.emit import for_range, i64
from ...native.target import host
from ...schedule import machine
from ...schedule.tuning import fingerprint as tuning_fingerprint
from ...schedule.tuning import gemm_signature
from ..amx import (
    amx_dims,
    amx_plan,
    amx_prepack_b,
    amx_supports,
    amx_usable,
    amx_workspace_bytes,
    emit_amx_gemm,
)
from ..elementwise import bf16_bits_to_f32, f32_to_bf16_bits, is_bf16
from ..gemm import (
    COMPUTE,
    ELEM_TYPES,
    GEMM_DIMS,
    GemmSpec,
    dynamic_able,
    dynamic_spec,
    emit_gemm,
    gemm_dims,
    gemm_num_tiles,
    gemm_plan,
    gemm_workspace_bytes,
    precision_note,
    prepack_b,
    variant_plan,
)
from ..kernel import ConstRef, LowerCtx
from ..plans import gemm_notes, gemm_tuning, precision_record
from .base import register_lowering


def _matmul_spec(a: TensorType, b: TensorType) -> tuple[GemmSpec | None, str | None]:
    """The GemmSpec of `a @ b` (ir.epilogue.MatmulShape), or None and the reason."""
    shape, why = matmul_shape(tuple(a.shape), tuple(b.shape))
    if shape is None:
        return None, why
    return GemmSpec(M=shape.M, N=shape.N, K=shape.K, batch=shape.batch,
                    a_batch_stride=shape.a_batch_stride, b_batch_stride=shape.b_batch_stride,
                    c_batch_stride=shape.c_batch_stride), None


# ---------------------------------------------------------------------------
# the loop nest (any dtype)
# ---------------------------------------------------------------------------

def acc_dtype(dt: np.dtype) -> np.dtype:
    """The dtype a contraction over `dt` accumulates in."""
    dt = np.dtype(dt)
    if dt.name in ("float16", "bfloat16", "float32"):
        return np.dtype(np.float32)
    return dt


def load_as(b: ir.IRBuilder, ptr: ir.Value, off: ir.Value, dt: np.dtype, acc: np.dtype,
            lanes: int) -> ir.Value:
    """Element(s) ptr[off : off+lanes] of dtype dt converted to the accumulator dtype."""
    dt, acc = np.dtype(dt), np.dtype(acc)
    et = emit.llvm_type(dt)
    ty = ir.VectorType(et, lanes) if lanes > 1 else et
    v = b.load(emit.gep(b, ptr, off, et), typ=ty)
    v.align = dt.itemsize
    at = emit.llvm_type(acc)
    aty = ir.VectorType(at, lanes) if lanes > 1 else at
    if dt == acc:
        return v
    if is_bf16(dt):
        v = bf16_bits_to_f32(b, v)
        return v if acc == np.float32 else b.fpext(v, aty)
    if emit.is_float(dt) and emit.is_float(acc):
        return b.fpext(v, aty) if dt.itemsize < acc.itemsize else b.fptrunc(v, aty)
    if emit.is_float(acc):
        return b.sitofp(v, aty) if emit.is_signed(dt) else b.uitofp(v, aty)
    if dt.itemsize < acc.itemsize:
        return b.sext(v, aty) if emit.is_signed(dt) else b.zext(v, aty)
    return v


def store_from(b: ir.IRBuilder, v: ir.Value, ptr: ir.Value, off: ir.Value, dt: np.dtype,
               acc: np.dtype) -> None:
    """Store accumulator value(s) v as dtype dt (floats round to nearest)."""
    dt, acc = np.dtype(dt), np.dtype(acc)
    lanes = v.type.count if isinstance(v.type, ir.VectorType) else 1
    et = emit.llvm_type(dt)
    ty = ir.VectorType(et, lanes) if lanes > 1 else et
    if is_bf16(dt):
        if acc != np.float32:
            v = b.fptrunc(v, ir.VectorType(emit.F32, lanes) if lanes > 1 else emit.F32)
        v = f32_to_bf16_bits(b, v)
    elif dt != acc:
        if emit.is_float(dt):
            v = b.fptrunc(v, ty) if dt.itemsize < acc.itemsize else b.fpext(v, ty)
        else:
            v = b.trunc(v, ty)
    st = b.store(v, emit.gep(b, ptr, off, et))
    st.align = dt.itemsize


def _bstrides(shape: tuple[int, ...], batch: tuple[int, ...], mat: int) -> list[int]:
    """Element strides of an operand's batch dims (0 where broadcast), matrices of `mat`."""
    st, acc = [0] * len(batch), mat
    for d in range(len(batch) - 1, -1, -1):
        st[d] = 0 if shape[d] == 1 else acc
        acc *= shape[d]
    return st


def emit_matmul_nest(ctx: LowerCtx, a_shape: tuple[int, ...], b_shape: tuple[int, ...],
                     acc: np.dtype, load_a: Any, load_b: Any, store: Any,
                     prologue: Any = None) -> None:
    """C[batch, M, N] = sum_k A[batch, M, k] * B[batch, k, N] (numpy matmul broadcasting,
    1-D operands promoted) as a loop nest: a tile is one row of C, vectorised along N.

    prologue(b) -> P (anything, e.g. pointers); load_a(b, P, off) -> scalar in `acc` (off:
    element offset in A); load_b(b, P, off, n, lanes) -> `lanes` values in `acc` from
    B[off : off+lanes] (n: the first column); store(b, P, value, c_off, n) with value the
    accumulators of columns [n, n+lanes)."""
    batch, M, K, N, ab, bb = _matmul_dims(tuple(a_shape), tuple(b_shape))
    nb = int(np.prod(batch)) if batch else 1
    acc = np.dtype(acc)
    at = emit.llvm_type(acc)
    lanes = max(1, 64 // acc.itemsize)
    flt = emit.is_float(acc)
    a_st = _bstrides(ab, batch, M * K)
    b_st = _bstrides(bb, batch, K * N)
    rows = nb * M
    ctx.num_tiles = max(1, rows)
    ctx.single_core = rows * N * max(K, 1) < 32768
    ctx.flops = 2 * rows * N * K
    fn, b = ctx.begin()
    P = prologue(b) if prologue is not None else None
    if rows == 0 or N == 0:
        b.ret_void()
        return
    # accumulators live in allocas (promoted to registers by LLVM)
    accs = {1: b.alloca(at, name="acc1")}
    if lanes > 1:
        accs[lanes] = b.alloca(ir.VectorType(at, lanes), name=f"acc{lanes}")

    def madd(x: ir.Value, y: ir.Value, z: ir.Value) -> ir.Value:
        if flt:
            return emit.intrinsic(b, "llvm.fma", [x, y, z])
        return b.add(b.mul(x, y), z)

    with for_range(b, ctx.tile_begin, ctx.tile_end, name="row") as t:
        bi = b.udiv(t, i64(M)) if M > 1 else t
        m = b.urem(t, i64(M)) if M > 1 else i64(0)
        a_off, b_off = b.mul(m, i64(K)), i64(0)
        rem = bi
        for d in range(len(batch) - 1, -1, -1):
            idx = b.urem(rem, i64(batch[d])) if d > 0 else rem
            rem = b.udiv(rem, i64(batch[d])) if d > 0 else rem
            if a_st[d]:
                a_off = b.add(a_off, b.mul(idx, i64(a_st[d])))
            if b_st[d]:
                b_off = b.add(b_off, b.mul(idx, i64(b_st[d])))
        c_off = b.mul(t, i64(N))

        def cols(n: ir.Value, w: int) -> None:
            ty = ir.VectorType(at, w) if w > 1 else at
            b.store(emit.const_like(0, ty), accs[w])
            if K:
                with for_range(b, 0, K, name="k") as k:
                    av = load_a(b, P, b.add(a_off, k))
                    if w > 1:
                        av = emit.splat(b, av, w)
                    bv = load_b(b, P, b.add(b_off, b.add(b.mul(k, i64(N)), n)), n, w)
                    b.store(madd(av, bv, b.load(accs[w], typ=ty)), accs[w])
            store(b, P, b.load(accs[w], typ=ty), b.add(c_off, n), n)

        nv = N - N % lanes if lanes > 1 else 0
        if nv:
            with for_range(b, 0, nv, step=lanes, name="nv") as n:
                cols(n, lanes)
        if nv < N:
            with for_range(b, nv, N, name="ns") as n:
                cols(n, 1)
    b.ret_void()


def _lower_matmul_nest(ctx: LowerCtx) -> None:
    a_t, b_t = ctx.in_types[0], ctx.in_types[1]
    dt = np.dtype(ctx.out_types[0].dtype)
    acc = acc_dtype(dt)

    def prologue(b: ir.IRBuilder) -> tuple:
        return ctx.in_ptr(b, 0), ctx.in_ptr(b, 1), ctx.out_ptr(b, 0)

    def load_a(b: ir.IRBuilder, P: tuple, off: ir.Value) -> ir.Value:
        return load_as(b, P[0], off, a_t.dtype, acc, 1)

    def load_b(b: ir.IRBuilder, P: tuple, off: ir.Value, n: ir.Value, w: int) -> ir.Value:
        return load_as(b, P[1], off, b_t.dtype, acc, w)

    def store(b: ir.IRBuilder, P: tuple, v: ir.Value, off: ir.Value, n: ir.Value) -> None:
        store_from(b, v, P[2], off, dt, acc)

    emit_matmul_nest(ctx, tuple(int(d) for d in a_t.shape), tuple(int(d) for d in b_t.shape),
                     acc, load_a, load_b, store, prologue)
    ctx.notes["matmul"] = "loop nest"


PRECISIONS = ("bf16", "fp16")  # the values of attrs["cannc_precision"]


def gemm_types(n: Node, ins: list[TensorType | None], out: TensorType | None
               ) -> dict[str, str] | None:
    """The element types and compute precision (GemmSpec fields a_type, b_type,
    bias_type, c_type, compute) of a MatMul/Gemm node with inputs ``ins`` (A, B, C) and
    output ``out``, or None where the GEMM generator does not take them. Products are in
    the node's ``cannc_precision`` (each operand float32 or that narrow type), else in
    the one narrow type among the operands (float32 when there is none)."""
    names = [dtype_name(t.dtype) if t is not None else "float32"
             for t in (list(ins[:3]) + [None] * (3 - len(ins[:3])))[:3] + [out]]
    if any(t not in ELEM_TYPES for t in names):
        return None
    narrow = {t for t in names if t != "float32"}
    prec = n.attrs.get("cannc_precision")
    if prec is not None:
        if prec not in PRECISIONS or not narrow <= {COMPUTE[prec]}:
            return None
        compute = prec
    elif len(narrow) > 1:
        return None
    else:
        compute = {"bfloat16": "bf16", "float16": "fp16"}[narrow.pop()] if narrow else "f32"
    return {"a_type": names[0], "b_type": names[1], "bias_type": names[2],
            "c_type": names[3], "compute": compute}


def _use_gemm(ctx: LowerCtx) -> bool:
    ins = ctx.in_types
    if gemm_types(ctx.node, ins, ctx.out_types[0]) is None:
        return False
    if any(int(d) == 0 for t in ins for d in t.shape):
        return False
    return _matmul_spec(ins[0], ins[1])[0] is not None


def _lower_matmul(ctx: LowerCtx) -> None:
    if ctx.tiling is not None:
        return _lower_dynamic(ctx)
    if not _use_gemm(ctx):
        return _lower_matmul_nest(ctx)
    spec = plan_contraction(ctx)
    tun = contraction_tuning(spec)
    emit_contraction(ctx.module, ctx.symbol, spec, tuning=tun)
    finish_contraction(ctx, spec, tuning=tun)


def plan_contraction(ctx: LowerCtx, node: Node | None = None) -> GemmSpec:
    """The GemmSpec of a MatMul/Gemm node (ctx.node by default; its inputs are ctx's first
    inputs); packs a constant B through ctx.replace_const and drops an unread Gemm C."""
    n = node or ctx.node
    if n.op_type == "MatMul":
        spec, why = _matmul_spec(ctx.in_types[0], ctx.in_types[1])
        assert spec is not None, why
    else:
        present_c = len(n.inputs) > 2 and bool(n.inputs[2])
        spec = _gemm_spec(ctx, n, ctx.in_types[:2] + ([ctx.in_types[2]] if present_c else []))
        if len(n.inputs) > 2 and not spec.bias:
            ctx.drop_input(2)  # absent, or beta == 0: C is not read
    spec = _with(spec, **_types_of(n, ctx.in_types[:len(n.inputs)], ctx.out_types[0]))
    b = ctx.const(1)
    if b is not None:
        spec = _with(spec, b_prepacked=True)
        ctx.replace_const(1, _prepack_const_b, spec, n.op_type == "MatMul", ConstRef(1),
                          use_amx(spec))
    return spec


# ---------------------------------------------------------------------------
# the AMX kernels (codegen/amx.py): bf16 products where the CPU has tiles
# ---------------------------------------------------------------------------

_AMX_TYPES = frozenset({"float32", "bfloat16"})
AMX_NOTE = "bf16 AMX (fp32 sums)"


def use_amx(spec: GemmSpec) -> bool:
    """Whether this GEMM runs on AMX tiles: bf16 products on a CPU (and process) with
    AMX, a constant B, the operand types the AMX kernel takes."""
    return (spec.compute == "bf16" and spec.b_prepacked
            and {spec.a_type, spec.b_type, spec.c_type} <= _AMX_TYPES
            and (not spec.bias or spec.bias_type in _AMX_TYPES)
            and amx_usable() is None and amx_supports(spec) is None)


def amx_candidate(spec: GemmSpec) -> bool:
    """Whether a GEMM of these types and layout would run on AMX if its B is a constant
    (what a tiling function, which sees types only, can tell)."""
    return use_amx(_with(spec, dyn=False, b_prepacked=True))


def contraction_tuning(spec: GemmSpec, epilogue: bool = False) -> dict | None:
    """`cannc tune`'s measured plan of a gemm.py kernel (None: the modelled plan; AMX
    kernels are not tuned)."""
    return None if use_amx(spec) else gemm_tuning(spec, epilogue)


def emit_contraction(module: ir.Module, name: str, spec: GemmSpec, epilogue: Any = None, *,
                     tuning: dict | None = None, dims_slot: int | None = None
                     ) -> ir.Function:
    """The GEMM kernel of `spec`: on AMX tiles where `use_amx`, else gemm.py's."""
    if use_amx(spec):
        return emit_amx_gemm(module, name, spec, epilogue, a_dtype=spec.a_type,
                             c_dtype=spec.c_type,
                             bias_dtype=spec.bias_type if spec.bias else "float32",
                             dims_slot=dims_slot)
    return emit_gemm(module, name, spec, epilogue, tuning=tuning, dims_slot=dims_slot)


def _types_of(n: Node, ins: list[TensorType | None], out: TensorType) -> dict[str, str]:
    """gemm_types of a node the GEMM generator takes (absent C: float32)."""
    ins = list(ins[:3])
    if n.op_type == "Gemm" and len(ins) > 2 and not n.inputs[2]:
        ins[2] = None
    t = gemm_types(n, ins if n.op_type == "Gemm" else ins[:2], out)
    assert t is not None, "not a GEMM the generator takes"
    return t


def _prepack_const_b(spec: GemmSpec, matmul: bool, b: np.ndarray, amx: bool = False
                     ) -> np.ndarray:
    """The packed constant B. A MatMul's B brings its own batch count: a memoised
    (shape-polymorphic) kernel is shared by B of one item and B of several, so the
    recipe replayed on another graph's B must not assume the count it was made for."""
    if matmul:
        kn = spec.K * spec.N
        nb = b.size // kn if kn else 1
        if nb > 1:
            spec = _with(spec, batch=nb, b_batch_stride=kn)
            b = b.reshape(nb, spec.K, spec.N)
        else:
            spec = _with(spec, batch=1, b_batch_stride=0)
            b = b.reshape(spec.K, spec.N)
    return amx_prepack_b(spec, b) if amx else prepack_b(spec, b)


def finish_contraction(ctx: LowerCtx, spec: GemmSpec, extra_ws: int = 0,
                       tuning: dict | None = None, epilogue: bool = False) -> None:
    if use_amx(spec):
        p = amx_plan(spec, spec.a_type)
        ctx.num_tiles = p.num_tiles(spec.batch)
        ctx.workspace_bytes = p.ws_bytes + extra_ws
        ctx.flops = 2 * spec.batch * spec.M * spec.N * spec.K
        ctx.notes["gemm"] = _describe(spec) + " AMX"
        ctx.notes.update(_amx_notes(spec, spec.M, spec.batch, (p.mt, p.nt, p.MB, p.NB),
                                    ctx.num_tiles, ctx.workspace_bytes, pack_a=p.pack_a))
        return
    ctx.num_tiles = gemm_num_tiles(spec, tuning)
    ctx.workspace_bytes = gemm_workspace_bytes(spec, tuning) + extra_ws
    ctx.flops = 2 * spec.batch * spec.M * spec.N * spec.K
    ctx.notes["gemm"] = _describe(spec)
    ctx.notes.update(gemm_notes(spec, tuning, epilogue))  # notes['plan'], notes['tiling']
    note_precision(ctx, spec, tuning)


def note_precision(ctx: LowerCtx, spec: GemmSpec, tuning: dict | None = None) -> None:
    """ctx.notes['precision'] of a GEMM with narrow operands or products."""
    note = AMX_NOTE if use_amx(spec) else precision_note(spec, tuning)
    if note is not None:
        ctx.notes["precision"] = note


def _with(spec: GemmSpec, **kw: Any) -> GemmSpec:
    return dataclasses.replace(spec, **kw)


def _describe(spec: GemmSpec) -> str:
    s = f"{spec.M}x{spec.N}x{spec.K}"
    if spec.batch > 1:
        s = f"{spec.batch}x[{s}]"
    s += " B-prepacked" if spec.b_prepacked else ""
    if spec.compute != "f32" or {spec.a_type, spec.b_type, spec.c_type} != {"float32"}:
        s += f" {spec.compute} (A {spec.a_type}, B {spec.b_type}, C {spec.c_type})"
    return s


# ---------------------------------------------------------------------------
# shape-polymorphic GEMMs: M (and the batch count) at run time
# ---------------------------------------------------------------------------

def dynamic_gemm(n: Node, ins: list[TensorType | None], out: TensorType | None = None
                 ) -> tuple[GemmSpec, int, int, int | None, GemmSpec] | None:
    """The kernel of a float32 MatMul/Gemm node for any M (rows: batch x sequence of a
    [.., M, K] x [K, N] MatMul, whose batch folds into M) and any batch count (a batched
    MatMul): (canonical GemmSpec without prepacking, M, batch, batch items of B when B is
    batched, the static GemmSpec of these shapes), or None where the shapes are emitted
    statically (other dtypes, A transposed, empty operands). ``out``: the output's type
    (its element type is C's; default: A's)."""
    if ins[0] is None or ins[1] is None:
        return None
    gin = list(ins[:3]) if n.op_type == "Gemm" else list(ins[:2])
    if n.op_type == "Gemm" and len(gin) > 2 and not (len(n.inputs) > 2 and n.inputs[2]):
        gin[2] = None
    types = gemm_types(n, gin, out if out is not None else ins[0])
    if types is None:
        return None
    if any(not t.is_static or any(int(d) == 0 for d in t.shape) for t in ins if t is not None):
        return None
    if n.op_type == "Gemm":
        present_c = len(n.inputs) > 2 and bool(n.inputs[2])
        spec = _with(_gemm_spec(None, n, ins[:2] + ([ins[2]] if present_c else [])), **types)
        if dynamic_able(spec):
            return None
        return dynamic_spec(spec), spec.M, 1, None, spec
    a, b = (tuple(int(d) for d in t.shape) for t in ins[:2])
    batch, M, K, N, ab, bb = _matmul_dims(a, b)
    nb = int(np.prod(batch)) if batch else 1
    spec, _ = _matmul_spec(ins[0], ins[1])
    if spec is None:
        return None
    spec = _with(spec, **types)
    if len(b) <= 2 or (nb > 1 and all(d == 1 for d in bb)):
        # B has no batch: A's batch dims fold into M
        return dynamic_spec(GemmSpec(M=nb * M, N=N, K=K, **types)), nb * M, 1, None, spec
    # batched; A is broadcast when it has no batch (at one item: when it is 2-D)
    a_one = len(a) <= 2 or (nb > 1 and all(d == 1 for d in ab))
    canon = dynamic_spec(GemmSpec(M=M, N=N, K=K, batch=2, a_batch_stride=0 if a_one else M * K,
                                  b_batch_stride=K * N, c_batch_stride=M * N, **types),
                         batched=True)
    return canon, M, nb, int(np.prod(bb)), spec


def _tuned(spec: GemmSpec, epilogue: bool) -> bool:
    """A `cannc tune` entry exists for these exact shapes (B prepacked or not: the tiling
    function does not know whether B is a constant)."""
    return any(gemm_tuning(_with(spec, b_prepacked=pre), epilogue) is not None
               for pre in (True, False))


def gemm_tiling(n: Node, ins: list[TensorType | None], outs: list[TensorType],
                epilogue: bool = False, consts: tuple[bool, ...] | None = None
                ) -> Tiling | None:
    """The host tiling function of MatMul and Gemm (codegen/ABI.md "Runtime dimensions"):
    the key is the canonical GEMM (N, K, layouts, bias pattern, alpha, beta), the dims
    are GEMM_DIMS for these M and batch (AMX_DIMS for an AMX kernel, which needs a
    constant B: ``consts``, which inputs are constants; not known: AMX candidates are
    emitted statically). Shapes that `cannc tune` measured get their tuned static
    kernel (None)."""
    d = dynamic_gemm(n, ins, outs[0] if outs else None)
    if d is None:
        return None
    canon, M, batch, _, full = d
    b_const = consts[1] if consts is not None and len(consts) > 1 else None
    return _gemm_tiling(canon, M, batch, full, epilogue, b_const, len(ins[1].shape) <= 2,
                        # (machine's read through it, as the planners read them)
                        (host(), tuning_fingerprint(), machine.l2_bytes(),
                         machine.fma_pipes()))


@lru_cache(maxsize=1024)
def _gemm_tiling(canon: GemmSpec, M: int, batch: int, full: GemmSpec, epilogue: bool,
                 b_const: bool | None, b_2d: bool, host_key: tuple) -> Tiling | None:
    """gemm_tiling of the dynamic GEMM `canon` at M rows and `batch` items (`full`: the
    static spec of these shapes; `b_2d`: B has no batch dims). Kept per these and
    `host_key` (the host target, the tuning entries in effect, L2 and FMA pipes: what
    the planners read), since a model's layers repeat their GEMMs and every new input
    shape asks again: 72 calls for ~6 answers; lowering a new BERT-base shape 42 -> 28 ms.
    The Tiling is shared: its notes are read, never changed."""
    if _tuned(full, epilogue):
        return None
    if amx_candidate(full) and b_const is not False:
        if b_const is None:
            return None    # a static AMX kernel once B proves a constant
        return _amx_tiling(_with(canon, b_prepacked=True), M, batch)
    # B may be a constant (prepacked: no workspace) or not (packed per block): the
    # workspace of the latter serves both, the dims serve both (gemm_dims); the grid
    # is the one of a prepacked B when B is 2-D (a weight, most likely)
    guess = _with(canon, b_prepacked=b_2d)
    dims, tiles = gemm_dims(guess, M, batch)
    ws = gemm_workspace_bytes(canon)
    p = variant_plan(gemm_plan(guess), dims[GEMM_DIMS.index("variant")])   # (that runs)
    notes = {"gemm": _describe(_with(canon, M=M, batch=batch, dyn=False)) + " dynamic",
             "plan": {"kind": "gemm", "M": M, "N": canon.N, "K": canon.K, "batch": batch,
                      "MR": p.MR, "NR": p.NR, "NV": p.NV, "KC": p.KC, "MC": p.MC,
                      "NC": p.NC, **dict(zip(GEMM_DIMS[2:], dims[2:])),
                      "b_mode": p.b_mode, "pack_a": p.pack_a, "pack_b": p.b_mode == "pack",
                      "tiles": tiles, "workspace_bytes": ws, "tuning": None,
                      "dynamic": True, **precision_record(canon, p),
                      # what `cannc tune` measures (B taken as a prepacked weight when 2-D)
                      "signature": gemm_signature(_with(full, b_prepacked=b_2d),
                                                  epilogue)}}
    note = precision_note(guess)
    if note is not None:
        notes["precision"] = note
    return Tiling(key=("gemm", canon), dims=dims, num_tiles=tiles,
                  workspace_bytes=ws, flops=2 * batch * M * canon.N * canon.K, notes=notes)


def _amx_notes(spec: GemmSpec, M: int, batch: int, grid: tuple[int, int, int, int],
               tiles: int, ws: int, **extra: Any) -> dict[str, Any]:
    """notes['plan'] / ['tiling'] / ['precision'] of an AMX GEMM of M rows and `batch`
    items on the grid (mt, nt, MB, NB)."""
    mt, nt, MB, NB = grid
    path = f"AMX 2x2 16x16 tiles, grid {mt}x{nt} of {MB}x{NB}"
    plan = {"kind": "amx", "M": M, "N": spec.N, "K": spec.K, "batch": batch, "MB": MB,
            "NB": NB, "mt": mt, "nt": nt, **extra, "tiles": tiles, "workspace_bytes": ws,
            "path": path}
    return {"plan": plan, "tiling": path, "precision": AMX_NOTE}


def _amx_tiling(canon: GemmSpec, M: int, batch: int) -> Tiling:
    """The tiling of a shape-polymorphic AMX GEMM (B a constant, prepacked)."""
    dims, tiles = amx_dims(canon, M, batch, canon.a_type)
    ws = amx_workspace_bytes(canon, canon.a_type)
    notes = {"gemm": _describe(_with(canon, M=M, batch=batch, dyn=False)) + " AMX dynamic",
             **_amx_notes(canon, M, batch, tuple(dims[2:6]), tiles, ws, dynamic=True)}
    return Tiling(key=("amx", canon), dims=dims, num_tiles=tiles, workspace_bytes=ws,
                  flops=2 * batch * M * canon.N * canon.K, notes=notes)


def plan_dynamic(ctx: LowerCtx, node: Node | None = None) -> GemmSpec:
    """plan_contraction for a kernel of any M and batch count (ctx.tiling is set): the
    canonical GemmSpec (prepacked when B is a constant: the packing depends on N and K
    only, so the recipe serves every M); drops an unread Gemm C."""
    n = node or ctx.node
    ncon = len(n.inputs)
    d = dynamic_gemm(n, ctx.in_types[:ncon], ctx.out_types[0])
    assert d is not None
    spec, _, _, b_items, _ = d
    if n.op_type == "Gemm" and len(n.inputs) > 2 and not spec.bias:
        ctx.drop_input(2)  # absent, or beta == 0: C is not read
    if ctx.const(1) is not None:
        spec = _with(spec, b_prepacked=True)
        # the packing spec: B's own batch items (when batched), no M
        pack = _with(spec, dyn=False, batch=b_items or 1, a_batch_stride=0,
                     b_batch_stride=spec.b_batch_stride if b_items and b_items > 1 else 0)
        ctx.replace_const(1, _prepack_const_b, pack, n.op_type == "MatMul", ConstRef(1),
                          use_amx(spec))
    # the tiling function chose the kernel (its dims are that kernel's)
    assert use_amx(spec) == (ctx.tiling.key[0] == "amx"), ctx.tiling.key[0]
    return spec


def dims_slot(ctx: LowerCtx) -> int:
    """The argument slot of the first runtime dim (after the tensor pointers)."""
    return len(ctx.node.inputs) - len(ctx.dropped) + len(ctx.node.outputs)


def _lower_dynamic(ctx: LowerCtx) -> None:
    spec = plan_dynamic(ctx)
    emit_contraction(ctx.module, ctx.symbol, spec, dims_slot=dims_slot(ctx))
    ctx.notes["gemm"] = _describe(spec) + " dynamic"
    note_precision(ctx, spec)


def _gemm_spec(ctx_or_types: Any, n: Node, ins: list[TensorType]) -> GemmSpec:
    ta, tb = bool(n.attrs.get("transA", 0)), bool(n.attrs.get("transB", 0))
    a, b = ins[0].shape, ins[1].shape
    M, K = (a[1], a[0]) if ta else (a[0], a[1])
    N = b[0] if tb else b[1]
    alpha = float(n.attrs.get("alpha", 1.0))
    beta = float(n.attrs.get("beta", 1.0))
    c = ins[2] if len(ins) > 2 else None
    rs = cs = 0
    has_bias = c is not None and beta != 0.0
    if has_bias:
        cshape = (1,) * (2 - len(c.shape)) + tuple(c.shape)
        # a 2-D C of one row is a [M, N] C when M is 1 (the same kernel as at other M)
        rs = 0 if cshape[0] == 1 and (M != 1 or len(c.shape) < 2) else cshape[1]
        cs = 0 if cshape[1] == 1 else 1
    return GemmSpec(M=M, N=N, K=K, trans_a=ta, trans_b=tb, alpha=alpha, beta=beta,
                    bias=has_bias, bias_row_stride=rs, bias_col_stride=cs)


def _lower_gemm(ctx: LowerCtx) -> None:
    if ctx.tiling is not None:
        return _lower_dynamic(ctx)
    spec = plan_contraction(ctx)
    tun = contraction_tuning(spec)
    emit_contraction(ctx.module, ctx.symbol, spec, tuning=tun)
    finish_contraction(ctx, spec, tuning=tun)


register_lowering("MatMul", tiling=gemm_tiling, tiling_consts=True)(_lower_matmul)
register_lowering("Gemm", tiling=gemm_tiling, tiling_consts=True)(_lower_gemm)
