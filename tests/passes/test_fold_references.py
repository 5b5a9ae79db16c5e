"""The constant folder's own NumPy references (Identity, Squeeze, Unsqueeze, Concat,
Gather) agree with onnx.reference, and leave to it the cases they do not take."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from cannc.ir.graph import Graph, Node
from cannc.passes import fold


def _node(op: str, n_in: int, opset: int, **attrs) -> Node:
    ins = tuple(f"i{k}" for k in range(n_in))
    return Node(name="n", op_type=op, inputs=ins, outputs=("o",), attrs=attrs, opset=opset)


def _onnx(graph: Graph, n: Node, inputs):
    from onnx.reference import ReferenceEvaluator
    vi = [helper.make_value_info(v, helper.make_empty_tensor_value_info(v).type)
          for v in n.inputs]
    g = helper.make_graph([fold.node_proto(n)], "g", vi,
                          [helper.make_empty_tensor_value_info("o")])
    ev = ReferenceEvaluator(g, opsets={"": n.opset})
    return ev.run(None, dict(zip(n.inputs, inputs)))


x = np.arange(24, dtype=np.int64).reshape(2, 1, 3, 4)
CASES = [
    (_node("Identity", 1, 17), [x]),
    (_node("Unsqueeze", 2, 13), [x, np.array([0, -1], np.int64)]),
    (_node("Unsqueeze", 1, 11, axes=[1, 3]), [x]),
    (_node("Squeeze", 2, 13), [x, np.array([-3], np.int64)]),
    (_node("Squeeze", 1, 11, axes=[1]), [x]),
    (_node("Squeeze", 1, 13), [x]),
    (_node("Concat", 3, 13, axis=-1), [x, x + 1, x[..., :2]]),
    (_node("Gather", 2, 13, axis=2), [x, np.array([[2, -1], [0, 0]], np.int32)]),
    (_node("Gather", 2, 13, axis=0), [x, np.array(-2, np.int64)]),
]


@pytest.mark.parametrize("n, inputs", CASES, ids=[f"{c[0].op_type}-{i}" for i, c in
                                                  enumerate(CASES)])
def test_own_references_match_onnx_reference(n, inputs):
    g = Graph("g")
    g.opsets = {"": n.opset}
    got = fold.reference_eval(g, n, inputs)
    exp = _onnx(g, n, inputs)
    assert len(got) == 1 and got[0].dtype == exp[0].dtype
    np.testing.assert_array_equal(got[0], exp[0])


def test_out_of_range_cases_are_left_to_onnx_reference():
    from cannc.ir.ops.movement import _gather_reference
    from cannc.ir.ops.shape_ops import _view_reference
    assert _gather_reference(_node("Gather", 2, 13, axis=2), [x, np.array([3])]) is None
    assert _view_reference(_node("Squeeze", 2, 13), [x, np.array([0])]) is None
    assert _view_reference(_node("Unsqueeze", 2, 13), [x, np.array([0, 0])]) is None
