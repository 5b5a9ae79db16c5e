"""@cannc.custom_op: an op written in Python over cannc.te tensors.

    @cannc.custom_op("FastGelu", domain="com.example")
    def fast_gelu(x):
        return 0.5 * x * (1.0 + te.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))

registers an OpDef (domain, name; output types from the traced expression or from
`infer`) and its lowering (cannc/codegen/lower/te.py). The body is traced per input
types when a model using the op is compiled. An elementwise body becomes the op's
`expr`: it gets the shared map lowering and fuses like a built-in (chains, GEMM/Conv
epilogues). The decorated function also runs eagerly on NumPy arrays: a one-node model
compiled through cannc.compile, cached in memory per input shapes and dtypes (a small
private cache here).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import linecache
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

import cannc.te as te

from .errors import CanncError, UnsupportedOpError
from .ir.graph import Node
from .ir.ops import lookup
from .ir.registry import Amp, Category, OpDef, register
from .ir.types import TensorType
from .te import analysis as A

DEFAULT_DOMAIN = "com.cannc.custom"
_lock = threading.RLock()
_OPS: dict[tuple[str, str], _CustomOp] = {}


def _code_digest(code: Any, h: Any) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        if inspect.iscode(c):
            _code_digest(c, h)
        else:
            h.update(repr(c).encode())


def _body_digest(fn: Callable[..., Any]) -> str:
    h = hashlib.sha256()
    _code_digest(fn.__code__, h)
    return h.hexdigest()[:16]


def _where(fn: Callable[..., Any]) -> str:
    c = fn.__code__
    return f"{c.co_filename}:{c.co_firstlineno}"


class _Version:
    def __init__(self, fn: Callable[..., Any], infer: Callable[..., Any] | None) -> None:
        self.fn, self.infer = fn, infer
        self.digest = _body_digest(fn)
        self.params = list(inspect.signature(fn).parameters)
        self.traces: dict[tuple, te.Program] = {}


class _CustomOp:
    def __init__(self, name: str, domain: str) -> None:
        self.name, self.domain = name, domain
        self.versions: dict[int, _Version] = {}
        self.kind: bool | None = None     # elementwise?
        self.opdef = OpDef(name=name, category=Category.OPAQUE, domain=domain,
                           check=self._check, infer=self._infer, amp=Amp.DENY,
                           doc="custom op (cannc.te)")
        register(self.opdef)
        from .codegen.lower.base import register_lowering  # (imports the code generators)
        from .codegen.lower.te import te_lowering

        lower, tiling = te_lowering(self._trace_lower, self.label)
        register_lowering(name, domain=domain, tiling=tiling)(lower)

    def label(self, n: Node | None = None) -> str:
        return f"{self.domain}::{self.name}"

    def version(self, n: Node) -> _Version:
        v = self.versions.get(n.opset)
        if v is None:
            raise UnsupportedOpError([(n.name, n.op_type, n.domain, n.opset,
                                       self._version_reason(n.opset))])
        return v

    def _version_reason(self, asked: int) -> str:
        have = ", ".join(str(k) for k in sorted(self.versions))
        return f"version {asked} of custom op {self.label()} is not registered (registered: {have})"

    def _check(self, n: Node, ins: list, outs: list) -> str | None:
        if n.opset not in self.versions:
            return self._version_reason(n.opset)
        return None

    # -- tracing -------------------------------------------------------------
    def trace(self, ver: _Version, types: list[TensorType], lower: bool) -> te.Program:
        dts = tuple(np.dtype(t.dtype).str for t in types)
        if lower:
            # every axis but the innermost is a runtime dim (unless 1); equal extents share
            # one dim (the equality pattern is part of the program, so of its key)
            shapes, seen = [], {}
            for i, t in enumerate(types):
                s: list[Any] = []
                for a, d in enumerate(t.shape):
                    d = int(d)
                    if a == len(t.shape) - 1 or d == 1:
                        s.append(d)
                    else:
                        s.append(seen.setdefault(d, ("rt", i, a)))
                shapes.append(tuple(s))
        else:
            shapes = [tuple(t.shape) for t in types]
        key = (lower, dts, tuple(shapes))
        with _lock:
            got = ver.traces.get(key)
            if got is not None:
                return got
            dims: dict[Any, te.Expr] = {}
            ins = []
            for i, (t, s) in enumerate(zip(types, shapes)):
                pshape: list[Any] = []
                for a, d in enumerate(s):
                    if isinstance(d, (tuple, str)):
                        if d not in dims:
                            dims[d] = te._mk("dim", (), te.INDEX,
                                             attr=(i, a, d if isinstance(d, str) else
                                                   f"{self._pname(ver, i)}.shape[{a}]"))
                        pshape.append(dims[d])
                    else:
                        pshape.append(int(d))
                ins.append(te.placeholder(pshape, t.dtype, name=self._pname(ver, i), index=i))
            try:
                prog = te.trace(ver.fn, ins)
            except CanncError as e:
                raise CanncError(f"custom op {self.label()}: tracing its body failed "
                                 f"{_user_line(ver.fn, e)}: {e}") from None
            except Exception as e:   # the user's code raised: name the op and the line
                raise CanncError(f"custom op {self.label()}: tracing its body failed "
                                 f"{_user_line(ver.fn, e)}: {type(e).__name__}: {e}") from None
            self._set_kind(prog)
            ver.traces[key] = prog
            return prog

    def _pname(self, ver: _Version, i: int) -> str:
        return ver.params[i] if i < len(ver.params) else f"input{i}"

    def _set_kind(self, prog: te.Program) -> None:
        if self.kind is None:
            self.kind = prog.elementwise
            if prog.elementwise:
                op = self.opdef
                op.category = Category.BROADCAST
                op.expr = self._expr
                op.fusible = True
                op.inplace = True
                op.amp = Amp.FOLLOW
                op.flops_per_elem = max(1, sum(1 for e in te.walk([o.body for o in
                                                                   prog.outputs])
                                               if e.op not in ("read", "const")))
        elif self.kind != prog.elementwise:
            raise CanncError(f"custom op {self.label()} is elementwise for some input types "
                             "and index-based for others: register two ops")

    def _trace_lower(self, n: Node, types: list[TensorType]) -> te.Program:
        return self.trace(self.version(n), types, lower=True)

    def _expr(self, E: Any, n: Any, xs: Any) -> list[Any]:
        ver = self.versions.get(n.opset) if isinstance(n, Node) else None
        if ver is None:
            ver = self.versions.get(getattr(n, "opset", 0)) or max(
                self.versions.items())[1]
        types = [t for t in n.in_types if t is not None]
        prog = self.trace(ver, types, lower=False)
        return A.eval_map(prog, E, [x for x in xs if x is not None])

    def _infer(self, n: Node, in_types: list[TensorType | None]) -> list[TensorType]:
        ver = self.version(n)
        types = [t for t in in_types if t is not None]
        if ver.infer is not None:
            out = ver.infer(*types)
            out = list(out) if isinstance(out, (list, tuple)) else [out]
            return [o if isinstance(o, TensorType) else TensorType(np.dtype(o[1]), tuple(o[0]))
                    for o in out]
        prog = self.trace(ver, types, lower=False)
        concrete = all(isinstance(d, int) for t in types for d in t.shape)
        if concrete and not prog.elementwise:
            A.check_bounds(prog, [tuple(t.shape) for t in types], self.label())
        res = []
        for k, o in enumerate(prog.outputs):
            shape = []
            for a, d in enumerate(o.shape):
                if isinstance(d, int):
                    shape.append(d)
                elif d.op == "dim" and isinstance(d.attr[2], str):
                    shape.append(d.attr[2])
                else:
                    v = A.interval(d, lambda i, ax: types[i].shape[ax]) if concrete else None
                    shape.append(v[0] if v is not None and v[0] == v[1]
                                 else f"{self.name}_{k}_{a}")
            res.append(TensorType(o.dtype, tuple(shape)))
        return res


def _user_line(fn: Callable[..., Any], exc: BaseException) -> str:
    """'at file:line (source)' of the deepest frame of the user's body file."""
    fname = fn.__code__.co_filename
    best = None
    for fr in traceback.extract_tb(exc.__traceback__):
        if fr.filename == fname:
            best = fr
    if best is None:
        return f"(defined at {_where(fn)})"
    src = (best.line or linecache.getline(best.filename, best.lineno)).strip()
    return f"at {best.filename}:{best.lineno} ({src})"


