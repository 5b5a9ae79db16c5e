"""Small helpers so that codegen reads like the loops it makes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import llvmlite.ir as ir
import numpy as np

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
