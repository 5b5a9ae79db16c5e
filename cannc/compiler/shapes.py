"""Concrete input shapes from the few a caller gives (`--shape`, `Session.inspect`,
`cannc.check`), the graph inputs whose *values* decide shapes (value specialisation),
and the one-line type string the reports print."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InputError
from ..ir.graph import Graph, Node
from ..ir.ops import lookup
from ..ir.ops.control import own_inputs

Shapes = dict[str, tuple[int, ...]]


def complete_input_shapes(graph: Graph, given: Shapes, known: Sequence[tuple] = ()) -> Shapes:
    """Concrete shapes for every graph input: the given ones; for the others, symbolic
    dims take the value they have in a given input (so `batch` agrees everywhere), else
    the first already compiled specialisation (`known`: keys of compiled programs), else 1."""
    unknown = sorted(set(given) - set(graph.inputs))
    if unknown:
        raise InputError(f"shape given for unknown input(s) {unknown}; "
                         f"the model's inputs are {graph.inputs}")
    if not given and known:
        return dict(zip(graph.inputs, known[0]))
    bound: dict[str, tuple[int, str]] = {}
    for name, shp in given.items():
        decl = graph.values[name].shape
        if len(shp) != len(decl):
            raise InputError(f"shape {list(shp)} given for input '{name}' has rank {len(shp)}, "
                             f"the model declares rank {len(decl)} {fmt_dims(decl)}")
        for i, (d, v) in enumerate(zip(decl, shp)):
            if isinstance(d, int) and d != v:
                raise InputError(f"shape {list(shp)} given for input '{name}' does not match "
                                 f"{fmt_dims(decl)} (dimension {i} must be {d})")
            if isinstance(d, str):
                if d in bound and bound[d][0] != v:
                    raise InputError(f"dimension '{d}' is {bound[d][0]} in input "
                                     f"'{bound[d][1]}' but {v} in input '{name}'")
                bound.setdefault(d, (int(v), name))
    out: Shapes = {}
    for i, name in enumerate(graph.inputs):
        if name in given:
            out[name] = tuple(int(d) for d in given[name])
            continue
        dims = graph.values[name].shape
        fallback = known[0][i] if known and len(known[0][i]) == len(dims) else (1,) * len(dims)
        out[name] = tuple(d if isinstance(d, int) else bound.get(d, (fallback[j],))[0]
                          for j, d in enumerate(dims))
    return out


# A value-deciding input is specialised on values of at most this many elements (the
# limit up to which the shape inference reads a constant's data, passes/fold.py).
VALUE_SPECIALISATION_ELEMS = 1 << 16


def value_deciding_inputs(graph: Graph) -> tuple[str, ...]:
    """The graph inputs whose values decide a shape or a kernel parameter: those that
    reach a value slot of some node (the op's `value_inputs`: a Reshape target, Resize
    scales or sizes, Slice starts, a TopK k, Range bounds...), directly or through any
    chain of nodes that computes that slot from them (Cast, Identity, Concat, Mul...),
    also from inside subgraphs (If branches read outer values). Nodes whose outputs
    follow from their inputs' *types* alone (Shape, Size: the op's `fold`) end the
    chain: their inputs' values decide nothing. In graph-input order."""
    found = _value_sources(graph)
    return tuple(n for n in graph.inputs if n in found)


def _value_sources(graph: Graph, seeds: list[str] | None = None) -> set[str]:
    """Inputs of `graph`, and outer values it reads, whose values reach a value slot (or,
    given `seeds`, decide the values of those)."""
    stack: list[str] = list(seeds or [])
    found: set[str] = set()
    if seeds is None:
        for n in graph.nodes():
            op = lookup(n.op_type, n.domain)
            for pos in op.value_inputs if op is not None else ():
                if pos < len(n.inputs) and n.inputs[pos]:
                    stack.append(n.inputs[pos])
            for a in n.attrs.values():
                if isinstance(a, Graph):
                    stack.extend(_value_sources(a) & set(a.meta.get("captures", ())))
            if op is not None and op.branch is not None:
                found |= _choice_sources(graph, n)
    seen: set[str] = set()
    while stack:
        v = stack.pop()
        if v in seen or v in graph.constants:
            continue
        seen.add(v)
        p = graph.producer(v)
        if p is None:
            found.add(v)                  # an input of this graph, or an outer value
            continue
        op = lookup(p.op_type, p.domain)
        if op is not None and op.fold is not None:
            continue
        subs = [a for a in p.attrs.values() if isinstance(a, Graph)]
        if not subs:
            stack.extend(i for i in p.inputs if i)
            continue
        # control flow: its own inputs, and the captures its subgraphs compute `v` from
        stack.extend(i for i in own_inputs(p) if i)
        i = p.outputs.index(v)
        for sub in subs:
            if i < len(sub.outputs):
                stack.extend(_value_sources(sub, [sub.outputs[i]])
                             & set(sub.meta.get("captures", ())))
    return found


def _choice_sources(graph: Graph, n: Node) -> set[str]:
    """The inputs that pick a control-flow node's subgraph (an If condition), when the
    choice is made of single elements all the way from graph inputs (a boolean input,
    a Not or a comparison of scalars): specialising on those costs a compile per
    distinct choice. A choice computed from larger data stays a runtime choice."""
    stack, seen, found = [v for v in own_inputs(n) if v], set(), set()
    while stack:
        v = stack.pop()
        if v in seen or v in graph.constants:
            continue
        seen.add(v)
        t = graph.values.get(v)
        if t is None or not t.is_static or t.numel != 1:
            return set()
        p = graph.producer(v)
        if p is None:
            found.add(v)
            continue
        op = lookup(p.op_type, p.domain)
        if op is None or op.subgraphs:
            return set()
        if op.fold is None:
            stack.extend(i for i in p.inputs if i)
    return found


def type_string(dtype: Any, shape: Sequence[Any]) -> str:
    """'float32[batch, 64]': the dtype's NumPy name and the dims."""
    return f"{np.dtype(dtype).name}[{', '.join(str(d) for d in shape)}]"


def fmt_dims(shape: Sequence[Any]) -> str:
    """'[batch, 64]'."""
    return "[" + ", ".join(str(d) for d in shape) + "]"
