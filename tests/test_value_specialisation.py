"""Shapes that depend on an input's values (issue 15 item 6): graph inputs that reach a
value slot of some op (Resize scales/sizes, Reshape/Expand/Tile targets, Slice bounds,
Range, ConstantOfShape...) are specialised on their values at run time, cached, like
onnxruntime runs them; every other input stays a runtime input of native code."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import cannc
from cannc.compiler import codegen_counts
from cannc.compiler.shapes import value_deciding_inputs
from cannc.errors import ShapeError
from cannc.frontend import import_model
from cannc.session import MAX_VALUE_PROGRAMS
from tests.helpers import check_session, model_of, ort_run

F32, I64 = np.float32, np.int64
RNG = np.random.default_rng(15)


def _vi(name, dtype, shape):
    return h.make_tensor_value_info(name, dtype, shape)


def _resize_model(slot: str):
    ins = ["x", "", "scales"] if slot == "scales" else ["x", "", "", "sizes"]
    dt = T.FLOAT if slot == "scales" else T.INT64
    return model_of([h.make_node("Resize", ins, ["y"], mode="linear")],
                    [_vi("x", T.FLOAT, [1, 2, 4, 6]), _vi(slot, dt, [4])],
                    [_vi("y", T.FLOAT, [None] * 4)], opset=19)


def test_resize_scales_as_a_graph_input_runs_and_is_cached():
    m = _resize_model("scales")
    s = cannc.compile(m, cores=2)
    assert s.value_inputs == ("scales",)
    x = RNG.standard_normal((1, 2, 4, 6)).astype(F32)
    check_session(s, m, {"x": x, "scales": np.array([1, 1, 2, 1.5], F32)})
    before = codegen_counts()
    x2 = RNG.standard_normal((1, 2, 4, 6)).astype(F32)
    check_session(s, m, {"x": x2, "scales": np.array([1, 1, 2, 1.5], F32)})
    assert codegen_counts() == before          # same values: nothing compiled
    assert len(s.specializations) == 1
    check_session(s, m, {"x": x2, "scales": np.array([1, 1, 0.5, 2], F32)})
    assert len(s.specializations) == 2         # a new value re-specialises


def test_resize_sizes_as_a_graph_input():
    m = _resize_model("sizes")
    s = cannc.compile(m, cores=2)
    x = RNG.standard_normal((1, 2, 4, 6)).astype(F32)
    for sizes in ([1, 2, 8, 9], [1, 2, 3, 3]):
        check_session(s, m, {"x": x, "sizes": np.array(sizes, I64)})


def test_movement_ops_from_graph_inputs():
    """Reshape / Expand / Tile / Slice targets fed at run time, the Reshape target through
    a Cast (a chain that computes the slot from the input)."""
    nodes = [h.make_node("Cast", ["shape32"], ["shape"], to=T.INT64),
             h.make_node("Reshape", ["x", "shape"], ["r"]),
             h.make_node("Expand", ["b", "eshape"], ["e"]),
             h.make_node("Tile", ["b", "reps"], ["t"]),
             h.make_node("Slice", ["x", "starts", "ends", "axes"], ["s"]),
             h.make_node("Relu", ["r"], ["rr"])]
    ins = [_vi("x", T.FLOAT, [4, 6]), _vi("shape32", T.INT32, [3]),
           _vi("b", T.FLOAT, [3, 1]), _vi("eshape", T.INT64, [3]),
           _vi("reps", T.INT64, [2]), _vi("starts", T.INT64, [1]),
           _vi("ends", T.INT64, [1]), _vi("axes", T.INT64, [1])]
    outs = [_vi(n, T.FLOAT, [None] * r) for n, r in (("rr", 3), ("e", 3), ("t", 2), ("s", 2))]
    m = model_of(nodes, ins, outs)
    s = cannc.compile(m, cores=2)
    assert set(s.value_inputs) == {"shape32", "eshape", "reps", "starts", "ends", "axes"}
    x = RNG.standard_normal((4, 6)).astype(F32)
    b = RNG.standard_normal((3, 1)).astype(F32)
    feeds = {"x": x, "shape32": np.array([2, -1, 3], np.int32), "b": b,
             "eshape": np.array([2, 3, 5], I64), "reps": np.array([2, 3], I64),
             "starts": np.array([1], I64), "ends": np.array([-1], I64),
             "axes": np.array([1], I64)}
    check_session(s, m, feeds)
    before = codegen_counts()
    check_session(s, m, dict(feeds, x=-x, b=-b))      # new data, same values: nothing compiled
    assert codegen_counts() == before
    check_session(s, m, dict(feeds, shape32=np.array([3, 2, 4], np.int32),
                      reps=np.array([1, 2], I64)))
    assert len(s.specializations) == 2
    # the data inputs are runtime inputs of the program; the value inputs its constants
    prog = next(iter(s.programs.values()))
    assert set(prog.input_names) == {"x", "b"}


def test_range_and_constant_of_shape_from_graph_inputs():
    nodes = [h.make_node("Range", ["start", "limit", "delta"], ["r"]),
             h.make_node("ConstantOfShape", ["shape"], ["c"],
                         value=h.make_tensor("v", T.FLOAT, [1], [2.5])),
             h.make_node("Add", ["c", "x"], ["y"])]
    ins = [_vi("start", T.FLOAT, []), _vi("limit", T.FLOAT, []), _vi("delta", T.FLOAT, []),
           _vi("shape", T.INT64, [2]), _vi("x", T.FLOAT, [1, 3])]
    m = model_of(nodes, ins, [_vi("r", T.FLOAT, [None]), _vi("y", T.FLOAT, [None, None])])
    s = cannc.compile(m, cores=2)
    x = RNG.standard_normal((1, 3)).astype(F32)
    for lim, shape in ((5.0, [2, 3]), (2.0, [4, 3])):
        check_session(s, m, {"start": np.array(0.5, F32), "limit": np.array(lim, F32),
                      "delta": np.array(0.75, F32), "shape": np.array(shape, I64), "x": x})


def test_shape_ops_end_the_chain_and_data_inputs_stay_runtime():
    """Reshape(x, Shape(x)) and friends: x's values decide nothing."""
    nodes = [h.make_node("Shape", ["x"], ["sh"]),
             h.make_node("Reshape", ["y", "sh"], ["r"])]
    m = model_of(nodes, [_vi("x", T.FLOAT, [2, 3]), _vi("y", T.FLOAT, [6])],
                 [_vi("r", T.FLOAT, [2, 3])])
    g, _ = import_model(m)
    assert value_deciding_inputs(g) == ()


