"""Dropout-12/13 with a training_mode input: a constant false (an initializer or a
Constant node) is inference, the identity with an all-true mask; a runtime or true
training_mode is unsupported with the reason (cannc compiles inference only)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.errors import UnsupportedOpError
from tests.helpers import assert_matches_ort

SHAPE = [2, 3, 5]


def _model(opset: int, training: str, *, mask: bool = True, ratio: float = 0.3,
           y_is_output: bool = True) -> onnx.ModelProto:
    """training: 'init-false' | 'init-true' | 'const-false' | 'input'."""
    nodes, inits, inputs = [], [numpy_helper.from_array(np.array(ratio, np.float32), "r")], \
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)]
    if training.startswith("init"):
        inits.append(numpy_helper.from_array(np.array(training == "init-true"), "t"))
    elif training == "const-false":
        nodes.append(helper.make_node("Constant", [], ["t"],
                                      value=numpy_helper.from_array(np.array(False))))
    else:
        inputs.append(helper.make_tensor_value_info("t", TensorProto.BOOL, []))
    nodes.append(helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"] if mask else ["y"],
                                  name="drop"))
    nodes.append(helper.make_node("Relu", ["y"], ["z"]))
    outputs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, SHAPE)]
    if y_is_output:
        outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE))
    if mask:
        outputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, SHAPE))
    m = helper.make_model(helper.make_graph(nodes, "dropout", inputs, outputs, initializer=inits),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _x() -> np.ndarray:
    return np.random.default_rng(13).standard_normal(SHAPE).astype(np.float32)


@pytest.mark.parametrize("opset,training,mask,y_out", [
    (13, "init-false", True, True), (12, "const-false", True, False),
    (13, "const-false", False, True), (12, "init-false", False, False)])
def test_constant_false_training_mode_is_the_identity(opset, training, mask, y_out):
    m = _model(opset, training, mask=mask, y_is_output=y_out)
    got = assert_matches_ort(m, {"x": _x()}, cores=1)
    if mask:
        assert got[-1].dtype == np.bool_ and got[-1].all()


def test_constant_true_training_mode_with_ratio_0_is_the_identity():
    assert_matches_ort(_model(13, "init-true", ratio=0.0), {"x": _x()}, cores=1)


@pytest.mark.parametrize("training,reason", [("init-true", "training_mode is a constant true"),
                                             ("input", "training_mode is a runtime input")])
def test_training_is_unsupported_with_a_reason(training, reason):
    m = _model(13, training)
    with pytest.raises(UnsupportedOpError, match=reason) as e:
        sess = cannc.compile(m, cores=1)
        sess.run(None, {"x": _x(), "t": np.array(True)} if training == "input" else
                 {"x": _x()})
    assert "drop" in str(e.value)
