"""ONNX ModelProto -> ir.Graph, with every check that can be made up front."""

from __future__ import annotations

import mmap
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..config import MAX_RANK, check_size
from ..errors import CanncError, ModelError, ShapeError, UnsupportedOpError
from ..ir.graph import Graph, Node
from ..ir.ops import lookup
from ..ir.types import Dim, TensorType, np_dtype
from . import wire

MIN_OPSET = 7


def load_model_proto(model: Any) -> tuple[onnx.ModelProto, str | None]:
    """Accept a path, bytes or ModelProto; external data is loaded."""
    base_dir = None
    try:
        if isinstance(model, onnx.ModelProto):
            proto = model
        elif isinstance(model, (bytes, bytearray, memoryview)):
            proto = onnx.load_from_string(bytes(model))
        elif isinstance(model, (str, os.PathLike)):
            path = Path(model)
            if not path.exists():
                raise ModelError(f"model file not found: {path}")
            base_dir = str(path.parent)
            proto = onnx.load(str(path), load_external_data=False)
            if _uses_external_data(proto):
                from onnx.external_data_helper import load_external_data_for_model
                load_external_data_for_model(proto, base_dir)
        else:
            raise ModelError("expected a path, bytes or onnx.ModelProto, "
                             f"got {type(model).__name__}")
    except ModelError:
        raise
    except Exception as e:  # protobuf DecodeError, OSError, ...
        raise ModelError(f"cannot read the model: {type(e).__name__}: {e}") from e
    return proto, base_dir


# A model file at least this large has its weights viewed in the file's bytes rather
# than parsed out of them (wire.strip_raw_data): they are then copied once, by the read,
# instead of three times (read, parse, to_array)
LAZY_MIN_FILE = 32 << 20

# element types whose raw_data is the array's bytes as numpy lays them out
_PLAIN = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.INT16: np.int16,
    onnx.TensorProto.UINT16: np.uint16, onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.UINT32: np.uint32, onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.UINT64: np.uint64,
}


@dataclass
class LoadedModel:
    """A model read for import: its ModelProto and, for a large model file, the values
    of its big initializers, viewed in the file's bytes (`weights`, by initializer
    index), whose raw_data the proto then lacks. `complete()` is the whole model."""

    proto: onnx.ModelProto
    base_dir: str | None = None
    weights: dict[int, np.ndarray] = field(default_factory=dict)

    def complete(self) -> onnx.ModelProto:
        """The ModelProto with every initializer's data (a copy when any was viewed)."""
        if not self.weights:
            return self.proto
        full = onnx.ModelProto()
        full.CopyFrom(self.proto)
        for i, a in self.weights.items():
            full.graph.initializer[i].raw_data = a.tobytes()
        return full


def load_model(model: Any) -> LoadedModel:
    """`load_model_proto`, with a large model file's weights viewed, not parsed."""
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, (str, os.PathLike)) and sys.byteorder == "little":
        try:
            lazy = _load_viewed(Path(model))
        except Exception:       # not a model this reader takes: the usual path reports it
            lazy = None
        if lazy is not None:
            return lazy
    proto, base_dir = load_model_proto(model)
    return LoadedModel(proto, base_dir)


def _load_viewed(path: Path) -> LoadedModel | None:
    size = path.stat().st_size
    if size < LAZY_MIN_FILE:
        return None
    buf = _read_buffer(size)
    with open(path, "rb") as f:
        view, got = memoryview(buf), 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                return None                 # (the file shrank meanwhile)
            got += n
    reduced, spans = wire.strip_raw_data(buf, EXACT_CHECK_BYTES + 1)
    if sum(e - s for s, e in spans.values()) < SKELETON_BYTES:
        return None     # the checker must not see a weight without its data (skeleton)
    proto = onnx.ModelProto()
    proto.ParseFromString(reduced)
    inits = proto.graph.initializer
    weights: dict[int, np.ndarray] = {}
    for i, (s, e) in spans.items():
        t = inits[i]
        dt = _PLAIN.get(t.data_type)
        n = 1
        for d in t.dims:
            n *= int(d)
        if dt is None or t.data_location == _T.EXTERNAL or \
                n * np.dtype(dt).itemsize != e - s or min(t.dims, default=1) < 0:
            t.raw_data = bytes(buf[s:e])    # as parsed: the usual checks report it
            continue
        weights[i] = buf[s:e].view(dt).reshape(tuple(int(d) for d in t.dims))
    if _uses_external_data(proto):
        from onnx.external_data_helper import load_external_data_for_model
        load_external_data_for_model(proto, str(path.parent))
    return LoadedModel(proto, str(path.parent), weights)


