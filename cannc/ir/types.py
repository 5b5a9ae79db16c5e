"""Tensor types: a dtype plus a shape whose dims are ints or symbolic names."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

Dim = int | str


@functools.cache
def onnx_to_np() -> dict[int, np.dtype]:
    """ONNX element type -> numpy dtype, the ml_dtypes types (bfloat16, float8, ...)
    included. Built at first use: it imports onnx and ml_dtypes, which cost most of
    `import cannc` (ml_dtypes 0.7 alone ~0.6 s) and which a program loaded from the
    cache never needs."""
    from onnx import TensorProto as T

    table = {
        T.FLOAT: np.float32, T.DOUBLE: np.float64, T.FLOAT16: np.float16,
        T.INT8: np.int8, T.INT16: np.int16, T.INT32: np.int32, T.INT64: np.int64,
        T.UINT8: np.uint8, T.UINT16: np.uint16, T.UINT32: np.uint32, T.UINT64: np.uint64,
        T.BOOL: np.bool_,
    }
    out = {k: np.dtype(v) for k, v in table.items()}
    try:  # bfloat16 / float8 dtypes for numpy
        import ml_dtypes as mld
    except ImportError:  # pragma: no cover - onnx requires ml_dtypes
        return out
    out[T.BFLOAT16] = np.dtype(mld.bfloat16)
    for name, attr in _LOWP_ONNX.items():
        code = getattr(T, name, None)
        if code is not None and hasattr(mld, attr):
            out[code] = np.dtype(getattr(mld, attr))
    return out


@functools.cache
def np_to_onnx() -> dict[np.dtype, int]:
    """numpy dtype -> ONNX element type (the inverse of `onnx_to_np`)."""
    return {v: k for k, v in onnx_to_np().items()}


def __getattr__(name: str) -> dict:
    # ONNX_TO_NP / NP_TO_ONNX as module attributes, built when first asked for
    if name == "ONNX_TO_NP":
        return onnx_to_np()
    if name == "NP_TO_ONNX":
        return np_to_onnx()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ONNX element types below 16 bits and their ml_dtypes dtype: one element per byte, in
# host and device memory alike (ml_dtypes' representation: a float8/float4 code in the
# byte, a sub-byte integer in its low bits, the high bits zero). The frontend reads them
# with onnx.numpy_helper.to_array, which unpacks int4/uint4/int2/uint2/float4 tensors.
_LOWP_ONNX = {
    "FLOAT8E4M3FN": "float8_e4m3fn", "FLOAT8E4M3FNUZ": "float8_e4m3fnuz",
    "FLOAT8E5M2": "float8_e5m2", "FLOAT8E5M2FNUZ": "float8_e5m2fnuz",
    "FLOAT8E8M0": "float8_e8m0fnu", "FLOAT4E2M1": "float4_e2m1fn",
    "FLOAT6E2M3": "float6_e2m3fn", "FLOAT6E3M2": "float6_e3m2fn",
    "INT4": "int4", "UINT4": "uint4", "INT2": "int2", "UINT2": "uint2",
}


@dataclass(frozen=True)
class SmallFloat:
    """A float format narrower than 16 bits, as codegen converts it bit by bit.

    kind: "ieee" (E5M2: inf and NaNs at the top exponent), "fn" (E4M3FN: no inf, the
    all-ones code is NaN), "fnuz" (no inf, no negative zero, 0x80 is the one NaN),
    "sat" (E2M1, E2M3, E3M2: no inf or NaN; every conversion saturates), "e8m0" (an unsigned
    exponent only: 2**(code - 127), 0xFF is NaN)."""

    name: str
    ebits: int
    mbits: int
    bias: int
    kind: str

    @property
    def nbits(self) -> int:
        return (0 if self.kind == "e8m0" else 1) + self.ebits + self.mbits

    @property
    def max(self) -> float:
        import ml_dtypes

        return float(ml_dtypes.finfo(np.dtype(getattr(ml_dtypes, self.name))).max)


SMALL_FLOATS: dict[str, SmallFloat] = {f.name: f for f in (
    SmallFloat("float8_e4m3fn", 4, 3, 7, "fn"),
    SmallFloat("float8_e4m3fnuz", 4, 3, 8, "fnuz"),
    SmallFloat("float8_e5m2", 5, 2, 15, "ieee"),
    SmallFloat("float8_e5m2fnuz", 5, 2, 16, "fnuz"),
    SmallFloat("float4_e2m1fn", 2, 1, 1, "sat"),
    SmallFloat("float6_e2m3fn", 2, 3, 1, "sat"),
    SmallFloat("float6_e3m2fn", 3, 2, 3, "sat"),
    SmallFloat("float8_e8m0fnu", 8, 0, 127, "e8m0"),
)}

# sub-byte integers: name -> (bits, signed)
SUBBYTE_INTS: dict[str, tuple[int, bool]] = {
    "int4": (4, True), "uint4": (4, False), "int2": (2, True), "uint2": (2, False),
}


def small_float(dt: np.dtype) -> SmallFloat | None:
    """The format of a float8/float4 dtype, None for any other dtype."""
    return SMALL_FLOATS.get(np.dtype(dt).name)


def subbyte_int(dt: np.dtype) -> tuple[int, bool] | None:
    """(bits, signed) of int4/uint4/int2/uint2, None for any other dtype."""
    return SUBBYTE_INTS.get(np.dtype(dt).name)


def int_range(dt: np.dtype) -> tuple[int, int]:
    """The value range of an integer dtype, sub-byte integers included."""
    sb = subbyte_int(dt)
    if sb is not None:
        bits, signed = sb
        return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    info = np.iinfo(dt)
    return int(info.min), int(info.max)


def np_dtype(elem_type: int) -> np.dtype:
    table = onnx_to_np()
    if elem_type not in table:
        from onnx import TensorProto

        name = TensorProto.DataType.Name(elem_type) if elem_type else "UNDEFINED"
        raise KeyError(name)
    return table[elem_type]


@functools.cache
def dtype_key(dt: np.dtype) -> str:
    """A string that tells dtypes apart, for cache keys: numpy's `dtype.str`, except
    for the ml_dtypes types, which all share one (`<V1` for every float8/float4/int4,
    `<V2` for bfloat16) and are told apart by name. (Kept per dtype: numpy computes
    `.name` in Python, and specialising BERT-base asks ~2000 times.)"""
    dt = np.dtype(dt)
    return dt.str if dt.kind != "V" and dt.name not in SMALL_FLOATS else dt.name


@functools.cache
def dtype_name(dt: np.dtype) -> str:
    """numpy's name of the dtype, kept per dtype: numpy computes `.name` in Python on
    every read, and the GEMM tiling function reads four per node."""
    return np.dtype(dt).name


def onnx_type_string(dt: np.dtype) -> str:
    """The onnxruntime-style type string, e.g. 'tensor(float)'."""
    names = {
        "float32": "float", "float64": "double", "float16": "float16", "bfloat16": "bfloat16",
        "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
        "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
        "bool": "bool",
        "float8_e4m3fn": "float8e4m3fn", "float8_e4m3fnuz": "float8e4m3fnuz",
        "float8_e5m2": "float8e5m2", "float8_e5m2fnuz": "float8e5m2fnuz",
        "float8_e8m0fnu": "float8e8m0", "float4_e2m1fn": "float4e2m1",
        "float6_e2m3fn": "float6e2m3", "float6_e3m2fn": "float6e3m2",
        "int4": "int4", "uint4": "uint4", "int2": "int2", "uint2": "uint2",
    }
    return f"tensor({names.get(np.dtype(dt).name, np.dtype(dt).name)})"


@dataclass(frozen=True)
class TensorType:
    dtype: np.dtype
    shape: tuple[Dim, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    @property
    def numel(self) -> int:
        assert self.is_static, f"symbolic shape {self.shape}"
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(self.dtype).itemsize

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.shape) or "scalar"
        return f"{np.dtype(self.dtype).name}[{dims}]"
