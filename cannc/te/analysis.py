"""What codegen needs to know about a traced program, without LLVM: which dims are
runtime dims, the range of every index expression for concrete shapes (bounds are
proved before any code runs), dependence on the innermost output variable, and the
evaluation of a program's value operations over an `ExprBuilder`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import CanncError
from . import INDEX, Expr, Program, Tensor, walk

Interval = tuple[int, int] | None


def runtime_dims(prog: Program) -> list[tuple[int, int]]:
    """(input, axis) of every symbolic dim the program's inputs carry, in order."""
    out = []
    for t in prog.inputs:
        for d in t.shape:
            if isinstance(d, Expr) and d.op == "dim":
                out.append(d.attr[:2])
    return out


def interval(e: Expr, dim_value: Callable[[int, int], int],
             memo: dict[int, Interval] | None = None) -> Interval:
    """The range [lo, hi] of integer expression e over its variables' extents (dims at
    their concrete values), or None where it is not bounded (a value read from data)."""
    memo = {} if memo is None else memo
    got = memo.get(id(e), False)
    if got is not False:
        return got  # type: ignore[return-value]
    r = _interval(e, dim_value, memo)
    memo[id(e)] = r
    return r


def _interval(e: Expr, dv: Callable[[int, int], int], memo: dict) -> Interval:
    iv = lambda x: interval(x, dv, memo)
    op = e.op
    if op == "const":
        if isinstance(e.attr, (bool, float)):
            return None
        return (int(e.attr), int(e.attr))
    if op == "dim":
        v = dv(e.attr[0], e.attr[1])
        return (v, v)
    if op == "var":
        ext = iv(e.args[0])
        if ext is None:
            return None
        return (0, max(0, ext[1] - 1))
    if op == "cast":
        if e.dtype.kind in "iu" and e.args[0].dtype.kind in "iu":
            return iv(e.args[0])
        return None
    if op in ("add", "sub", "mul", "min", "max", "floordiv", "mod"):
        a, b = iv(e.args[0]), iv(e.args[1])
        if a is None or b is None:
            return None
        if op == "add":
            return (a[0] + b[0], a[1] + b[1])
        if op == "sub":
            return (a[0] - b[1], a[1] - b[0])
        if op == "mul":
            c = [a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]]
            return (min(c), max(c))
        if op == "min":
            return (min(a[0], b[0]), min(a[1], b[1]))
        if op == "max":
            return (max(a[0], b[0]), max(a[1], b[1]))
        if b[0] <= 0 <= b[1]:
            return None          # a divisor that may be 0 (or change sign)
        if op == "floordiv":
            c = [a[0] // b[0], a[0] // b[1], a[1] // b[0], a[1] // b[1]]
            return (min(c), max(c))
        if b[0] > 0:             # mod by a positive divisor
            if 0 <= a[0] and a[1] < b[0]:
                return a
            return (0, b[1] - 1)
        return (b[0] + 1, 0)
    if op == "neg":
        a = iv(e.args[0])
        return None if a is None else (-a[1], -a[0])
    if op == "abs":
        a = iv(e.args[0])
        if a is None:
            return None
        if a[0] >= 0:
            return a
        return (0, max(-a[0], a[1])) if a[1] >= 0 else (-a[1], -a[0])
    if op == "where":
        a, b = iv(e.args[1]), iv(e.args[2])
        return None if a is None or b is None else (min(a[0], b[0]), max(a[1], b[1]))
    return None


def check_bounds(prog: Program, shapes: Sequence[Sequence[int]], label: str) -> None:
    """Every input read of the program stays inside its input for these concrete input
    shapes, or a CanncError naming the op, the input and the axis."""
    def dv(i: int, a: int) -> int:
        return int(shapes[i][a])

    memo: dict[int, Interval] = {}
    roots = [o.body for o in prog.outputs]
    # an empty iteration domain reads nothing
    for o in prog.outputs:
        for d in o.shape:
            r = interval(d, dv, memo) if isinstance(d, Expr) else (d, d)
            if r is not None and r[1] <= 0:
                return
    for e in walk(roots):
        if e.op == "reduce":
            ext = interval(e.args[1].args[0], dv, memo)
            if ext is not None and ext[1] <= 0:
                raise CanncError(f"custom op {label}: a reduction over an empty axis "
                                 f"(te.{e.attr} has no identity here)")
        if e.op != "read":
            continue
        t: Tensor = prog.inputs[e.attr]
        for a, ix in enumerate(e.args):
            r = interval(ix, dv, memo)
            n = int(shapes[e.attr][a])
            name = t.name or f"input {e.attr}"
            if r is None:
                raise CanncError(f"custom op {label}: the index of input '{name}' on axis {a} "
                                 f"({ix!r}) cannot be bounded at compile time (it depends on "
                                 "tensor data or on a division by a value that may be 0)")
            if r[0] < 0 or r[1] >= n:
                raise CanncError(f"custom op {label}: input '{name}' (shape "
                                 f"{tuple(int(s) for s in shapes[e.attr])}) is read at index "
                                 f"{r[0]}..{r[1]} on axis {a}, outside [0, {n - 1}] "
                                 f"(index expression {ix!r})")


def deps(e: Expr, memo: dict[int, frozenset]) -> frozenset:
    """The uids of the variables e depends on (a reduction binds its own)."""
    got = memo.get(id(e))
    if got is not None:
        return got
    for x in walk([e]):
        if id(x) in memo:
            continue
        if x.op == "var":
            s = frozenset({x.attr[0]})
        elif x.op == "reduce":
            s = memo[id(x.args[0])] - {x.args[1].attr[0]}
        else:
            s = frozenset().union(*(memo[id(a)] for a in x.args)) if x.args else frozenset()
        memo[id(x)] = s
    return memo[id(e)]


def inner_coef(e: Expr, inner: Expr, dep: Callable[[Expr], bool]) -> int | None:
    """The constant coefficient of `inner` in e when e is affine in it, else None."""
    if not dep(e):
        return 0
    if e is inner:
        return 1
    if e.op in ("add", "sub"):
        a, b = inner_coef(e.args[0], inner, dep), inner_coef(e.args[1], inner, dep)
        if a is None or b is None:
            return None
        return a + b if e.op == "add" else a - b
    if e.op == "neg":
        a = inner_coef(e.args[0], inner, dep)
        return None if a is None else -a
    if e.op == "mul":
        x, y = e.args
        if not dep(x):
            x, y = y, x
        if y.op == "const" and not dep(y):
            a = inner_coef(x, inner, dep)
            return None if a is None else a * int(y.attr)
    return None


def nonneg(e: Expr, memo: dict[int, bool] | None = None) -> bool:
    """Whether integer expression e is >= 0 whatever the shapes (dims and index
    variables are)."""
    memo = {} if memo is None else memo
    got = memo.get(id(e))
    if got is not None:
        return got
    op = e.op
    if op == "const":
        r = not isinstance(e.attr, float) and e.attr >= 0
    elif op in ("var", "dim"):
        r = True
    elif op in ("add", "mul", "floordiv", "mod", "min", "max"):
        r = all(nonneg(a, memo) for a in e.args)
    elif op == "where":
        r = nonneg(e.args[1], memo) and nonneg(e.args[2], memo)
    elif op == "abs":
        r = True
    else:
        r = False
    memo[id(e)] = r
    return r


_MATH = {"exp": "exp", "log": "log", "tanh": "tanh", "erf": "erf", "sigmoid": "sigmoid",
         "sin": "sin", "cos": "cos"}
_CMPS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


class Evaluator:
    """Builds the value of an expression with an `ExprBuilder` E (values memoised per
    node). Leaves (`read`, `var`, `dim`, `reduce`) come from `leaf`, which a lowering
    supplies; everything else is E's arithmetic. Integer // and % are floor operations
    (Python's), cheap where both operands are known non-negative."""

    def __init__(self, E: Any, leaf: Callable[[Expr], Any]) -> None:
        self.E = E
        self.leaf = leaf
        self.memo: dict[int, Any] = {}
        self._nn: dict[int, bool] = {}

    def __call__(self, e: Expr) -> Any:
        got = self.memo.get(id(e))
        if got is not None:
            return got
        v = self._emit(e)
        self.memo[id(e)] = v
        return v

    def _emit(self, e: Expr) -> Any:
        E = self.E
        op = e.op
        if op in ("read", "var", "dim", "reduce"):
            return self.leaf(e)
        if op == "const":
            return E.const(e.attr, e.dtype)
        xs = [self(a) for a in e.args]
        if op in ("add", "sub", "mul", "min", "max"):
            return getattr(E, op)(*xs)
        if op == "div":
            return E.div(*xs)
        if op == "pow":
            return E.math("pow", *xs)
        if op in ("floordiv", "mod"):
            return self._floor(op, e, *xs)
        if op in _CMPS:
            return E.cmp(_CMPS[op], *xs)
        if op == "and":
            return E.and_(*xs)
        if op == "or":
            return E.or_(*xs)
        if op == "not":
            return E.not_(*xs)
        if op == "where":
            return E.select(*xs)
        if op == "neg":
            return E.neg(*xs)
        if op == "abs":
            return E.abs(*xs)
        if op == "sqrt":
            return E.call("llvm.sqrt", *xs)
        if op in _MATH:
            return E.math(_MATH[op], *xs)
        if op == "cast":
            return E.cast(xs[0], e.dtype)
        raise CanncError(f"te: no lowering of operation {op}")

    def _floor(self, op: str, e: Expr, x: Any, y: Any) -> Any:
        E = self.E
        if E.is_float(x):
            q = E.call("llvm.floor", E.div(x, y))
            return q if op == "floordiv" else E.sub(x, E.mul(q, y))
        zero = E.const(0, x.dtype)
        b = e.args[1]
        if not (b.op == "const" and b.attr != 0):
            y = E.select(E.cmp("==", y, zero), E.const(1, y.dtype), y)   # never trap
        if nonneg(e.args[0], self._nn) and nonneg(b, self._nn) and x.dtype == INDEX:
            u = np.dtype(np.uint64)
            xu, yu = E.cast(x, u), E.cast(y, u)
            r = E.div(xu, yu) if op == "floordiv" else E.rem(xu, yu)
            return E.cast(r, x.dtype)
        q, r = E.div(x, y), E.rem(x, y)
        adj = E.and_(E.cmp("!=", r, zero),
                     E.xor(E.cmp("<", r, zero), E.cmp("<", y, zero)))
        if op == "floordiv":
            return E.select(adj, E.sub(q, E.const(1, x.dtype)), q)
        return E.select(adj, E.add(r, y), r)


def eval_map(prog: Program, E: Any, xs: Sequence[Any]) -> list[Any]:
    """An elementwise program's outputs from its operands' values (the op's `expr`)."""
    def leaf(e: Expr) -> Any:
        if e.op == "read":
            return xs[e.attr]
        raise CanncError(f"te: {e.op} in an elementwise body")

    ev = Evaluator(E, leaf)
    return [ev(o.body) for o in prog.outputs]
