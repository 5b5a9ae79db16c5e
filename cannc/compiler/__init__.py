"""The compiler: frontend -> passes -> codegen -> artifact.

`pipeline` holds the named pass pipelines and `specialize` (a graph compiled for
one set of input shapes); `lowering` turns the passes' result into kernels;
`support` says which nodes cannc can compile and why not, `report` turns that into the
support report of a whole model (`cannc check`), `inspect` builds the inspect report
(`cannc inspect`, `Session.inspect`), `shapes` completes partly given input shapes.
"""

from typing import Any

from .pipeline import DEFAULT_PIPELINE, PIPELINES, CompileOptions, specialize
from .report import NodeSupport, SupportReport, support_report
from .support import node_support, support_problems, unknown_ops


def __getattr__(name: str) -> Any:
    # the lowering's names, imported at first use: it imports the code generators
    # (import cannc ~227 -> ~165 ms with them left out), which a process that runs
    # programs from the program cache never needs
    if name in ("codegen_counts", "lower_graph", "onnx_origin"):
        from . import lowering

        return getattr(lowering, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["CompileOptions", "DEFAULT_PIPELINE", "NodeSupport", "PIPELINES", "SupportReport",
           "codegen_counts", "lower_graph", "node_support", "onnx_origin", "specialize",
           "support_problems", "support_report", "unknown_ops"]