def custom_op(name: str, domain: str = DEFAULT_DOMAIN, version: int = 1,
              infer: Callable[..., Any] | None = None) -> Callable[[Callable[..., Any]], Any]:
    """Register op `name` of `domain` (its `version`) from a Python function over
    cannc.te tensors. `infer(*input_types) -> output types` overrides the output
    types the traced expression gives. The decorated function runs eagerly on NumPy
    arrays (compiled through cannc.compile, cached per shapes and dtypes), and inline
    on te tensors (a custom op used inside another's body)."""
    if not isinstance(name, str) or not name:
        raise CanncError("custom_op needs an op name")
    if domain in ("", "ai.onnx"):
        raise CanncError(f"custom op {name}: give it a domain of its own (domain='com.example'); "
                         "the ONNX domain holds ONNX's ops")
    if not isinstance(version, int) or version < 1:
        raise CanncError(f"custom op {domain}::{name}: version must be an int >= 1")

    def deco(fn: Callable[..., Any]) -> Any:
        with _lock:
            key = (domain, name)
            op = _OPS.get(key)
            if op is None:
                existing = lookup(name, domain)
                if existing is not None:
                    raise CanncError(f"custom op {domain}::{name}: cannc already defines "
                                     "an op of that name and domain")
                op = _CustomOp(name, domain)
                _OPS[key] = op
            new = _Version(fn, infer)
            old = op.versions.get(version)
            if old is not None and old.digest != new.digest:
                raise CanncError(f"custom op {domain}::{name} version {version} is registered "
                                 f"twice with different bodies (first {_where(old.fn)}, then "
                                 f"{_where(fn)})")
            if old is None:
                op.versions[version] = new
                op.opdef.revision = hashlib.sha256("".join(
                    f"{k}:{v.digest};" for k, v in sorted(op.versions.items())).encode()
                ).hexdigest()[:16]
        return _Eager(op, version, fn)

    return deco


