"""Mixed precision: float32 nodes into bfloat16 or float16 by policy (CANN's and TVM's lists).

Opt-in (`cannc.compile(model, precision="bf16")`); float32 is the default and this pass
then changes nothing. Each float32 node gets a class (`cannc.ir.registry.amp_class`, the
op's `amp` field or its category, overridden by the user's lists by op type):

- ALLOW (contractions: MatMul, Gemm, Conv, fused attention) runs in the reduced type:
  products narrow, sums float32 (the kernels accumulate in float32);
- FOLLOW (elementwise, movement) runs in the reduced type when all its non-constant float
  inputs already are; otherwise float32;
- DENY (reductions, normalisations, softmax, exp/log/pow, casts) stays float32.

`keep_fp32` names ONNX nodes that stay float32 whatever their class (the accuracy guard
fills it). The rewrite keeps the IR ONNX-typed: a reduced node's float inputs and outputs
take the reduced type; constants are converted here, once, at compile time; a float32
consumer of a reduced value reads it through a Cast to float32, which fusion then puts into
the producer's kernel (convert on store); graph inputs and outputs keep their dtypes.

Casts do not stand in front of contractions: an ALLOW node reads a float32 activation as
it is and carries ``attrs["cannc_precision"]``, which tells its kernel to convert while
loading (codegen/ABI.md "Reduced precision"); likewise a contraction whose only use is a
Cast back to float32 writes float32 itself (rounded once, from its float32 sums). Both are
the fusion rule ``precision_casts`` (``fusion={"precision_casts": False}`` keeps every
Cast a node of its own).

The decision for every node is recorded in ``graph.meta["precision"]`` (node name -> "bf16"
/ "fp16" / "fp32"), which `Session.inspect()["precision"]` reports (an ONNX node that no
longer exists when this pass runs, folded into a constant or removed, is "folded" there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import CompileError
from ..ir.graph import Graph, Node
from ..ir.ops import lookup
from ..ir.registry import Amp, amp_class
from ..ir.types import TensorType, np_to_onnx
from .manager import PassContext, graph_pass

PRECISIONS = ("fp32", "bf16", "fp16")
ATTR = "cannc_precision"           # on a contraction: multiply narrow, convert on load/store
LIST_KINDS = ("allow", "deny", "follow")


def narrow_dtype(precision: str) -> np.dtype:
    """The storage dtype of a reduced precision."""
    if precision == "bf16":
        try:
            import ml_dtypes
        except ImportError as e:  # pragma: no cover - onnx requires ml_dtypes
            raise CompileError("precision='bf16' needs the ml_dtypes package") from e
        return np.dtype(ml_dtypes.bfloat16)
    if precision == "fp16":
        return np.dtype(np.float16)
    raise CompileError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")


@dataclass(frozen=True)
class PrecisionOptions:
    """``precision``: "fp32" (nothing changes), "bf16" or "fp16"; ``allow`` / ``deny`` /
    ``follow``: op types moved into that list (an op type in two lists is an error);
    ``keep_fp32``: node names kept in float32."""

    precision: str = "fp32"
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    follow: tuple[str, ...] = ()
    keep_fp32: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise CompileError(f"unknown precision {self.precision!r}; "
                               f"choose one of {', '.join(PRECISIONS)}")
        seen: dict[str, str] = {}
        for kind in LIST_KINDS:
            names = getattr(self, kind)
            if isinstance(names, str) or not all(isinstance(x, str) for x in names):
                raise CompileError(f"precision list {kind!r} must be a list of op type "
                                   f"names, got {names!r}")
            object.__setattr__(self, kind, tuple(names))
            for op_type in names:
                domain, _, name = op_type.rpartition("::")
                if lookup(name, domain) is None:
                    raise CompileError(f"precision list {kind!r}: unknown op type "
                                       f"{op_type!r}")
                if op_type in seen and seen[op_type] != kind:
                    raise CompileError(f"op type {op_type!r} is in both the "
                                       f"{seen[op_type]!r} and the {kind!r} precision lists")
                seen[op_type] = kind
        keep = self.keep_fp32
        if isinstance(keep, str) or not all(isinstance(x, str) for x in keep):
            raise CompileError(f"keep_fp32 must be a list of node names, got {keep!r}")
        object.__setattr__(self, "keep_fp32", tuple(keep))

    def class_of(self, n: Node) -> Amp | None:
        """The node's class under these lists, or None for an op cannc does not know."""
        op = lookup(n.op_type, n.domain)
        if op is None:
            return None
        key = f"{n.domain}::{n.op_type}" if n.domain else n.op_type
        for kind in LIST_KINDS:
            if key in getattr(self, kind):
                return Amp(kind)
        return amp_class(op)


