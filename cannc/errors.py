"""The cannc exception hierarchy: every failure a user can cause is one of these."""

from __future__ import annotations


class CanncError(Exception):
    """Base class of every error cannc raises on purpose."""


class ModelError(CanncError):
    """The model is malformed: it fails the ONNX checker, cannot be parsed, or is inconsistent."""


class UnsupportedOpError(CanncError):
    """One or more nodes use ops cannc cannot compile. `nodes` lists all of them."""

    def __init__(self, nodes: list[tuple[str, str, str, int, str]]):
        # (node name, op_type, domain, opset, reason)
        self.nodes = nodes
        lines = [
            f"  node '{name}': {op} (domain '{dom or 'ai.onnx'}', opset {ver}): {why}"
            for name, op, dom, ver, why in nodes
        ]
        super().__init__(
            f"{len(nodes)} node(s) cannot be compiled:\n" + "\n".join(lines)
            + "\nsupported ops: `cannc ops`"
        )


class InputError(CanncError):
    """An input passed to Session.run is unknown, missing, or has the wrong dtype or shape."""


class ShapeError(CanncError):
    """Shapes in the graph are inconsistent (e.g. MatMul inner dimensions differ)."""


class CompileError(CanncError):
    """Code generation or an optimisation pass failed; names the pass and the node."""


class CacheError(CanncError):
    """A cache entry or a saved .cnc artifact is damaged."""