def test_inspect_names_the_value_inputs_and_the_cache_is_bounded():
    m = _resize_model("scales")
    s = cannc.compile(m, cores=1)
    with pytest.raises(ShapeError, match="scales"):
        s.inspect(without_fusion=False)             # nothing ran yet: no values to use
    x = np.ones((1, 2, 4, 6), F32)
    s.run(None, {"x": x, "scales": np.array([1, 1, 2, 2], F32)})
    rep = s.inspect(without_fusion=False)
    vs = rep["value_specialisation"]
    assert vs["inputs"] == ["scales"] and vs["values"]["scales"] == [1, 1, 2, 2]
    assert vs["limit"] == MAX_VALUE_PROGRAMS and "once per distinct value" in vs["note"]
    rep = s.inspect(values={"scales": np.array([1, 1, 1, 2], F32)}, without_fusion=False)
    assert rep["outputs"]["y"] == "float32[1, 2, 4, 12]"
    for i in range(MAX_VALUE_PROGRAMS + 3):
        s.specialize({"x": (1, 2, 4, 6), "scales": (4,)},
                     values={"scales": np.array([1, 1, 1, 1 + (i + 1) / 8], F32)})
    assert len(s.programs) == MAX_VALUE_PROGRAMS


def test_oversized_value_input_is_a_shape_error():
    m = model_of([h.make_node("Reshape", ["x", "shape"], ["y"])],
                 [_vi("x", T.FLOAT, ["n"]), _vi("shape", T.INT64, ["k"])],
                 [_vi("y", T.FLOAT, [None])])
    s = cannc.compile(m, cores=1)
    big = np.ones(70000, I64)
    with pytest.raises(ShapeError, match="'shape' decides shapes"):
        s.run(None, {"x": np.ones(1, F32), "shape": big})


def test_backend_uses_the_session_mechanism():
    import cannc.backend as backend
    m = _resize_model("sizes")
    rep = backend.prepare(m)
    assert rep.value_inputs == ["sizes"]
    x = RNG.standard_normal((1, 2, 4, 6)).astype(F32)
    sizes = np.array([1, 2, 5, 7], I64)
    (y,) = rep.run([x, sizes])
    np.testing.assert_allclose(y, ort_run(m, {"x": x, "sizes": sizes})[0], rtol=1e-4,
                               atol=1e-5)
