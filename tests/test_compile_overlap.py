"""What a compile does while LLVM compiles in its worker processes: the weights the
kernels read are on the device before the compile waits for the objects
(compiler.control.compile_program), so the program copies none after."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.compiler import lowering
from cannc.runtime.device import shared_device
from tests.helpers import ort_run


def _mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    w0 = numpy_helper.from_array(rng.standard_normal((64, 96)).astype(np.float32), "w0")
    b0 = numpy_helper.from_array(rng.standard_normal(96).astype(np.float32), "b0")
    w1 = numpy_helper.from_array(rng.standard_normal((96, 8)).astype(np.float32), "w1")
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["m"]),
             helper.make_node("Add", ["m", "b0"], ["a"]),
             helper.make_node("Tanh", ["a"], ["t"]),
             helper.make_node("MatMul", ["t", "w1"], ["y"])]
    g = helper.make_graph(nodes, "mlp",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
                          [w0, b0, w1])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_weights_are_on_the_device_before_the_compile_waits_for_llvm(monkeypatch, tmp_path):
    monkeypatch.setenv("CANNC_CACHE_DIR", str(tmp_path))   # nothing cached: LLVM runs
    seen = []
    real = lowering.compile_modules   # (pipeline.specialize imports it when it runs)

    def spy(modules, cache, batch=None):
        seen.append((len(modules), shared_device(1).mem_info().get("weights_bytes", 0)))
        return real(modules, cache, batch)

    monkeypatch.setattr(lowering, "compile_modules", spy)
    before = shared_device(1).mem_info().get("weights_bytes", 0)
    model = _mlp()
    sess = cannc.compile(model.SerializeToString(), cores=1, shapes={"x": (5, 64)})
    after = sess.mem_info().get("weights_bytes", 0)
    (prog,) = sess.programs.values()
    assert len(seen) == 1 and seen[0][0] > 0                 # modules were still compiling
    assert seen[0][1] - before == after - before == prog.weights_bytes > 0
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(model, {"x": x})[0],
                               rtol=1e-4, atol=1e-5)