# madvise(2)'s MADV_POPULATE_WRITE (Linux 5.14; Python names it from 3.13 only)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _read_buffer(size: int) -> np.ndarray:
    """Memory for a model file's bytes, on small pages. The weights are read from it once
    (packed or copied into device memory), and a first touch of huge pages, which numpy
    advises from 4 MiB on, can cost several times more: on the Sapphire Rapids guest
    measured, BERT-base's 435 MB took 0.3-1.7 s to read into numpy's memory, 0.2-0.4 s
    into this (the kernel compacts memory to find huge pages on a fault).

    On Linux the pages are made in one call (MADV_POPULATE_WRITE) before the read, not
    one fault at a time as it writes them: BERT-base's 418 MB on the Zen 4 guest, mapped
    and read, 0.22-0.45 s -> 0.16-0.18 s. (A kernel older than 5.14 refuses the advice:
    the read faults the pages in as before.)"""
    try:
        m = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:                 # (address space or map count): numpy's memory
        return np.empty(size, np.uint8)
    try:
        m.madvise(mmap.MADV_NOHUGEPAGE)
    except (AttributeError, OSError):       # a kernel without transparent huge pages
        pass
    if sys.platform == "linux":
        try:
            m.madvise(_MADV_POPULATE_WRITE)
        except OSError:                     # (older kernel: EINVAL; no memory: ENOMEM)
            pass
    return np.frombuffer(m, np.uint8)[:size]


def _uses_external_data(proto: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)


