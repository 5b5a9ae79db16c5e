"""Regression tests: each a small explicit model of one class of failure the random-graph
fuzzer (tests/fuzz) found, compared with onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.artifact import Kernel
from cannc.errors import CompileError
from tests.helpers import assert_matches_ort, model_of

F = TensorProto.FLOAT


def _vi(name, shape):
    return helper.make_tensor_value_info(name, F, list(shape))


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_prologue_input_that_is_a_graph_output():
    """Softmax prologue fusion took Floor into the LogSoftmax kernel although Floor's
    result is also a graph output: the output had no buffer (KeyError in the plan)."""
    m = model_of([helper.make_node("Floor", ["x"], ["f"]),
                  helper.make_node("LogSoftmax", ["f"], ["y"], axis=-1)],
                 [_vi("x", [4])], [_vi("y", [4]), _vi("f", [4])])
    assert_matches_ort(m, {"x": _rand(4) * 3})


def test_prologue_group_output_inside_and_outside():
    """The same with a longer prologue group and the Softmax's input read twice."""
    m = model_of([helper.make_node("Abs", ["x"], ["a"]),
                  helper.make_node("HardSwish", ["a"], ["h"]),
                  helper.make_node("Softmax", ["h"], ["s"], axis=-1),
                  helper.make_node("Add", ["s", "a"], ["y"])],
                 [_vi("x", [3, 5])], [_vi("y", [3, 5]), _vi("h", [3, 5])])
    assert_matches_ort(m, {"x": _rand(3, 5)})


def test_plan_names_an_output_no_kernel_writes():
    """The plan checks that every graph output lives somewhere (input, constant or a
    kernel's result) and names the one that does not, as a CompileError."""
    from cannc.compiler.planning import plan_memory
    from tests.helpers import pass_graph
    g = pass_graph([helper.make_node("Relu", ["x"], ["r"]),
                    helper.make_node("Neg", ["r"], ["y"])],
                   {"x": (np.float32, (4,))}, ["y", "r"])
    k = Kernel(symbol="k", nodes=["n"], op_types=["Neg"], inputs=["x"], outputs=["y"],
               num_tiles=1, workspace_bytes=0, single_core=True, flops=0, bytes_read=0,
               bytes_written=0)
    with pytest.raises(CompileError, match="graph output 'r'"):
        plan_memory(g, [k], {}, {})


@pytest.mark.parametrize("pads,mode", [([-1, 0, -2, 1], "constant"),
                                       ([1, -1, 0, -2], "constant"),
                                       ([0, 1, 0, 1], "edge")])
def test_constant_pad_with_negative_pads_folds(pads, mode):
    """Pad of an initializer with negative pads (cropping) failed in constant folding
    (np.pad refuses negative widths)."""
    c = _rand(4, 5, seed=1)
    m = model_of([helper.make_node("Pad", ["c", "p"], ["q"], mode=mode),
                  helper.make_node("Add", ["q", "x"], ["y"])],
                 [_vi("x", [1])], [_vi("y", [4 + pads[0] + pads[2], 5 + pads[1] + pads[3]])],
                 [numpy_helper.from_array(c, "c"),
                  numpy_helper.from_array(np.array(pads, np.int64), "p")])
    assert_matches_ort(m, {"x": _rand(1)})


def test_runtime_pad_with_negative_pads():
    m = model_of([helper.make_node("Pad", ["x", "p", "v"], ["y"])],
                 [_vi("x", [3, 6])], [_vi("y", [3, 5])],
                 [numpy_helper.from_array(np.array([-1, 2, 1, -3], np.int64), "p"),
                  numpy_helper.from_array(np.array(1.5, np.float32), "v")])
    assert_matches_ort(m, {"x": _rand(3, 6)})


def test_constant_mean_of_broadcasting_inputs_folds():
    """Mean over constants whose first input broadcasts (onnx.reference accumulates in
    place into the first input and fails)."""
    m = model_of([helper.make_node("Mean", ["a", "b"], ["c"]),
                  helper.make_node("Add", ["c", "x"], ["y"])],
                 [_vi("x", [2, 6])], [_vi("y", [2, 6])],
                 [numpy_helper.from_array(_rand(6), "a"),
                  numpy_helper.from_array(_rand(2, 6, seed=2), "b")])
    assert_matches_ort(m, {"x": _rand(2, 6)})


def test_batched_constant_b_of_one_and_several_items():
    """Two MatMuls with a batched constant B share one shape-polymorphic kernel (one
    lowering-memo entry), B of 1 item and B of 5: replaying the packing recipe made for
    one item on the other's B raised a raw numpy reshape ValueError."""
    def model(nb):
        return model_of([helper.make_node("MatMul", ["x", "w"], ["y"])],
                        [_vi("x", [nb, 5, 1])], [_vi("y", [nb, 5, 9])],
                        [numpy_helper.from_array(_rand(nb, 1, 9, seed=nb), "w")])
    for nb in (1, 5, 3):
        assert_matches_ort(model(nb), {"x": _rand(nb, 5, 1)})


