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

from ...errors import UnsupportedOpError
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

def _axes(n: Node, inputs: list[Any]) -> tuple[int, ...] | None:
    """Squeeze/Unsqueeze axes: the attribute before opset 13, the second input after."""
    if n.opset is not None and n.opset < 13:
        a = n.attrs.get("axes")
    else:
        a = inputs[1] if len(inputs) > 1 else None
    return None if a is None else tuple(int(v) for v in np.asarray(a).reshape(-1))


def _view_reference(n: Node, inputs: list[Any]) -> list[np.ndarray] | None:
    """What the constant folder runs for Identity, Unsqueeze and Squeeze (PyTorch exports
    fold hundreds of them; onnx.reference costs ~0.5 ms a node); None: the general
    evaluator decides (and reports) the rest."""
    x = inputs[0] if inputs else None
    if not isinstance(x, np.ndarray):
        return None
    if n.op_type == "Identity":
        return [x]
    axes = _axes(n, inputs)
    if n.op_type == "Unsqueeze":
        r = x.ndim + len(axes or ())
        if not axes or len({a % r for a in axes if -r <= a < r}) != len(axes):
            return None
        return [np.expand_dims(x, axes)]
    if axes is None:                               # Squeeze every size-1 dim
        return [np.squeeze(x)]
    if not all(-x.ndim <= a < x.ndim and x.shape[a] == 1 for a in axes):
        return None
    return [np.squeeze(x, axis=tuple(a % x.ndim for a in axes))]


for _name in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"):
    register(OpDef(name=_name, category=Category.VIEW, doc="shares its input's buffer",
                   value_inputs=(1,) if _name in ("Reshape", "Squeeze", "Unsqueeze") else (),
                   forwards_input=(lambda n, values: True) if _name == "Identity" else None,
                   reference=_view_reference
                   if _name in ("Squeeze", "Unsqueeze", "Identity") else None))


def _dropout_training(n: Node, values: list[Any]) -> bool | None:
    """Whether the node trains: False without a training_mode input (Dropout-12+) or with
    a constant false one, or when nothing is dropped (a constant ratio of 0); True with a
    constant true; None when training_mode is a runtime input."""
    if len(n.inputs) <= 2 or not n.inputs[2]:
        return False
    t = values[2] if len(values) > 2 else None
    if t is None or np.asarray(t).size != 1:
        return None         # (ONNX requires a scalar)
    if not bool(np.asarray(t).reshape(-1)[0]):
        return False
    r = values[1] if len(values) > 1 and n.inputs[1] else None
    if r is not None and np.asarray(r).size == 1 and float(np.asarray(r).reshape(-1)[0]) == 0:
        return False        # training with ratio 0 drops nothing: the identity as well
    return True


def _dropout_value_check(n: Node, values: list[Any]) -> str | None:
    training = _dropout_training(n, values)
    if training is None:
        return ("training_mode is a runtime input (cannc compiles inference only: it must "
                "be absent or a constant false)")
    if training:
        return "training_mode is a constant true (cannc compiles inference only)"
    if len(n.outputs) > 1 and n.outputs[1]:     # (at inference the folder makes it a constant)
        return "the mask output is used (only inference is supported)"
    return None


def dropout_mask_dtype(n: Node, x: np.dtype) -> np.dtype:
    """Dropout-7/9's mask has the input's type; from Dropout-10 on it is bool."""
    return np.dtype(x) if n.opset < 10 else np.dtype(bool)


def dropout_mask(n: Node, shape: tuple[int, ...], x: np.dtype) -> np.ndarray:
    """The mask at inference, where nothing is dropped. Dropout-12+ defines it as all
    ones (true); before that the spec leaves it unfilled and onnxruntime (the reference
    cannc matches) writes zeros, so that is what cannc gives at those opsets."""
    fill = 1 if n.opset >= 12 else 0
    return np.full(shape, fill, dtype=dropout_mask_dtype(n, x))


def _dropout_infer(n: Node, ins: list[TensorType | None]) -> list[TensorType]:
    """ONNX infers no mask type for Dropout-7/9: the mask has the data's shape."""
    x = ins[0]
    assert x is not None
    outs = [x]
    if len(n.outputs) > 1:
        outs.append(TensorType(dropout_mask_dtype(n, x.dtype), x.shape))
    return outs


def _dropout_const_outputs(n: Node, ins: list[TensorType | None],
                           outs: list[TensorType | None],
                           values: list[Any]) -> dict[int, np.ndarray]:
    """At inference the mask depends on the data's shape only: it becomes a constant and
    the node is left an identity on its data (removed by `remove_identities`)."""
    if len(n.outputs) < 2 or not n.outputs[1] or _dropout_training(n, values) is not False:
        return {}       # no mask, or not known to be inference
    x = ins[0]
    if x is None or not x.is_static:
        return {}
    return {1: dropout_mask(n, tuple(int(d) for d in x.shape), x.dtype)}


def _dropout_reference(n: Node, inputs: list[Any]) -> list[np.ndarray | None]:
    training = len(inputs) > 2 and inputs[2] is not None and bool(np.asarray(inputs[2]))
    ratio = float(np.asarray(inputs[1])) if len(inputs) > 1 and inputs[1] is not None \
        else float(n.attrs.get("ratio", 0.5))
    if training and ratio != 0:
        raise UnsupportedOpError([(n.name, n.op_type, n.domain, n.opset,
                                   "training_mode is true (only inference is supported)")])
    x = np.asarray(inputs[0])
    mask = dropout_mask(n, x.shape, x.dtype) if len(n.outputs) > 1 and n.outputs[1] else None
    return [x, mask] if len(n.outputs) > 1 else [x]


register(OpDef(name="Dropout", category=Category.VIEW, value_check=_dropout_value_check,
               forwards_input=lambda n, values: _dropout_value_check(n, values) is None,
               infer=_dropout_infer, const_outputs=_dropout_const_outputs,
               reference=_dropout_reference,
               doc="inference: the identity (the mask, when declared, a constant)"))


def _needs_constant(what: str):
    def check(n: Node, ins: list[Any], outs: list[Any]) -> str | None:
        return f"{what} must be constant (the output shape would depend on runtime data)"
    return check


# Folded by the constant folder; reaching the compiler means a runtime input decides a shape.
for _name, _what in (("Constant", "value"), ("Range", "start/limit/delta"),
                     ("NonZero", "the input")):
    register(OpDef(name=_name, category=Category.SHAPE, check=_needs_constant(_what),
                   value_inputs={"Range": (0, 1, 2)}.get(_name, ()),
                   doc="folded at compile time"))

# Folded when its shape input is constant and the result small enough; a result larger than
# the folder's limit (a zoo graph's 4096 x 18432 weight) is filled by a kernel instead.
register(OpDef(name="ConstantOfShape", category=Category.OPAQUE, value_inputs=(0,),
               doc="folded at compile time; a fill kernel when too large to fold"))
