"""The decomposed erf GELU (x * 0.5 * (1 + Erf(x / sqrt2)), as BERT exports it) becomes one
Gelu op (passes/patterns.py fuse_gelu), in every operand order; near misses stay as they
are; results match onnxruntime either way."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import ort_run
from onnx import TensorProto, helper, numpy_helper

import cannc

R = np.random.default_rng(0)
K, N = 32, 48


def _model(variant: str, scale: float | None = None, extra_out: bool = False):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["h"])]
    if variant == "div":           # HF BERT: (h * (1 + erf(h / sqrt2))) * 0.5
        nodes += [helper.make_node("Div", ["h", "s"], ["d"])]
        c = math.sqrt(2.0) if scale is None else scale
    else:                          # (0.5 * h) * (erf(h * (1/sqrt2)) + 1)
        nodes += [helper.make_node("Mul", ["s", "h"], ["d"])]
        c = math.sqrt(0.5) if scale is None else scale
    nodes += [helper.make_node("Erf", ["d"], ["e"])]
    if variant == "div":
        nodes += [helper.make_node("Add", ["e", "one"], ["e1"]),
                  helper.make_node("Mul", ["h", "e1"], ["g"]),
                  helper.make_node("Mul", ["g", "half"], ["y"])]
    else:
        nodes += [helper.make_node("Add", ["one", "e"], ["e1"]),
                  helper.make_node("Mul", ["half", "h"], ["hh"]),
                  helper.make_node("Mul", ["hh", "e1"], ["y"])]
    inits = {"w": R.standard_normal((K, N)) / 4, "b": R.standard_normal(N),
             "s": np.float32(c), "one": np.float32(1.0), "half": np.float32(0.5)}
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, N])]
    if extra_out:
        outs.append(helper.make_tensor_value_info("e", TensorProto.FLOAT, [3, N]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [3, K])], outs,
                          [numpy_helper.from_array(np.asarray(a, np.float32), n)
                           for n, a in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _epilogues(sess):
    return [k["notes"].get("epilogue") for k in sess.inspect()["kernels"]]


def _check(model, **kw):
    x = (R.standard_normal((3, K)) * 3).astype(np.float32)
    sess = cannc.compile(model, cores=1, **kw)
    for got, want in zip(sess.run(None, {"x": x}), ort_run(model, {"x": x})):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    return sess


@pytest.mark.parametrize("variant", ["div", "mul"])
def test_decomposed_gelu_becomes_gelu(variant):
    sess = _check(_model(variant))
    assert _epilogues(sess) == ["Add+Gelu"]


def test_gelu_rule_can_be_switched_off():
    sess = _check(_model("div"), fusion={"gelu": False})
    assert _epilogues(sess) == ["Add+Div+Erf+Add+Mul+Mul"]


def test_near_misses_stay_decomposed():
    # not 1/sqrt2: an erf of another argument
    assert _epilogues(_check(_model("div", scale=1.5))) == ["Add+Div+Erf+Add+Mul+Mul"]
    # the erf is also a graph output: its value must exist
    sess = _check(_model("div", extra_out=True))
    assert not any(e and "Gelu" in e for e in _epilogues(sess))
