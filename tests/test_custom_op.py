"""@cannc.custom_op: the issue's FastGelu and Rope, fusion, runtime dims, errors, --ops."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import cannc
from cannc import te
from cannc.compiler import codegen_counts


@cannc.custom_op("FastGelu", domain="com.example")
def fast_gelu(x):
    return 0.5 * x * (1.0 + te.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


@cannc.custom_op("Rope", domain="com.example")
def rope(x, cos, sin):                    # x [B, S, H, D]; cos, sin [S, D // 2]
    d_model = x.shape[3]
    half = d_model // 2

    def at(b, s, h, d):
        partner = x[b, s, h, (d + half) % d_model]
        sign = te.where(d < half, -1.0, 1.0)
        return x[b, s, h, d] * cos[s, d % half] + sign * partner * sin[s, d % half]
    return te.compute(x.shape, at)


def np_gelu(x):
    return 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def np_rope(x, c, s):
    D = x.shape[3]
    h = D // 2
    d = np.arange(D)
    sign = np.where(d < h, -1.0, 1.0).astype(np.float32)
    cc, ss = c[:, d % h][None, :, None, :], s[:, d % h][None, :, None, :]
    return x * cc + sign * x[..., (d + h) % D] * ss


def _model(B=2, H=3, D=32, W=None, version=1, extra=()):
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]),
             helper.make_node("FastGelu", ["m"], ["g"], domain="com.example"),
             helper.make_node("Rope", ["g", "cos", "sin"], ["y"], domain="com.example"),
             *extra]
    g = helper.make_graph(
        nodes, "m",
        [helper.make_tensor_value_info("x", T.FLOAT, [B, "S", H, D]),
         helper.make_tensor_value_info("cos", T.FLOAT, ["S", D // 2]),
         helper.make_tensor_value_info("sin", T.FLOAT, ["S", D // 2])],
        [helper.make_tensor_value_info("y", T.FLOAT, [B, "S", H, D])],
        [numpy_helper.from_array(W, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid("com.example", version)])


def test_eager_fast_gelu_as_in_the_issue():
    x = np.ones((4, 8), np.float32)
    y = fast_gelu(x)
    assert y.shape == (4, 8) and y.dtype == np.float32
    np.testing.assert_allclose(y, np_gelu(x), rtol=1e-5)
    x2 = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    np.testing.assert_allclose(fast_gelu(x2), np_gelu(x2), rtol=1e-4, atol=1e-6)
    assert len(fast_gelu.sessions) >= 2          # cached per shape
    before = codegen_counts()
    fast_gelu(x)
    assert codegen_counts() == before


def test_rope_model_runtime_seq_lengths_one_fused_gemm(tmp_path):
    rng = np.random.default_rng(1)
    B, H, D = 2, 3, 32
    W = rng.standard_normal((D, D)).astype(np.float32) * 0.2
    path = tmp_path / "model.onnx"
    onnx.save(_model(B, H, D, W), str(path))
    sess = cannc.compile(str(path))
    counts = None
    for S in (5, 7, 12, 9):
        x = rng.standard_normal((B, S, H, D)).astype(np.float32)
        c = rng.standard_normal((S, D // 2)).astype(np.float32)
        s = rng.standard_normal((S, D // 2)).astype(np.float32)
        out = sess.run(None, {"x": x, "cos": c, "sin": s})[0]
        np.testing.assert_allclose(out, np_rope(np_gelu(x @ W), c, s), rtol=1e-4, atol=1e-5)
        if counts is None:
            counts = codegen_counts()
        else:
            assert codegen_counts() == counts, f"new code generated at S={S}"
    kernels = sess.inspect()["kernels"]
    ops = [k["op_types"] for k in kernels]
    assert ["MatMul", "FastGelu"] in ops, ops      # one FusedGemm kernel
    assert ["Rope"] in ops
    assert len(kernels) == 2


def test_unregistered_op_names_it_with_its_domain():
    W = np.eye(32, dtype=np.float32)
    extra = [helper.make_node("NoSuchOp", ["y"], ["z"], domain="com.example")]
    m = _model(W=W, extra=extra)
    m.graph.output[0].name = "z"
    with pytest.raises(cannc.UnsupportedOpError, match="NoSuchOp.*com.example"):
        cannc.compile(m)


def test_version_not_registered():
    m = _model(W=np.eye(32, dtype=np.float32), version=2)
    with pytest.raises(cannc.CanncError, match="version 2 of custom op com.example::"):
        cannc.compile(m)


def test_registered_twice_with_different_bodies():
    @cannc.custom_op("Twice", domain="com.test")
    def a(x):
        return x * 2.0

    @cannc.custom_op("Twice", domain="com.test")   # the same body again: fine
    def a(x):  # noqa: F811
        return x * 2.0

    with pytest.raises(cannc.CanncError, match="registered twice with different bodies"):
        @cannc.custom_op("Twice", domain="com.test")
        def b(x):
            return x * 3.0


def test_body_that_fails_to_trace_names_op_and_line():
    @cannc.custom_op("Broken", domain="com.test")
    def broken(x):
        y = x * 2.0
        if y > 0:            # no truth value at trace time
            return y
        return x

    with pytest.raises(cannc.CanncError, match=r"com.test::Broken.*test_custom_op.py:\d+ "
                                               r"\(if y > 0:"):
        broken(np.ones(4, np.float32))


def test_out_of_range_read_is_a_compile_error():
    @cannc.custom_op("Shift", domain="com.test")
    def shift(x):
        return te.compute(x.shape, lambda i, j: x[i, j + 1])

    with pytest.raises(cannc.CanncError, match=r"com.test::Shift.*outside \[0, 7\]"):
        shift(np.ones((2, 8), np.float32))


def test_cli_ops_flag(tmp_path, capsys):
    from cannc.cli import main
    ops = tmp_path / "my_ops.py"
    ops.write_text("import cannc\nfrom cannc import te\n"
                   "@cannc.custom_op('Twice2', domain='com.cli')\n"
                   "def twice(x):\n    return x * 2.0\n")
    g = helper.make_graph([helper.make_node("Twice2", ["x"], ["y"], domain="com.cli")], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("com.cli", 1)])
    onnx.save(m, str(tmp_path / "t.onnx"))
    assert main(["check", str(tmp_path / "t.onnx"), "--ops", str(ops)]) == 0
    assert main(["compile", str(tmp_path / "t.onnx"), "--ops", str(ops),
                 "-o", str(tmp_path / "t.cnc")]) == 0