class _Eager:
    """The decorated function: eager on NumPy arrays, inline on te tensors."""

    def __init__(self, op: _CustomOp, version: int, fn: Callable[..., Any]) -> None:
        self.op, self.version, self.fn = op, version, fn
        self.sessions: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    @property
    def op_name(self) -> str:
        return self.op.name

    @property
    def domain(self) -> str:
        return self.op.domain

    def __call__(self, *args: Any) -> Any:
        if any(isinstance(a, (te.Tensor, te.Expr)) for a in args):
            return self.fn(*args)
        arrs = [np.asarray(a) for a in args]
        key = tuple((a.dtype.str, a.shape) for a in arrs)
        sess = self.sessions.get(key)
        if sess is None:
            with self._lock:
                sess = self.sessions.get(key)
                if sess is None:
                    sess = self._compile(arrs)
                    self.sessions[key] = sess
        names = sess._te_inputs
        outs = sess.run(None, dict(zip(names, arrs)))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _compile(self, arrs: list[np.ndarray]) -> Any:
        import onnx
        from onnx import helper

        from .ir.types import NP_TO_ONNX
        from .session import Session

        ver = self.op.versions[self.version]
        names = [ver.params[i] if i < len(ver.params) else f"input{i}" for i in range(len(arrs))]
        types = [TensorType(a.dtype, tuple(a.shape)) for a in arrs]
        n = Node(name=self.op.name, op_type=self.op.name, inputs=tuple(names), outputs=(),
                 domain=self.op.domain, opset=self.version)
        outs = self.op._infer(n, types)
        onames = [f"out{k}" for k in range(len(outs))]

        def vi(nm: str, t: TensorType) -> Any:
            return helper.make_tensor_value_info(nm, NP_TO_ONNX[np.dtype(t.dtype)],
                                                 list(t.shape))

        node = helper.make_node(self.op.name, names, onames, domain=self.op.domain)
        g = helper.make_graph([node], f"eager_{self.op.name}",
                              [vi(nm, t) for nm, t in zip(names, types)],
                              [vi(nm, t) for nm, t in zip(onames, outs)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid(self.op.domain,
                                                                    self.version)])
        m.ir_version = min(m.ir_version, onnx.IR_VERSION)
        sess = Session(m)
        sess._te_inputs = names
        return sess


def registered_custom_ops() -> list[tuple[str, str, list[int]]]:
    return [(d, n, sorted(op.versions)) for (d, n), op in sorted(_OPS.items())]


def load_ops_file(path: str) -> None:
    """Import a user's registrations (``cannc check/compile --ops my_ops.py``)."""
    import importlib.util
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise CanncError(f"--ops {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"cannc_user_ops_{p.stem}", p)
    if spec is None or spec.loader is None:
        raise CanncError(f"--ops {path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    except CanncError:
        raise
    except Exception as e:
        raise CanncError(f"--ops {path}: importing it failed: {type(e).__name__}: {e}") from e
