"""Ops that only compute shapes or re-label buffers.

Shape-category ops fold to constants as soon as shapes are concrete. View ops
(Reshape, Flatten, Squeeze, Unsqueeze, Identity, Dropout at inference) move no
data: their output shares the input's buffer (the memory planner extends the
lifetime of the shared buffer). Ops whose output shape depends on their input
values (Range, ConstantOfShape, ...) are folded when those values are constant
and otherwise reported as unsupported.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..graph import Node
from ..registry import Category, OpDef, register
from ..types import TensorType


def _shape_fold(n: Node, ins: list[TensorType | None]) -> list[np.ndarray]:
    t = ins[0]
    assert t is not None
    shape = np.array(t.shape, dtype=np.int64)
    if n.op_type == "Size":
        return [np.array(int(np.prod(shape)), dtype=np.int64)]
    r = len(shape)
    start = n.attrs.get("start", 0)
    end = n.attrs.get("end", r)
    start = max(0, min(r, start + r if start < 0 else start))
    end = max(0, min(r, end + r if end < 0 else end))
    return [shape[start:end]]


for _name in ("Shape", "Size"):
    register(OpDef(name=_name, category=Category.SHAPE, fold=_shape_fold,
                   doc="folds to a constant once shapes are known"))

for _name in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"):
    register(OpDef(name=_name, category=Category.VIEW, doc="shares its input's buffer",
                   value_inputs=(1,) if _name in ("Reshape", "Squeeze", "Unsqueeze") else (),
                   forwards_input=(lambda n: True) if _name == "Identity" else None))


def _dropout_check(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
    if len(n.inputs) > 2 and n.inputs[2]:
        return "training_mode given as a runtime input (only inference is supported)"
    if len(n.outputs) > 1 and n.outputs[1]:
        return "the mask output is used (only inference is supported)"
    return None


register(OpDef(name="Dropout", category=Category.VIEW, check=_dropout_check,
               forwards_input=lambda n: _dropout_check(n, [], []) is None,
               doc="inference: the identity"))


def _needs_constant(what: str):
    def check(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
        return f"{what} must be constant (the output shape would depend on runtime data)"
    return check


# Folded by the constant folder; reaching the compiler means a runtime input decides a shape.
for _name, _what in (("Constant", "value"), ("ConstantOfShape", "the shape input"),
                     ("Range", "start/limit/delta"), ("NonZero", "the input")):
    register(OpDef(name=_name, category=Category.SHAPE, check=_needs_constant(_what),
                   value_inputs={"ConstantOfShape": (0,), "Range": (0, 1, 2)}.get(_name, ()),
                   doc="folded at compile time"))
