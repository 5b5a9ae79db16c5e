"""ORT's OrtGraph as an onnx.ModelProto: what the EP's GetCapability and Compile hand to
cannc's own partitioner and compiler.

The mirror walks the graph through the OrtApi (nodes, their inputs and outputs, attributes,
the types of every value ORT knows, initializers with their data, opsets). A node cannc
cannot mirror faithfully (a graph attribute: If, Loop, Scan; a list of strings) becomes an
opaque node of domain OPAQUE_DOMAIN with the same inputs (implicit ones too) and outputs, so
the partitioner sees every edge and never claims it.
"""

from __future__ import annotations

import ctypes
from ctypes import c_char_p, c_float, c_int, c_int64, c_size_t, c_void_p
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from ._abi import (
    ATTR_FLOAT,
    ATTR_FLOATS,
    ATTR_INT,
    ATTR_INTS,
    ATTR_STRING,
    ATTR_TENSOR,
    ONNX_TYPE_TENSOR,
    FunctionTable,
    OrtCallError,
)

OPAQUE_DOMAIN = "ai.cannc.ort.opaque"
_STRING = TensorProto.STRING


@dataclass
class Mirror:
    model: onnx.ModelProto
    nodes: dict[str, int]                       # node name (in the mirror) -> const OrtNode*
    opaque: dict[str, str] = field(default_factory=dict)   # node -> why it is opaque
    model_path: str = ""


def _str(p: bytes | None) -> str:
    return (p or b"").decode("utf-8", "replace")


