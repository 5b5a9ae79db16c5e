"""Eager calls: one op on NumPy arrays, compiled once per signature, then launched directly.

The first call at a (op, attributes, input dtypes and shapes, constant inputs, precision,
output dtype) combination builds a one-node ONNX graph and compiles it through the normal
pipeline (`cannc.session.Session`: frontend, passes, codegen); the compiled program is
kept in an in-memory cache, and later calls with the same signature run its kernels
directly on the caller's buffers (cannc/ops/_fast.py).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CanncError, InputError, ShapeError, UnsupportedOpError
from ..ir.graph import Node
from ..ir.ops import lookup
from ..ir.registry import Amp, amp_class
from ..ir.types import TensorType, onnx_type_string
from ..passes.precision import narrow_dtype
from ..session import Session
from ._fast import FastLaunch
from ._policy import current_precision, precision_name

if TYPE_CHECKING:
    import onnx

DEFAULT_OPSET = 21
# compiled signatures kept (the oldest compiled is dropped beyond this)
MAX_ENTRIES = 512

_FLOATS = frozenset(["float32", "float64", "float16", "bfloat16"])


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def _dtype(d: Any, what: str, op: str) -> np.dtype:
    if isinstance(d, str) and d.lower() in ("bf16", "bfloat16"):
        return narrow_dtype("bf16")
    if isinstance(d, str) and d.lower() in ("fp16", "half"):
        return np.dtype(np.float16)
    if isinstance(d, str) and d.lower() == "fp32":
        return np.dtype(np.float32)
    try:
        return np.dtype(d)
    except TypeError as e:
        raise CanncError(f"cannc.ops.{op}: {what} {d!r} is not a dtype") from e


def _freeze(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    return v


class _Entry:
    """One compiled signature: its session, and the fast launch when it has one."""

    __slots__ = ("session", "fast", "single", "names")

    def __init__(self, session: Session, fast: FastLaunch | None) -> None:
        self.session = session
        self.fast = fast
        self.single = len(session.graph.outputs) == 1
        self.names = list(session.graph.inputs)

    def run(self, arrays: list[np.ndarray]) -> Any:
        if self.fast is not None:
            outs = self.fast(arrays)
        else:
            outs = self.session.run(None, dict(zip(self.names, arrays)))
        return outs[0] if self.single else tuple(outs)


_CACHE: OrderedDict[tuple, _Entry] = OrderedDict()
_LOCK = threading.Lock()
_KEY_LOCKS: dict[tuple, threading.Lock] = {}
_STATS = {"hits": 0, "compiles": 0}
_VALUE_INPUTS: dict[tuple[str, str], tuple[int, ...]] = {}


def _arg(arg_names: tuple[str, ...] | None, i: int) -> str:
    return arg_names[i] if arg_names and i < len(arg_names) else f"input {i}"


def _value_inputs(op: str, domain: str) -> tuple[int, ...]:
    vi = _VALUE_INPUTS.get((op, domain))
    if vi is None:
        d = lookup(op, domain)
        vi = _VALUE_INPUTS[(op, domain)] = tuple(d.value_inputs) if d is not None else ()
    return vi


def invoke(op: str, domain: str, inputs: tuple, attrs: dict[str, Any], *,
           output_dtype: Any = None, precision: str | None = None,
           num_results: int | None = None, name: str | None = None,
           arg_names: tuple[str, ...] | None = None) -> Any:
    """Run `op` eagerly (the engine behind every cannc.ops function)."""
    p = current_precision() if precision is None else precision
    vi = _value_inputs(op, domain)
    arrays = []
    sig: list[Any] = []
    converted = None
    for i, x in enumerate(inputs):
        if type(x) is np.ndarray and i not in vi:
            arrays.append(x)
            sig.append((x.dtype, x.shape))
        elif x is None:
            sig.append(None)
        elif i in vi or isinstance(x, (bool, int, float, complex, np.generic)):
            # a compile-time constant: a value-deciding input, or a Python/NumPy number
            sig.append(("const", _freeze(np.asarray(x)), type(x).__name__))
        else:
            # another array-like (a list, an ndarray subclass...): a runtime input
            try:
                a = np.asarray(x)
            except Exception as e:
                raise InputError(f"cannc.ops.{name or _snake(op)}: input {i} is not "
                                 f"array-like: {type(e).__name__}: {e}") from e
            if a.dtype == object or a.dtype.kind in "USV":
                raise InputError(f"cannc.ops.{name or _snake(op)}: argument "
                                 f"'{_arg(arg_names, i)}' is not an array or a number: "
                                 f"{x!r:.80}")
            if converted is None:
                converted = list(inputs)
            converted[i] = a
            arrays.append(a)
            sig.append((a.dtype, a.shape))
    if converted is not None:
        inputs = tuple(converted)
    if attrs:
        akey: Any = tuple(sorted(attrs.items()))
        try:
            hash(akey)
        except TypeError:
            akey = _freeze(attrs)
    else:
        akey = ()
    key = (op, domain, akey, tuple(sig), p, output_dtype, num_results)
    try:
        entry = _CACHE.get(key)
    except TypeError as e:      # an unhashable output_dtype, ...
        raise CanncError(f"cannc.ops.{name or _snake(op)}: {e}") from e
    if entry is None:
        entry = _compile(key, op, domain, inputs, attrs, output_dtype, p, num_results,
                         name or _snake(op), arg_names)
    else:
        _STATS["hits"] += 1
    return entry.run(arrays)


def _compile(key: tuple, op: str, domain: str, inputs: tuple, attrs: dict[str, Any],
             output_dtype: Any, precision: str, num_results: int | None, name: str,
             arg_names: tuple[str, ...] | None) -> _Entry:
    with _LOCK:
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with lock:                  # one compile per signature, however many threads ask
        entry = _CACHE.get(key)
        if entry is not None:
            return entry
        model = build_model(op, domain, inputs, attrs, output_dtype, precision, num_results,
                            name, arg_names)
        try:
            sess = Session(model, precision=precision)
        except CanncError as e:
            raise _rethrow(e, name) from e
        progs = list(sess.programs.values())
        fast = FastLaunch.build(progs[0]) if len(progs) == 1 else None
        entry = _Entry(sess, fast)
        with _LOCK:
            _CACHE[key] = entry
            _STATS["compiles"] += 1
            while len(_CACHE) > MAX_ENTRIES:
                old, _ = _CACHE.popitem(last=False)
                _KEY_LOCKS.pop(old, None)
        return entry


def _rethrow(e: CanncError, name: str) -> CanncError:
    if isinstance(e, UnsupportedOpError) or str(e).startswith("cannc.ops."):
        return e                # (names the node, which is named after the op)
    try:
        return type(e)(f"cannc.ops.{name}: {e}")
    except TypeError:           # an error class with its own constructor
        return CanncError(f"cannc.ops.{name}: {e}")


# -- the one-node graph ------------------------------------------------------------------
def _schema(op: str, opset: int, domain: str) -> Any:
    import onnx  # here, not at the top: `import cannc` should not pay for onnx (ml_dtypes)

    try:
        return onnx.defs.get_schema(op, opset, domain)
    except Exception:
        return None


def _opset_for(op: str, domain: str) -> int:
    d = lookup(op, domain)
    if domain:
        return max(1, d.min_opset if d is not None else 1)
    return max(DEFAULT_OPSET, d.min_opset if d is not None else 1)


def _describe(arg_names: list[str], types: list[Any]) -> str:
    parts = []
    for n, t in zip(arg_names, types):
        if t is None:
            continue
        parts.append(f"{n}: {np.dtype(t[0]).name}{list(t[1])}")
    return ", ".join(parts)


def build_model(op: str, domain: str, inputs: tuple, attrs: dict[str, Any], output_dtype: Any,
                precision: str, num_results: int | None, name: str,
                arg_names: tuple[str, ...] | None) -> onnx.ModelProto:
    """The one-node graph of an eager call, checked: a wrong dtype, shape, attribute or
    argument count is a cannc error naming the op and the argument."""
    import onnx
    from onnx import helper

    try:
        precision = precision_name(precision)
    except CanncError as e:
        raise CanncError(f"cannc.ops.{name}: {e}") from e
    opset = _opset_for(op, domain)
    opdef = lookup(op, domain)
    schema = _schema(op, opset, domain)
    if opdef is None and schema is None:
        raise CanncError(f"cannc.ops.{name}: no op {domain + '::' if domain else ''}{op} is "
                         "registered (a custom op is registered with @cannc.custom_op)")
    names = list(arg_names or ())
    if schema is not None:
        formal = [f.name for f in schema.inputs]
        for i in range(len(names), len(inputs)):
            names.append(formal[min(i, len(formal) - 1)] if formal else f"input {i}")
    else:
        names += [f"input {i}" for i in range(len(names), len(inputs))]
    names = [n if n not in names[:i] else f"{n}{i}" for i, n in enumerate(names)]

    # attributes: snake_case names of the ONNX ones
    onnx_attrs: dict[str, Any] = {}
    if schema is not None:
        known = {_snake(a): a for a in schema.attributes}
        known.update({a: a for a in schema.attributes})
        bad = [k for k in attrs if k not in known]
        if bad:
            listing = ", ".join(sorted({_snake(a) for a in schema.attributes}))
            takes = f"{name} takes: {listing}" if listing else f"{name} takes no attributes"
            raise CanncError(f"cannc.ops.{name}: unknown attribute{'s' if len(bad) > 1 else ''}"
                             f" {', '.join(map(repr, bad))}; {takes}")
        for k, v in attrs.items():
            onnx_attrs[known[k]] = v
        if len(inputs) > len(schema.inputs) and not (
                schema.inputs and schema.inputs[-1].option == schema.inputs[-1].option.Variadic):
            raise InputError(f"cannc.ops.{name} takes at most {len(schema.inputs)} inputs "
                             f"({', '.join(formal)}), got {len(inputs)}")
        need = sum(1 for f in schema.inputs if f.option == f.option.Single)
        if len(inputs) < need:
            missing = [f.name for f in schema.inputs[len(inputs):]
                       if f.option == f.option.Single]
            raise InputError(f"cannc.ops.{name}: missing input{'s' if len(missing) > 1 else ''}"
                             f" {', '.join(missing)}")
    else:
        onnx_attrs = dict(attrs)
    for k, v in list(onnx_attrs.items()):
        if isinstance(v, (np.dtype, type)) and k == "to":
            onnx_attrs[k] = helper.np_dtype_to_tensor_dtype(np.dtype(v))
        elif isinstance(v, str) and k == "to":
            onnx_attrs[k] = helper.np_dtype_to_tensor_dtype(_dtype(v, "to", name))
        elif isinstance(v, tuple):
            onnx_attrs[k] = list(v)

    # inputs: arrays are graph inputs, the rest constants
    vi = _value_inputs(op, domain)
    # a Python number takes the dtype of the first array (or NumPy scalar) among the inputs
    ref = next((x.dtype for i, x in enumerate(inputs) if isinstance(x, (np.ndarray, np.generic))
                and i not in vi and x.dtype != np.bool_), None)
    nodes: list[onnx.NodeProto] = []
    g_inputs, inits, node_ins = [], [], []
    op_types: list[Any] = []    # (dtype, shape) of each op input, None when absent
    amp = precision != "fp32"
    narrow = narrow_dtype(precision) if amp else None
    runtime_float, runtime_narrow = 0, 0
    for i, x in enumerate(inputs):
        arg = names[i]
        if x is None:
            node_ins.append("")
            op_types.append(None)
            continue
        if isinstance(x, np.ndarray) and i not in vi:
            a = x
            if not a.dtype.isnative:
                raise InputError(f"cannc.ops.{name}: argument '{arg}' has non-native byte "
                                 f"order ({a.dtype.str}); convert it with "
                                 "a.astype(a.dtype.newbyteorder('='))")
            try:
                elem = helper.np_dtype_to_tensor_dtype(a.dtype)
            except Exception as e:
                raise InputError(f"cannc.ops.{name}: argument '{arg}' has dtype {a.dtype}, "
                                 "which has no ONNX type") from e
            v = f"x{i}"
            g_inputs.append(helper.make_tensor_value_info(v, elem, list(a.shape)))
            dt = a.dtype
            if a.dtype.name in _FLOATS:
                runtime_float += 1
                if amp and a.dtype.name in ("bfloat16", "float16"):
                    runtime_narrow += 1
                    # the op is ONNX-typed float32; the policy decides what it computes in
                    w = f"x{i}::f32"
                    nodes.append(helper.make_node("Cast", [v], [w], to=onnx.TensorProto.FLOAT,
                                                  name=f"widen_{i}"))
                    v, dt = w, np.dtype(np.float32)
            node_ins.append(v)
            op_types.append((dt, tuple(a.shape)))
            continue
        try:
            if isinstance(x, np.ndarray):
                c = x
            elif i in vi:
                c = np.asarray(x)
                if c.dtype.kind in "iu":
                    c = c.astype(np.int64)
            else:
                c = np.asarray(x)
                if c.dtype == object or c.dtype.kind in "US":
                    raise ValueError("not numeric")
                if isinstance(x, np.generic):
                    pass
                elif ref is not None and c.dtype.kind in "biuf":
                    c = c.astype(np.float32 if amp and ref.name in ("bfloat16", "float16")
                                 else ref)
                elif c.dtype == np.float64:
                    c = c.astype(np.float32)    # a bare Python float: float32, like ONNX
        except (ValueError, TypeError) as e:
            raise InputError(f"cannc.ops.{name}: argument '{arg}' is not an array or a "
                             f"number: {x!r}") from e
        v = f"c{i}"
        try:
            inits.append(onnx.numpy_helper.from_array(c, v))
        except Exception as e:
            raise InputError(f"cannc.ops.{name}: argument '{arg}' ({c.dtype}) cannot be a "
                             f"constant: {e}") from e
        node_ins.append(v)
        op_types.append((c.dtype, tuple(c.shape)))
    while node_ins and node_ins[-1] == "":
        node_ins.pop()

    if schema is not None:
        _check_types(schema, name, names, op_types)

    # outputs: how many, their types
    n_out = num_results
    if n_out is None and schema is not None:
        if schema.outputs and schema.outputs[-1].option == schema.outputs[-1].option.Variadic:
            n_out = int(onnx_attrs.get("num_outputs", 0)) or None
            if n_out is None and len(node_ins) > 1 and node_ins[1].startswith("c"):
                n_out = len(inits[[t.name for t in inits].index(node_ins[1])].int64_data or
                            onnx.numpy_helper.to_array(inits[[t.name for t in inits]
                                                              .index(node_ins[1])]))
            if n_out is None:
                raise CanncError(f"cannc.ops.{name}: say how many outputs with "
                                 "num_results= (or the op's num_outputs / split)")
        else:
            n_out = sum(1 for f in schema.outputs if f.option == f.option.Single) or 1
    op_outs = [f"y{k}" for k in range(n_out)] if n_out is not None else None
    node = helper.make_node(op, node_ins, op_outs or ["y0"], domain=domain or None, name=name,
                            **onnx_attrs)
    out_types = _infer_outputs(op, domain, opset, node, g_inputs, inits, nodes, name, names,
                               op_types, opdef)
    if op_outs is None:
        node = helper.make_node(op, node_ins, [f"y{k}" for k in range(len(out_types))],
                                domain=domain or None, name=name, **onnx_attrs)
    nodes.append(node)

    # what the caller gets: output_dtype, else the policy's dtype
    want = None
    if output_dtype is not None:
        want = _dtype(output_dtype, "output_dtype", name)
    elif amp and opdef is not None:
        cls = amp_class(opdef)
        if cls is Amp.ALLOW or (cls is Amp.FOLLOW and runtime_float
                                and runtime_narrow == runtime_float):
            want = narrow
    g_outputs = []
    for k, (dt, shape) in enumerate(out_types):
        y = f"y{k}"
        target = dt
        if want is not None and (output_dtype is not None or np.dtype(dt).name in _FLOATS):
            target = want
        if target != dt:
            nodes.append(helper.make_node("Cast", [y], [f"out{k}"], name=f"result_{k}",
                                          to=helper.np_dtype_to_tensor_dtype(target)))
            y = f"out{k}"
        g_outputs.append(helper.make_tensor_value_info(y, helper.np_dtype_to_tensor_dtype(
            np.dtype(target)), list(shape)))
    opsets = [helper.make_opsetid("", DEFAULT_OPSET if domain else opset)]
    if domain:
        opsets.append(helper.make_opsetid(domain, opset))
    m = helper.make_model(helper.make_graph(nodes, f"eager_{name}", g_inputs, g_outputs,
                                            initializer=inits), opset_imports=opsets)
    m.ir_version = min(m.ir_version, 10)
    return m


def _check_types(schema: Any, name: str, names: list[str], op_types: list[Any]) -> None:
    """The schema's type constraints, per argument: an unsupported dtype, or two arguments
    that must share a dtype and do not, named."""
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    first: dict[str, tuple[str, np.dtype]] = {}
    for i, t in enumerate(op_types):
        if t is None:
            continue
        f = schema.inputs[min(i, len(schema.inputs) - 1)]
        ts = onnx_type_string(np.dtype(t[0]))
        if f.type_str in allowed and ts not in allowed[f.type_str]:
            ok = sorted(s[7:-1] for s in allowed[f.type_str])
            raise InputError(f"cannc.ops.{name}: argument '{names[i]}' has dtype "
                             f"{np.dtype(t[0]).name}; {name} takes {', '.join(ok)}")
        if f.type_str in allowed:
            prev = first.setdefault(f.type_str, (names[i], np.dtype(t[0])))
            if prev[1] != np.dtype(t[0]):
                raise InputError(f"cannc.ops.{name}: arguments '{prev[0]}' ({prev[1].name}) "
                                 f"and '{names[i]}' ({np.dtype(t[0]).name}) must have the "
                                 "same dtype")


def _infer_outputs(op: str, domain: str, opset: int, node: onnx.NodeProto, g_inputs: list,
                   inits: list, pre: list, name: str, names: list[str], op_types: list,
                   opdef: Any) -> list[tuple[np.dtype, tuple[int, ...]]]:
    """The op's output dtypes and shapes: ONNX's inference, else the registry's."""
    import onnx
    from onnx import helper

    desc = _describe(names, op_types)
    if domain == "" or _schema(op, opset, domain) is not None:
        outs = [onnx.ValueInfoProto(name=o) for o in node.output]
        opsets = [helper.make_opsetid("", opset if not domain else DEFAULT_OPSET)]
        if domain:
            opsets.append(helper.make_opsetid(domain, opset))
        m = helper.make_model(helper.make_graph(pre + [node], "infer", g_inputs, outs,
                                                initializer=inits), opset_imports=opsets)
        try:
            inf = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
        except Exception as e:
            msg = " ".join(str(e).split())
            msg = re.sub(r"^\[[A-Za-z]+\]\s*", "", msg)
            raise ShapeError(f"cannc.ops.{name}({desc}): {msg}") from e
        got = {vi.name: vi for vi in inf.graph.output}
        res = []
        for o in node.output:
            vi = got.get(o)
            tt = vi.type.tensor_type if vi is not None else None
            if tt is None or not tt.elem_type or not tt.HasField("shape") or any(
                    not d.HasField("dim_value") for d in tt.shape.dim):
                break
            res.append((np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)),
                        tuple(int(d.dim_value) for d in tt.shape.dim)))
        else:
            return res
    if opdef is None or opdef.infer is None:
        raise ShapeError(f"cannc.ops.{name}({desc}): cannot infer the output shapes")
    n = Node(name=name, op_type=op, inputs=tuple(node.input), outputs=tuple(node.output),
             attrs={a.name: helper.get_attribute_value(a) for a in node.attribute},
             domain=domain, opset=opset)
    ins = [TensorType(np.dtype(t[0]), tuple(t[1])) if t is not None else None
           for t in op_types]
    try:
        types = opdef.infer(n, ins)
    except CanncError as e:
        raise _rethrow(e, name) from e
    except Exception as e:
        raise ShapeError(f"cannc.ops.{name}({desc}): {type(e).__name__}: {e}") from e
    return [(np.dtype(t.dtype), tuple(int(d) for d in t.shape)) for t in types]


# -- cache inspection ----------------------------------------------------------------------
def cache_info() -> dict[str, int]:
    """Compiled signatures in the eager cache, calls that hit it, and compiles so far."""
    with _LOCK:
        return {"entries": len(_CACHE), "hits": _STATS["hits"],
                "compiles": _STATS["compiles"], "max_entries": MAX_ENTRIES}


def clear_cache() -> None:
    """Drop every compiled eager op (the next call of each compiles again; the on-disk
    object cache still makes that fast)."""
    with _LOCK:
        _CACHE.clear()
        _KEY_LOCKS.clear()
        _STATS["hits"] = _STATS["compiles"] = 0
