"""One helper to compare cannc with onnxruntime (and with the NumPy reference)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.ir.types import NP_TO_ONNX


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], threads: int = 1) -> list:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def single_node_model(op_type: str, inputs: Sequence[np.ndarray | None], n_outputs: int = 1,
                      opset: int = 17, const_inputs: Sequence[int] = (), domain: str = "",
                      output_dtypes: Sequence[Any] | None = None, **attrs: Any
                      ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A model with one node. inputs[i] None means an absent optional input; indices in
    const_inputs become initializers, the others graph inputs (returned as feeds)."""
    names, graph_inputs, inits, feeds = [], [], [], {}
    for i, a in enumerate(inputs):
        if a is None:
            names.append("")
            continue
        nm = f"in{i}"
        names.append(nm)
        a = np.asarray(a)
        if i in const_inputs:
            inits.append(numpy_helper.from_array(a, nm))
        else:
            graph_inputs.append(helper.make_tensor_value_info(nm, NP_TO_ONNX[a.dtype], a.shape))
            feeds[nm] = a
    outs = [f"out{j}" for j in range(n_outputs)]
    node = helper.make_node(op_type, names, outs, domain=domain or None, **attrs)
    out_vi = []
    for j, o in enumerate(outs):
        et = TensorProto.UNDEFINED if output_dtypes is None else NP_TO_ONNX[np.dtype(output_dtypes[j])]
        out_vi.append(helper.make_tensor_value_info(o, et, None))
    g = helper.make_graph([node], f"{op_type.lower()}_test", graph_inputs, out_vi, initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = min(m.ir_version, 9)
    # let ONNX fill in the output types so the checker is satisfied
    m = onnx.shape_inference.infer_shapes(m)
    for vi in m.graph.output:
        for v in m.graph.value_info:
            if v.name == vi.name:
                vi.CopyFrom(v)
    return m, feeds


def assert_matches_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
                       rtol: float = 1e-4, atol: float = 1e-5, cores: int = 2,
                       **compile_opts: Any) -> list[np.ndarray]:
    """Compile with cannc, run, and compare every output with onnxruntime:
    same dtype, same shape, values within tolerance (exact for ints/bools)."""
    expected = ort_run(model, feeds)
    sess = cannc.compile(model, cores=cores, shapes={k: v.shape for k, v in feeds.items()},
                         **compile_opts)
    got = sess.run(None, feeds)
    assert len(got) == len(expected)
    for g, e, o in zip(got, expected, model.graph.output):
        e = np.asarray(e)
        assert g.dtype == e.dtype, f"{o.name}: dtype {g.dtype} != {e.dtype}"
        assert g.shape == e.shape, f"{o.name}: shape {g.shape} != {e.shape}"
        if e.dtype.kind in "fc":
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=o.name)
        else:
            np.testing.assert_array_equal(g, e, err_msg=o.name)
    return got


def check_op(op_type: str, inputs: Sequence[np.ndarray | None], n_outputs: int = 1,
             opset: int = 17, const_inputs: Sequence[int] = (), rtol: float = 1e-4,
             atol: float = 1e-5, cores: int = 2, **attrs: Any) -> list[np.ndarray]:
    """Single-node model: cannc vs onnxruntime."""
    m, feeds = single_node_model(op_type, inputs, n_outputs, opset, const_inputs, **attrs)
    return assert_matches_ort(m, feeds, rtol=rtol, atol=atol, cores=cores)