def check_model(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The ONNX checker plus shape inference; returns the model with inferred value_info."""
    if not proto.graph.node and not proto.graph.output:
        raise ModelError("the model has an empty graph")
    opset = opset_of(proto)
    if opset < MIN_OPSET:
        raise ModelError(f"opset {opset} is older than the oldest supported ({MIN_OPSET}); "
                         "convert it with onnx.version_converter")
    check_graph_declarations(proto.graph)
    proto = skeleton(proto)
    try:
        onnx.checker.check_model(_outputs_shaped(proto))
    except onnx.checker.ValidationError as e:
        msg = str(e).strip().splitlines()
        if "deprecated" in str(e).lower():
            # e.g. GroupNormalization-18: deprecated, but real exporters still emit it
            warnings.warn(f"ONNX checker: {' '.join(msg[:2])}", stacklevel=3)
            return _infer(proto)
        raise ModelError("the model fails the ONNX checker: " + " ".join(msg[:6])) from e
    except ValueError as e:  # > 2 GiB models: check what we can
        if "2GB" not in str(e) and "2 GB" not in str(e):
            raise ModelError(f"the model fails the ONNX checker: {e}") from e
    return _infer(proto)


SKELETON_BYTES = 16 << 20


def _outputs_shaped(proto: onnx.ModelProto) -> onnx.ModelProto:
    """What the checker is shown: graph outputs declared as tensors of unknown rank (a
    type without a shape, which exporters write and onnxruntime runs) get an empty shape
    in a copy, since the checker requires the field; their real shapes come from
    inference, which sees the model as it is."""
    bare = [i for i, o in enumerate(proto.graph.output)
            if o.type.HasField("tensor_type") and not o.type.tensor_type.HasField("shape")]
    if not bare:
        return proto
    shown = onnx.ModelProto()
    shown.CopyFrom(proto)
    for i in bare:
        shown.graph.output[i].type.tensor_type.shape.SetInParent()
    return shown


# element type -> (bytes per element in raw_data, values per element in the typed field)
_T = onnx.TensorProto
_DATA_LAYOUT = {
    _T.FLOAT: (4, 1), _T.DOUBLE: (8, 1), _T.FLOAT16: (2, 1), _T.BFLOAT16: (2, 1),
    _T.INT8: (1, 1), _T.UINT8: (1, 1), _T.INT16: (2, 1), _T.UINT16: (2, 1),
    _T.INT32: (4, 1), _T.UINT32: (4, 1), _T.INT64: (8, 1), _T.UINT64: (8, 1),
    _T.BOOL: (1, 1), _T.COMPLEX64: (8, 2), _T.COMPLEX128: (16, 2),
    _T.FLOAT8E4M3FN: (1, 1), _T.FLOAT8E4M3FNUZ: (1, 1), _T.FLOAT8E5M2: (1, 1),
    _T.FLOAT8E5M2FNUZ: (1, 1),
}
EXACT_CHECK_BYTES = 1 << 20   # tensors declared up to this size have their data counted


def check_tensor(t: onnx.TensorProto, what: str) -> None:
    """A tensor's declared dims against the size guard and, for small tensors (the ones
    whose values ONNX's shape inference reads: shapes, axes, repeats), against the data
    it holds, before the checker or inference see it (onnxruntime refuses such a tensor
    too). Big tensors are not counted here (that would copy every weight): reading them
    checks them."""
    if t.data_location == _T.EXTERNAL or t.data_type == _T.STRING:
        return
    dims = list(t.dims)
    layout = _DATA_LAYOUT.get(t.data_type)
    n = check_size(what, dims, layout[0] if layout else 1)
    if layout is None or n * layout[0] > EXACT_CHECK_BYTES:
        return
    if t.HasField("raw_data"):
        have, want, unit = len(t.raw_data), n * layout[0], "bytes"
    else:
        field = helper.tensor_dtype_to_field(t.data_type)
        have, want, unit = len(getattr(t, field)), n * layout[1], f"values in {field}"
    if have != want:
        raise ModelError(f"{what} declares dims {dims} ({n} elements of "
                         f"{_T.DataType.Name(t.data_type)}: {want} {unit}) but holds "
                         f"{have} {unit}")


def _declared_numel(vi_or_t: Any) -> int | None:
    """The element count a value is declared with (None: not fully known)."""
    if isinstance(vi_or_t, onnx.TensorProto):
        dims = list(vi_or_t.dims)
    else:
        tt = vi_or_t.type.tensor_type
        if not vi_or_t.type.HasField("tensor_type") or not tt.HasField("shape"):
            return None
        if not all(d.HasField("dim_value") for d in tt.shape.dim):
            return None
        dims = [d.dim_value for d in tt.shape.dim]
    n = 1
    for d in dims:
        n *= int(d)
    return n


def check_graph_declarations(g: onnx.GraphProto, where: str = "") -> None:
    """What must hold before the ONNX checker and shape inference see a graph (and its
    subgraphs):

    - every initializer and tensor attribute passes `check_tensor`;
    - an input whose values decide an output's shape (the op's `value_inputs`: a shape,
      axes, pads, repeats, sizes, scales) holds at most two values per dimension of the
      highest rank, or one per output (Split), as declared: ONNX's inference makes an
      Expand/Reshape/ConstantOfShape output of rank = that length, and a shape
      initializer declared with 2^31 values made it build a rank-2^31 shape for minutes.
      A ShapeError naming the value and the node, in microseconds."""
    declared: dict[str, Any] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        declared.setdefault(vi.name, vi)
    for t in g.initializer:
        check_tensor(t, f"initializer '{t.name}'{where}")
        declared[t.name] = t
    for i, n in enumerate(g.node):
        name = n.name or f"{n.op_type}_{i}"
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                check_tensor(a.t, f"tensor attribute '{a.name}' of node '{name}'{where}")
                if n.op_type == "Constant" and not n.domain and n.output:
                    declared[n.output[0]] = a.t
            elif a.type == onnx.AttributeProto.TENSORS:
                for t in a.tensors:
                    check_tensor(t, f"tensor attribute '{a.name}' of node '{name}'{where}")
            elif a.type == onnx.AttributeProto.GRAPH:
                check_graph_declarations(a.g, f" (in subgraph '{a.name}' of node '{name}')")
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sg in a.graphs:
                    check_graph_declarations(sg, f" (in subgraph '{a.name}' of node '{name}')")
    for i, n in enumerate(g.node):
        op = lookup(n.op_type, n.domain)
        if op is None or not op.value_inputs:
            continue
        bound = max(2 * MAX_RANK, len(n.output))
        for k in op.value_inputs:
            v = n.input[k] if k < len(n.input) else ""
            numel = _declared_numel(declared[v]) if v in declared else None
            if numel is not None and numel > bound:
                raise ShapeError(
                    f"input {k} ('{v}') of node '{n.name or f'{n.op_type}_{i}'}' "
                    f"({n.op_type}){where} is declared with {numel} values; its values "
                    f"decide the output's shape and it may hold at most {bound} (tensors "
                    f"have at most {MAX_RANK} dimensions)")


def _nbytes(t: onnx.TensorProto) -> int:
    """The size of an initializer's data, without touching it."""
    try:
        item = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except Exception:   # (strings, unknown types: never big weights)
        return 0
    n = 1
    for d in t.dims:
        n *= int(d)
    return n * item


