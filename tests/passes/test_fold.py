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


def test_inference_is_kept_for_what_it_reads(monkeypatch):
    """ONNX's node inference runs once per (op, opset, attributes, input types, small
    constant values): repeated layers and another specialisation reuse it, and nodes
    that differ in any of those (a Reshape target, a Transpose perm) do not."""
    calls = []
    real = onnx.shape_inference.infer_node_outputs

    def counted(*a, **k):
        calls.append(a[1].op_type)
        return real(*a, **k)
    monkeypatch.setattr(onnx.shape_inference, "infer_node_outputs", counted)
    monkeypatch.setattr(fold, "_INFER_MEMO", {})
    nodes, inits, x = [], [], "x"
    for i in range(4):          # four identical layers, then two that differ
        nodes += [helper.make_node("Transpose", [x], [f"t{i}"], perm=[1, 0]),
                  helper.make_node("Relu", [f"t{i}"], [f"y{i}"])]
        x = f"y{i}"
    inits += [helper.make_tensor("s1", TensorProto.INT64, [2], [8, 2]),
              helper.make_tensor("s2", TensorProto.INT64, [2], [2, 8])]
    nodes += [helper.make_node("Reshape", [x, "s1"], ["r1"]),
              helper.make_node("Reshape", ["r1", "s2"], ["r2"]),
              helper.make_node("Transpose", ["r2"], ["out"], perm=[1, 0])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["n", 4])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                          inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    shapes = []
    for n in (4, 4, 4):
        graph, _ = import_model(model)
        fold.bind_input_shapes(graph, {"x": (n, 4)})
        PassManager(PIPELINES["O0"]).run(graph)
        shapes.append([graph.values[v].shape for v in ("y3", "r1", "r2", "out")])
    assert shapes[0] == [(4, 4), (8, 2), (2, 8), (8, 2)]
    assert shapes[1] == shapes[2] == shapes[0]
    # first pass: Transpose and Relu at (4, 4) once each, both Reshapes, the last Transpose
    # ((2, 8) in); the second and third imports ask nothing again
    assert sorted(calls) == sorted(["Transpose", "Relu", "Reshape", "Reshape", "Transpose"])


def test_kept_inference_tells_narrow_float_types_apart(monkeypatch):
    """ml_dtypes' narrow floats share a numpy .str ('<V1' for float4_e2m1fn and
    float8_e4m3fn alike): a CastLike to one must not answer one to the other (the ONNX node
    tests met this, test_castlike_FLOAT16_to_FLOAT4E2M1 then ..._FLOAT8E4M3FN)."""
    monkeypatch.setattr(fold, "_INFER_MEMO", {})
    got = []
    for elem in (TensorProto.FLOAT4E2M1, TensorProto.FLOAT8E4M3FN):
        g = helper.make_graph(
            [helper.make_node("CastLike", ["x", "like"], ["y"])], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [3]),
             helper.make_tensor_value_info("like", elem, [1])],
            [helper.make_tensor_value_info("y", elem, [3])])
        graph, _ = import_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]))
        fold.bind_input_shapes(graph, {"x": (3,), "like": (1,)})
        PassManager(PIPELINES["O0"]).run(graph)
        got.append(np.dtype(graph.values["y"].dtype).name)
    assert got == ["float4_e2m1fn", "float8_e4m3fn"]


def test_a_large_fold_is_the_same_array_at_every_specialisation():
    """A tied embedding transposed for the LM head (GPT-2's dynamo export): the fold of
    the model's own large constant is made once, and the same array serves every input
    shape, so the GEMM's packed weights made from it are shared too (a new sequence length
    copied and packed 154 MB again). A smaller model of the same form; outputs against
    onnxruntime at each shape."""
    from onnx import numpy_helper

    import cannc
    from tests.helpers import ort_run

    rng = np.random.default_rng(0)
    w = rng.standard_normal((700, 512)).astype(np.float32)       # 1.4 MB
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["batch", "seq", 512])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, ["batch", "seq", 700])], [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    sess = cannc.compile(m, cores=1)
    for s in (5, 9):
        x = rng.standard_normal((1, s, 512)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(m, {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)
    specs = sess.specializations
    assert len(specs) == 3            # the default shapes, then the two runs'
    big = [{id(a) for a in sp.constants.values() if a.nbytes >= 1 << 20} for sp in specs]
    assert big[0] and big[0] == big[1] == big[2], big
