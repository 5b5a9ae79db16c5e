"""The pass manager and single passes, before and after (tests/helpers.run_pass)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from helpers import model_of, pass_graph, run_pass
from onnx import helper

from cannc.backend import shape_deciding_inputs
from cannc.errors import CompileError
from cannc.ir.graph import Node
from cannc.passes.manager import PassContext, PassManager, graph_pass, registered_passes

F32 = np.float32


def _chain(*ops: str, shape=(4, 8)):
    """x -> ops[0] -> ops[1] -> ... -> y"""
    vals = ["x"] + [f"t{i}" for i in range(len(ops) - 1)] + ["y"]
    nodes = [helper.make_node(op, [a], [b], name=f"{op.lower()}{i}")
             for i, (op, a, b) in enumerate(zip(ops, vals, vals[1:]))]
    return pass_graph(nodes, {"x": (F32, shape)}, ["y"])


def test_remove_identities_forwards_the_input():
    r = run_pass("remove_identities", _chain("Relu", "Identity", "Dropout", "Exp"))
    assert r.changed
    assert r.before.ops == ["Relu", "Identity", "Dropout", "Exp"]
    assert r.after.ops == ["Relu", "Exp"]
    assert r.graph.node("exp3").inputs == ("t0",)


def test_remove_identities_keeps_dropout_with_its_mask_and_graph_outputs():
    nodes = [helper.make_node("Dropout", ["x"], ["y", "mask"], name="drop"),
             helper.make_node("Identity", ["x"], ["z"], name="id")]
    g = pass_graph(nodes, {"x": (F32, (3,))}, ["y", "mask", "z"])
    r = run_pass("remove_identities", g)
    assert not r.changed and r.after.ops == r.before.ops == ["Dropout", "Identity"]


def test_fold_option_limits_the_size_of_folded_results():
    nodes = [helper.make_node("Add", ["c1", "c2"], ["c3"], name="add"),
             helper.make_node("Mul", ["x", "c3"], ["y"], name="mul")]
    inits = {"c1": np.arange(6, dtype=F32), "c2": np.ones(6, F32)}
    r = run_pass("infer_and_fold", pass_graph(nodes, {"x": (F32, (6,))}, ["y"], inits))
    assert r.before.ops == ["Add", "Mul"] and r.after.ops == ["Mul"]
    np.testing.assert_array_equal(r.after.constants["c3"], np.arange(6) + 1)
    r = run_pass("infer_and_fold", pass_graph(nodes, {"x": (F32, (6,))}, ["y"], inits),
                 limit_elems=4)
    assert r.after.ops == ["Add", "Mul"] and "c3" not in r.after.constants
    assert r.after.values["c3"] == ("float32", (6,))


def test_fusion_epilogue_and_its_switch():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"], name="mm"),
             helper.make_node("Add", ["t", "b"], ["u"], name="add"),
             helper.make_node("Relu", ["u"], ["y"], name="relu")]
    inits = {"w": np.ones((8, 16), F32), "b": np.ones(16, F32)}
    g = pass_graph(nodes, {"x": (F32, (4, 8))}, ["y"], inits)
    r = run_pass("fusion", g)
    assert r.before.ops == ["MatMul", "Add", "Relu"] and r.after.ops == ["FusedGemm"]
    assert r.after.values["y"] == r.before.values["y"] == ("float32", (4, 16))

    g = pass_graph(nodes, {"x": (F32, (4, 8))}, ["y"], inits)
    r = run_pass("fusion", g, fusion={"gemm_epilogue": False})
    assert r.after.ops == ["MatMul", "FusedMap"]
    assert [(d.producer, d.consumer, d.rule, d.reason) for d in g.meta["fusion_log"]] == \
        [("mm", "add", "gemm_epilogue", "rule switched off")]


def test_fusion_refusal_reason_comes_from_the_operand_check():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"], name="mm"),
             helper.make_node("Add", ["t", "b"], ["y"], name="add")]
    inits = {"w": np.ones((2, 8, 16), F32), "b": np.ones((2, 4, 16), F32)}
    g = pass_graph(nodes, {"x": (F32, (2, 4, 8))}, ["y"], inits)
    r = run_pass("fusion", g)
    assert r.after.ops == ["MatMul", "Add"]
    (d,) = g.meta["fusion_log"]
    assert d.rule == "gemm_epilogue" and d.reason == (
        "epilogue operand 'b' of shape [2, 4, 16] is not a scalar, row, column or full "
        "tensor of the GEMM's output")


def test_softmax_prologue_from_the_registry():
    nodes = [helper.make_node("Mul", ["x", "s"], ["t"], name="scale"),
             helper.make_node("Add", ["t", "m"], ["u"], name="mask"),
             helper.make_node("Softmax", ["u"], ["y"], name="sm", axis=-1)]
    inits = {"s": np.array(0.5, F32), "m": np.zeros((1, 16), F32)}
    g = pass_graph(nodes, {"x": (F32, (4, 16))}, ["y"], inits)
    assert run_pass("fusion", g).after.ops == ["FusedSoftmax"]
    g = pass_graph(nodes, {"x": (F32, (4, 16))}, ["y"], inits)
    assert run_pass("fusion", g, fusion=False).after.ops == ["Mul", "Add", "Softmax"]


def test_a_misspelt_pass_name_lists_the_known_ones():
    with pytest.raises(CompileError, match=r"unknown pass 'fusoin'; known passes: .*\bfusion\b"):
        PassManager(["infer_and_fold", "fusoin"])
    assert "fusion" in registered_passes()


def test_a_pass_name_is_registered_once():
    with pytest.raises(CompileError, match=r"pass 'dce' is registered twice"):
        @graph_pass("dce")
        def dce_again(graph, ctx):  # pragma: no cover - never registered
            return False


def test_unknown_options_are_errors():
    with pytest.raises(CompileError, match=r"unknown option\(s\) limit for pass "
                                           r"'infer_and_fold'; its options: limit_elems"):
        PassManager(["infer_and_fold"], PassContext(pass_options={"infer_and_fold":
                                                                  {"limit": 1}}))
    with pytest.raises(CompileError, match=r"pass 'dce' takes no options"):
        PassManager(["dce"], PassContext(pass_options={"dce": {"x": 1}}))
    with pytest.raises(CompileError, match=r"unknown pass 'nope'"):
        PassManager(["dce"], PassContext(pass_options={"nope": {}}))


def test_the_context_is_frozen_and_typed():
    ctx = PassContext(fusion={"elementwise": False})
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.fusion = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        ctx.fusion["elementwise"] = True  # type: ignore[index]
    assert not ctx.fusion_enabled("elementwise") and ctx.fusion_enabled("gemm_epilogue")
    assert ctx.target is None and ctx.tuning
    assert not PassContext(fusion=False).fusion_enabled("conv_bn")


def test_the_ir_is_verified_before_the_first_pass():
    g = _chain("Relu", "Exp")
    g.add_node(Node(name="bad", op_type="Relu", inputs=("nowhere",), outputs=("z",)))
    with pytest.raises(CompileError, match=r"IR invalid before pass 'dce'"):
        PassManager(["dce"], verify=True).run(g)


def test_errors_name_the_pass():
    @graph_pass("test_broken_pass")
    def broken(graph, ctx):
        raise RuntimeError("boom")

    with pytest.raises(CompileError, match=r"pass 'test_broken_pass' failed: RuntimeError: boom"):
        PassManager(["test_broken_pass"]).run(_chain("Relu"))


def test_value_deciding_inputs_come_from_the_registry():
    vis = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3]),
           helper.make_tensor_value_info("shape", onnx.TensorProto.INT64, [1]),
           helper.make_tensor_value_info("k", onnx.TensorProto.INT64, [1])]
    out = [helper.make_tensor_value_info(v, t, [None, None]) for v, t in
           (("y", onnx.TensorProto.FLOAT), ("vals", onnx.TensorProto.FLOAT),
            ("idx", onnx.TensorProto.INT64))]
    m = model_of([helper.make_node("Reshape", ["x", "shape"], ["y"]),
                  helper.make_node("TopK", ["x", "k"], ["vals", "idx"]),
                  helper.make_node("Relu", ["x"], ["r"])], vis, out)
    assert shape_deciding_inputs(m) == ["shape", "k"]


# -- the public API: options reach the passes, and misspelt ones fail at compile() -----

def _add_mul_model() -> onnx.ModelProto:
    nodes = [helper.make_node("Add", ["c1", "c2"], ["c3"], name="add"),
             helper.make_node("Mul", ["x", "c3"], ["y"], name="mul")]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [6])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [6])],
        [onnx.numpy_helper.from_array(np.arange(6, dtype=F32), "c1"),
         onnx.numpy_helper.from_array(np.ones(6, F32), "c2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_compile_hands_pass_options_to_the_pass():
    import cannc

    x = np.arange(6, dtype=F32)
    folded = cannc.compile(_add_mul_model(), cores=1)
    kept = cannc.compile(_add_mul_model(), cores=1,
                         pass_options={"infer_and_fold": {"limit_elems": 4}})
    want = x * (np.arange(6) + 1)
    np.testing.assert_allclose(folded.run(None, {"x": x})[0], want)
    np.testing.assert_allclose(kept.run(None, {"x": x})[0], want)
    # the Add stayed a kernel of its own (folded: only the Mul, fused or not, is left)
    ops = lambda s: [op for k in s.inspect(without_fusion=False)["kernels"] for op in k["op_types"]]
    assert "Add" in ops(kept) and "Add" not in ops(folded)


@pytest.mark.parametrize("kw, message", [
    ({"pass_options": {"infer_and_fold": {"limit": 4}}}, "its options: limit_elems"),
    ({"pass_options": {"fold_everything": {}}}, "unknown pass 'fold_everything'"),
    ({"dump_after": ["fusoin"]}, "'fusoin', which the pipeline does not run"),
    ({"fusoin": False}, "unknown option fusoin; cannc.compile takes"),
])
def test_compile_rejects_misspelt_options(kw, message):
    import cannc
    from cannc.errors import CanncError

    with pytest.raises(CanncError, match=message):
        cannc.compile(_add_mul_model(), cores=1, eager=False, **kw)
