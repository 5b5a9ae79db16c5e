"""The op registry: each op is defined once, here and in the op-family modules.

An OpDef gathers what every layer needs to know about an op: its fusion
category, which dtypes and opset versions it supports, its type/shape inference
(defaulting to ONNX's own per-node inference, so each opset version is read
with its own semantics), its NumPy reference (defaulting to onnx.reference, used
by the constant folder and the tests, never by compiled code), and its lowering
to a native kernel. Passes and codegen ask the registry; they never branch on
op names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from ..codegen.kernel import LowerCtx
    from .graph import Node
    from .types import TensorType


class Category(str, Enum):
    ELEMENTWISE = "elementwise"   # same-shape map
    BROADCAST = "broadcast"       # map with numpy broadcasting
    INJECTIVE = "injective"       # data movement: each output element reads one input element
    REDUCTION = "reduction"
    CONTRACTION = "contraction"   # MatMul, Gemm, Conv
    OPAQUE = "opaque"
    VIEW = "view"                 # no data movement: output aliases the input's buffer
    SHAPE = "shape"               # computes shapes only; always constant once shapes are known


CheckFn = Callable[["Node", list["TensorType"], list["TensorType"]], "str | None"]
LowerFn = Callable[["LowerCtx"], None]


@dataclass
class OpDef:
    name: str
    category: Category
    lower: LowerFn | None = None
    domain: str = ""
    min_opset: int = 1
    dtypes: frozenset[str] | None = None      # supported input dtypes (None = any)
    check: CheckFn | None = None              # extra support check, returns a reason or None
    flops: Callable[["Node", list["TensorType"], list["TensorType"]], int] | None = None
    reference: Callable[..., list[np.ndarray]] | None = None
    fusible: bool = False
    doc: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # host tiling function of a shape-polymorphic lowering: (node, in_types,
    # out_types) -> codegen.kernel.Tiling, or None where that shape is emitted
    # statically (see codegen/ABI.md "Runtime dimensions")
    tiling: Callable[["Node", list["TensorType | None"], list["TensorType"]], Any] | None = None

    def unsupported_reason(self, node: "Node", ins: list["TensorType"],
                           outs: list["TensorType"]) -> str | None:
        if self.lower is None and self.category not in (Category.VIEW, Category.SHAPE):
            return "no native lowering yet"
        if self.dtypes is not None:
            for t in ins + outs:
                if t is not None and np.dtype(t.dtype).name not in self.dtypes:
                    return f"dtype {np.dtype(t.dtype).name} not supported " \
                           f"(supported: {', '.join(sorted(self.dtypes))})"
        if self.check is not None:
            return self.check(node, ins, outs)
        return None


_REGISTRY: dict[tuple[str, str], OpDef] = {}


def register(op: OpDef) -> OpDef:
    key = (op.domain, op.name)
    if key in _REGISTRY:
        raise ValueError(f"op {op.name} registered twice")
    _REGISTRY[key] = op
    return op


def defop(name: str, category: Category, **kw: Any) -> Callable[[LowerFn], LowerFn]:
    """Decorator form: `@defop("Relu", Category.ELEMENTWISE)` over the lowering."""

    def deco(fn: LowerFn) -> LowerFn:
        register(OpDef(name=name, category=category, lower=fn, **kw))
        return fn

    return deco


def lookup(op_type: str, domain: str = "") -> OpDef | None:
    _load_ops()
    if domain in ("ai.onnx",):
        domain = ""
    return _REGISTRY.get((domain, op_type))


def all_ops() -> list[OpDef]:
    _load_ops()
    return sorted(_REGISTRY.values(), key=lambda o: (o.domain, o.name))


_loaded = False


def _load_ops() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from . import ops  # noqa: F401  (registers every op family)
