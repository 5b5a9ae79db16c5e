"""The compiler: frontend -> passes -> codegen -> artifact.

`pipeline` holds the named pass pipelines and `specialize` (a graph compiled for
one set of input shapes); `lowering` turns the passes' result into kernels;
`support` says which nodes cannc can compile and why not.
"""

from .lowering import codegen_counts, lower_graph, onnx_origin
from .pipeline import DEFAULT_PIPELINE, PIPELINES, CompileOptions, specialize
from .support import node_support, support_problems, unknown_ops

__all__ = ["CompileOptions", "DEFAULT_PIPELINE", "PIPELINES", "codegen_counts", "lower_graph",
           "node_support", "onnx_origin", "specialize", "support_problems", "unknown_ops"]
