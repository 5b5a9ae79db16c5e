"""Recurrent layers: RNN, GRU, LSTM (float32; forward, reverse, bidirectional;
layout 0 and 1; optional biases, sequence lengths, initial states, peepholes).

What the layers are: gates, activations per direction, the support check. Their
kernel (one tile per direction and batch entry) is in codegen/lower/rnn.py.
"""

from __future__ import annotations

import numpy as np

from ..graph import Node
from ..registry import Category, OpDef, register

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
DEFAULT_ACTS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
ACTS = ("Sigmoid", "Tanh", "Relu")


def acts(n: Node) -> list[str]:
    a = n.attrs.get("activations")
    if not a:
        return DEFAULT_ACTS[n.op_type] * ndirs(n)
    return [x.decode() if isinstance(x, bytes) else x for x in a]


def direction(n: Node) -> str:
    d = n.attrs.get("direction", "forward")
    return d.decode() if isinstance(d, bytes) else d


def ndirs(n: Node) -> int:
    return 2 if direction(n) == "bidirectional" else 1


def _check(n: Node, ins: list, outs: list) -> str | None:
    for t in ins[:3]:
        if t is not None and np.dtype(t.dtype) != np.float32:
            return f"dtype {np.dtype(t.dtype).name} (supported: float32)"
    for a in acts(n):
        if a not in ACTS:
            return f"activation {a} (supported: {', '.join(ACTS)})"
    if direction(n) not in ("forward", "reverse", "bidirectional"):
        return f"direction {direction(n)}"
    if n.op_type == "LSTM" and int(n.attrs.get("input_forget", 0)):
        return "input_forget=1"
    return None


def present(n: Node, i: int) -> bool:
    return i < len(n.inputs) and bool(n.inputs[i])


for _name in ("RNN", "GRU", "LSTM"):
    register(OpDef(name=_name, category=Category.OPAQUE, min_opset=7,
                   check=_check, doc="one tile per (direction, batch entry); float32"))
