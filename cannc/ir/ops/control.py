"""Control flow: ops whose attributes hold subgraphs (If, Loop, Scan).

The frontend imports each subgraph attribute as an `ir.Graph` (its own inputs, outputs,
nodes and initializers) and appends the outer-scope values the subgraphs read to the
node's inputs (the *captures*: `If(cond, *captures)`), so that every pass sees those
dependencies. An If whose condition is known at compile time becomes its branch
(`passes/control.py`, asking `branch`). Otherwise the compiled model is a host program
(`compiler/control.py`): the subgraphs are compiled programs, and the host picks the
branch, iterates the Loop body or walks the Scan slices (`control`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..graph import Node
from ..registry import Category, Control, OpDef, register


def own_inputs(n: Node) -> tuple[str, ...]:
    """A control-flow node's ONNX inputs, without the outer values its subgraphs read,
    which the frontend appends to its inputs (the captures)."""
    k = len(n.proto.input) if n.proto is not None else len(n.inputs)
    return tuple(n.inputs[:k])


def _if_branch(n: Node, ins: list[np.ndarray | None]) -> str | None:
    cond = ins[0] if ins else None
    if cond is None:
        return None
    if cond.size != 1:
        return None       # (ONNX requires a single element; the checker reports others)
    return "then_branch" if bool(cond.reshape(-1)[0]) else "else_branch"


def _runtime_only(what: str):
    def check(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
        return (f"{what}: one program cannot hold it (Session compiles a host program "
                "over compiled subgraphs instead: cannc.compiler.control)")
    return check


def scan_layout(n: Node, n_inputs: int) -> tuple[int, list[int], list[int], list[int], list[int]]:
    """Scan: the number of state variables, and per scan input its axis and direction
    (1: reversed), per scan output its axis and direction. `n_inputs` counts the states
    and scan inputs (at opset 8 without the leading sequence_lens). At opset 8 the axes
    are those of one batch entry (the time axis, 0) and only the inputs have directions
    (`directions`); the outputs are stacked forward."""
    m = int(n.attr("num_scan_inputs"))
    states = n_inputs - m
    k = len(n.outputs) - states
    if n.opset < 9:
        return states, [0] * m, list(n.attr("directions", None) or [0] * m), [0] * k, [0] * k
    in_axes = list(n.attr("scan_input_axes", None) or [0] * m)
    in_dirs = list(n.attr("scan_input_directions", None) or [0] * m)
    out_axes = list(n.attr("scan_output_axes", None) or [0] * k)
    out_dirs = list(n.attr("scan_output_directions", None) or [0] * k)
    return states, in_axes, in_dirs, out_axes, out_dirs


register(OpDef(name="If", category=Category.OPAQUE,
               check=_runtime_only("the condition depends on runtime data"),
               subgraphs=("then_branch", "else_branch"), branch=_if_branch,
               control=Control.BRANCH, deterministic=False,
               doc="becomes its branch once the condition is known (passes/control.py); "
                   "else the host picks a compiled branch per run"))
register(OpDef(name="Loop", category=Category.OPAQUE, min_opset=11,
               check=_runtime_only("a loop"), subgraphs=("body",), control=Control.LOOP,
               deterministic=False,
               doc="the host iterates a compiled body (trip count, condition, carried values, "
                   "scan outputs stacked)"))
register(OpDef(name="Scan", category=Category.OPAQUE, min_opset=8,
               check=_runtime_only("a scan"), subgraphs=("body",), control=Control.SCAN,
               deterministic=False,
               doc="the host runs a compiled body per slice of the scan inputs (Scan-8: per "
                   "batch entry, up to its sequence length)"))
