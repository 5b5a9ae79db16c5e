"""cannc: an ahead-of-time graph compiler for ONNX models.

    sess = cannc.compile("model.onnx")          # a path, bytes or onnx.ModelProto
    outputs = sess.run(None, {"x": x})          # like onnxruntime.InferenceSession.run
"""

from __future__ import annotations

from typing import Any

from ._version import __version__  # noqa: E402
from .errors import (  # noqa: E402
    CacheError, CanncError, CompileError, InputError, ModelError, ShapeError,
    UnsupportedOpError,
)
from .session import NodeArg, Session, load  # noqa: E402


def compile(model: Any, **options: Any) -> Session:
    """Compile an ONNX model for this machine and return a runnable Session.

    Options: cores (number of AI Cores, default: usable CPU cores), shapes
    ({input: shape} to specialise eagerly; symbolic dims default to 1),
    pipeline ('O0' | 'O1'), dump_after (pass names).
    """
    return Session(model, **options)


def supported_ops() -> list[dict[str, Any]]:
    """The table of supported ops: name, domain, category, dtypes, whether it fuses."""
    from .ir.ops import all_ops

    return [{"op": o.name, "domain": o.domain or "ai.onnx", "category": o.category.value,
             "min_opset": o.min_opset, "dtypes": sorted(o.dtypes) if o.dtypes else "any",
             "fusible": o.fusible} for o in all_ops()]


__all__ = ["compile", "load", "Session", "NodeArg", "supported_ops", "CanncError",
           "ModelError", "UnsupportedOpError", "InputError", "ShapeError", "CompileError",
           "CacheError", "__version__"]
