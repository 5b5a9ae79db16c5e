"""Concrete input shapes from the few a caller gives (`--shape`, `Session.inspect`,
`cannc.check`), the graph inputs whose *values* decide shapes (value specialisation),
and the one-line type string the reports print."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InputError
from ..ir.graph import Graph
from ..ir.ops import lookup

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
                             f"the model declares rank {len(decl)} {_fmt_dims(decl)}")
        for i, (d, v) in enumerate(zip(decl, shp)):
            if isinstance(d, int) and d != v:
                raise InputError(f"shape {list(shp)} given for input '{name}' does not match "
                                 f"{_fmt_dims(decl)} (dimension {i} must be {d})")
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
    chain of nodes that computes that slot from them (Cast, Identity, Concat, Mul...).
    Nodes whose outputs follow from their inputs' *types* alone (Shape, Size: the op's
    `fold`) end the chain: their inputs' values decide nothing. In graph-input order."""
    stack: list[str] = []
    for n in graph.nodes():
        op = lookup(n.op_type, n.domain)
        for pos in op.value_inputs if op is not None else ():
            if pos < len(n.inputs) and n.inputs[pos]:
                stack.append(n.inputs[pos])
    inputs = set(graph.inputs)
    seen: set[str] = set()
    found: set[str] = set()
    while stack:
        v = stack.pop()
        if v in seen or v in graph.constants:
            continue
        seen.add(v)
        if v in inputs:
            found.add(v)
            continue
        p = graph.producer(v)
        if p is None:
            continue
        op = lookup(p.op_type, p.domain)
        if op is not None and op.fold is not None:
            continue
        stack.extend(i for i in p.inputs if i)
    return tuple(n for n in graph.inputs if n in found)


def type_string(dtype: Any, shape: Sequence[Any]) -> str:
    """'float32[batch, 64]': the dtype's NumPy name and the dims."""
    return f"{np.dtype(dtype).name}[{', '.join(str(d) for d in shape)}]"


def _fmt_dims(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
