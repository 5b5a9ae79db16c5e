"""Control flow: ops whose attributes hold subgraphs (If; Loop and Scan are not defined
yet, so a model using them gets the usual UnsupportedOpError naming them).

The frontend imports each subgraph attribute as an `ir.Graph` (its own inputs, outputs,
nodes and initializers) and appends the outer-scope values the subgraphs read to the
node's inputs (the *captures*: `If(cond, *captures)`), so that every pass sees those
dependencies. An If whose condition is known at compile time becomes its branch
(`passes/control.py`, asking `branch`); one chosen by runtime data makes the compiled
model a host program whose branches are compiled programs (`compiler/control.py`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..graph import Node
from ..registry import Category, OpDef, register


def _if_branch(n: Node, ins: list[np.ndarray | None]) -> str | None:
    cond = ins[0] if ins else None
    if cond is None:
        return None
    if cond.size != 1:
        return None       # (ONNX requires a single element; the checker reports others)
    return "then_branch" if bool(cond.reshape(-1)[0]) else "else_branch"


def _if_check(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    return ("the condition depends on runtime data: one program holds an If only when its "
            "condition is known at compile time (Session compiles a host program instead: "
            "cannc.compiler.control)")


register(OpDef(name="If", category=Category.OPAQUE, check=_if_check,
               subgraphs=("then_branch", "else_branch"), branch=_if_branch,
               deterministic=False,
               doc="becomes its branch once the condition is known (passes/control.py)"))
