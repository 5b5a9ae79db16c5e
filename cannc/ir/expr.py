"""What an elementwise op's expression is written against (no LLVM here).

An elementwise op's semantics is one function ``expr(E, n, operands) -> results``
(`OpDef.expr`). ``E`` builds typed scalar-or-vector values (`ExprBuilder`); ``n``
is a read-only view of the node being computed (`NodeView`); the operands sit at
their input positions (None for an absent optional input). The same expression is
emitted once over vectors and once over scalars, and fusion composes several of
them, so it must build its values only through ``E``.

`cannc.codegen.elementwise.Expr` implements `ExprBuilder` (its values are
`codegen.elementwise.TV`); `LowerCtx` and the fused-kernel body view implement
`NodeView`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from .types import TensorType


class Value(Protocol):
    """A typed value inside an expression: holds elements of numpy dtype ``dtype``
    (bool as a truth value; bfloat16 computed in float32)."""

    @property
    def dtype(self) -> np.dtype: ...


class NodeView(Protocol):
    """The node an expression computes, as the expression may read it."""

    in_types: Sequence[TensorType | None]
    out_types: Sequence[TensorType]

    @property
    def opset(self) -> int: ...

    def attr(self, name: str, default: Any = None) -> Any: ...

    def const(self, i: int) -> np.ndarray | None:
        """The value of input i when it is a compile-time constant, else None."""
        ...


class ExprBuilder(Protocol):
    """Dtype-aware builders of `Value`s (implemented by codegen.elementwise.Expr).

    Arithmetic follows the operands' dtype (float, signed or unsigned integer); the
    result has the dtype of the first operand unless said otherwise."""

    # -- types and constants
    def const(self, value: float | int | bool, dtype: np.dtype) -> Value: ...
    def is_float(self, x: Value) -> bool: ...

    # -- arithmetic
    def add(self, x: Value, y: Value) -> Value: ...
    def sub(self, x: Value, y: Value) -> Value: ...
    def mul(self, x: Value, y: Value) -> Value: ...

    def div(self, x: Value, y: Value) -> Value:
        """Integer division truncates toward zero; by zero it does not trap."""
        ...

    def rem(self, x: Value, y: Value) -> Value:
        """The remainder of truncating division (C fmod / %: the sign of x)."""
        ...

    def neg(self, x: Value) -> Value: ...
    def fma(self, x: Value, y: Value, z: Value) -> Value: ...
    def min(self, x: Value, y: Value) -> Value: ...    # floats propagate NaN
    def max(self, x: Value, y: Value) -> Value: ...
    def abs(self, x: Value) -> Value: ...

    def call(self, name: str, *xs: Value) -> Value:
        """An overloaded LLVM math intrinsic by name ('llvm.sqrt', 'llvm.floor',
        'llvm.copysign', ...) on float operands."""
        ...

    def math(self, name: str, *xs: Value) -> Value:
        """A vector-math function of float operands: exp, log, log1p, erf, tanh, sigmoid,
        sin, cos, softplus, pow, gelu_erf, gelu_tanh."""
        ...

    # -- comparisons and logic (comparisons return bool values)
    def cmp(self, op: str, x: Value, y: Value) -> Value:
        """'==', '!=', '<', '<=', '>', '>=': ordered for floats, signed/unsigned per dtype."""
        ...

    def ucmp(self, op: str, x: Value, y: Value) -> Value:
        """An integer comparison as unsigned, whatever the dtype."""
        ...

    def isnan(self, x: Value) -> Value: ...
    def select(self, c: Value, x: Value, y: Value) -> Value: ...
    def and_(self, x: Value, y: Value) -> Value: ...
    def or_(self, x: Value, y: Value) -> Value: ...
    def xor(self, x: Value, y: Value) -> Value: ...
    def not_(self, x: Value) -> Value: ...

    def shl(self, x: Value, y: Value) -> Value:
        """x << y (y below the bit width)."""
        ...

    def shr(self, x: Value, y: Value) -> Value:
        """x >> y: arithmetic for signed dtypes, logical for unsigned (y below the width)."""
        ...

    # -- conversions
    def cast(self, x: Value, dtype: np.dtype, saturate: bool = True,
             round_mode: str = "up") -> Value:
        """saturate / round_mode: ONNX Cast's attributes, for float8 destinations."""
        ...


# expr(E, node view, operands at their input positions) -> results
ExprFn = Callable[[ExprBuilder, NodeView, Sequence[Any]], Sequence[Value]]
