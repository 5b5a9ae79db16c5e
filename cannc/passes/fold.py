"""Type inference and constant folding over concrete shapes.

Once the input shapes are bound, every Shape is a constant, so the
Shape -> Gather -> Concat -> Reshape chains PyTorch exports fold away here,
together with everything else computed only from initializers. Output types
come from ONNX's own per-node inference (so each opset version is read with its
own semantics); folding uses the op's NumPy reference.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..config import check_size
from ..errors import CanncError, ModelError, ShapeError
from ..ir.graph import Graph, Node
from ..ir.ops import lookup
from ..ir.registry import MAP_CATEGORIES, Category, FoldFn, OpDef
from ..ir.types import TensorType, dtype_key, np_dtype, np_to_onnx
from .manager import PassContext, graph_pass

if TYPE_CHECKING:
    import onnx

FOLD_LIMIT_ELEMS = 1 << 26
_SHAPE_INPUT_LIMIT = 1 << 16


def node_proto(n: Node) -> onnx.NodeProto:
    # onnx is imported where it is used: `import cannc` and a program loaded from the
    # cache do not pay for it (with ml_dtypes, ~0.6 s)
    import onnx
    from onnx import helper, numpy_helper

    if n.proto is not None and tuple(n.proto.input) == n.inputs \
            and tuple(n.proto.output) == n.outputs:
        return n.proto
    attrs = {k: v for k, v in n.attrs.items()}
    p = helper.make_node(n.op_type, list(n.inputs), list(n.outputs), name=n.name,
                         domain=n.domain or None)
    for k, v in attrs.items():
        if isinstance(v, onnx.AttributeProto):
            p.attribute.append(v)
        elif isinstance(v, np.ndarray):
            p.attribute.append(helper.make_attribute(k, numpy_helper.from_array(v)))
        else:
            p.attribute.append(helper.make_attribute(k, v))
    return p


def reference_eval(graph: Graph, n: Node,
                   inputs: list[np.ndarray | None]) -> list[np.ndarray | None]:
    """Run one node with the ONNX reference implementation (NumPy), read at the node's
    opset; one array per output (None for an absent optional output)."""
    op = lookup(n.op_type, n.domain)
    if op is not None and op.reference is not None:
        got = op.reference(n, inputs)
        if got is not None:       # (None: a case the op's own reference leaves to onnx's)
            return got
    if op is not None and op.category in MAP_CATEGORIES and inputs and all(
            a is None or np.ndim(a) == 0 for a in inputs):
        # elementwise over scalars: as 1-element arrays (some onnx.reference kernels,
        # e.g. Softsign's np.divide(out=...), fail on the numpy scalars 0-d math gives)
        outs = reference_eval(graph, n, [None if a is None else np.reshape(a, (1,))
                                         for a in inputs])
        return [np.reshape(o, ()) for o in outs]
    if n.op_type == "Constant" and not n.domain and isinstance(n.attrs.get("value"), np.ndarray):
        return [n.attrs["value"]]    # (the evaluator would round-trip it through a proto)
    import onnx
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    # A bare NodeProto would be evaluated at the newest opset (Unsqueeze-1's `axes`
    # attribute read as Unsqueeze-13's): wrap it in a graph that carries the model's opsets.
    p = node_proto(n)
    def vi(v: str) -> onnx.ValueInfoProto:
        return helper.make_value_info(v, onnx.TypeProto())

    g = helper.make_graph([p], "fold", [vi(v) for v in dict.fromkeys(n.inputs) if v],
                          [vi(v) for v in n.outputs if v])
    opsets = {d: v for d, v in graph.opsets.items()}
    opsets.setdefault(n.domain or "", n.opset or 1)
    ev = ReferenceEvaluator(g, opsets=opsets)
    feeds = {name: arr for name, arr in zip(n.inputs, inputs) if name}
    outs = dict(zip([v for v in n.outputs if v], ev.run(None, feeds)))
    return [np.asarray(outs[v]) if v else None for v in n.outputs]


def _type_proto(t: TensorType) -> onnx.TypeProto:
    from onnx import helper

    return helper.make_tensor_type_proto(np_to_onnx()[np.dtype(t.dtype)], list(t.shape))


def infer_node(graph: Graph, n: Node) -> list[TensorType]:
    """Concrete output types of node n from its (concrete) input types and constants.
    ONNX's own inference first; an op may supply `infer` where ONNX has none."""
    import onnx

    op = lookup(n.op_type, n.domain)
    if op is not None and op.shape_check is not None:
        reason = op.shape_check(n, [graph.values[v] if v else None for v in n.inputs])
        if reason:
            shapes = ", ".join(str(graph.values[v]) for v in n.inputs if v)
            raise ShapeError(f"{n.op_type} at node '{n.name}' rejects its inputs "
                             f"({shapes}): {reason}")
    own = op.infer if op is not None else None
    if own is not None and op.domain and not onnx.defs.has(n.op_type, n.domain):
        # an op ONNX has no schema for (a custom op): its own inference only
        return own(n, [graph.values[v] if v else None for v in n.inputs])
    if own is not None:
        try:
            return _onnx_infer(graph, n)
        except ShapeError:
            return own(n, [graph.values[v] if v else None for v in n.inputs])
    return _onnx_infer(graph, n)


