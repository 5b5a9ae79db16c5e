"""Small helpers so that codegen reads like the loops it makes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import llvmlite.ir as ir
import numpy as np

from ._llvm_worker import VECTOR_CODE
from .target import host

I1 = ir.IntType(1)
I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32 = ir.FloatType()
F64 = ir.DoubleType()
PTR = ir.PointerType()
VOID = ir.VoidType()


class BFloatType(ir.Type):
    """LLVM's ``bfloat`` (llvmlite.ir has none): the element of the operands of
    ``llvm.x86.avx512bf16.dpbf16ps.512`` and of ``fptrunc`` to bfloat16
    (``vcvtneps2bf16``). Vectors of it work with ir.VectorType; values come from a
    bitcast of i16 lanes (bfloat16 data is stored and loaded as i16)."""

    null = "0xR0000"
    intrinsic_name = "bf16"

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BFloatType)

    def __hash__(self) -> int:
        return hash(BFloatType)


BF16 = BFloatType()


class X86AMXType(ir.Type):
    """LLVM's ``x86_amx``: an Intel AMX tile register (up to 16 rows of 64 bytes) whose
    shape is given by the ``(i16 rows, i16 colbytes)`` operands of the ``*.internal``
    tile intrinsics; LLVM's backend writes the tile configuration (``ldtilecfg``)."""

    def _to_string(self) -> str:
        return "x86_amx"

    def __eq__(self, other) -> bool:
        return isinstance(other, X86AMXType)

    def __hash__(self) -> int:
        return hash(X86AMXType)


X86_AMX = X86AMXType()


def i64(v: int) -> ir.Constant:
    return ir.Constant(I64, int(v))


def i32(v: int) -> ir.Constant:
    return ir.Constant(I32, int(v))


def llvm_type(dtype: np.dtype) -> ir.Type:
    """The LLVM type that stores one element of `dtype` (bool is an i8 0/1)."""
    dt = np.dtype(dtype)
    if dt == np.float32:
        return F32
    if dt == np.float64:
        return F64
    if dt == np.float16:
        return ir.HalfType()
    if dt.name == "bfloat16":
        return ir.BFloatType() if hasattr(ir, "BFloatType") else ir.IntType(16)
    if dt == np.bool_:
        return I8
    if dt.kind in "iu":
        return ir.IntType(dt.itemsize * 8)
    if dt.itemsize == 1 and (dt.name.startswith("float") or dt.name in _SUBBYTE_INTS):
        return I8   # float8/float4 codes and sub-byte integers: one element per byte
    raise NotImplementedError(f"no LLVM type for dtype {dt}")


# ml_dtypes' sub-byte integers (held one per byte; cannc.ir.types.SUBBYTE_INTS)
_SUBBYTE_INTS = frozenset({"int4", "uint4", "int2", "uint2"})


def is_float(dtype: np.dtype) -> bool:
    """float16/32/64, bfloat16 and the float8/float4 types of ml_dtypes."""
    dt = np.dtype(dtype)
    return dt.kind == "f" or dt.name == "bfloat16" or dt.name.startswith("float")


def is_signed(dtype: np.dtype) -> bool:
    dt = np.dtype(dtype)
    return dt.kind == "i" or dt.name in ("int4", "int2")


@contextmanager
def for_range(b: ir.IRBuilder, start: ir.Value | int, stop: ir.Value | int,
              step: int = 1, name: str = "i") -> Iterator[ir.Value]:
    """`with for_range(b, 0, n) as i:` emits a counted loop; the body is emitted inside."""
    start = i64(start) if isinstance(start, int) else start
    stop = i64(stop) if isinstance(stop, int) else stop
    pre = b.block
    fn = b.function
    cond_bb = fn.append_basic_block(f"{name}.cond")
    body_bb = fn.append_basic_block(f"{name}.body")
    end_bb = fn.append_basic_block(f"{name}.end")
    b.branch(cond_bb)
    b.position_at_end(cond_bb)
    iv = b.phi(I64, name=name)
    iv.add_incoming(start, pre)
    b.cbranch(b.icmp_signed("<", iv, stop), body_bb, end_bb)
    b.position_at_end(body_bb)
    yield iv
    nxt = b.add(iv, i64(step), name=f"{name}.next")
    iv.add_incoming(nxt, b.block)
    b.branch(cond_bb)
    b.position_at_end(end_bb)


def gep(b: ir.IRBuilder, ptr: ir.Value, index: ir.Value | int, ty: ir.Type) -> ir.Value:
    idx = i64(index) if isinstance(index, int) else index
    return b.gep(ptr, [idx], source_etype=ty)


def load_arg(b: ir.IRBuilder, args: ir.Value, i: int) -> ir.Value:
    """The i-th pointer of the kernel's argument array."""
    return b.load(gep(b, args, i, PTR), typ=PTR)