def _is_f32(t: TensorType | None) -> bool:
    return t is not None and np.dtype(t.dtype) == np.float32


def _is_float(t: TensorType | None) -> bool:
    if t is None:
        return False
    dt = np.dtype(t.dtype)
    return dt.kind == "f" or dt.name == "bfloat16"


def _takes(op, n: Node, ins: list, outs: list, float_ins: list[int], float_outs: list[int],
           narrow: np.dtype) -> bool:
    """Whether the op's definition takes the node with its float tensors narrowed."""
    def nar(ts: list, idx: list[int]) -> list:
        return [TensorType(narrow, t.shape) if i in idx and t is not None else t
                for i, t in enumerate(ts)]
    return op.schema_reason(n, nar(ins, float_ins), nar(outs, float_outs)) is None


def _origin(n: Node) -> list[str]:
    """The ONNX nodes a node stands for (a pattern fusion before this pass lists them)."""
    return list(n.attrs["fused_from"]) if "fused_from" in n.attrs else [n.name]


@graph_pass("mixed_precision", options=PrecisionOptions)
def mixed_precision(graph: Graph, ctx: PassContext) -> bool:
    """float32 nodes into the reduced type by policy; casts at the cluster boundaries."""
    o: PrecisionOptions = ctx.options
    if o.precision == "fp32":       # nothing changes; the record says what runs
        graph.meta["precision"] = {**graph.meta.get("precision", {}),
                                   **{b: "fp32" for n in graph.nodes() for b in _origin(n)}}
        return False
    narrow = narrow_dtype(o.precision)
    keep = set(o.keep_fp32)
    decided: dict[str, str] = {}
    reduced_vals: set[str] = set()        # values now carrying the narrow type
    narrow_const: dict[str, str] = {}     # float32 constant -> its narrow copy
    wide_of: dict[str, str] = {}          # narrow value -> the float32 Cast of it
    tag = o.precision

    def const_narrow(v: str) -> str:
        if v not in narrow_const:
            name = f"{v}::{tag}"
            graph.set_constant(name, graph.constants[v].astype(narrow))
            narrow_const[v] = name
        return narrow_const[v]

    def widen(v: str, order: float) -> str:
        if v not in wide_of:
            wide_of[v] = _add_cast(graph, v, f"{v}::fp32", f"{v}::to_fp32",
                                   np.dtype(np.float32), order)
        return wide_of[v]

    changed = False
    for name in [n.name for n in graph.nodes()]:
        n = graph.node(name)
        cls = o.class_of(n)
        op = lookup(n.op_type, n.domain)
        ins = [graph.values.get(v) if v else None for v in n.inputs]
        outs = [graph.values.get(v) if v else None for v in n.outputs]
        value_ins = set(op.value_inputs) if op is not None else set()
        float_ins = [i for i, (v, t) in enumerate(zip(n.inputs, ins))
                     if v and i not in value_ins and (_is_f32(t) or v in reduced_vals)]
        float_outs = [i for i, t in enumerate(outs) if _is_f32(t)]
        others = [t for v, t in zip(n.inputs, ins) if v and t is not None and _is_float(t)
                  and not _is_f32(t) and v not in reduced_vals]
        candidate = (cls is not None and op is not None and bool(float_ins or float_outs)
                     and not others and not any(b in keep for b in _origin(n))
                     and _takes(op, n, ins, outs, float_ins, float_outs, narrow))
        reduce_it = False
        if candidate and cls is Amp.ALLOW:
            reduce_it = True
        elif candidate and cls is Amp.FOLLOW:
            live = [i for i in float_ins if not graph.is_constant(n.inputs[i])]
            reduce_it = bool(live) and all(n.inputs[i] in reduced_vals for i in live)
        order = graph.g.nodes[n.name]["order"]
        new_inputs = list(n.inputs)
        attrs = dict(n.attrs)
        if reduce_it:
            for i in float_ins:
                v = n.inputs[i]
                if v in reduced_vals:
                    continue
                if graph.is_constant(v):
                    new_inputs[i] = const_narrow(v)
                else:   # ALLOW reading a float32 activation (precision_casts folds the Cast)
                    out = f"{v}::{tag}"
                    if out not in graph.values:
                        _add_cast(graph, v, out, f"{v}::to_{tag}", narrow, order - 0.25)
                    new_inputs[i] = out
                    reduced_vals.add(out)
            for i in float_outs:
                v = n.outputs[i]
                graph.values[v] = TensorType(narrow, graph.values[v].shape)
                reduced_vals.add(v)
            if cls is Amp.ALLOW:
                attrs[ATTR] = o.precision
        else:
            for i, v in enumerate(n.inputs):
                if v and v in reduced_vals:
                    new_inputs[i] = widen(v, order - 0.25)
        for b in _origin(n):
            decided[b] = o.precision if reduce_it else "fp32"
        if tuple(new_inputs) != n.inputs or attrs != n.attrs:
            graph.replace_node(n.name, n.replace(inputs=tuple(new_inputs), attrs=attrs,
                                                 proto=None))
            changed = True
        changed |= reduce_it
    # graph outputs keep their dtypes
    for v in list(graph.outputs):
        if v in reduced_vals:
            _rename_output(graph, v, f"{v}::{tag}")
            reduced_vals.discard(v)
            reduced_vals.add(f"{v}::{tag}")
            _add_cast(graph, f"{v}::{tag}", v, f"{v}::output_fp32", np.dtype(np.float32))
    if ctx.fusion_enabled("precision_casts"):
        _cast_fusion(graph)
    prior = graph.meta.get("precision", {})
    graph.meta["precision"] = {**prior, **decided}
    return changed


