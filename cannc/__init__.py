"""cannc: an ahead-of-time graph compiler for ONNX models.

    sess = cannc.compile("model.onnx")          # a path, bytes or onnx.ModelProto
    outputs = sess.run(None, {"x": x})          # like onnxruntime.InferenceSession.run
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from . import (
    ops,  # noqa: F401  (eager ops: cannc.ops.matmul(x, w), ...)
    te,
)
from ._version import __version__
from .compiler.pipeline import DEFAULT_PIPELINE
from .compiler.report import NodeSupport, SupportReport, support_report
from .compiler.support import supported_ops
from .custom_op import custom_op
from .errors import (
    CacheError,
    CanncError,
    CompileError,
    InputError,
    ModelError,
    ShapeError,
    UnsupportedOpError,
)
from .session import NodeArg, Session, given_shapes, load


def compile(model: Any, **options: Any) -> Session:
    """Compile an ONNX model for this machine and return a runnable Session.

    Options: cores (number of AI Cores, default: usable CPU cores), shapes
    ({input: shape} to specialise eagerly; symbolic dims default to 1),
    pipeline ('O0' | 'O1'), dump_after (pass names), fusion (False, per-rule
    switches or a JSON switch file), pass_options ({pass name: {option: value}}),
    inflight, cache, eager. An unknown option is a CanncError naming the known ones.
    """
    known = [p for p in inspect.signature(Session.__init__).parameters if p not in ("self",
                                                                                    "model")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise CanncError(f"unknown option{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(unknown)}; cannc.compile takes {', '.join(known)}")
    return Session(model, **options)


def check(model: Any, shapes: dict[str, Sequence[int]] | None = None,
          pipeline: str = DEFAULT_PIPELINE) -> SupportReport:
    """Before compiling: every node of the model (a path, bytes, onnx.ModelProto or
    ir.Graph), supported or not, with op, domain, opset, input dtypes and the reason.
    `.supported` says whether the whole model compiles; `.to_dict()` is what
    `cannc check --json` prints. Shapes not given: symbolic dims are 1."""
    given = given_shapes(shapes)
    return support_report(model, given, pipeline)


__all__ = ["compile", "custom_op", "te", "load", "check", "Session", "NodeArg", "SupportReport",
           "NodeSupport",
           "supported_ops", "CanncError", "ModelError", "UnsupportedOpError", "InputError",
           "ShapeError", "CompileError", "CacheError", "__version__"]