def vec(ty: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(ty, n)


def splat(b: ir.IRBuilder, scalar: ir.Value, n: int) -> ir.Value:
    vt = ir.VectorType(scalar.type, n)
    if isinstance(scalar, ir.Constant):
        return ir.Constant(vt, [scalar.constant] * n)
    v = b.insert_element(ir.Constant(vt, ir.Undefined), scalar, ir.Constant(I32, 0))
    return b.shuffle_vector(v, ir.Constant(vt, ir.Undefined),
                            ir.Constant(ir.VectorType(I32, n), [0] * n))


def const_like(value: float | int, ty: ir.Type) -> ir.Constant:
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [_scalar_const(value, ty.element)] * ty.count)
    return ir.Constant(ty, _scalar_const(value, ty))


def _scalar_const(value: float | int, ty: ir.Type) -> float | int:
    if isinstance(ty, ir.IntType):
        return int(value)
    return float(value)


def intrinsic(b: ir.IRBuilder, name: str, args: list[ir.Value],
              ret: ir.Type | None = None) -> ir.Value:
    """Call an overloaded LLVM intrinsic such as 'llvm.fma' on the type of args[0]."""
    return call_intrinsic(b, name, args, ret)


def mangle(ty: ir.Type) -> str:
    """The overloaded-intrinsic name suffix of a type (``v16f32``, ``f64``, ``i32``)."""
    if isinstance(ty, ir.VectorType):
        return f"v{ty.count}{mangle(ty.element)}"
    if isinstance(ty, ir.FloatType):
        return "f32"
    if isinstance(ty, ir.DoubleType):
        return "f64"
    if isinstance(ty, ir.HalfType):
        return "f16"
    if isinstance(ty, ir.IntType):
        return f"i{ty.width}"
    if str(ty) == "bfloat":
        return "bf16"
    if isinstance(ty, ir.PointerType):
        return "p0"
    raise TypeError(f"cannot mangle type {ty}")


_mangle = mangle  # the name elementwise, movement, reduce and ops/fused use


def call_intrinsic(builder: ir.IRBuilder, name: str, args: Sequence[ir.Value],
                   ret_type: ir.Type | None = None,
                   overload: Sequence[ir.Type] | None = None) -> ir.Value:
    """Declare (once per module) and call an overloaded LLVM intrinsic.

    ``name`` is the base name (``'llvm.fma'``); the mangled suffix is built
    from ``overload`` (default: the type of the first argument), giving e.g.
    ``llvm.fma.v16f32``. A name that already carries that suffix is used as is.
    The return type defaults to the first argument's type.
    """
    args = list(args)
    if overload is None:
        overload = [args[0].type]
    suffix = "".join("." + mangle(t) for t in overload)
    full = name if name.endswith(suffix) else name + suffix
    if ret_type is None:
        ret_type = args[0].type
    module = builder.block.parent.module
    fn = module.globals.get(full)
    if fn is None:
        fnty = ir.FunctionType(ret_type, [a.type for a in args])
        fn = ir.Function(module, fnty, name=full)
    return builder.call(fn, args)


def internalise(module: ir.Module, keep: str) -> None:
    """Give every definition but the kernel entry internal linkage, so that the
    objects of many kernels can be loaded into one engine without clashes."""
    for gv in module.global_values:
        if gv.name == keep or gv.name.startswith("llvm."):
            continue
        if isinstance(gv, ir.Function) and gv.is_declaration:
            continue
        gv.linkage = "internal"


def mark_vector_code(module: ir.Module) -> None:
    """Say that `module` is vector code already, its loops unrolled as its generator
    chose: LLVM optimises it without its unroller and vectorisers, at O1
    (native._llvm_worker.VECTOR_CODE)."""
    module.add_named_metadata(VECTOR_CODE)


# ---------------------------------------------------------------------------
# masked loads
#
# LLVM 22's x86 lowering of llvm.masked.load on an AVX2 target (no AVX-512 mask
# registers) goes wrong when the mask is wider than a ymm register and one 256-bit
# half of it folds to all-false: the assertion "Getting value from an unknown
# LocationSize!" in an assertion-enabled LLVM (llvmlite's), and with
# `select(cond, <8 x true, 8 x false>, 0)` inside a kernel, a load that reads the
# masked-off lanes (Zen 3, depthwise Conv with an output 9 wide: column 8 took the
# next row's first pixel). `masked_load` is the one way codegen emits a masked load:
# lanes whose mask is known at compile time are folded here (all false: the
# pass-through; all true: a plain load), and on an AVX2 target a mask wider than 256
# bits is split into 256-bit pieces so that no piece LLVM sees folds to all-false.
# ---------------------------------------------------------------------------

_INT_BINOPS = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
}
_ICMP = {
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
}