def skeleton(proto: onnx.ModelProto) -> onnx.ModelProto:
    """For large models: the same graph with every big initializer turned into a typed
    graph input, so that the checker and shape inference (which serialise the whole
    model) do not copy the weights. Initializer values are read separately."""
    # sizes from the dims: reading raw_data would copy every weight once more
    sizes = {t.name: _nbytes(t) for t in proto.graph.initializer}
    big = [t for t in proto.graph.initializer if sizes[t.name] > 4096]
    if sum(sizes[t.name] for t in big) < SKELETON_BYTES:
        return proto
    names = {t.name for t in big}
    sk = onnx.ModelProto()
    sk.CopyFrom(onnx.ModelProto(ir_version=proto.ir_version, opset_import=proto.opset_import,
                                producer_name=proto.producer_name, domain=proto.domain,
                                model_version=proto.model_version,
                                functions=proto.functions))
    g = sk.graph
    g.name = proto.graph.name
    g.node.extend(proto.graph.node)
    g.output.extend(proto.graph.output)
    g.value_info.extend(proto.graph.value_info)
    g.initializer.extend(t for t in proto.graph.initializer if t.name not in names)
    listed = {i.name for i in proto.graph.input}
    g.input.extend(proto.graph.input)
    for t in big:
        if t.name not in listed:
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return sk


