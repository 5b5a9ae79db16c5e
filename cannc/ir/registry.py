"""The op registry: what each op IS, defined once in the op-family modules.

An OpDef gathers what every layer needs to know about an op: its fusion
category, which dtypes and opset versions it supports, its type/shape inference
(defaulting to ONNX's own per-node inference, so each opset version is read
with its own semantics), its NumPy reference (defaulting to onnx.reference, used
by the constant folder and the tests, never by compiled code), and its fusion
attributes as typed fields. How an op is lowered to native code is not here:
lowerings live in `cannc.codegen.lower` and register themselves onto the op by
name. Passes, the compiler and the faces ask the registry; they never branch on
op names.

This module imports nothing from codegen, runtime, passes or the compiler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from .expr import ExprFn  # an elementwise op's scalar semantics, over codegen's builder

if TYPE_CHECKING:
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


MAP_CATEGORIES = (Category.ELEMENTWISE, Category.BROADCAST)


class Amp(str, Enum):
    """How the mixed-precision pass treats an op (CANN's and TVM's lists): ALLOW runs in
    the reduced type (contractions: the products narrow, the sums float32); DENY stays
    float32 (range-sensitive: reductions, normalisations, softmax, exp/log/pow); FOLLOW
    runs in the reduced type when its float inputs already are (elementwise, movement)."""

    ALLOW = "allow"
    DENY = "deny"
    FOLLOW = "follow"


_AMP_BY_CATEGORY = {"contraction": "allow", "reduction": "deny", "opaque": "deny"}


def amp_class(op: OpDef) -> Amp:
    """The op's default mixed-precision class: its `amp` field, else by category."""
    if op.amp is not None:
        return op.amp
    return Amp(_AMP_BY_CATEGORY.get(op.category.value, "follow"))


class Control(str, Enum):
    """How a control-flow op runs its subgraphs (the host program, compiler/control.py)."""

    BRANCH = "branch"   # one of its subgraphs, picked by a value (If; see `branch`)
    LOOP = "loop"       # its body while a trip count and a condition allow (Loop)
    SCAN = "scan"       # its body once per slice of its scan inputs (Scan)

CheckFn = Callable[["Node", list["TensorType"], list["TensorType"]], "str | None"]
# The values of a node's inputs that are compile-time constants (None where not constant,
# or absent), by input position: what `value_check`, `forwards_input` and `const_outputs`
# read to decide on an input's value (Dropout's training_mode).
Values = list["np.ndarray | None"]
# Support check on input values: (node, values) -> a reason, or None.
ValueCheckFn = Callable[["Node", Values], "str | None"]
FlopsFn = Callable[["Node", list["TensorType"], list["TensorType"]], int]
# Type/shape inference where ONNX has none: (node, input types) -> output types.
InferFn = Callable[["Node", list["TensorType | None"]], list["TensorType"]]
# Shape ops: outputs computed from input *types* alone, once shapes are known.
FoldFn = Callable[["Node", list["TensorType | None"]], list[np.ndarray]]
# Outputs whose value the op fixes from the types alone while the others are computed
# (inference-mode Dropout's mask): (node, input types, output types, input values)
# -> {output index: value}.
ConstOutputsFn = Callable[["Node", list["TensorType | None"], list["TensorType | None"], Values],
                          dict[int, np.ndarray]]
# Epilogue operand check: (operand type, node, its input types, its output type) -> why the
# operand cannot be read inside the fused kernel ("is not a ... of the GEMM's output"), or None.
OperandCheck = Callable[["TensorType", "Node", list["TensorType"], "TensorType"], "str | None"]
# Control flow: the attribute naming the subgraph a node becomes once its inputs' values
# are known (node, input values, None where not constant) -> attribute name, or None.
BranchFn = Callable[["Node", list["np.ndarray | None"]], "str | None"]
# Whether the node itself can take an epilogue: (node, input types, output type) -> reason.
NodeCheck = Callable[["Node", list["TensorType"], "TensorType"], "str | None"]


@dataclass(frozen=True)
class Fusion:
    """How a contraction (or a row op) takes neighbouring elementwise groups into its kernel.

    ``rule`` is the fusion switch that governs it (`cannc.compile(fusion={rule: False})`),
    ``fused_op`` the op (in the ``cannc`` domain) that the pair becomes, ``operand`` the
    check of every extra operand the group reads, ``node`` the check of the node itself."""

    rule: str
    fused_op: str
    operand: OperandCheck | None = None
    node: NodeCheck | None = None
    # element types of the contraction's result and of the epilogue's result that the fused
    # kernel generates (the epilogue itself runs in float32 registers)
    dtypes: frozenset[str] = frozenset({"float32"})
    # check of the epilogue's result type (node, its input types, its output type, the
    # epilogue's result type): a reason the kernel cannot store it, or None
    result: Callable[[Node, list[TensorType], TensorType, TensorType], str | None] | None = None