# ONNX's inference of a node depends on its op, opset and attributes, the opsets the
# model imports, the types of its inputs and the values of its small constant inputs, and
# on nothing else: the types it gave are kept under those, so a model's repeated layers
# and each new input shape of a model specialised again do not ask twice (BERT-base
# infers 1064 nodes per specialisation, ~60 us each). Failures are not kept.
_INFER_MEMO: dict[tuple, tuple[TensorType | None, ...]] = {}
_INFER_MEMO_MAX = 1 << 14


def _onnx_infer(graph: Graph, n: Node) -> list[TensorType]:
    proto = node_proto(n)
    key = _infer_key(graph, n, proto)
    if key is not None:
        hit = _INFER_MEMO.get(key)
        if hit is not None:
            return list(hit)
    types = _onnx_infer_node(graph, n, proto)
    if key is not None:
        if len(_INFER_MEMO) >= _INFER_MEMO_MAX:
            _INFER_MEMO.clear()
        _INFER_MEMO[key] = tuple(types)
    return types


def _infer_key(graph: Graph, n: Node, proto: onnx.NodeProto) -> tuple | None:
    """Everything ONNX's inference of n reads (None for a node with subgraphs: not kept)."""
    from onnx import AttributeProto

    if any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in proto.attribute):
        return None
    ins: list[tuple | None] = []
    for v in n.inputs:
        if not v:
            ins.append(None)
            continue
        t = graph.values[v]
        c = graph.constants.get(v)
        data = None
        if c is not None and c.size <= _SHAPE_INPUT_LIMIT:
            data = (dtype_key(c.dtype), c.shape, np.ascontiguousarray(c).tobytes())
        ins.append((dtype_key(t.dtype), tuple(t.shape), data))
    return (n.op_type, n.domain or "", n.opset,
            tuple(a.SerializeToString() for a in proto.attribute),
            tuple(sorted(graph.opsets.items())), tuple(ins),
            tuple(bool(v) for v in n.outputs))