def _infer(proto: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(proto, strict_mode=False)
    except Exception as e:
        raise ModelError(f"ONNX shape inference failed: {e}") from e


def opset_of(proto: onnx.ModelProto) -> int:
    for o in proto.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return 1


def _tensor_type(vi: onnx.ValueInfoProto, where: str,
                 negative_is_unknown: bool = False) -> TensorType | None:
    """The declared type. A negative dimension is a ModelError, except where exporters
    write -1 for "unknown" and onnxruntime reads it so (`negative_is_unknown`: the outputs
    of subgraphs, e.g. ONNX's own expanded AffineGrid)."""
    t = vi.type
    if not t.HasField("tensor_type"):
        raise ModelError(f"{where} {vi.name!r} is not a tensor (sequence/map/optional types "
                         "are not supported)")
    tt = t.tensor_type
    try:
        dt = np_dtype(tt.elem_type)
    except (KeyError, ValueError) as e:
        try:
            tname = onnx.TensorProto.DataType.Name(tt.elem_type)
        except ValueError:
            tname = str(tt.elem_type)
        raise ModelError(f"{where} {vi.name!r} has unsupported element type "
                         f"{tname} ({tt.elem_type})") from e
    if not tt.HasField("shape"):
        return TensorType(dt, ("?",))
    dims: list[Dim] = []
    for i, d in enumerate(tt.shape.dim):
        if d.HasField("dim_value"):
            if d.dim_value < 0 and negative_is_unknown:
                dims.append(f"{vi.name}_dim{i}")
                continue
            if d.dim_value < 0:
                raise ModelError(f"{where} {vi.name!r} declares a negative dimension "
                                 f"{d.dim_value} (dimension {i})")
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(f"{vi.name}_dim{i}")
    return TensorType(dt, tuple(dims))


def _tensor_array(t: onnx.TensorProto, what: str) -> np.ndarray:
    """A TensorProto's value, its dims checked against the size guard before any data is
    read (a tensor declaring 2^40 elements is a ShapeError, not a huge allocation)."""
    try:
        item = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except Exception:
        item = 1
    check_size(what, list(t.dims), item)
    try:
        return numpy_helper.to_array(t)
    except Exception as e:
        raise ModelError(f"cannot read {what}: {type(e).__name__}: {e}") from e


def _node_attrs(n: onnx.NodeProto, name: str) -> dict[str, Any]:
    """A node's attributes as Python values; an unreadable one is a ModelError naming it."""
    try:
        return {a.name: attr_value(a, f" of node '{name}' ({n.op_type})") for a in n.attribute}
    except CanncError:
        raise
    except Exception as e:
        raise ModelError(f"node '{name}' ({n.op_type}) has an unreadable attribute: "
                         f"{type(e).__name__}: {e}") from e


def attr_value(a: onnx.AttributeProto, where: str = "") -> Any:
    if a.type == onnx.AttributeProto.TENSOR:
        return _tensor_array(a.t, f"tensor attribute '{a.name}'{where}")
    if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return a  # kept as proto here; the import makes GRAPH attributes ir.Graphs
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [x.decode("utf-8", "replace") for x in v]
    return v


def _with_subgraphs(n: onnx.NodeProto, attrs: dict[str, Any], opsets: dict[str, int],
                    scope: dict[str, TensorType], where: str,
                    types: dict[str, TensorType]) -> tuple[str, ...]:
    """Import the node's GRAPH attributes into `attrs` as ir.Graphs and return its inputs
    followed by the outer-scope values its subgraphs read (the captures), so that every
    pass sees those dependencies. Outputs ONNX could not type (an If whose branches
    differ in shape) take the type of a subgraph's output (into `types`)."""
    inputs = list(n.input)
    subs = []
    for a in n.attribute:
        if a.type != onnx.AttributeProto.GRAPH:
            continue
        sub = import_subgraph(a.g, opsets, scope, f"{where}.{a.name}")
        attrs[a.name] = sub
        subs.append(sub)
        inputs.extend(v for v in sub.meta["captures"] if v not in inputs)
    for i, o in enumerate(n.output):
        if o and o not in types:
            t = next((s.values[s.outputs[i]] for s in subs
                      if i < len(s.outputs) and s.outputs[i] in s.values), None)
            if t is not None:
                types[o] = t
    return tuple(inputs)


def import_subgraph(gp: onnx.GraphProto, opsets: dict[str, int],
                    outer: dict[str, TensorType], where: str) -> Graph:
    """A subgraph attribute (If branch, Loop body) as an ir.Graph: its formal inputs,
    initializers, nodes (nested subgraphs too) and outputs; `meta["captures"]` lists the
    outer-scope values it reads (in first-use order), typed from `outer`."""
    sub = Graph(gp.name or where)
    sub.opsets = dict(opsets)
    for t in gp.initializer:
        sub.set_constant(t.name, _tensor_array(t, f"initializer '{t.name}' of subgraph {where}"))
    for vi in gp.input:
        sub.values[vi.name] = _tensor_type(vi, f"input of subgraph {where}")
        sub.inputs.append(vi.name)
    for vi in gp.output:
        # sequences, optionals: ModelError
        _tensor_type(vi, f"output of subgraph {where}", negative_is_unknown=True)
    for vi in list(gp.value_info) + list(gp.output):
        if vi.name not in sub.values and vi.type.HasField("tensor_type"):
            try:
                sub.values[vi.name] = _tensor_type(vi, "value")
            except ModelError:
                pass
    scope = {**outer, **sub.values}
    seen: set[str] = set()
    for i, n in enumerate(gp.node):
        name = n.name or f"{n.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        seen.add(name)
        attrs = _node_attrs(n, f"{where}/{name}")
        inputs = _with_subgraphs(n, attrs, opsets, scope, f"{where}/{name}", sub.values)
        sub.add_node(Node(name=name, op_type=n.op_type, inputs=inputs,
                          outputs=tuple(n.output), attrs=attrs, domain=n.domain,
                          opset=opsets.get(n.domain or "", 1), proto=n))
    sub.outputs = [o.name for o in gp.output]
    defined = set(sub.inputs) | set(sub.constants) | {o for n in sub.nodes() for o in n.outputs}
    captures: list[str] = []
    for v in [v for n in sub.nodes() for v in n.inputs] + sub.outputs:
        if v and v not in defined and v not in captures:
            captures.append(v)         # (the ONNX checker saw that an enclosing graph has it)
            if v in outer:
                sub.values[v] = outer[v]
    sub.meta["captures"] = captures
    return sub


def _infer_untyped(g: Graph) -> None:
    """Outputs ONNX's inference leaves untyped (Dropout-7's mask) typed by the op's own
    `infer`, on the symbolic shapes, where it has one."""
    for n in g.nodes():
        if all(v in g.values for v in n.outputs if v):
            continue
        op = lookup(n.op_type, n.domain)
        ins = [g.values.get(v) if v else None for v in n.inputs]
        if op is None or op.infer is None or any(v and t is None for v, t in zip(n.inputs, ins)):
            continue
        try:
            types = op.infer(n, ins)
        except UnsupportedOpError:   # (a custom op the model asks for at another version)
            raise
        except Exception:      # (an op's inference may need concrete shapes: later, then)
            continue
        for v, t in zip(n.outputs, types):
            if v and v not in g.values and t is not None:
                g.values[v] = t


def import_model(model: Any) -> tuple[Graph, onnx.ModelProto]:
    """Read, check and import a model. Returns the IR graph (symbolic shapes kept)
    and the checked ModelProto (with inferred shapes)."""
    loaded = load_model(model)
    proto = loaded.proto
    inferred = check_model(proto)
    g = Graph(proto.graph.name or "graph")
    for o in proto.opset_import:
        g.opsets[o.domain or ""] = o.version
    init_names = set()
    for i, t in enumerate(proto.graph.initializer):
        arr = loaded.weights.get(i)
        if arr is None:
            arr = _tensor_array(t, f"initializer '{t.name}'")
        g.set_constant(t.name, arr)
        init_names.add(t.name)
    for vi in proto.graph.input:
        if vi.name in init_names:
            continue  # old exporters list initializers as inputs too
        tt = _tensor_type(vi, "graph input")
        check_size(f"graph input '{vi.name}'", tt.shape, np.dtype(tt.dtype).itemsize,
                   " (as declared)")
        g.values[vi.name] = tt
        g.inputs.append(vi.name)
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        if vi.name not in g.values and vi.type.HasField("tensor_type"):
            try:
                g.values[vi.name] = _tensor_type(vi, "value")
            except ModelError:
                pass
    seen: set[str] = set()
    for i, n in enumerate(proto.graph.node):
        name = n.name or f"{n.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        seen.add(name)
        attrs = _node_attrs(n, name)
        inf = inferred.graph.node[i] if i < len(inferred.graph.node) else n
        inputs = _with_subgraphs(inf if inf.op_type == n.op_type else n, attrs, g.opsets,
                                 g.values, name, g.values)
        g.add_node(Node(name=name, op_type=n.op_type, inputs=inputs,
                        outputs=tuple(n.output), attrs=attrs, domain=n.domain,
                        opset=g.opsets.get(n.domain or "", 1), proto=n))
    _infer_untyped(g)
    g.outputs = [o.name for o in proto.graph.output]
    defined = set(g.inputs) | set(g.constants) | {o for n in g.nodes() for o in n.outputs}
    for o in g.outputs:
        if o not in defined:
            raise ModelError(f"graph output {o!r} is not produced by any node")
    if not g.outputs:
        raise ModelError("the model has no outputs")
    return g, inferred
