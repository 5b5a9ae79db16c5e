"""The ONNX frontend: a model (path, bytes or onnx.ModelProto) -> ir.Graph.

`onnx_import` is imported when one of its names is first asked for, not with the
package: `frontend.wire` (the protobuf reader the program cache uses) and `import cannc`
do not pay for onnx, whose import (with ml_dtypes) costs ~0.6 s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .onnx_import import LoadedModel, import_model, load_model, load_model_proto

__all__ = ["LoadedModel", "import_model", "load_model", "load_model_proto"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import onnx_import

        return getattr(onnx_import, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