class _Reader:
    def __init__(self, api: FunctionTable) -> None:
        self.api = api

    # -- small typed getters -----------------------------------------------------------------
    def _count(self, fn: str, obj: int) -> int:
        n = c_size_t(0)
        getattr(self.api, fn)(obj, ctypes.byref(n))
        return n.value

    def _array(self, count_fn: str, get_fn: str, obj: int) -> list[int]:
        n = self._count(count_fn, obj)
        if n == 0:
            return []
        arr = (c_void_p * n)()
        getattr(self.api, get_fn)(obj, arr, n)
        return [a or 0 for a in arr]

    def _cstr(self, fn: str, obj: int) -> str:
        s = c_char_p()
        getattr(self.api, fn)(obj, ctypes.byref(s))
        return _str(s.value)

    def value_name(self, vi: int) -> str:
        return self._cstr("GetValueInfoName", vi) if vi else ""

    def tensor_type(self, vi: int) -> onnx.TypeProto | None:
        """The value's tensor type (dtype and dims, symbolic names kept), None if not a tensor
        or unknown."""
        ti = c_void_p()
        try:
            self.api.GetValueInfoTypeInfo(vi, ctypes.byref(ti))
        except OrtCallError:
            return None
        if not ti.value:
            return None
        kind = c_int(0)
        self.api.GetOnnxTypeFromTypeInfo(ti, ctypes.byref(kind))
        if kind.value != ONNX_TYPE_TENSOR:
            return None
        info = c_void_p()
        self.api.CastTypeInfoToTensorInfo(ti, ctypes.byref(info))
        if not info.value:
            return None
        return self._type_from_info(info.value)

    def _dtype_dims(self, info: int) -> tuple[int, list[int]]:
        """A tensor type-and-shape info's element type and dims (-1: not known)."""
        et = c_int(0)
        self.api.GetTensorElementType(info, ctypes.byref(et))
        nd = c_size_t(0)
        self.api.GetDimensionsCount(info, ctypes.byref(nd))
        dims = (c_int64 * max(nd.value, 1))()
        if nd.value:
            self.api.GetDimensions(info, dims, nd.value)
        return et.value, [int(dims[i]) for i in range(nd.value)]

    def _type_from_info(self, info: int) -> onnx.TypeProto:
        et, dims = self._dtype_dims(info)
        syms = (c_char_p * max(len(dims), 1))()
        if dims:
            self.api.GetSymbolicDimensions(info, syms, len(dims))
        shape = [d if d >= 0 else (_str(syms[i]) or None) for i, d in enumerate(dims)]
        return helper.make_tensor_type_proto(et, shape)

    def _shape_of_value(self, value: int) -> tuple[int, list[int]]:
        info = c_void_p()
        self.api.GetTensorTypeAndShape(value, ctypes.byref(info))
        try:
            return self._dtype_dims(info)
        finally:
            self.api.ReleaseTensorTypeAndShapeInfo(info)

    def node_name(self, ptr: int, seen: set[str] | dict[str, int]) -> str:
        """A node's name in the mirror: its own, or (unnamed, or a name taken already)
        `<name or node>#<ORT's node id>`."""
        name = self._cstr("Node_GetName", ptr)
        if not name or name in seen:
            nid = c_size_t(0)
            self.api.Node_GetId(ptr, ctypes.byref(nid))
            name = f"{name or 'node'}#{nid.value}"
        return name

    def tensor(self, name: str, value: int, out: TensorProto | None = None
               ) -> TensorProto | None:
        """An OrtValue's tensor as a TensorProto (its bytes copied; into `out` if given);
        None for strings."""
        et, dims = self._shape_of_value(value)
        if et == _STRING:
            return None
        numel = 1
        for d in dims:
            numel *= d
        itemsize = helper.tensor_dtype_to_np_dtype(et).itemsize
        data = c_void_p()
        self.api.GetTensorData(value, ctypes.byref(data))
        nbytes = numel * itemsize
        t = TensorProto() if out is None else out
        t.name = name
        t.data_type = et
        t.dims.extend(dims)
        if nbytes and data.value:
            t.raw_data = ctypes.string_at(data.value, nbytes)
        else:
            t.raw_data = b""
        return t

    # -- attributes -------------------------------------------------------------------------
    def _read(self, attr: int, kind: int) -> bytes:
        need = c_size_t(0)
        st = self.api.fn("ReadOpAttr")(attr, kind, None, 0, ctypes.byref(need))
        if st:   # expected: "buffer too small", with the size needed
            self.api.fn("ReleaseStatus")(st)
        n = need.value
        if n == 0:
            return b""
        buf = ctypes.create_string_buffer(n)
        self.api.ReadOpAttr(attr, kind, buf, n, ctypes.byref(need))
        return buf.raw[:need.value]

    def attribute(self, attr: int) -> onnx.AttributeProto | str:
        """The attribute, or a string saying why it cannot be mirrored."""
        name = self._cstr("OpAttr_GetName", attr)
        kind = c_int(0)
        self.api.OpAttr_GetType(attr, ctypes.byref(kind))
        k = kind.value
        if k == ATTR_INT:
            v = c_int64(0)
            out = c_size_t(0)
            self.api.ReadOpAttr(attr, k, ctypes.byref(v), 8, ctypes.byref(out))
            return helper.make_attribute(name, int(v.value))
        if k == ATTR_FLOAT:
            f = c_float(0)
            out = c_size_t(0)
            self.api.ReadOpAttr(attr, k, ctypes.byref(f), 4, ctypes.byref(out))
            return helper.make_attribute(name, float(f.value))
        if k == ATTR_INTS:
            raw = self._read(attr, k)
            vals = list((c_int64 * (len(raw) // 8)).from_buffer_copy(raw))
            return helper.make_attribute(name, [int(x) for x in vals],
                                         attr_type=onnx.AttributeProto.INTS)
        if k == ATTR_FLOATS:
            raw = self._read(attr, k)
            vals = list((c_float * (len(raw) // 4)).from_buffer_copy(raw))
            return helper.make_attribute(name, [float(x) for x in vals],
                                         attr_type=onnx.AttributeProto.FLOATS)
        if k == ATTR_STRING:
            return helper.make_attribute(name, self._read(attr, k))
        if k == ATTR_TENSOR:
            val = c_void_p()
            self.api.OpAttr_GetTensorAttributeAsOrtValue(attr, ctypes.byref(val))
            if not val.value:
                return f"attribute '{name}': an empty tensor"
            try:
                t = self.tensor(name, val.value)
            finally:
                self.api.ReleaseValue(val)
            if t is None:
                return f"attribute '{name}': a string tensor"
            return helper.make_attribute(name, t)
        return f"attribute '{name}' of type {k} (graph or strings) is not mirrored"


def mirror_graph(api: FunctionTable, graph: int) -> Mirror:
    """The OrtGraph `graph` as a ModelProto (see the module docstring)."""
    r = _Reader(api)
    ortnodes = r._array("Graph_GetNumNodes", "Graph_GetNodes", graph)
    inits = r._array("Graph_GetNumInitializers", "Graph_GetInitializers", graph)
    gins = r._array("Graph_GetNumInputs", "Graph_GetInputs", graph)
    gouts = r._array("Graph_GetNumOutputs", "Graph_GetOutputs", graph)

    value_types: dict[str, onnx.TypeProto] = {}

    def note(vi: int) -> str:
        if not vi:
            return ""
        name = r.value_name(vi)
        if name and name not in value_types:
            t = r.tensor_type(vi)
            if t is not None:
                value_types[name] = t
        return name

    # the model is built in place: protobuf copies a message appended to a container, and
    # copying the weights of a large model took seconds
    model = onnx.ModelProto()
    gp = model.graph
    gp.name = "ort_graph"
    init_names: set[str] = set()
    for vi in inits:
        name = note(vi)
        val = c_void_p()
        api.ValueInfo_GetInitializerValue(vi, ctypes.byref(val))
        if val.value and r.tensor(name, val.value, gp.initializer.add()):
            init_names.add(name)
        elif val.value:
            del gp.initializer[len(gp.initializer) - 1]

    nodes: list[onnx.NodeProto] = []
    by_name: dict[str, int] = {}
    opaque: dict[str, str] = {}
    for ptr in ortnodes:
        name = r.node_name(ptr, by_name)
        by_name[name] = ptr
        op = r._cstr("Node_GetOperatorType", ptr)
        domain = r._cstr("Node_GetDomain", ptr)
        ins = [note(v) for v in r._array("Node_GetNumInputs", "Node_GetInputs", ptr)]
        outs = [note(v) for v in r._array("Node_GetNumOutputs", "Node_GetOutputs", ptr)]
        attrs: list[onnx.AttributeProto] = []
        why = ""
        if r._count("Node_GetNumSubgraphs", ptr):
            why = f"{op} has subgraphs (not mirrored)"
        else:
            for a in r._array("Node_GetNumAttributes", "Node_GetAttributes", ptr):
                got = r.attribute(a)
                if isinstance(got, str):
                    why = got
                    break
                attrs.append(got)
        if why:
            implicit = [note(v) for v in r._array("Node_GetNumImplicitInputs",
                                                  "Node_GetImplicitInputs", ptr)]
            n = helper.make_node(op, ins + [v for v in implicit if v and v not in ins], outs,
                                 name=name, domain=OPAQUE_DOMAIN)
            opaque[name] = why
        else:
            n = helper.make_node(op, ins, outs, name=name, domain=domain)
            n.attribute.extend(attrs)
        nodes.append(n)
    gp.node.extend(nodes)

    def vinfo(name: str) -> onnx.ValueInfoProto:
        t = value_types.get(name)
        vi = onnx.ValueInfoProto()
        vi.name = name
        if t is not None:
            vi.type.CopyFrom(t)
        return vi

    for n in (note(v) for v in gins):
        if n and n not in init_names:
            gp.input.append(vinfo(n))
    for n in (note(v) for v in gouts):
        if n:
            gp.output.append(vinfo(n))
    known = {i.name for i in gp.input} | {o.name for o in gp.output} | init_names
    for n in value_types:
        if n not in known:
            gp.value_info.append(vinfo(n))
    nops = r._count("Graph_GetNumOperatorSets", graph)
    doms = (c_char_p * max(nops, 1))()
    vers = (c_int64 * max(nops, 1))()
    if nops:
        api.Graph_GetOperatorSets(graph, doms, vers, nops)
    opsets = [helper.make_opsetid(_str(doms[i]), int(vers[i])) for i in range(nops)]
    if not any(o.domain in ("", "ai.onnx") for o in opsets):
        opsets.append(helper.make_opsetid("", 17))
    irv = c_int64(0)
    api.Graph_GetOnnxIRVersion(graph, ctypes.byref(irv))
    model.opset_import.extend(opsets)
    model.producer_name = "cannc.ort"
    model.ir_version = int(irv.value) or onnx.IR_VERSION
    if any(o.domain == OPAQUE_DOMAIN for o in nodes) and not any(
            o.domain == OPAQUE_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(OPAQUE_DOMAIN, 1))
    return Mirror(model, by_name, opaque)


def node_names(api: FunctionTable, graph: int) -> list[str]:
    """The names of a graph's nodes as mirror_graph names them (Compile's sub-graphs)."""
    r = _Reader(api)
    seen: set[str] = set()
    out = []
    for ptr in r._array("Graph_GetNumNodes", "Graph_GetNodes", graph):
        name = r.node_name(ptr, seen)
        seen.add(name)
        out.append(name)
    return out


def io_names(api: FunctionTable, node: int) -> tuple[list[str], list[str]]:
    """A (fused) node's input and output value names, in order ('' for absent ones)."""
    r = _Reader(api)
    ins = [r.value_name(v) for v in r._array("Node_GetNumInputs", "Node_GetInputs", node)]
    outs = [r.value_name(v) for v in r._array("Node_GetNumOutputs", "Node_GetOutputs", node)]
    return ins, outs


__all__ = ["OPAQUE_DOMAIN", "Mirror", "io_names", "mirror_graph", "node_names"]
