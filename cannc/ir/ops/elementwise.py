"""Elementwise and broadcasting ops: one expression each, one shared loop nest.

Each op's `expr(E, n, operands)` is its semantics, built from typed values with the
dtype-aware builder `E` (the protocol `cannc.ir.expr.ExprBuilder`; codegen's
`Expr` implements it); `n` is the node (`cannc.ir.expr.NodeView`). The shared map
lowering (codegen/lower/elementwise.py) turns any op with an `expr` into a
vectorised, broadcasting loop nest, and fusion composes the same expressions into
bigger kernels. Adding an op is one `defmap` or `unary` line here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..expr import ExprBuilder, ExprFn, NodeView, Value
from ..graph import Node
from ..registry import Amp, Category, OpDef, register, registered
from ..types import SMALL_FLOATS, SUBBYTE_INTS

FLOATS = frozenset({"float32", "float64", "float16", "bfloat16"})
UINTS = frozenset({"uint8", "uint16", "uint32", "uint64"})
INTS = frozenset({"int8", "int16", "int32", "int64"}) | UINTS
NUMERIC = FLOATS | INTS
ALL = NUMERIC | {"bool"}


def _input_dtypes(allowed: frozenset[str]):
    """A support check on the input dtypes only (for ops whose output is bool)."""
    def check(n: Node, ins: list, outs: list) -> str | None:
        for t in ins:
            if t is not None and np.dtype(t.dtype).name not in allowed:
                return f"dtype {np.dtype(t.dtype).name} not supported " \
                       f"(supported: {', '.join(sorted(allowed))})"
        return None
    return check


def defmap(name: str, expr: ExprFn, dtypes: frozenset[str] = FLOATS,
           category: Category = Category.BROADCAST, flops: int = 1,
           input_dtypes: frozenset[str] | None = None, **kw: Any) -> None:
    """input_dtypes: check the inputs only (the outputs' dtype is fixed, e.g. bool)."""
    if input_dtypes is not None:
        kw["check"] = _input_dtypes(input_dtypes)
        dtypes = None  # type: ignore[assignment]
    register(OpDef(name=name, category=category, dtypes=dtypes, fusible=True,
                   expr=expr, flops_per_elem=flops, **kw))


UnaryFn = Callable[[ExprBuilder, Value, NodeView], Value]     # fn(E, x, n) -> result


def unary(name: str, fn: UnaryFn, dtypes: frozenset[str] = FLOATS, flops: int = 1,
          **kw: Any) -> None:
    """A one-input map: fn(E, x, n) -> result."""
    defmap(name, lambda E, n, xs: [fn(E, xs[0], n)], dtypes, Category.ELEMENTWISE, flops,
           **kw)


def _vm(name: str) -> UnaryFn:
    """A vector-math function (codegen.vmath) of the input."""
    return lambda E, x, n: E.math(name, x)


def _c(E: ExprBuilder, value: float, like: Value) -> Value:
    return E.const(value, like.dtype)


# -- arithmetic -----------------------------------------------------------------
defmap("Add", lambda E, n, xs: [E.add(xs[0], xs[1])], NUMERIC)
defmap("Sub", lambda E, n, xs: [E.sub(xs[0], xs[1])], NUMERIC)
defmap("Mul", lambda E, n, xs: [E.mul(xs[0], xs[1])], NUMERIC)
defmap("Div", lambda E, n, xs: [E.div(xs[0], xs[1])], NUMERIC)


def _pow(E: ExprBuilder, n: NodeView, xs: Sequence[Value]) -> list[Value]:
    x, y = xs
    out_dt = n.out_types[0].dtype
    c = n.const(1)
    if c is not None and c.size == 1 and E.is_float(x):
        e = float(c.reshape(-1)[0])
        if e == 2.0:
            return [E.mul(x, x)]
        if e == 3.0:
            return [E.mul(E.mul(x, x), x)]
        if e == 1.0:
            return [x]
        if e == 0.5:
            return [E.call("llvm.sqrt", x)]
    if not E.is_float(x):
        # integer base: compute in float64 and convert back (exact for the usual ranges)
        xf, yf = E.cast(x, np.float64), E.cast(y, np.float64)
        return [E.cast(E.math("pow", xf, yf), out_dt)]
    y = E.cast(y, x.dtype)
    return [E.math("pow", x, y)]


defmap("Pow", _pow, NUMERIC, flops=10, amp=Amp.DENY)   # range-sensitive: float32 under AMP


def _sum(E: ExprBuilder, n: NodeView, xs: Sequence[Value]) -> list[Value]:
    acc = xs[0]
    for x in xs[1:]:
        acc = E.add(acc, x)
    return [acc]


def _mean(E: ExprBuilder, n: NodeView, xs: Sequence[Value]) -> list[Value]:
    s = _sum(E, n, xs)[0]
    return [E.div(s, _c(E, len(xs), s))]


def _fold(f: Callable[[ExprBuilder, Value, Value], Value]) -> ExprFn:
    def expr(E: ExprBuilder, n: NodeView, xs: Sequence[Value]) -> list[Value]:
        acc = xs[0]
        for x in xs[1:]:
            acc = f(E, acc, x)
        return [acc]
    return expr


defmap("Sum", _sum, NUMERIC)
def _mean_reference(n: Node, inputs: list) -> list[np.ndarray]:
    """Mean with multidirectional broadcasting (onnx.reference's accumulates in place into
    its first input, which fails when that one broadcasts)."""
    xs = [np.asarray(x) for x in inputs]
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x
    return [(acc / len(xs)).astype(xs[0].dtype)]


defmap("Mean", _mean, FLOATS, reference=_mean_reference)
defmap("Min", _fold(lambda E, a, b: E.min(a, b)), NUMERIC)
defmap("Max", _fold(lambda E, a, b: E.max(a, b)), NUMERIC)


def _mod(E: ExprBuilder, n: NodeView, xs: Sequence[Value]) -> list[Value]:
    x, y = xs
    if E.is_float(x):
        if n.attr("fmod", 0):
            return [E.rem(x, y)]
        r = E.rem(x, y)
        # python-style: result takes the sign of the divisor
        zero = _c(E, 0.0, x)
        fix = E.and_(E.cmp("!=", r, zero), E.xor(E.cmp("<", r, zero), E.cmp("<", y, zero)))
        return [E.select(fix, E.add(r, y), r)]
    zero = E.const(0, x.dtype)
    one = E.const(1, x.dtype)
    ys = E.select(E.cmp("==", y, zero), one, y)
    signed = np.dtype(x.dtype).kind == "i"
    r = E.rem(x, ys)
    if n.attr("fmod", 0) or not signed:
        return [r]
    fix = E.and_(E.cmp("!=", r, zero), E.xor(E.cmp("<", r, zero), E.cmp("<", ys, zero)))
    return [E.select(fix, E.add(r, ys), r)]


defmap("Mod", _mod, NUMERIC)

# -- unary math ---------------------------------------------------------------------
unary("Neg", lambda E, x, n: E.neg(x), NUMERIC - {"uint8", "uint16", "uint32", "uint64"})
unary("Abs", lambda E, x, n: E.abs(x), NUMERIC)
unary("Sqrt", lambda E, x, n: E.call("llvm.sqrt", x))
unary("Reciprocal", lambda E, x, n: E.div(_c(E, 1.0, x), x), amp=Amp.DENY)
unary("Exp", _vm("exp"), flops=10, amp=Amp.DENY)
unary("Log", _vm("log"), flops=10, amp=Amp.DENY)
unary("Erf", _vm("erf"), flops=15)
unary("Tanh", _vm("tanh"), flops=15)
unary("Sigmoid", _vm("sigmoid"), flops=12)
unary("Sin", _vm("sin"), flops=15)
unary("Cos", _vm("cos"), flops=15)
unary("Floor", lambda E, x, n: E.call("llvm.floor", x))
unary("Ceil", lambda E, x, n: E.call("llvm.ceil", x))
unary("Round", lambda E, x, n: E.call("llvm.roundeven", x))
unary("Softplus", _vm("softplus"), flops=20, amp=Amp.DENY)
unary("Relu", lambda E, x, n: E.max(x, E.const(0, x.dtype)),
      NUMERIC - {"uint8", "uint16", "uint32", "uint64"})


def _softsign(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    return E.div(x, E.add(_c(E, 1.0, x), E.abs(x)))


unary("Softsign", _softsign, flops=3)


def _shrink(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    lam, bias = float(n.attr("lambd", 0.5)), float(n.attr("bias", 0.0))
    if E.is_float(x):
        lo, hi = _c(E, -lam, x), _c(E, lam, x)
        bv = _c(E, bias, x)
    else:  # integer inputs: the attributes are floats; compare in float64
        xf = E.cast(x, np.float64)
        lo_c = E.cmp("<", xf, E.const(-lam, np.float64))
        hi_c = E.cmp(">", xf, E.const(lam, np.float64))
        bv = E.const(int(bias), x.dtype)
        zero = E.const(0, x.dtype)
        return E.select(lo_c, E.add(x, bv), E.select(hi_c, E.sub(x, bv), zero))
    zero = _c(E, 0.0, x)
    return E.select(E.cmp("<", x, lo), E.add(x, bv),
                    E.select(E.cmp(">", x, hi), E.sub(x, bv), zero))


unary("Shrink", _shrink, NUMERIC, flops=3)


def _libm(name: str) -> UnaryFn:
    """An LLVM math intrinsic (llvm.tan, llvm.asin, ...: libm per lane)."""
    return lambda E, x, n: E.call(name, x)


for _name, _intr in (("Tan", "llvm.tan"), ("Asin", "llvm.asin"), ("Acos", "llvm.acos"),
                     ("Atan", "llvm.atan"), ("Sinh", "llvm.sinh"), ("Cosh", "llvm.cosh")):
    unary(_name, _libm(_intr), flops=20)


def _asinh(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    # sign(x) * log(|x| + sqrt(x^2 + 1)), on |x| so that it is odd and exact at 0
    a = E.abs(x)
    r = E.math("log", E.add(a, E.call("llvm.sqrt", E.fma(a, a, _c(E, 1.0, x)))))
    return E.call("llvm.copysign", r, x)


def _acosh(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    return E.math("log", E.add(x, E.call("llvm.sqrt", E.fma(x, x, _c(E, -1.0, x)))))


def _atanh(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    lp = E.math("log1p", x)
    lm = E.math("log1p", E.neg(x))
    return E.mul(_c(E, 0.5, x), E.sub(lp, lm))


unary("Asinh", _asinh, flops=20)
unary("Acosh", _acosh, flops=20)
unary("Atanh", _atanh, flops=20)


def _sign(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    zero, one = E.const(0, x.dtype), E.const(1, x.dtype)
    pos = E.select(E.cmp(">", x, zero), one, zero)
    if np.dtype(x.dtype).kind == "u":
        return pos
    neg = E.select(E.cmp("<", x, zero), E.neg(one), zero)
    r = E.add(pos, neg)
    if E.is_float(x):  # NaN stays NaN
        r = E.select(E.isnan(x), x, r)
    return r


unary("Sign", _sign, NUMERIC)


def _leaky(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    a = _c(E, n.attr("alpha", 0.01), x)
    return E.select(E.cmp("<", x, _c(E, 0.0, x)), E.mul(x, a), x)


unary("LeakyRelu", _leaky)


def _elu(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    a = _c(E, n.attr("alpha", 1.0), x)
    em1 = E.sub(E.math("exp", x), _c(E, 1.0, x))
    return E.select(E.cmp("<", x, _c(E, 0.0, x)), E.mul(a, em1), x)


unary("Elu", _elu, flops=12)


def _selu(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    a = _c(E, n.attr("alpha", 1.67326319217681884765625), x)
    g = _c(E, n.attr("gamma", 1.05070102214813232421875), x)
    em1 = E.sub(E.math("exp", x), _c(E, 1.0, x))
    return E.mul(g, E.select(E.cmp("<=", x, _c(E, 0.0, x)), E.mul(a, em1), x))


unary("Selu", _selu, flops=12)


def _celu(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    a = n.attr("alpha", 1.0)
    em1 = E.sub(E.math("exp", E.div(x, _c(E, a, x))), _c(E, 1.0, x))
    neg = E.min(_c(E, 0.0, x), E.mul(_c(E, a, x), em1))
    return E.add(E.max(_c(E, 0.0, x), x), neg)


unary("Celu", _celu, flops=12)


def _thresholded(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    return E.select(E.cmp(">", x, _c(E, n.attr("alpha", 1.0), x)), x, _c(E, 0.0, x))


unary("ThresholdedRelu", _thresholded)


def _hardsigmoid(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    a, b = n.attr("alpha", 0.2), n.attr("beta", 0.5)
    y = E.fma(x, _c(E, a, x), _c(E, b, x))
    return E.min(E.max(y, _c(E, 0.0, x)), _c(E, 1.0, x))


unary("HardSigmoid", _hardsigmoid)


def _hardswish(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    y = E.fma(x, _c(E, 1.0 / 6.0, x), _c(E, 0.5, x))
    return E.mul(x, E.min(E.max(y, _c(E, 0.0, x)), _c(E, 1.0, x)))


unary("HardSwish", _hardswish)


def _mish(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    return E.mul(x, E.math("tanh", E.math("softplus", x)))


unary("Mish", _mish, flops=30)


def _gelu(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    if n.attr("approximate", "none") == "tanh":
        return E.math("gelu_tanh", x)
    return E.math("gelu_erf", x)


unary("Gelu", _gelu, flops=20)


def _swish(E: ExprBuilder, x: Value, n: NodeView) -> Value:
    a = n.attr("alpha", 1.0)
    return E.mul(x, E.math("sigmoid", E.mul(x, _c(E, a, x))))


unary("Swish", _swish, flops=14)


def _clip(E: ExprBuilder, n: NodeView, xs: Sequence[Value]) -> list[Value]:
    x = xs[0]
    if n.opset < 11:
        lo = n.attr("min", -math.inf)
        hi = n.attr("max", math.inf)
        return [E.min(E.max(x, _c(E, lo, x)), _c(E, hi, x))]
    y = x
    if len(xs) > 1 and xs[1] is not None:
        y = E.max(y, xs[1])
    if len(xs) > 2 and xs[2] is not None:
        y = E.min(y, xs[2])
    return [y]


defmap("Clip", _clip, NUMERIC, Category.ELEMENTWISE)

# -- comparisons, logic, selection ---------------------------------------------------
for _name, _op in (("Equal", "=="), ("Less", "<"), ("Greater", ">"),
                   ("LessOrEqual", "<="), ("GreaterOrEqual", ">=")):
    defmap(_name, (lambda op: lambda E, n, xs: [E.cmp(op, xs[0], xs[1])])(_op), ALL,
           input_dtypes=ALL)

defmap("Not", lambda E, n, xs: [E.not_(xs[0])], frozenset({"bool"}), Category.ELEMENTWISE)
defmap("And", lambda E, n, xs: [E.and_(xs[0], xs[1])], frozenset({"bool"}))
defmap("Or", lambda E, n, xs: [E.or_(xs[0], xs[1])], frozenset({"bool"}))
defmap("Xor", lambda E, n, xs: [E.xor(xs[0], xs[1])], frozenset({"bool"}))
defmap("Where", lambda E, n, xs: [E.select(xs[0], xs[1], xs[2])], ALL)


def _isnan(E: ExprBuilder, n: NodeView, xs: Sequence[Value]) -> list[Value]:
    return [E.isnan(xs[0])]


defmap("IsNaN", _isnan, FLOATS, Category.ELEMENTWISE, input_dtypes=FLOATS)


def _isinf(E: ExprBuilder, n: NodeView, xs: Sequence[Value]) -> list[Value]:
    x = xs[0]
    pos, neg = int(n.attr("detect_positive", 1)), int(n.attr("detect_negative", 1))
    inf = _c(E, math.inf, x)
    if pos and neg:
        return [E.cmp("==", E.abs(x), inf)]
    if pos:
        return [E.cmp("==", x, inf)]
    if neg:
        return [E.cmp("==", x, E.neg(inf))]
    return [E.cmp("!=", x, x)]  # ordered !=: always false


defmap("IsInf", _isinf, FLOATS, Category.ELEMENTWISE, input_dtypes=FLOATS, min_opset=10)


def _cast(E: ExprBuilder, n: NodeView, xs: Sequence[Value]) -> list[Value]:
    # Cast-19+ `saturate` (float8 only; 1 = clamp to the largest finite value), Cast-24+
    # `round_mode` (float8e8m0 only)
    sat = bool(int(n.attr("saturate", 1))) if n.opset >= 19 else True
    mode = n.attr("round_mode", "up") if n.opset >= 24 else "up"
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    return [E.cast(xs[0], n.out_types[0].dtype, saturate=sat, round_mode=mode)]


def _check_cast(n: Node, ins: list, outs: list) -> str | None:
    mode = n.attrs.get("round_mode", "up")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in ("up", "down", "nearest"):
        return f"round_mode {mode!r} (ONNX defines up, down, nearest)"
    for what, t in [("input", x) for x in ins] + [("output", y) for y in outs]:
        if t is not None and np.dtype(t.dtype).name not in CASTABLE:
            return f"{what} element type {np.dtype(t.dtype).name} not supported"
    return None


# float8 / float4 and sub-byte integers (cannc/ir/types.py): Cast and CastLike convert
# them bit by bit (codegen/lowp.py); no arithmetic op takes them
LOWP = frozenset(SMALL_FLOATS) | frozenset(SUBBYTE_INTS)
CASTABLE = ALL | LOWP
defmap("Cast", _cast, None, Category.ELEMENTWISE, check=_check_cast)   # type: ignore[arg-type]
defmap("CastLike", _cast, None, Category.ELEMENTWISE, check=_check_cast)  # type: ignore[arg-type]


def _prelu(E: ExprBuilder, n: NodeView, xs: Sequence[Value]) -> list[Value]:
    x, slope = xs
    zero = E.const(0, x.dtype)
    return [E.select(E.cmp("<", x, zero), E.mul(x, slope), x)]


defmap("PRelu", _prelu, NUMERIC - UINTS, flops=2)


# -- bitwise ------------------------------------------------------------------------
def _bitshift(E: ExprBuilder, n: NodeView, xs: Sequence[Value]) -> list[Value]:
    x, y = xs
    left = n.attr("direction", "LEFT")
    left = (left.decode() if isinstance(left, bytes) else left) == "LEFT"
    bits = np.dtype(x.dtype).itemsize * 8
    wide = E.const(bits, y.dtype)
    # a shift by the width or more, or by a negative amount (large as unsigned), shifts
    # every bit out (LLVM would make it poison): 0, or -1 for an arithmetic right shift
    oor = E.ucmp(">=", y, wide)
    if left:
        return [E.select(oor, E.const(0, x.dtype), E.shl(x, y))]
    if np.dtype(x.dtype).kind == "i":
        amt = E.select(oor, E.const(bits - 1, y.dtype), y)
        return [E.shr(x, amt)]
    return [E.select(oor, E.const(0, x.dtype), E.shr(x, y))]


defmap("BitShift", _bitshift, INTS, min_opset=11)
defmap("BitwiseAnd", lambda E, n, xs: [E.and_(xs[0], xs[1])], INTS, min_opset=18)
defmap("BitwiseOr", lambda E, n, xs: [E.or_(xs[0], xs[1])], INTS, min_opset=18)
defmap("BitwiseXor", lambda E, n, xs: [E.xor(xs[0], xs[1])], INTS, min_opset=18)
defmap("BitwiseNot", lambda E, n, xs: [E.not_(xs[0])], INTS, Category.ELEMENTWISE, min_opset=18)


# Under mixed precision a Cast is a boundary: it reads float32 (what it converts is exact)
for _name in ("Cast", "CastLike"):
    registered(_name).amp = Amp.DENY  # type: ignore[union-attr]