def _onnx_infer_node(graph: Graph, n: Node, proto: onnx.NodeProto) -> list[TensorType]:
    import onnx
    from onnx import helper, numpy_helper

    try:
        schema = onnx.defs.get_schema(n.op_type, n.opset, n.domain or "")
    except onnx.defs.SchemaError as e:
        raise ModelError(f"unknown op {n.op_type} (domain '{n.domain or 'ai.onnx'}', "
                         f"opset {n.opset}) at node '{n.name}'") from e
    in_types = {}
    data = {}
    for v in n.inputs:
        if not v:
            continue
        t = graph.values[v]
        in_types[v] = _type_proto(t)
        c = graph.constants.get(v)
        if c is not None and c.size <= _SHAPE_INPUT_LIMIT:
            data[v] = numpy_helper.from_array(c, v)
    opsets = [helper.make_opsetid(d, ver) for d, ver in graph.opsets.items()]
    try:
        out = onnx.shape_inference.infer_node_outputs(schema, proto, in_types, data,
                                                      opset_imports=opsets)
    except Exception as e:
        shapes = ", ".join(str(graph.values[v]) for v in n.inputs if v)
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ShapeError(f"{n.op_type} at node '{n.name}' rejects its inputs ({shapes}): "
                         f"{msg}") from e
    types = []
    for v in n.outputs:
        if not v:
            types.append(None)
            continue
        tp = out.get(v)
        if tp is None or not tp.tensor_type.HasField("shape"):
            raise ShapeError(f"cannot infer the shape of '{v}' produced by {n.op_type} "
                             f"at node '{n.name}' (data-dependent shape?)")
        dims = []
        for i, d in enumerate(tp.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif (z := _resize_zero_dim(graph, n, i)) is not None:
                dims.append(z)
            else:
                raise ShapeError(f"the shape of '{v}' produced by {n.op_type} at node "
                                 f"'{n.name}' depends on data")
        types.append(TensorType(np_dtype(tp.tensor_type.elem_type), tuple(dims)))
    return types


def _resize_zero_dim(graph: Graph, n: Node, i: int) -> int | None:
    """Dim i of a Resize's output that ONNX's inference leaves unset because it is 0 (an
    empty batch through a segmentation head: its sizes input, computed from Shape ops,
    holds a 0, or its scales meet a 0 dim of X). onnxruntime runs such a model and
    returns an empty output, so cannc must know the 0."""
    if n.op_type not in ("Resize", "Upsample") or not n.inputs or not n.inputs[0]:
        return None
    if "axes" in n.attrs:
        return None     # (sizes / scales then cover some dims only)
    x = graph.values[n.inputs[0]]
    if i >= len(x.shape):
        return None
    sizes = graph.constants.get(n.inputs[3]) if len(n.inputs) > 3 and n.inputs[3] else None
    if sizes is not None and sizes.size:
        return 0 if int(sizes.reshape(-1)[i]) == 0 else None
    return 0 if x.shape[i] == 0 else None


def shape_fold(op: OpDef | None) -> FoldFn | None:
    """The op's fold from input types (SHAPE ops), or None."""
    if op is None or op.category != Category.SHAPE:
        return None
    return op.fold


def foldable_op(op: OpDef | None) -> bool:
    """Whether nodes of this op may be folded at all. Random ops are not deterministic;
    ops cannc does not define never reach the passes of a compile (it rejects them first),
    and `cannc check` reports them as unsupported rather than folded."""
    return op is not None and op.deterministic


def _foldable(graph: Graph, n: Node) -> bool:
    op = lookup(n.op_type, n.domain)
    if not foldable_op(op):
        return False
    present = [v for v in n.inputs if v]
    if all(v in graph.constants for v in present):
        return True
    return shape_fold(op) is not None


@dataclass(frozen=True)
class FoldOptions:
    limit_elems: int = FOLD_LIMIT_ELEMS   # larger results stay computed at run time


@graph_pass("infer_and_fold", options=FoldOptions)
def infer_and_fold(graph: Graph, ctx: PassContext) -> bool:
    """Infer concrete types node by node and fold every node whose result is known.
    Tensors with no elements carry no data: they fold like constants (an empty batch
    runs no kernel at all)."""
    changed = False
    for v in graph.inputs:
        t = graph.values[v]
        if t.is_static and t.numel == 0:
            graph.constants[v] = np.zeros(t.shape, t.dtype)
    for n in list(graph.nodes()):
        types: list[TensorType | None] | None = None   # inferred and size-checked
        if _foldable(graph, n):
            ins = [graph.constants.get(v) if v else None for v in n.inputs]
            kept = _kept_fold(n, ins)
            if kept is not None:
                _fold_to(graph, n, kept)
                changed = True
                continue
            if any(a is not None and a.size == 0 for a in ins) and \
                    _fold_empty(graph, n, infer_node(graph, n)):
                changed = True
                continue
            fold_types = shape_fold(lookup(n.op_type, n.domain))
            if fold_types is not None:
                outs = fold_types(n, [graph.values[v] if v else None for v in n.inputs])
            else:
                # the result's size first (from the constant inputs): a ConstantOfShape,
                # Expand or Tile to a huge shape is a ShapeError, and a result above the
                # fold limit is computed at run time, before NumPy allocates it
                types = _guarded_types(graph, n)
                if types is not None and any(
                        t is not None and t.numel > ctx.options.limit_elems for t in types):
                    outs = None
                else:
                    try:
                        outs = reference_eval(graph, n, ins)
                    except CanncError:
                        raise
                    except Exception as e:
                        raise ModelError(f"cannot evaluate constant node '{n.name}' "
                                         f"({n.op_type}): {type(e).__name__}: {e}") from e
            if outs is not None:
                for v, o in zip(n.outputs, outs):
                    if v and o is not None:
                        check_size(f"value '{v}'", o.shape, o.dtype.itemsize,
                                   f" (folded at node '{n.name}', {n.op_type})")
            if outs is not None and all(o is None or o.size <= ctx.options.limit_elems
                                        for o in outs):
                _fold_to(graph, n, outs)
                _keep_fold(n, ins, [graph.constants.get(v) if v else None for v in n.outputs])
                changed = True
                continue
        if types is None:       # (a node left unfolded above was inferred there already)
            types = infer_node(graph, n)
            _check_types(graph, n, types)
        for v, t in zip(n.outputs, types):
            if v and t is not None:
                graph.values[v] = t
        if _fold_empty(graph, n, types):
            changed = True
            continue
        changed |= _fold_const_outputs(graph, n, types)
    return changed


def _fold_to(graph: Graph, n: Node, outs: list[np.ndarray | None]) -> None:
    """Node n goes; its outputs become these constants."""
    graph.remove_node(n.name)
    for v, o in zip(n.outputs, outs):
        if v and o is not None:
            graph.set_constant(v, o)


# A node folded from large constants of the model itself (a tied embedding transposed for
# the LM head: 154 MB for GPT-2) gives the same arrays at every specialisation, and the
# same array objects let the packed weights made from them be shared too
# (compiler.lowering._replay): GPT-2's new sequence lengths copied and packed that matrix
# again, ~0.9 s each. Kept by node and input identity while the node, its inputs and its
# results live (the sessions' specialisations hold them); constants are never changed in
# place, the base graph's being shared by every specialisation already.
_FOLDS: dict[tuple, tuple[list[weakref.ref | None], list[weakref.ref | None]]] = {}
_FOLDS_LOCK = threading.Lock()   # (sessions specialise in threads of their own)
_BIG_FOLD = 1 << 20     # bytes of the largest input before a fold is kept


def _fold_key(n: Node, ins: list[np.ndarray | None]) -> tuple | None:
    if not any(a is not None and a.nbytes >= _BIG_FOLD for a in ins):
        return None
    return (id(n),) + tuple(id(a) for a in ins)


def _kept_fold(n: Node, ins: list[np.ndarray | None]) -> list[np.ndarray | None] | None:
    key = _fold_key(n, ins)
    if key is None:
        return None
    with _FOLDS_LOCK:
        hit = _FOLDS.get(key)
    if hit is None:
        return None
    srcs, outs = hit
    if any((r() if r is not None else None) is not a for r, a in zip(srcs, [n, *ins])):
        return None
    got = [r() if r is not None else None for r in outs]
    if any(r is not None and g is None for r, g in zip(outs, got)):
        return None
    return got


def _keep_fold(n: Node, ins: list[np.ndarray | None], outs: list[np.ndarray | None]) -> None:
    key = _fold_key(n, ins)
    if key is None:
        return
    entry = ([weakref.ref(x) if x is not None else None for x in [n, *ins]],
             [weakref.ref(o) if o is not None else None for o in outs])
    with _FOLDS_LOCK:
        if len(_FOLDS) >= 1024:
            for k in [k for k, (_, o) in _FOLDS.items() if any(r is not None and r() is None
                                                               for r in o)]:
                del _FOLDS[k]
        _FOLDS[key] = entry


def _check_types(graph: Graph, n: Node, types: list[TensorType | None]) -> None:
    """The size guard on a node's inferred outputs (a Reshape/Expand/Tile/ConstantOfShape
    to a huge shape fails here, naming the value and node, before any code exists); a
    VIEW op's output shares its input's buffer, so it must hold as many elements (ONNX's
    inference does not check a Reshape's element count: a wrong one would let native code
    read past the buffer)."""
    for v, t in zip(n.outputs, types):
        if v and t is not None:
            check_size(f"value '{v}'", t.shape, np.dtype(t.dtype).itemsize,
                       f" (produced by {n.op_type} at node '{n.name}')")
    op = lookup(n.op_type, n.domain)
    if op is not None and op.category == Category.VIEW and n.inputs and n.inputs[0] \
            and types and types[0] is not None:
        src, out = graph.values.get(n.inputs[0]), types[0]
        if src is not None and src.is_static and out.is_static and src.numel != out.numel:
            raise ShapeError(f"{n.op_type} at node '{n.name}' turns {src} "
                             f"({src.numel} elements) into {out} ({out.numel} elements)")


def _guarded_types(graph: Graph, n: Node) -> list[TensorType | None] | None:
    """The inferred output types of a node about to be folded, checked by the size guard;
    None when inference cannot say (the fold then decides)."""
    try:
        types = infer_node(graph, n)
    except Exception:   # (inference needs data it was not given, ...)
        return None
    _check_types(graph, n, types)
    return types


def _fold_const_outputs(graph: Graph, n: Node, types: list[TensorType | None]) -> bool:
    """Outputs the op fixes from the types alone (its `const_outputs`, e.g. inference-mode
    Dropout's mask) become constants; the node keeps computing the others."""
    op = lookup(n.op_type, n.domain)
    if op is None or op.const_outputs is None:
        return False
    known = op.const_outputs(n, [graph.values[v] if v else None for v in n.inputs], types,
                             graph.input_values(n))
    known = {i: a for i, a in known.items() if i < len(n.outputs) and n.outputs[i]}
    if not known:
        return False
    for i, a in known.items():
        graph.set_constant(n.outputs[i], a)
    outs = tuple("" if i in known else v for i, v in enumerate(n.outputs))
    graph.replace_node(n.name, n.replace(outputs=outs))
    return True


def _fold_empty(graph: Graph, n: Node, types: list[TensorType | None]) -> bool:
    """A node all of whose outputs have no elements computes nothing: its outputs become
    empty constants and the node goes."""
    if not all(t is None or t.numel == 0 for t in types):
        return False
    graph.remove_node(n.name)
    for v, t in zip(n.outputs, types):
        if v and t is not None:
            graph.set_constant(v, np.zeros(t.shape, t.dtype))
    return True


@graph_pass("dce")
def dead_code_elimination(graph: Graph, ctx: PassContext) -> bool:
    """Remove nodes none of whose outputs is used, and unused constants."""
    changed = False
    used = set(graph.outputs)
    for n in reversed(list(graph.nodes())):
        if not any(o in used for o in n.outputs if o):
            graph.remove_node(n.name)
            changed = True
        else:
            used.update(v for v in n.inputs if v)
    for c in list(graph.constants):
        if c not in used:
            del graph.constants[c]
            changed = True
    return changed


def bind_input_shapes(graph: Graph, shapes: dict[str, tuple[int, ...]]) -> None:
    """Concrete input shapes, each checked by the size guard (negative, overflowing or
    over-budget shapes are a ShapeError naming the input)."""
    for name in graph.inputs:
        t = graph.values[name]
        check_size(f"input '{name}'", shapes[name], np.dtype(t.dtype).itemsize)
        graph.values[name] = TensorType(t.dtype, tuple(int(d) for d in shapes[name]))




@graph_pass("remove_identities")
def remove_identities(graph: Graph, ctx: PassContext) -> bool:
    """Nodes that forward their input (the op's `forwards_input`: Identity, inference-mode
    Dropout): consumers read the input directly (kept when the output is a graph output,
    which must exist under its own name)."""
    changed = False
    for name in [n.name for n in graph.nodes()]:
        n = graph.node(name)        # re-read: an earlier removal may have rewritten its inputs
        op = lookup(n.op_type, n.domain)
        if op is None or op.forwards_input is None \
                or not op.forwards_input(n, graph.input_values(n)):
            continue
        out, src = n.outputs[0], n.inputs[0]
        if out in graph.outputs:
            continue
        graph.remove_node(n.name)
        graph.replace_uses(out, src)
        changed = True
    return changed