@dataclass
class OpDef:
    name: str
    category: Category
    domain: str = ""
    min_opset: int = 1
    dtypes: frozenset[str] | None = None      # supported input dtypes (None = any)
    check: CheckFn | None = None              # extra support check, returns a reason or None
    value_check: ValueCheckFn | None = None   # support check on constant input values
    flops: FlopsFn | None = None
    # bytes a kernel of the op reads, where that is less than all of every input (a gather
    # reads the rows it takes); None: every input whole
    bytes_read: FlopsFn | None = None
    reference: Callable[..., list[np.ndarray] | None] | None = None   # None: onnx.reference
    fusible: bool = False
    doc: str = ""
    # -- typed per-op behaviour (what passes, the compiler and the faces ask) ------------
    expr: ExprFn | None = None                # elementwise semantics (maps and fusion)
    flops_per_elem: int = 1                   # of `expr`, per output element
    infer: InferFn | None = None              # inference where ONNX's own has none
    # input shapes the op's semantics reject though ONNX's inference accepts them (a pool
    # over an empty window): a reason, raised as a ShapeError naming the node
    shape_check: Callable[[Node, list[TensorType]], str | None] | None = None
    fold: FoldFn | None = None                # SHAPE ops: outputs from input types
    const_outputs: ConstOutputsFn | None = None  # some outputs known from types alone
    value_inputs: tuple[int, ...] = ()        # inputs whose *value* decides output shapes
    tiling_attrs: tuple[str, ...] = ()        # attributes a tiling key depends on (memo key)
    inplace: bool = False                     # an output may overwrite a same-shaped input
    # node is an identity on input 0 (given its constant input values)
    forwards_input: Callable[[Node, Values], bool] | None = None
    deterministic: bool = True                # False: never constant-folded (random ops)
    epilogue: Fusion | None = None            # contraction taking an elementwise epilogue
    prologue: Fusion | None = None            # row op computing its producers inside it
    subgraphs: tuple[str, ...] = ()           # attributes holding subgraphs (ir.Graph)
    control: Control | None = None            # how a control-flow op runs them
    branch: BranchFn | None = None            # control flow: the subgraph taken, if known
    amp: Amp | None = None                    # mixed-precision class (None: by category)
    # what the generated code depends on beyond name and attributes (a custom op's body
    # digest): part of the lowering memo's persistent key
    revision: str = ""

    def schema_reason(self, node: Node, ins: list[TensorType],
                      outs: list[TensorType], values: Values | None = None) -> str | None:
        """Why this op's definition rejects the node (dtypes, attributes, the values of
        its constant inputs: `values`, None where an input is not constant; not given,
        none is taken as constant), or None. The opset is checked by the caller; whether
        a native lowering exists is codegen's to say (`cannc.codegen.lower.lowering_for`)."""
        if self.dtypes is not None:
            for t in ins + outs:
                if t is not None and np.dtype(t.dtype).name not in self.dtypes:
                    return f"dtype {np.dtype(t.dtype).name} not supported " \
                           f"(supported: {', '.join(sorted(self.dtypes))})"
        if self.check is not None:
            r = self.check(node, ins, outs)
            if r:
                return r
        if self.value_check is not None:
            return self.value_check(node, list(values) if values is not None
                                    else [None] * len(node.inputs))
        return None

    @property
    def needs_kernel(self) -> bool:
        """Views alias their input and shape ops fold away: neither is ever lowered."""
        return self.category not in (Category.VIEW, Category.SHAPE)


_REGISTRY: dict[tuple[str, str], OpDef] = {}


def register(op: OpDef) -> OpDef:
    key = (op.domain, op.name)
    if key in _REGISTRY:
        raise ValueError(f"op {op.domain + '::' if op.domain else ''}{op.name} registered twice")
    if op.expr is not None and op.category in MAP_CATEGORIES:
        op.inplace = True      # maps read and write element i together
    _REGISTRY[key] = op
    return op


def registered(op_type: str, domain: str = "") -> OpDef | None:
    """The op as registered so far. Use `cannc.ir.ops.lookup`, which loads every family
    first; this raw form is for the family modules themselves."""
    if domain in ("ai.onnx",):
        domain = ""
    return _REGISTRY.get((domain, op_type))


def registered_ops() -> list[OpDef]:
    return sorted(_REGISTRY.values(), key=lambda o: (o.domain, o.name))

