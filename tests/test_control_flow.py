"""Control flow (issue 15 item 5): subgraphs are imported (outer-scope values included)
and an If whose condition is known at compile time becomes its branch; compared with
onnxruntime on models built with onnx.helper."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import cannc
from cannc.compiler.control import ControlProgram
from cannc.errors import UnsupportedOpError
from cannc.frontend import import_model
from tests.helpers import check_session, model_of, ort_run

F32, I64 = np.float32, np.int64
RNG = np.random.default_rng(5)


def _vi(name, dtype, shape):
    return h.make_tensor_value_info(name, dtype, shape)


def _branches(prefix=""):
    """then: Relu(x) + c (an initializer of the branch), else: -x; both read the outer x."""
    then = h.make_graph([h.make_node("Relu", ["x"], ["t"]),
                         h.make_node("Constant", [], ["c"],
                                     value=nh.from_array(np.array(1.5, F32))),
                         h.make_node("Add", ["t", "c"], ["out"])],
                        "then", [], [_vi("out", T.FLOAT, None)])
    els = h.make_graph([h.make_node("Neg", ["x"], ["out"])], "else", [],
                       [_vi("out", T.FLOAT, None)])
    return then, els


def _torch_style_if():
    """`y = relu(x) + 1.5 if x.size(0) > 1 else -x; z = y * y` as torch.onnx exports it."""
    then, els = _branches()
    nodes = [h.make_node("Shape", ["x"], ["s"]),
             h.make_node("Gather", ["s", "zero"], ["d0"], axis=0),
             h.make_node("Greater", ["d0", "one"], ["gt"]),
             h.make_node("Cast", ["gt"], ["cond"], to=T.BOOL),
             h.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=els),
             h.make_node("Mul", ["y", "y"], ["z"])]
    inits = [nh.from_array(np.array(0, I64), "zero"), nh.from_array(np.array(1, I64), "one")]
    return model_of(nodes, [_vi("x", T.FLOAT, ["n", 3])], [_vi("z", T.FLOAT, ["n", 3])], inits)


def test_frontend_imports_subgraphs_with_their_captures():
    g, _ = import_model(_torch_style_if())
    node = next(n for n in g.nodes() if n.op_type == "If")
    assert node.inputs == ("cond", "x")                  # the outer x is a capture
    then = node.attrs["then_branch"]
    assert then.meta["captures"] == ["x"]
    assert [n.op_type for n in then.nodes()] == ["Relu", "Constant", "Add"]


def test_if_on_a_shape_condition_becomes_its_branch():
    m = _torch_style_if()
    s = cannc.compile(m, cores=2)
    for n in (1, 4):                                     # else, then
        check_session(s, m, {"x": RNG.standard_normal((n, 3)).astype(F32)})
    ops = [[t for k in p.kernels for t in k.op_types] for p in s.specializations]
    assert all("If" not in o for o in ops)
    assert any("Neg" in o for o in ops) and any("Relu" in o for o in ops)


def test_nested_and_repeated_ifs_with_clashing_inner_names():
    """Two Ifs whose branches use the same inner names; the second's then-branch holds a
    nested If reading a value of the enclosing branch and the outer graph."""
    then1, else1 = _branches()
    inner_then = h.make_graph([h.make_node("Mul", ["t", "x"], ["out"])], "it", [],
                              [_vi("out", T.FLOAT, None)])
    inner_else = h.make_graph([h.make_node("Sub", ["t", "x"], ["out"])], "ie", [],
                              [_vi("out", T.FLOAT, None)])
    then2 = h.make_graph([h.make_node("Sigmoid", ["y1"], ["t"]),
                          h.make_node("If", ["f"], ["out"], then_branch=inner_then,
                                      else_branch=inner_else)],
                         "then2", [], [_vi("out", T.FLOAT, None)])
    _, else2 = _branches()
    nodes = [h.make_node("If", ["tr"], ["y1"], then_branch=then1, else_branch=else1),
             h.make_node("If", ["tr"], ["y2"], then_branch=then2, else_branch=else2)]
    inits = [nh.from_array(np.array(True), "tr"), nh.from_array(np.array(False), "f")]
    m = model_of(nodes, [_vi("x", T.FLOAT, [2, 5])],
                 [_vi("y1", T.FLOAT, [2, 5]), _vi("y2", T.FLOAT, [2, 5])], inits)
    s = cannc.compile(m, cores=2)
    check_session(s, m, {"x": RNG.standard_normal((2, 5)).astype(F32)})


def test_branch_output_that_is_a_capture_or_an_initializer():
    then = h.make_graph([h.make_node("Identity", ["x"], ["o"])], "then", [],
                        [_vi("o", T.FLOAT, None)])
    els = h.make_graph([], "else", [], [_vi("k", T.FLOAT, None)],
                       [nh.from_array(np.zeros((2, 2), F32), "k")])
    for cond in (True, False):
        m = model_of([h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=els),
                      h.make_node("Add", ["y", "x"], ["z"])],
                     [_vi("x", T.FLOAT, [2, 2])], [_vi("z", T.FLOAT, [2, 2])],
                     [nh.from_array(np.array([cond]), "c")])
        check_session(cannc.compile(m, cores=1), m, {"x": RNG.standard_normal((2, 2)).astype(F32)})


def test_a_value_slot_inside_a_branch_is_value_specialised():
    """A Reshape target read inside a branch from a graph input: specialised on its value."""
    then = h.make_graph([h.make_node("Reshape", ["x", "shape"], ["out"])], "then", [],
                        [_vi("out", T.FLOAT, None)])
    els = h.make_graph([h.make_node("Identity", ["x"], ["out"])], "else", [],
                       [_vi("out", T.FLOAT, None)])
    m = model_of([h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=els)],
                 [_vi("x", T.FLOAT, [2, 6]), _vi("shape", T.INT64, [2])],
                 [_vi("y", T.FLOAT, [None, None])], [nh.from_array(np.array(True), "c")])
    s = cannc.compile(m, cores=1)
    assert s.value_inputs == ("shape",)
    x = RNG.standard_normal((2, 6)).astype(F32)
    for shape in ([3, 4], [12, 1]):
        check_session(s, m, {"x": x, "shape": np.array(shape, I64)})


def test_one_program_pipeline_reports_a_runtime_condition_by_node():
    """`compiler.specialize` makes one program: an If on runtime data cannot be one."""
    from cannc.compiler import CompileOptions, specialize
    g, _ = import_model(_runtime_if_model())
    with pytest.raises(UnsupportedOpError, match="node 'pick': If .*condition depends on "
                                                 "runtime data"):
        specialize(g, {"x": (2, 3), "w": (3,)}, CompileOptions())


def _loop_model(with_cond: bool):
    """v = v0; for i < n (and while sum(v) < limit): v = v * 0.5 + x + i; collect v."""
    body = h.make_graph(
        [h.make_node("Cast", ["i"], ["fi"], to=T.FLOAT),
         h.make_node("Mul", ["v_in", "half"], ["h"]),
         h.make_node("Add", ["h", "x"], ["hx"]),
         h.make_node("Add", ["hx", "fi"], ["v_out"]),
         h.make_node("ReduceSum", ["v_out"], ["s"], keepdims=0),
         h.make_node("Less", ["s", "limit"], ["cond_out"]),
         h.make_node("Identity", ["v_out"], ["scan_out"])],
        "body", [_vi("i", T.INT64, []), _vi("cond_in", T.BOOL, []), _vi("v_in", T.FLOAT, [3])],
        [_vi("cond_out", T.BOOL, []), _vi("v_out", T.FLOAT, [3]), _vi("scan_out", T.FLOAT, [3])],
        [nh.from_array(np.array(0.5, F32), "half")])
    ins = ["n", "c0", "v0"] if with_cond else ["n", "", "v0"]
    graph_ins = [_vi("x", T.FLOAT, [3]), _vi("v0", T.FLOAT, [3]), _vi("n", T.INT64, []),
                 _vi("limit", T.FLOAT, [])]
    inits = [nh.from_array(np.array(True), "c0")] if with_cond else []
    return model_of([h.make_node("Loop", ins, ["v", "vs"], body=body, name="loop"),
                     h.make_node("Neg", ["v"], ["nv"])],
                    graph_ins, [_vi("nv", T.FLOAT, [3]), _vi("vs", T.FLOAT, [None, 3])], inits)


@pytest.mark.parametrize("with_cond", [True, False])
def test_loop_runs_its_compiled_body_on_the_host(with_cond):
    m = _loop_model(with_cond)
    s = cannc.compile(m, cores=1)
    x = RNG.standard_normal(3).astype(F32)
    v0 = RNG.standard_normal(3).astype(F32)
    for n, limit in ((4, 100.0), (6, 5.0), (1, 100.0)):
        check_session(s, m, {"x": x, "v0": v0, "n": np.array(n, I64),
                             "limit": np.array(limit, F32)})
    before = cannc.compiler.codegen_counts()
    check_session(s, m, {"x": -x, "v0": v0, "n": np.array(5, I64), "limit": np.array(9.0, F32)})
    assert cannc.compiler.codegen_counts() == before   # the body is compiled once


def test_scan_cumulative_sum_both_directions_and_axes():
    body = h.make_graph([h.make_node("Add", ["s_in", "x_t"], ["s_out"]),
                         h.make_node("Mul", ["s_out", "x_t"], ["y_t"])], "body",
                        [_vi("s_in", T.FLOAT, [2]), _vi("x_t", T.FLOAT, [2])],
                        [_vi("s_out", T.FLOAT, [2]), _vi("y_t", T.FLOAT, [2])])
    for dirs, in_axis, out_axis in (([0], 0, 0), ([1], 1, 1), ([1], 0, -1)):
        shape = [5, 2] if in_axis == 0 else [2, 5]
        node = h.make_node("Scan", ["s0", "xs"], ["s", "ys"], body=body, num_scan_inputs=1,
                           scan_input_directions=dirs, scan_output_directions=dirs,
                           scan_input_axes=[in_axis], scan_output_axes=[out_axis])
        m = model_of([node], [_vi("s0", T.FLOAT, [2]), _vi("xs", T.FLOAT, shape)],
                     [_vi("s", T.FLOAT, [2]), _vi("ys", T.FLOAT, [None, None])])
        s = cannc.compile(m, cores=1)
        check_session(s, m, {"s0": RNG.standard_normal(2).astype(F32),
                      "xs": RNG.standard_normal(shape).astype(F32)})


def _runtime_if_model():
    """`y = relu(x) + 1.5 if x.sum() > 0 else -x`, then `z = y * w`: the condition is data."""
    then, els = _branches()
    nodes = [h.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             h.make_node("Greater", ["s", "zero"], ["cond"]),
             h.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=els, name="pick"),
             h.make_node("Mul", ["y", "w"], ["z"])]
    return model_of(nodes, [_vi("x", T.FLOAT, ["n", 3]), _vi("w", T.FLOAT, [3])],
                    [_vi("z", T.FLOAT, ["n", 3])], [nh.from_array(np.array(0, F32), "zero")])


def test_runtime_if_picks_its_compiled_branch_per_run():
    m = _runtime_if_model()
    s = cannc.compile(m, cores=2)
    w = RNG.standard_normal(3).astype(F32)
    x = np.abs(RNG.standard_normal((4, 3)).astype(F32))
    check_session(s, m, {"x": x, "w": w})           # then
    assert isinstance(next(iter(s.programs.values())), ControlProgram)
    check_session(s, m, {"x": -x, "w": w})          # else
    before = cannc.compiler.codegen_counts()
    check_session(s, m, {"x": 2 * x, "w": w})       # both branches compiled: nothing new
    check_session(s, m, {"x": -2 * x, "w": w})
    assert cannc.compiler.codegen_counts() == before
    check_session(s, m, {"x": np.ones((2, 3), F32), "w": w})      # a new shape
    fut = s.run_async(None, {"x": -x, "w": w})
    np.testing.assert_allclose(fut.result()[0], ort_run(m, {"x": -x, "w": w})[0],
                               rtol=1e-4, atol=1e-5)


def test_runtime_if_with_branches_of_different_shapes_and_a_nested_runtime_if():
    """then: x[:, :2] then an inner If on max(x) > 1 choosing exp or 2*; else: x.T"""
    it = h.make_graph([h.make_node("Exp", ["sl"], ["out"])], "it", [], [_vi("out", T.FLOAT, None)])
    ie = h.make_graph([h.make_node("Add", ["sl", "sl"], ["out"])], "ie", [],
                      [_vi("out", T.FLOAT, None)])
    then = h.make_graph([h.make_node("Slice", ["x", "st", "en", "ax"], ["sl"]),
                         h.make_node("ReduceMax", ["x"], ["mx"], keepdims=0),
                         h.make_node("Greater", ["mx", "one"], ["c2"]),
                         h.make_node("If", ["c2"], ["out"], then_branch=it, else_branch=ie)],
                        "then", [], [_vi("out", T.FLOAT, None)],
                        [nh.from_array(np.array([0], I64), "st"),
                         nh.from_array(np.array([2], I64), "en"),
                         nh.from_array(np.array([1], I64), "ax")])
    els = h.make_graph([h.make_node("Transpose", ["x"], ["out"])], "else", [],
                       [_vi("out", T.FLOAT, None)])
    nodes = [h.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             h.make_node("Greater", ["s", "zero"], ["cond"]),
             h.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=els),
             h.make_node("Neg", ["y"], ["z"])]
    m = model_of(nodes, [_vi("x", T.FLOAT, [3, 3])], [_vi("z", T.FLOAT, [None, None])],
                 [nh.from_array(np.array(0, F32), "zero"), nh.from_array(np.array(1, F32), "one")])
    s = cannc.compile(m, cores=1)
    base = np.arange(9, dtype=F32).reshape(3, 3) / 10
    for x in (base, base + 1, -base):        # then/else-inner, then/then-inner, else
        check_session(s, m, {"x": x})


def test_a_boolean_graph_input_condition_is_value_specialised():
    """An If on a boolean graph input (a flag) compiles one program per flag value, the
    branch inlined; a host program is not needed."""
    then, els = _branches()
    m = model_of([h.make_node("If", ["flag"], ["y"], then_branch=then, else_branch=els)],
                 [_vi("flag", T.BOOL, []), _vi("x", T.FLOAT, [2, 3])],
                 [_vi("y", T.FLOAT, [2, 3])])
    s = cannc.compile(m, cores=1)
    assert s.value_inputs == ("flag",)
    x = RNG.standard_normal((2, 3)).astype(F32)
    for flag in (True, False, True):
        check_session(s, m, {"flag": np.array(flag), "x": x})
    assert len(s.programs) == 2
    assert not any(isinstance(p, ControlProgram) for p in s.programs.values())


def test_inspect_and_profile_of_a_host_program_say_why_not():
    s = cannc.compile(_runtime_if_model(), cores=1)
    feeds = {"x": np.ones((2, 3), F32), "w": np.ones(3, F32)}
    s.run(None, feeds)
    with pytest.raises(cannc.errors.CanncError, match="chosen at run time"):
        s.profile(feeds, runs=1, warmup=0)
    with pytest.raises(cannc.errors.CanncError, match="chosen at run time"):
        s.inspect({"x": (2, 3), "w": (3,)}, without_fusion=False)


def _scan8_model(with_seq: bool, directions: list[int]):
    """Scan-8: a batch of 3 running sums (state [2]) over xs [3, 5, 2] and a second scan
    input ws [3, 5, 2]; outputs the final state [3, 2] and ys [3, 5, 2]."""
    body = h.make_graph([h.make_node("Add", ["s_in", "x_t"], ["s_out"]),
                         h.make_node("Mul", ["s_out", "w_t"], ["y_t"])], "body",
                        [_vi("s_in", T.FLOAT, [2]), _vi("x_t", T.FLOAT, [2]),
                         _vi("w_t", T.FLOAT, [2])],
                        [_vi("s_out", T.FLOAT, [2]), _vi("y_t", T.FLOAT, [2])])
    node = h.make_node("Scan", ["lens" if with_seq else "", "s0", "xs", "ws"], ["s", "ys"],
                       body=body, num_scan_inputs=2, directions=directions)
    ins = [_vi("s0", T.FLOAT, [3, 2]), _vi("xs", T.FLOAT, [3, 5, 2]),
           _vi("ws", T.FLOAT, [3, 5, 2])]
    if with_seq:
        ins.insert(0, _vi("lens", T.INT64, [3]))
    return model_of([node], ins, [_vi("s", T.FLOAT, [3, 2]), _vi("ys", T.FLOAT, [3, 5, 2])],
                    opset=8)


@pytest.mark.parametrize("with_seq,directions", [(False, [0, 0]), (False, [1, 0]),
                                                 (True, [0, 1])])
def test_scan8_batch_and_sequence_lens(with_seq, directions):
    m = _scan8_model(with_seq, directions)
    s = cannc.compile(m, cores=1)
    feeds = {"s0": RNG.standard_normal((3, 2)).astype(F32),
             "xs": RNG.standard_normal((3, 5, 2)).astype(F32),
             "ws": RNG.standard_normal((3, 5, 2)).astype(F32)}
    if with_seq:
        feeds["lens"] = np.array([5, 5, 5], np.int64)
        check_session(s, m, feeds)
        feeds["lens"] = np.array([5, 2, 3], np.int64)     # shorter: zeros beyond
    check_session(s, m, feeds)
