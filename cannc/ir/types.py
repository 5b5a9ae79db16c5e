"""Tensor types: a dtype plus a shape whose dims are ints or symbolic names."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

Dim = int | str

try:  # bfloat16 / float8 dtypes for numpy
    import ml_dtypes as _mld
except ImportError:  # pragma: no cover
    _mld = None


def _onnx_to_np() -> dict[int, np.dtype]:
    from onnx import TensorProto as T

    table = {
        T.FLOAT: np.float32, T.DOUBLE: np.float64, T.FLOAT16: np.float16,
        T.INT8: np.int8, T.INT16: np.int16, T.INT32: np.int32, T.INT64: np.int64,
        T.UINT8: np.uint8, T.UINT16: np.uint16, T.UINT32: np.uint32, T.UINT64: np.uint64,
        T.BOOL: np.bool_,
    }
    out = {k: np.dtype(v) for k, v in table.items()}
    if _mld is not None:
        out[T.BFLOAT16] = np.dtype(_mld.bfloat16)
    return out


ONNX_TO_NP: dict[int, np.dtype] = _onnx_to_np()
NP_TO_ONNX: dict[np.dtype, int] = {v: k for k, v in ONNX_TO_NP.items()}


def np_dtype(elem_type: int) -> np.dtype:
    if elem_type not in ONNX_TO_NP:
        name = onnx.TensorProto.DataType.Name(elem_type) if elem_type else "UNDEFINED"
        raise KeyError(name)
    return ONNX_TO_NP[elem_type]


def onnx_type_string(dt: np.dtype) -> str:
    """The onnxruntime-style type string, e.g. 'tensor(float)'."""
    names = {
        "float32": "float", "float64": "double", "float16": "float16", "bfloat16": "bfloat16",
        "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
        "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
        "bool": "bool",
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