def _wrap(x: int, bits: int, signed: bool) -> int:
    x &= (1 << bits) - 1
    return x - (1 << bits) if signed and x >> (bits - 1) else x


def const_lanes(v: ir.Value, depth: int = 0) -> list[int | None] | None:
    """The lanes of an integer (or i1) vector or scalar that are compile-time constants
    (``None`` where a lane is not known; ``None`` for a value not understood at all).
    Understands constants and the integer arithmetic, compares, selects, shuffles and
    insertions that codegen builds its masks from (llvmlite folds none of them).

    The answer is kept on the value (``_cannc_lanes``, with the depth it was found at):
    masks share their sub-expressions, and without it the walk revisited them once per
    path (a BERT-base GEMM's masks cost ~260 visits a query, 1.5 s a compile). An answer
    found at a depth no deeper than this query's is reused: it had at least this query's
    budget, so it knows at least as many lanes, and every lane it knows is exact. The
    returned list is shared: callers read it, never change it."""
    if depth > 24:
        return None
    memo = getattr(v, "_cannc_lanes", None)
    if memo is not None and memo[0] <= depth:
        return memo[1]
    out = _const_lanes(v, depth)
    try:
        v._cannc_lanes = (depth, out)
    except AttributeError:               # a value type with __slots__: not kept
        pass
    return out


def _const_lanes(v: ir.Value, depth: int) -> list[int | None] | None:
    ty = v.type
    n = ty.count if isinstance(ty, ir.VectorType) else 1
    et = ty.element if isinstance(ty, ir.VectorType) else ty
    if not isinstance(et, ir.IntType):
        return None
    if isinstance(v, ir.Constant):
        c = v.constant
        if c is None:
            return [0] * n
        if isinstance(c, (list, tuple)):
            out = [e.constant if isinstance(e, ir.Constant) else e for e in c]
            return [_wrap(int(x), et.width, False) if isinstance(x, (int, bool)) else None
                    for x in out]
        if isinstance(c, (int, bool)):
            return [_wrap(int(c), et.width, False)] * n
        return None
    op = getattr(v, "opname", None)
    ops = getattr(v, "operands", None)
    if op is None or ops is None:
        return None
    sub = [const_lanes(o, depth + 1) if isinstance(o.type, (ir.IntType, ir.VectorType))
           else None for o in ops]
    if op in _INT_BINOPS and len(ops) == 2:
        a, b = (x if x is not None else [None] * n for x in sub)
        f = _INT_BINOPS[op]
        out = []
        for x, y in zip(a, b):
            if x is not None and y is not None:
                out.append(_wrap(f(x, y), et.width, False))
            elif op == "and" and 0 in (x, y):            # x & 0 whatever x is
                out.append(0)
            elif op == "or" and et.width == 1 and 1 in (x, y):
                out.append(1)
            else:
                out.append(None)
        return out
    if op == "icmp" and len(ops) == 2:
        a, b = sub
        cmp = getattr(v, "op", "")          # 'eq', 'ne', 'slt', 'ult', ...
        key = cmp[-2:]
        if a is None or b is None or key not in _ICMP:
            return None
        signed = cmp.startswith("s")
        t0 = ops[0].type
        bits = (t0.element if isinstance(t0, ir.VectorType) else t0).width
        return [None if x is None or y is None else
                int(_ICMP[key](_wrap(x, bits, signed), _wrap(y, bits, signed)))
                for x, y in zip(a, b)]
    if op == "select" and len(ops) == 3:
        c, a, b = sub
        if a is None or b is None:
            return None
        if c is not None and len(c) == 1:
            c = c * n
        return [x if x == y else (None if cc is None else (x if cc else y))
                for cc, x, y in zip(c or [None] * n, a, b)]
    if op == "shufflevector" and len(ops) == 3:
        a, b, m = sub
        idx = const_lanes(ops[2], depth + 1) if m is None else m
        if idx is None:
            return None
        na = ops[0].type.count
        src = (a or [None] * na) + (b or [None] * ops[1].type.count)
        return [None if i is None else src[i] for i in idx]
    if op == "insertelement" and len(ops) == 3:
        base, elt, idx = sub
        if idx is None or idx[0] is None:
            return None
        out = list(base) if base is not None else [None] * n
        out[idx[0]] = None if elt is None else elt[0]
        return out
    if op in ("zext", "sext", "trunc") and len(ops) == 1:
        a = sub[0]
        if a is None:
            return None
        src_t = ops[0].type.element if isinstance(ops[0].type, ir.VectorType) else ops[0].type
        if op == "sext":
            return [None if x is None else _wrap(_wrap(x, src_t.width, True), et.width, False)
                    for x in a]
        return [None if x is None else _wrap(x, et.width, False) for x in a]
    return None