def test_memo_shared_between_sessions_stays_correct():
    """The same, in the order the fuzzer met it (B of several items first)."""
    def model(nb, n=7):
        return model_of([helper.make_node("MatMul", ["x", "w"], ["y"])],
                        [_vi("x", [nb, 3, 2])], [_vi("y", [nb, 3, n])],
                        [numpy_helper.from_array(_rand(nb, 2, n, seed=nb), "w")])
    for nb in (4, 1):
        s = cannc.compile(model(nb), cores=1)
        x = _rand(nb, 3, 2)
        w = numpy_helper.to_array(model(nb).graph.initializer[0])
        np.testing.assert_allclose(s.run(None, {"x": x})[0], x @ w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("a,b,c", [((5, 6, 1), (1,), (5, 1)),      # N dropped: [5, 6] out
                                   ((3, 4, 2), (2,), (1, 4)),
                                   ((5, 6, 3), (3,), (5, 6)),      # full operand: fuses
                                   ((3,), (2, 3, 4), (4,)),        # M dropped: [2, 4] out
                                   ((3,), (3, 4), (4,))])
def test_matmul_vector_epilogue_operand(a, b, c):
    """A MatMul with a 1-D operand drops a GEMM dim from its output; an epilogue operand
    broadcast against that output was indexed as if it were the GEMM's (a [5, 1] operand of
    a [5, 6] = [5, 6, 1] @ [1] output read as one value per GEMM row: off by up to 2.5)."""
    m = model_of([helper.make_node("MatMul", ["x", "w"], ["p"]),
                  helper.make_node("Max", ["p", "c"], ["y"])],
                 [_vi("x", a)], [_vi("y", (np.zeros(a) @ np.zeros(b) + np.zeros(c)).shape)],
                 [numpy_helper.from_array(_rand(*b, seed=3), "w"),
                  numpy_helper.from_array(_rand(*c, seed=4), "c")])
    assert_matches_ort(m, {"x": _rand(*a)})


def test_elementwise_groups_that_would_wait_for_each_other():
    """Abs -> Add -> Pow in one elementwise group, Tanh -> Max in another, with Tanh
    feeding Pow and Abs feeding Max: each group would depend on the other (a cycle of
    kernels: NetworkXUnfeasible in the topological sort)."""
    m = model_of([helper.make_node("ReduceMax", ["x"], ["r"], axes=[0, 1], keepdims=1),
                  helper.make_node("Abs", ["z"], ["a"]),
                  helper.make_node("Add", ["a", "one"], ["b"]),
                  helper.make_node("Tanh", ["r"], ["t"]),
                  helper.make_node("Pow", ["b", "t"], ["p"]),
                  helper.make_node("Max", ["t", "a"], ["q"])],
                 [_vi("x", [2, 4]), _vi("z", [1, 1])], [_vi("p", [1, 1]), _vi("q", [1, 1])],
                 [numpy_helper.from_array(np.array(0.5, np.float32), "one")])
    assert_matches_ort(m, {"x": _rand(2, 4), "z": _rand(1, 1, seed=5)})



@pytest.mark.parametrize("op", ["Softsign", "Softplus", "HardSwish"])
def test_constant_scalar_elementwise_folds(op):
    """A map op over a 0-d constant (a ReduceSum with keepdims=0 of an initializer) failed
    in constant folding: onnx.reference's Softsign writes into a numpy scalar."""
    m = model_of([helper.make_node("ReduceSum", ["c", "ax"], ["s"], keepdims=0),
                  helper.make_node(op, ["s"], ["t"]),
                  helper.make_node("Add", ["t", "x"], ["y"])],
                 [_vi("x", [3])], [_vi("y", [3])],
                 [numpy_helper.from_array(_rand(2), "c"),
                  numpy_helper.from_array(np.array([-1], np.int64), "ax")])
    assert_matches_ort(m, {"x": _rand(3)})


def test_fuzz_check_tells_an_onnxruntime_optimizer_bug_from_a_mismatch():
    """Reshape -> Transpose -> MatMul with a 1-D B: onnxruntime's optimised graph (its
    Transpose+MatMul fusion) gives a different answer from its unoptimised graph, the ONNX
    reference and cannc. The fuzzer's check reports it as such, not as cannc's mismatch."""
    from tests.fuzz.gen import Case
    from tests.fuzz.run import check
    m = model_of([helper.make_node("Reshape", ["x", "s"], ["r"]),
                  helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
                  helper.make_node("MatMul", ["t", "w"], ["y"])],
                 [_vi("x", [6]), _vi("w", [2])], [_vi("y", [3])],
                 [numpy_helper.from_array(np.array([-1, 3], np.int64), "s")])
    feeds = {"x": np.arange(6, dtype=np.float32), "w": np.array([1, 10], np.float32)}
    r = check(Case(0, m, feeds, []))
    assert r.kind in ("ok", "ort_bug"), r.detail
    got = cannc.compile(m, cores=1).run(None, feeds)[0]
    np.testing.assert_array_equal(got, np.arange(6, dtype=np.float32).reshape(2, 3).T @
                                  feeds["w"])


@pytest.mark.parametrize("group", [1, 2], ids=["gemm", "depthwise"])
def test_float32_conv_epilogue_ending_in_float16(group):
    """A float32 Conv took Tanh, Cast(to float16) and Sin into its kernel, which stores
    float32: it wrote float32 into the float16 buffer (fuzz seed 20263412: NaNs and writes
    past the end; on AVX-512 machines a TypeError in lowering). Such an epilogue is not
    fused now (a reduced-precision Conv would store the epilogue's dtype)."""
    x = _rand(1, 2, 8, 6)
    w = _rand(2, 2 // group, 3, 1, seed=1)
    m = model_of([helper.make_node("Conv", ["x", "w"], ["c"], group=group),
                  helper.make_node("Tanh", ["c"], ["t"]),
                  helper.make_node("Cast", ["t"], ["h"], to=TensorProto.FLOAT16),
                  helper.make_node("Sin", ["h"], ["y"])],
                 [_vi("x", x.shape)],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
                 [numpy_helper.from_array(w, "w")])
    got = assert_matches_ort(m, {"x": x}, rtol=2e-3, atol=2e-3)
    assert got[0].dtype == np.float16 and np.isfinite(got[0]).all()
