"""cannc.te: a small tensor-expression language for custom ops written in Python.

A custom op's body is a Python function over symbolic tensors (`Tensor`: a dtype and a
shape of ints or symbolic dims). Whole-tensor arithmetic broadcasts like numpy::

    0.5 * x * (1.0 + te.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))

and `te.compute(shape, fn)` builds a tensor from a function of the output's index
variables, reading inputs at computed indices (index arithmetic ``+ - * // %`` on
index variables, ints and symbolic dims)::

    te.compute(x.shape, lambda b, s, h, d: x[b, s, h, (d + half) % d_model] * ...)

Reductions: ``te.sum(t, axis=1)`` / ``te.max(t, axis=-1)`` over a tensor's axis, or
over a reduction variable inside a compute (``k = te.reduce_axis(n)``;
``te.sum(a[i, k] * b[k, j], axis=k)``).

Nothing here knows LLVM: a traced body is a `Program` (expression DAG, inputs,
outputs) that codegen lowers (cannc/codegen/lower/te.py). Integer ``//`` and ``%``
follow Python (floor) semantics. Python numbers are weakly typed: they take the dtype
of the tensor they meet (float32 / int64 when they meet none).
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CanncError

__all__ = ["Tensor", "Expr", "placeholder", "compute", "reduce_axis", "where", "exp", "log",
           "tanh", "erf", "sqrt", "sigmoid", "abs", "min", "max", "minimum", "maximum",
           "cast", "sum", "sin", "cos", "pow", "TraceError", "Program"]

INDEX = np.dtype(np.int64)
BOOL = np.dtype(np.bool_)
F32 = np.dtype(np.float32)


class TraceError(CanncError):
    """A te body does something the language cannot express."""


# ---------------------------------------------------------------------------
# scalar expressions (hash-consed: one object per structure, so equal
# subexpressions are shared and dims compare by identity)
# ---------------------------------------------------------------------------

_lock = threading.RLock()
_table: dict[tuple, Expr] = {}
_uid = [0]


class Expr:
    """A scalar expression node: ``op`` with ``args`` (Exprs), ``attr`` (hashable) and
    the numpy ``dtype`` of its value. ``weak``: built from Python numbers only."""

    __slots__ = ("op", "args", "attr", "dtype", "weak", "__weakref__")
    __hash__ = object.__hash__

    op: str
    args: tuple[Expr, ...]
    attr: Any
    dtype: np.dtype
    weak: bool

    # -- arithmetic (also index arithmetic) ------------------------------
    def __add__(self, o: Any) -> Any: return _binary("add", self, o)
    def __radd__(self, o: Any) -> Any: return _binary("add", o, self)
    def __sub__(self, o: Any) -> Any: return _binary("sub", self, o)
    def __rsub__(self, o: Any) -> Any: return _binary("sub", o, self)
    def __mul__(self, o: Any) -> Any: return _binary("mul", self, o)
    def __rmul__(self, o: Any) -> Any: return _binary("mul", o, self)
    def __truediv__(self, o: Any) -> Any: return _binary("div", self, o)
    def __rtruediv__(self, o: Any) -> Any: return _binary("div", o, self)
    def __floordiv__(self, o: Any) -> Any: return _binary("floordiv", self, o)
    def __rfloordiv__(self, o: Any) -> Any: return _binary("floordiv", o, self)
    def __mod__(self, o: Any) -> Any: return _binary("mod", self, o)
    def __rmod__(self, o: Any) -> Any: return _binary("mod", o, self)
    def __pow__(self, o: Any) -> Any: return _binary("pow", self, o)
    def __rpow__(self, o: Any) -> Any: return _binary("pow", o, self)
    def __neg__(self) -> Any: return _unary("neg", self)
    def __pos__(self) -> Any: return self
    def __abs__(self) -> Any: return _unary("abs", self)
    def __lt__(self, o: Any) -> Any: return _binary("lt", self, o)
    def __le__(self, o: Any) -> Any: return _binary("le", self, o)
    def __gt__(self, o: Any) -> Any: return _binary("gt", self, o)
    def __ge__(self, o: Any) -> Any: return _binary("ge", self, o)
    def __eq__(self, o: Any) -> Any: return _binary("eq", self, o)  # type: ignore[override]
    def __ne__(self, o: Any) -> Any: return _binary("ne", self, o)  # type: ignore[override]
    def __and__(self, o: Any) -> Any: return _binary("and", self, o)
    def __rand__(self, o: Any) -> Any: return _binary("and", o, self)
    def __or__(self, o: Any) -> Any: return _binary("or", self, o)
    def __ror__(self, o: Any) -> Any: return _binary("or", o, self)
    def __invert__(self) -> Any: return _unary("not", self)

    def __bool__(self) -> bool:
        raise TraceError("a te expression has no truth value while tracing (it is only known "
                         "at run time): use te.where(cond, a, b) instead of if/and/or")

    def __index__(self) -> int:
        raise TraceError("a te expression is not a Python int (a symbolic dim or an index "
                         "variable cannot size a Python range or slice)")

    def __repr__(self) -> str:
        if self.op == "const":
            return repr(self.attr)
        if self.op in ("var", "dim"):
            return str(self.attr[-1])
        if self.op == "read":
            return f"in{self.attr}[{', '.join(map(repr, self.args))}]"
        return f"{self.op}({', '.join(map(repr, self.args))})"


def _mk(op: str, args: tuple[Expr, ...], dtype: np.dtype, attr: Any = None,
        weak: bool = False) -> Expr:
    key = (op, tuple(id(a) for a in args), np.dtype(dtype).str, attr, weak)
    with _lock:
        e = _table.get(key)
        if e is None:
            e = Expr.__new__(Expr)
            e.op, e.args, e.attr, e.dtype, e.weak = op, args, attr, np.dtype(dtype), weak
            _table[key] = e
        return e


def const(value: Any, dtype: Any = None) -> Expr:
    """A constant; without a dtype a weakly typed one (float32, int64 or bool)."""
    if isinstance(value, (bool, np.bool_)):
        return _mk("const", (), np.dtype(dtype) if dtype is not None else BOOL, bool(value),
                   weak=dtype is None)
    if isinstance(value, (int, np.integer)) and (dtype is None or np.dtype(dtype).kind in "iu"):
        return _mk("const", (), np.dtype(dtype) if dtype is not None else INDEX, int(value),
                   weak=dtype is None)
    if isinstance(value, (int, float, np.integer, np.floating)):
        dt = np.dtype(dtype) if dtype is not None else F32
        v = float(value) if dt.kind not in "iu" else int(value)
        return _mk("const", (), dt, v, weak=dtype is None)
    raise TraceError(f"cannot use {type(value).__name__} {value!r} in a te expression")


def _as_expr(x: Any) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, Tensor):
        if x.ndim == 0:
            return x.body
        raise TraceError(f"a tensor of shape {x.shape} used where a scalar is expected "
                         "(index it, or apply the operation to whole tensors)")
    return const(x)


def _kind(dt: np.dtype) -> str:
    return "b" if dt == BOOL else ("f" if dt.kind == "f" or dt.kind == "V"
                                   or dt.name == "bfloat16" else "i")


def _unify(a: Expr, b: Expr, what: str) -> tuple[Expr, Expr]:
    """Operands of one dtype: a weak side takes the other's dtype; an integer meeting a
    float becomes that float."""
    if a.dtype == b.dtype:
        return a, b
    if a.weak and not b.weak:
        return _retype(a, b.dtype), b
    if b.weak and not a.weak:
        return a, _retype(b, a.dtype)
    ka, kb = _kind(a.dtype), _kind(b.dtype)
    if ka == "i" and kb == "f":
        return cast(a, b.dtype), b
    if kb == "i" and ka == "f":
        return a, cast(b, a.dtype)
    if a.weak and b.weak:       # (weak int meets weak float)
        return (_retype(a, b.dtype), b) if kb == "f" else (a, _retype(b, a.dtype))
    raise TraceError(f"{what} of {a.dtype.name} and {b.dtype.name}: convert one with "
                     "te.cast(x, dtype)")


def _retype(e: Expr, dtype: np.dtype) -> Expr:
    if e.op == "const":
        return const(e.attr if np.dtype(dtype).kind in "fV" or np.dtype(dtype).name ==
                     "bfloat16" else int(e.attr), dtype)
    return cast(e, dtype)


_CMP = {"lt", "le", "gt", "ge", "eq", "ne"}


def _binary(op: str, a: Any, b: Any) -> Any:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return _tensor_map(lambda x, y: _binary(op, x, y), a, b)
    a, b = _as_expr(a), _as_expr(b)
    a, b = _unify(a, b, op)
    dt = a.dtype
    weak = a.weak and b.weak
    if op == "div" and _kind(dt) == "i":
        raise TraceError("/ of integers: use // (floor division) for index arithmetic, or "
                         "te.cast to a float first")
    if op in ("and", "or") and _kind(dt) != "b":
        raise TraceError(f"& and | take booleans (comparisons), not {dt.name}")
    if op in _CMP:
        return _mk(op, (a, b), BOOL, weak=weak)
    # fold integer constants (static shapes stay Python-sized)
    if a.op == "const" and b.op == "const" and _kind(dt) == "i":
        x, y = a.attr, b.attr
        r = {"add": lambda: x + y, "sub": lambda: x - y, "mul": lambda: x * y,
             "floordiv": lambda: x // y if y else None, "mod": lambda: x % y if y else None,
             "min": lambda: builtins.min(x, y), "max": lambda: builtins.max(x, y)}.get(op)
        if r is not None and r() is not None:
            return const(r(), None if weak else dt)
    return _mk(op, (a, b), dt, weak=weak)


_FLOAT_ONLY = {"exp", "log", "tanh", "erf", "sqrt", "sigmoid", "sin", "cos"}


def _unary(op: str, a: Any) -> Any:
    if isinstance(a, Tensor):
        return _tensor_map(lambda x: _unary(op, x), a)
    a = _as_expr(a)
    if op in _FLOAT_ONLY and _kind(a.dtype) != "f":
        if a.weak or _kind(a.dtype) == "i":
            a = cast(a, F32) if not a.weak else _retype(a, F32)
        else:
            raise TraceError(f"{op} of {a.dtype.name}: it takes floats")
    if op == "not" and _kind(a.dtype) != "b":
        raise TraceError(f"~ takes booleans (comparisons), not {a.dtype.name}")
    return _mk(op, (a,), a.dtype, weak=a.weak)


# ---------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------

DimLike = int | Expr


class Tensor:
    """A symbolic tensor: ``shape`` (ints and symbolic dims), ``dtype`` and a body, the
    scalar expression of its element at index variables ``vars``. Inputs of a custom op
    are tensors; so are the results of arithmetic on tensors and of `compute`."""

    __array_priority__ = 1000     # numpy scalars on the left defer to Tensor

    def __init__(self, shape: Sequence[DimLike], dtype: np.dtype, vars: Sequence[Expr],
                 body: Expr, name: str = "") -> None:
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.vars = tuple(vars)
        self.body = body
        self.name = name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TraceError("len() of a 0-d tensor")
        d = self.shape[0]
        if isinstance(d, Expr):
            raise TraceError("len() of a tensor whose first dim is symbolic: use t.shape[0]")
        return d

    def __getitem__(self, idx: Any) -> Expr:
        if not isinstance(idx, tuple):
            idx = (idx,)
        if builtins.any(i is Ellipsis or isinstance(i, slice) for i in idx):
            raise TraceError(f"{self._label()}[...]: index every axis with an index expression "
                             "(slices are not supported; use te.compute)")
        if len(idx) != self.ndim:
            raise TraceError(f"{self._label()} has {self.ndim} axes, indexed with {len(idx)}")
        es = []
        for i in idx:
            e = _as_expr(i)
            if _kind(e.dtype) != "i":
                raise TraceError(f"{self._label()} indexed with a {e.dtype.name} value: "
                                 "indices are integer expressions")
            es.append(e if e.dtype == INDEX else cast(e, INDEX))
        return substitute(self.body, dict(zip(self.vars, es)))

    def _label(self) -> str:
        return f"tensor '{self.name}'" if self.name else "the tensor"

    def astype(self, dtype: Any) -> Tensor:
        return cast(self, dtype)

    def __repr__(self) -> str:
        return f"te.Tensor({self.name or '?'}, shape={self.shape}, dtype={self.dtype.name})"

    __add__ = Expr.__add__
    __radd__ = Expr.__radd__
    __sub__ = Expr.__sub__
    __rsub__ = Expr.__rsub__
    __mul__ = Expr.__mul__
    __rmul__ = Expr.__rmul__
    __truediv__ = Expr.__truediv__
    __rtruediv__ = Expr.__rtruediv__
    __floordiv__ = Expr.__floordiv__
    __rfloordiv__ = Expr.__rfloordiv__
    __mod__ = Expr.__mod__
    __rmod__ = Expr.__rmod__
    __pow__ = Expr.__pow__
    __rpow__ = Expr.__rpow__
    __neg__ = Expr.__neg__
    __abs__ = Expr.__abs__
    __lt__ = Expr.__lt__
    __le__ = Expr.__le__
    __gt__ = Expr.__gt__
    __ge__ = Expr.__ge__
    __eq__ = Expr.__eq__  # type: ignore[assignment]
    __ne__ = Expr.__ne__  # type: ignore[assignment]
    __and__ = Expr.__and__
    __or__ = Expr.__or__
    __invert__ = Expr.__invert__
    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        raise TraceError("a te tensor has no truth value while tracing: use te.where")


def _new_var(extent: DimLike, name: str) -> Expr:
    with _lock:
        _uid[0] += 1
        uid = _uid[0]
    return _mk("var", (_as_expr(extent),), INDEX, attr=(uid, name))


def _same_dim(a: DimLike, b: DimLike) -> bool:
    if isinstance(a, Expr) or isinstance(b, Expr):
        return _as_expr(a) is _as_expr(b)
    return a == b


def broadcast_shapes(*shapes: tuple[DimLike, ...]) -> tuple[DimLike, ...]:
    r = builtins.max((len(s) for s in shapes), default=0)
    out: list[DimLike] = []
    for ax in range(r):
        d: DimLike = 1
        for s in shapes:
            k = ax - (r - len(s))
            if k < 0:
                continue
            e = s[k]
            if isinstance(e, int) and e == 1:
                continue
            if isinstance(d, int) and d == 1:
                d = e
            elif not _same_dim(d, e):
                raise TraceError(f"shapes {' and '.join(str(tuple(s)) for s in shapes)} do not "
                                 f"broadcast (axis {ax}: {d} vs {e})")
        out.append(d)
    return tuple(out)


def _tensor_map(fn: Callable[..., Expr], *xs: Any) -> Tensor:
    """Elementwise fn over tensors (numpy broadcasting) and scalars."""
    shapes = [x.shape for x in xs if isinstance(x, Tensor)]
    shape = broadcast_shapes(*shapes)
    vars = [_new_var(d, f"i{k}") for k, d in enumerate(shape)]
    r = len(shape)
    vals = []
    for x in xs:
        if isinstance(x, Tensor):
            idx = []
            for k, d in enumerate(x.shape):
                ax = r - x.ndim + k
                bcast = isinstance(d, int) and d == 1 and not (isinstance(shape[ax], int)
                                                               and shape[ax] == 1)
                idx.append(const(0) if bcast else vars[ax])
            vals.append(substitute(x.body, dict(zip(x.vars, idx))) if x.ndim else x.body)
        else:
            vals.append(x)
    body = _as_expr(fn(*vals))
    names = [x.name for x in xs if isinstance(x, Tensor)]
    return Tensor(shape, body.dtype, vars, body, name="(" + ", ".join(names) + ")")


def substitute(e: Expr, mapping: dict[Expr, Expr]) -> Expr:
    """e with variables replaced (by identity)."""
    if not mapping:
        return e
    memo: dict[int, Expr] = {}
    ids = {id(k): v for k, v in mapping.items()}

    def go_fast(x: Expr) -> Expr:
        r = memo.get(id(x))
        if r is not None:
            return r
        if id(x) in ids:
            r = ids[id(x)]
        elif not x.args:
            r = x
        else:
            args = tuple(go_fast(a) for a in x.args)
            r = x if builtins.all(a is b for a, b in zip(args, x.args)) else \
                _mk(x.op, args, x.dtype, x.attr, x.weak)
        memo[id(x)] = r
        return r

    return go_fast(e)


def placeholder(shape: Sequence[DimLike | str], dtype: Any = np.float32, name: str = "x",
                index: int = 0) -> Tensor:
    """An input tensor: dims are ints, or strings (symbolic dims, known at run time)."""
    dims: list[DimLike] = []
    for a, d in enumerate(shape):
        if isinstance(d, str):
            dims.append(_mk("dim", (), INDEX, attr=(index, a, d)))
        elif isinstance(d, Expr):
            dims.append(d)
        else:
            dims.append(int(d))
    vars = [_new_var(d, f"{name}{k}") for k, d in enumerate(dims)]
    body = _mk("read", tuple(vars), np.dtype(dtype), attr=index)
    return Tensor(dims, np.dtype(dtype), vars, body, name=name)


def compute(shape: Sequence[DimLike], fn: Callable[..., Any], name: str = "") -> Tensor:
    """A tensor of `shape` whose element at index (i0, i1, ...) is ``fn(i0, i1, ...)``."""
    shape = tuple(d if isinstance(d, Expr) else _check_int_dim(d) for d in shape)
    vars = [_new_var(d, f"i{k}") for k, d in enumerate(shape)]
    body = _as_expr(fn(*vars))
    return Tensor(shape, body.dtype, vars, body, name=name)


def _check_int_dim(d: Any) -> int:
    try:
        v = int(d)
    except (TypeError, ValueError):
        raise TraceError(f"a shape dim must be an int or a symbolic dim, not {d!r}") from None
    if v < 0:
        raise TraceError(f"negative shape dim {v}")
    return v


def reduce_axis(extent: DimLike, name: str = "k") -> Expr:
    """A reduction variable over [0, extent), for te.sum / te.max inside a compute."""
    return _new_var(extent, name)


def _reduce(kind: str, x: Any, axis: Any, keepdims: bool) -> Any:
    if isinstance(axis, Expr):
        if axis.op != "var":
            raise TraceError(f"te.{kind}(..., axis=k): k must be a te.reduce_axis")
        body = _as_expr(x)
        return _mk("reduce", (body, axis), body.dtype, attr=kind)
    if not isinstance(x, Tensor):
        raise TraceError(f"te.{kind}: reduce a tensor over an int axis, or an expression "
                         "over a te.reduce_axis")
    axes = [axis] if isinstance(axis, int) else list(axis) if axis is not None \
        else list(range(x.ndim))
    axes = sorted({a + x.ndim if a < 0 else a for a in axes})
    if builtins.any(not 0 <= a < x.ndim for a in axes):
        raise TraceError(f"te.{kind}: axis {axis} out of range for rank {x.ndim}")
    red = {a: _new_var(x.shape[a], f"r{a}") for a in axes}
    out_shape = [1 if a in red else d for a, d in enumerate(x.shape)
                 if keepdims or a not in red]
    ovars = [_new_var(d, f"i{k}") for k, d in enumerate(out_shape)]
    it = iter(ovars)
    idx = []
    for a in range(x.ndim):
        if a in red:
            if keepdims:
                next(it)
            idx.append(red[a])
        else:
            idx.append(next(it))
    body = substitute(x.body, dict(zip(x.vars, idx)))
    for a in reversed(axes):
        body = _mk("reduce", (body, red[a]), body.dtype, attr=kind)
    return Tensor(out_shape, body.dtype, ovars, body, name=f"{kind}({x.name})")


def _is_axis(axis: Any) -> bool:
    return axis is None or isinstance(axis, (int, list, tuple)) and not isinstance(axis, bool) \
        or isinstance(axis, Expr) and axis.op == "var"


def sum(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
    """Sum over an axis (an int, ints, None for all; or a te.reduce_axis in a compute)."""
    return _reduce("sum", x, axis, keepdims)


def max(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
    """Maximum over an axis (as te.sum); ``te.max(a, b)`` of two operands where b is not
    an axis (a float, a tensor, an expression) is the elementwise maximum."""
    if not _is_axis(axis):
        return _binary("max", x, axis)
    return _reduce("max", x, axis, keepdims)


def min(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
    """Minimum over an axis, or of two operands (see te.max)."""
    if not _is_axis(axis):
        return _binary("min", x, axis)
    return _reduce("min", x, axis, keepdims)


def where(cond: Any, a: Any, b: Any) -> Any:
    if builtins.any(isinstance(v, Tensor) for v in (cond, a, b)):
        return _tensor_map(lambda c, x, y: where(c, x, y), cond, a, b)
    c, x, y = _as_expr(cond), _as_expr(a), _as_expr(b)
    if c.dtype != BOOL:
        raise TraceError(f"te.where's condition must be a comparison, not {c.dtype.name}")
    x, y = _unify(x, y, "te.where")
    return _mk("where", (c, x, y), x.dtype, weak=x.weak and y.weak)


def minimum(a: Any, b: Any) -> Any:
    return _binary("min", a, b)


def maximum(a: Any, b: Any) -> Any:
    return _binary("max", a, b)


def cast(x: Any, dtype: Any) -> Any:
    dt = np.dtype(dtype)
    if isinstance(x, Tensor):
        return _tensor_map(lambda v: cast(v, dt), x)
    e = _as_expr(x)
    if e.dtype == dt:
        return e if not e.weak else _mk(e.op, e.args, e.dtype, e.attr) if e.op != "const" \
            else const(e.attr, dt)
    if e.op == "const":
        return const(e.attr, dt)
    return _mk("cast", (e,), dt)


def exp(x: Any) -> Any: return _unary("exp", x)
def log(x: Any) -> Any: return _unary("log", x)
def tanh(x: Any) -> Any: return _unary("tanh", x)
def erf(x: Any) -> Any: return _unary("erf", x)
def sqrt(x: Any) -> Any: return _unary("sqrt", x)
def sigmoid(x: Any) -> Any: return _unary("sigmoid", x)
def sin(x: Any) -> Any: return _unary("sin", x)
def cos(x: Any) -> Any: return _unary("cos", x)
def abs(x: Any) -> Any: return _unary("abs", x)
def pow(x: Any, y: Any) -> Any: return _binary("pow", x, y)


# ---------------------------------------------------------------------------
# a traced body
# ---------------------------------------------------------------------------


@dataclass
class Program:
    """A traced body: its input placeholders and output tensors. ``elementwise``: every
    output is a broadcasting map of the inputs (the op's `expr`); else the outputs are
    computed by an index loop nest (codegen/lower/te.py)."""

    inputs: list[Tensor]
    outputs: list[Tensor]
    elementwise: bool = False
    fingerprint: str = ""
    notes: dict[str, Any] = field(default_factory=dict)


def walk(roots: Sequence[Expr]) -> list[Expr]:
    """Every node reachable from roots, children before parents."""
    seen: set[int] = set()
    order: list[Expr] = []
    stack: list[tuple[Expr, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        e, done = stack.pop()
        if done:
            order.append(e)
            continue
        if id(e) in seen:
            continue
        seen.add(id(e))
        stack.append((e, True))
        for a in reversed(e.args):
            if id(a) not in seen:
                stack.append((a, False))
    return order


def is_elementwise(inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> bool:
    """Whether each output reads every input at its own (broadcast) position only."""
    if not outputs:
        return False
    shape = outputs[0].shape
    try:
        if broadcast_shapes(*[t.shape for t in inputs]) != shape and not builtins.all(
                _same_dim(a, b) for a, b in zip(broadcast_shapes(*[t.shape for t in inputs]),
                                                shape)):
            return False
        full = broadcast_shapes(*[t.shape for t in inputs])
    except TraceError:
        return False
    if len(full) != len(shape) or not builtins.all(_same_dim(a, b)
                                                   for a, b in zip(full, shape)):
        return False
    for out in outputs:
        if len(out.shape) != len(shape) or not builtins.all(
                _same_dim(a, b) for a, b in zip(out.shape, shape)):
            return False
        r = len(shape)
        stack, seen = [out.body], set()
        while stack:
            e = stack.pop()
            if id(e) in seen:
                continue
            seen.add(id(e))
            if e.op in ("var", "dim", "reduce"):
                return False
            if e.op == "read":
                t = inputs[e.attr]
                for k, a in enumerate(e.args):
                    ax = r - t.ndim + k
                    d = t.shape[k]
                    one = isinstance(d, int) and d == 1
                    if a is out.vars[ax]:
                        continue
                    if one and a.op == "const" and a.attr == 0:
                        continue
                    return False
                continue
            stack.extend(e.args)
    return True


def fingerprint(inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> str:
    """A structural digest of a program (variables by order of appearance): the code a
    program generates depends on nothing else, so it keys the compiled-kernel caches."""
    import hashlib

    roots = [o.body for o in outputs]
    for o in outputs:
        roots.extend(_as_expr(d) for d in o.shape)
        roots.extend(o.vars)
    order = walk(roots)
    num = {id(e): k for k, e in enumerate(order)}
    h = hashlib.sha256()
    for e in order:
        attr = e.attr[:-1] if e.op == "var" else e.attr
        if e.op == "var":
            attr = ()
        h.update(f"{e.op}|{e.dtype.str}|{attr!r}|{[num[id(a)] for a in e.args]};".encode())
    for o in outputs:
        h.update(f"out{o.dtype.str}{[num[id(v)] for v in o.vars]}"
                 f"{[num[id(_as_expr(d))] for d in o.shape]};".encode())
    for t in inputs:
        h.update(f"in{t.dtype.str}{t.ndim};".encode())
    return h.hexdigest()[:24]


def trace(fn: Callable[..., Any], inputs: Sequence[Tensor]) -> Program:
    """Run fn over the input tensors; its result (a tensor or a tuple of tensors) is the
    program's outputs. A Python number result is a 0-d tensor."""
    with _lock:
        res = fn(*inputs)
        outs = list(res) if isinstance(res, (tuple, list)) else [res]
        tensors = []
        for k, o in enumerate(outs):
            if isinstance(o, Expr) or not isinstance(o, Tensor):
                e = _as_expr(o)
                if builtins.any(x.op == "var" for x in walk([e])):
                    raise TraceError(f"output {k} is a scalar expression of index variables: "
                                     "wrap it in te.compute(shape, fn)")
                o = Tensor((), e.dtype, (), e)
            if o.body.weak:
                o = Tensor(o.shape, o.dtype, o.vars, cast(o.body, o.dtype) if o.body.op != "const"
                           else const(o.body.attr, o.dtype), o.name)
            tensors.append(o)
        if not tensors:
            raise TraceError("the body returned no tensor")
        ew = is_elementwise(inputs, tensors)
        return Program(list(inputs), tensors, ew, fingerprint(inputs, tensors))