def _add_cast(graph: Graph, src: str, out: str, name: str, dtype: np.dtype,
              order: float | None = None) -> str:
    """A Cast node `name` writing `out`: `src` as `dtype` (float32, bfloat16, float16)."""
    graph.values[out] = TensorType(dtype, graph.values[src].shape)
    graph.add_node(Node(name=name, op_type="Cast", inputs=(src,), outputs=(out,),
                        attrs={"to": np_to_onnx()[np.dtype(dtype)]},
                        opset=graph.opsets.get("", 13)), order=order)
    return out


def _rename_output(graph: Graph, old: str, new: str) -> None:
    """The producer of graph output `old` writes `new` (its consumers read `new`)."""
    p = graph.producer(old)
    assert p is not None
    graph.values[new] = graph.values[old]
    for cname in graph.consumers(old):
        c = graph.node(cname)
        graph.replace_node(cname, c.replace(inputs=tuple(new if x == old else x
                                                         for x in c.inputs), proto=None))
    graph.replace_node(p.name, p.replace(outputs=tuple(new if x == old else x
                                                       for x in p.outputs), proto=None))


def _is_cast_to(n: Node, elem: int) -> bool:
    return n.op_type == "Cast" and n.domain == "" and int(n.attrs.get("to", -1)) == elem


def _cast_fusion(graph: Graph) -> None:
    """Casts into the contractions around them: a contraction marked ATTR reads the float32
    activation a Cast narrowed for it (convert on load), and writes float32 itself when a
    Cast to float32 is the only use of its output (convert on store, one rounding)."""
    from onnx import TensorProto

    for n in list(graph.nodes()):
        if ATTR not in n.attrs:
            continue
        new_inputs = list(n.inputs)
        for i, v in enumerate(n.inputs):
            p = graph.producer(v) if v else None
            if p is None or not (_is_cast_to(p, TensorProto.BFLOAT16)
                                 or _is_cast_to(p, TensorProto.FLOAT16)):
                continue
            if not _is_f32(graph.values.get(p.inputs[0])):
                continue
            new_inputs[i] = p.inputs[0]
        if tuple(new_inputs) != n.inputs:
            graph.replace_node(n.name, n.replace(inputs=tuple(new_inputs), proto=None))
        for v in n.outputs:
            users = graph.consumers(v)
            if len(users) != 1 or v in graph.outputs:
                continue
            c = graph.node(users[0])
            if not _is_cast_to(c, TensorProto.FLOAT):
                continue
            out = c.outputs[0]
            graph.remove_node(c.name)
            graph.values[v] = TensorType(np.dtype(np.float32), graph.values[v].shape)
            if out in graph.outputs:    # a graph output keeps its name: n writes it
                del graph.values[v]
                n = graph.node(n.name)
                graph.replace_node(n.name, n.replace(outputs=tuple(
                    out if x == v else x for x in n.outputs), proto=None))
            else:
                graph.replace_uses(out, v)
    # narrowing Casts nobody reads any more
    for n in list(graph.nodes()):
        if n.op_type == "Cast" and n.name.endswith(("::to_bf16", "::to_fp16")) \
                and not graph.consumers(n.outputs[0]) and n.outputs[0] not in graph.outputs:
            graph.remove_node(n.name)
            del graph.values[n.outputs[0]]