def _target_has_avx512() -> bool:
    return host().has("avx512f")     # (read each time: tests swap the host target)


def _layout(vt: ir.VectorType, mask: ir.Value,
            align: int | None) -> tuple[int, int, int, list[int | None]]:
    """(lanes, element bits, alignment: the element size by default, the mask's lanes
    known at compile time) of a masked access of type vt."""
    n = vt.count
    ebits = vt.element.width if isinstance(vt.element, ir.IntType) else \
        {"float": 32, "double": 64, "half": 16, "bfloat": 16}[str(vt.element)]
    return n, ebits, align or ebits // 8, const_lanes(mask) or [None] * n


def _lanes(b: ir.IRBuilder, v: ir.Value, lo: int, n: int) -> ir.Value:
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(lo, lo + n))))


def masked_load(b: ir.IRBuilder, ptr: ir.Value, mask: ir.Value, passthru: ir.Value,
                align: int | None = None) -> ir.Value:
    """``llvm.masked.load`` of ``passthru.type`` at ``ptr`` (lanes whose mask is false are
    not read and take ``passthru``'s), emitted so that LLVM's x86 lowering gets it right
    (see above). ``align`` defaults to the element size."""
    vt = passthru.type
    n, ebits, align, known = _layout(vt, mask, align)
    if all(k == 0 for k in known):
        return passthru
    if all(k == 1 for k in known):
        return b.load(ptr, typ=vt, align=align)
    piece = n if _target_has_avx512() or n * ebits <= 256 else max(1, 256 // ebits)
    if piece >= n:
        return _masked_load_call(b, ptr, mask, passthru, align)
    parts = []
    for lo in range(0, n, piece):
        k = known[lo:lo + piece]
        pt = _lanes(b, passthru, lo, piece)
        if all(x == 0 for x in k):
            parts.append(pt)
            continue
        p = b.gep(ptr, [ir.Constant(I64, lo)], source_etype=vt.element) if lo else ptr
        if all(x == 1 for x in k):
            parts.append(b.load(p, typ=pt.type, align=align))
        else:
            parts.append(_masked_load_call(b, p, _lanes(b, mask, lo, piece), pt, align))
    while len(parts) > 1:
        w = parts[0].type.count
        parts = [b.shuffle_vector(parts[i], parts[i + 1],
                                  ir.Constant(ir.VectorType(I32, 2 * w), list(range(2 * w))))
                 for i in range(0, len(parts), 2)]
    return parts[0]


def _masked_load_call(b: ir.IRBuilder, ptr: ir.Value, mask: ir.Value, passthru: ir.Value,
                      align: int) -> ir.Value:
    return call_intrinsic(b, "llvm.masked.load", [ptr, ir.Constant(I32, align), mask, passthru],
                          passthru.type, overload=[passthru.type, PTR])


# ---------------------------------------------------------------------------
# masked stores
#
# vmaskmovps / vpmaskmovd stores are slow on AMD's AVX2 cores: Zen 3 takes ~14 ns per
# <16 x float> with a runtime mask that is all true, against ~1.9 ns for a plain store
# (a loop of stores, one core). Every output vector of a kernel goes through a mask
# (edge tiles), so on an AVX2 target `masked_store` tests the mask at run time and
# stores plainly when every lane is on; AVX-512's k-register stores need no such help.
# ---------------------------------------------------------------------------

def masked_store(b: ir.IRBuilder, val: ir.Value, ptr: ir.Value, mask: ir.Value,
                 align: int | None = None) -> None:
    """``llvm.masked.store`` of ``val`` at ``ptr`` (lanes whose mask is false are not
    written). Lanes known at compile time are folded; on an AVX2 target a mask that is all
    true at run time takes a plain store. Leaves ``b`` in a new block on that path (a
    caller that adds phi incomings afterwards must name ``b.block``, not an older one)."""
    vt = val.type
    n, _, align, known = _layout(vt, mask, align)
    if all(k == 0 for k in known):
        return
    if all(k == 1 for k in known):
        b.store(val, ptr, align=align)
        return
    if _target_has_avx512():
        _masked_store_call(b, val, ptr, mask, align)
        return
    bits = b.bitcast(mask, ir.IntType(n))
    full = b.icmp_unsigned("==", bits, ir.Constant(ir.IntType(n), (1 << n) - 1))
    with b.if_else(full, likely=True) as (then, otherwise):
        with then:
            b.store(val, ptr, align=align)
        with otherwise:
            _masked_store_call(b, val, ptr, mask, align)


def _masked_store_call(b: ir.IRBuilder, val: ir.Value, ptr: ir.Value, mask: ir.Value,
                       align: int) -> None:
    call_intrinsic(b, "llvm.masked.store", [val, ptr, ir.Constant(I32, align), mask], VOID,
                   overload=[val.type, PTR])
