"""Before/after graphs of the folding passes."""

import numpy as np
import onnx
from onnx import TensorProto, helper

from cannc.compiler import PIPELINES
from cannc.frontend import import_model
from cannc.passes import fold
from cannc.passes.manager import PassManager


def _reshape_chain_model():
    # y = Reshape(x, Concat(Gather(Shape(x), 0), [-1])) : the PyTorch-exported flatten
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axes"], ["b1"]),
        helper.make_node("Concat", ["b1", "minus1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Relu", ["r"], ["y"]),
    ]
    inits = [helper.make_tensor("zero", TensorProto.INT64, [], [0]),
             helper.make_tensor("axes", TensorProto.INT64, [1], [0]),
             helper.make_tensor("minus1", TensorProto.INT64, [1], [-1])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["batch", 3, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "m"])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_shape_chain_folds_to_a_constant_reshape():
    g, _ = import_model(_reshape_chain_model())
    assert g.num_nodes() == 6
    fold.bind_input_shapes(g, {"x": (5, 3, 4)})
    pm = PassManager(PIPELINES["O1"], verify=True, dump_after={"dce"})
    pm.run(g)
    ops = [n.op_type for n in g.nodes()]
    assert ops == ["Reshape", "Relu"]
    reshape = next(n for n in g.nodes() if n.op_type == "Reshape")
    np.testing.assert_array_equal(g.constants[reshape.inputs[1]], [5, -1])
    assert g.values["y"].shape == (5, 12)
    assert "Relu" in pm.dumps["dce"]
    assert [r.name for r in pm.records] == PIPELINES["O1"]


def test_constant_subgraph_folds():
    nodes = [helper.make_node("Add", ["c1", "c2"], ["c3"]),
             helper.make_node("Mul", ["x", "c3"], ["y"])]
    inits = [helper.make_tensor("c1", TensorProto.FLOAT, [2], [1, 2]),
             helper.make_tensor("c2", TensorProto.FLOAT, [2], [3, 4])]
    m = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], inits),
        opset_imports=[helper.make_opsetid("", 13)])
    g, _ = import_model(m)
    fold.bind_input_shapes(g, {"x": (2,)})
    PassManager(PIPELINES["O1"], verify=True).run(g)
    assert [n.op_type for n in g.nodes()] == ["Mul"]
    np.testing.assert_array_equal(g.constants["c3"], [4, 6])
    assert "c1" not in g.constants  # dead constants are dropped


def test_opset_semantics_are_per_version():
    # Squeeze: axes attribute at opset 11, input at opset 13 — both fold to the same shape
    for opset in (11, 13):
        if opset == 11:
            node = helper.make_node("Squeeze", ["x"], ["y"], axes=[1])
            inits = []
        else:
            node = helper.make_node("Squeeze", ["x", "ax"], ["y"])
            inits = [helper.make_tensor("ax", TensorProto.INT64, [1], [1])]
        m = helper.make_model(helper.make_graph(
            [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 1, 2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "m"])], inits),
            opset_imports=[helper.make_opsetid("", opset)])
        g, _ = import_model(m)
        fold.bind_input_shapes(g, {"x": (3, 1, 2)})
        PassManager(PIPELINES["O1"]).run(g)
        assert g.values["y"].shape == (3, 2)
    assert onnx.defs.onnx_opset_version() >= 13
