"""The compiler: frontend -> passes -> codegen -> artifact.

`pipeline` holds the named pass pipelines and `specialize` (a graph compiled for
one set of input shapes); `lowering` turns the passes' result into kernels;
`support` says which nodes cannc can compile and why not, `report` turns that into the
support report of a whole model (`cannc check`), `inspect` builds the inspect report
(`cannc inspect`, `Session.inspect`), `shapes` completes partly given input shapes.
"""

from .lowering import codegen_counts, lower_graph, onnx_origin
from .pipeline import DEFAULT_PIPELINE, PIPELINES, CompileOptions, specialize
from .report import NodeSupport, SupportReport, support_report
from .support import node_support, support_problems, unknown_ops

__all__ = ["CompileOptions", "DEFAULT_PIPELINE", "NodeSupport", "PIPELINES", "SupportReport",
           "codegen_counts", "lower_graph", "node_support", "onnx_origin", "specialize",
           "support_problems", "support_report", "unknown_ops"]
