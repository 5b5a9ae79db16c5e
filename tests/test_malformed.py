"""Malformed models and wrong feeds (issue 15 items 2, 3, 7): the size guard, cannc errors
only, the reproducers the mutator found, and a short mutator campaign (a long one:
`python -m tests.fuzz_malformed --minutes 30`)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import cannc
from tests.fuzz_malformed import load_reproducer, run_case
from tests.fuzz_malformed.campaign import campaign

REGRESSIONS = Path(__file__).parent / "fuzz_malformed" / "regressions"


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _vi(name, shape, et=T.FLOAT):
    return helper.make_tensor_value_info(name, et, shape)


def _relu(shape) -> onnx.ModelProto:
    return _model([helper.make_node("Relu", ["x"], ["y"], name="r")], [_vi("x", shape)],
                  [_vi("y", shape)])


def _shape_op(op: str, target, x_shape=(1,)) -> onnx.ModelProto:
    ins = ["x", "s"] if op != "ConstantOfShape" else ["s"]
    return _model([helper.make_node(op, ins, ["y"], name="n")],
                  [_vi("x", list(x_shape))] if op != "ConstantOfShape" else [],
                  [_vi("y", ["a", "b"])],
                  [numpy_helper.from_array(np.array(target, np.int64), "s")])


def _huge_init() -> onnx.ModelProto:
    t = onnx.TensorProto(name="W", data_type=T.FLOAT)
    t.dims.extend([1 << 20, 1 << 20])             # declares 4 TiB, holds nothing
    return _model([helper.make_node("Add", ["x", "W"], ["y"], name="add")], [_vi("x", [1])],
                  [_vi("y", ["a", "b"])], [t])


# -- the size guard: a ShapeError naming the value and the figure, in milliseconds -----------

@pytest.mark.parametrize("make, phrase", [
    (lambda: _relu([1 << 40]), "graph input 'x'.*4.0 TiB"),
    (lambda: _relu([1 << 62, 4]), "graph input 'x'.*overflow int64"),
    (lambda: _relu([1 << 20, 1 << 20]), "graph input 'x'.*device memory budget"),
    (_huge_init, "initializer 'W'"),
    (lambda: _shape_op("ConstantOfShape", [1 << 20, 1 << 20]), "value 'y'.*ConstantOfShape"),
    (lambda: _shape_op("ConstantOfShape", [1 << 62, 8]), "value 'y'.*overflow int64"),
    (lambda: _shape_op("Expand", [1 << 20, 1 << 20]), "value 'y'.*Expand at node 'n'"),
    (lambda: _shape_op("Tile", [1 << 30, 1 << 30], (2, 2)), "value 'y'.*Tile"),
], ids=["input-2^40", "input-overflow", "input-2^20x2^20", "initializer", "constantofshape",
        "constantofshape-overflow", "expand", "tile"])
def test_size_guard(make, phrase):
    m = make()
    t0 = time.perf_counter()
    with pytest.raises(cannc.ShapeError, match=phrase):
        cannc.compile(m, cores=1)
    assert time.perf_counter() - t0 < 2.0


def test_size_guard_on_shapes_feeds_and_inspect():
    with pytest.raises(cannc.ShapeError, match="input 'x'.*16.0 TiB"):
        cannc.compile(_relu(["n", 4]), cores=1, shapes={"x": (1 << 40, 4)})
    s = cannc.compile(_relu(["n", 4]), cores=1)
    huge = np.lib.stride_tricks.as_strided(np.zeros(4, np.float32), (1 << 40, 4), (0, 4))
    for call in (lambda: s.run(None, {"x": huge}), lambda: s.run_async(None, {"x": huge}),
                 lambda: s.inspect({"x": (1 << 40, 4)}, without_fusion=False)):
        with pytest.raises(cannc.ShapeError, match="input 'x'"):
            call()


def test_device_memory_budget_covers_the_arena(monkeypatch):
    """Every tensor fits, the specialisation does not: refused before it allocates."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="r0"),
             helper.make_node("Exp", ["x"], ["b"], name="e0"),
             helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    m = _model(nodes, [_vi("x", ["n", 1024])], [_vi("y", ["n", 1024])])
    monkeypatch.setenv("CANNC_DEVICE_MEMORY", "1.5M")
    with pytest.raises(cannc.ShapeError, match="specialisation .* device memory"):
        cannc.compile(m, cores=1, shapes={"x": (256, 1024)}, fusion=False)   # 1 MiB each
    monkeypatch.setenv("CANNC_DEVICE_MEMORY", "lots")
    with pytest.raises(cannc.CanncError, match="CANNC_DEVICE_MEMORY"):
        cannc.compile(m, cores=1)


def test_negative_declared_dim_is_a_model_error():
    with pytest.raises(cannc.ModelError, match="negative dimension -3"):
        cannc.compile(_relu([-3, 4]), cores=1)


@pytest.mark.parametrize("target", [[2, 3], [2, 1 << 20], [5]], ids=["fewer", "more", "odd"])
def test_reshape_must_keep_the_element_count(target):
    """ONNX's inference does not check it: a Reshape to more elements than its input let
    native code read past the buffer (a segfault the mutator found), to fewer a wrong
    answer."""
    with pytest.raises(cannc.ShapeError, match="Reshape at node 'n' turns"):
        cannc.compile(_shape_op("Reshape", target, (2, 4)), cores=1)


def _expand_by(decl: str) -> onnx.ModelProto:
    """Expand whose shape input is declared with 2^31 values (an initializer holding 2,
    a graph input, a value_info of a computed shape)."""
    k = 1 << 31
    x, y = _vi("x", [1, 4]), _vi("y", None)
    if decl == "initializer":
        t = numpy_helper.from_array(np.array([3, 4], np.int64), "s")
        t.dims[:] = [k]
        return _model([helper.make_node("Expand", ["x", "s"], ["y"], name="n")], [x], [y], [t])
    if decl == "input":
        return _model([helper.make_node("Expand", ["x", "s"], ["y"], name="n")],
                      [x, _vi("s", [k], T.INT64)], [y])
    m = _model([helper.make_node("Identity", ["s0"], ["s"], name="id"),
                helper.make_node("Expand", ["x", "s"], ["y"], name="n")],
               [x, _vi("s0", ["r"], T.INT64)], [y])
    m.graph.value_info.append(_vi("s", [k], T.INT64))
    return m


@pytest.mark.parametrize("decl", ["initializer", "input", "value_info"])
def test_declared_length_of_a_shape_input_is_bounded(decl):
    """A shape input declared with 2^31 values made ONNX's inference build a rank-2^31
    output for minutes (the mutator's hang, seed 424242 case 36560): refused first."""
    t0 = time.perf_counter()
    with pytest.raises(cannc.ShapeError, match=r"input 1 \('s'\) of node 'n' \(Expand\) "
                                               r"is declared with 2147483648 values"):
        cannc.compile(_expand_by(decl), cores=1)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("dims, holds", [([3], "16 bytes"), ([], "16 bytes"),
                                         ([2, 2], "16 bytes")])
def test_initializer_dims_must_match_its_data(dims, holds):
    t = numpy_helper.from_array(np.array([3, 4], np.int64), "s")
    t.dims[:] = dims
    m = _model([helper.make_node("Expand", ["x", "s"], ["y"], name="n")], [_vi("x", [1, 4])],
               [_vi("y", None)], [t])
    with pytest.raises(cannc.ModelError, match=f"initializer 's' declares dims .* holds {holds}"):
        cannc.compile(m, cores=1)


@pytest.mark.parametrize("opset, dtype, keepdims", [(13, np.float32, 0), (13, np.float32, 1),
                                                    (18, np.float32, 0), (18, np.int64, 1)])
def test_mean_over_an_empty_set_is_zero(opset, dtype, keepdims):
    """A ReduceMean over an empty axis (an empty pooling result: seed 424242 case 11119)
    folds to 0, as onnxruntime answers (ONNX leaves it undefined), not NumPy's NaN."""
    et = T.FLOAT if dtype == np.float32 else T.INT64
    ins, inits, attrs = ["x"], [], {"keepdims": keepdims}
    if opset >= 18:
        ins.append("axes")
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "axes"))
    else:
        attrs["axes"] = [1]
    m = _model([helper.make_node("ReduceMean", ins, ["y"], name="mean", **attrs)],
               [_vi("x", ["n", 0, 3], et)], [_vi("y", None, et)], inits)
    m.opset_import[0].version = opset
    x = np.ones((2, 0, 3), dtype)
    got = cannc.compile(m, cores=1).run(None, {"x": x})[0]
    import onnxruntime as ort
    want = ort.InferenceSession(m.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.shape == want.shape == ((2, 1, 3) if keepdims else (2, 3))
    np.testing.assert_array_equal(got, want)
    assert not got.any()


@pytest.mark.parametrize("op, attrs", [("GlobalAveragePool", {}), ("GlobalMaxPool", {}),
                                       ("AveragePool", {"kernel_shape": [1, 1]}),
                                       ("MaxPool", {"kernel_shape": [1, 1]}),
                                       ("LpPool", {"kernel_shape": [1, 1]})])
def test_pool_over_an_empty_plane_is_a_shape_error(op, attrs):
    """Only the batch of a pool's input may be empty, as onnxruntime says ("Only N can be
    zero"); a (1, 3, 0, 4) input folded a GlobalAveragePool to NaN (NumPy's mean of nothing).
    Declared or fed at run time, the error names the node; an empty batch still runs."""
    declared = _model([helper.make_node(op, ["x"], ["y"], name="pool", **attrs)],
                      [_vi("x", [1, 3, 0, 4])], [_vi("y", None)])
    with pytest.raises(cannc.ShapeError, match="'pool'.*dimension 2 of its input is 0"):
        cannc.compile(declared, cores=1)
    dynamic = _model([helper.make_node(op, ["x"], ["y"], name="pool", **attrs)],
                     [_vi("x", ["n", 3, "h", 4])], [_vi("y", None)])
    sess = cannc.compile(dynamic, cores=1)
    with pytest.raises(cannc.ShapeError, match="'pool'.*dimension 2 of its input is 0"):
        sess.run(None, {"x": np.zeros((1, 3, 0, 4), np.float32)})
    if op != "LpPool":              # (onnxruntime runs no LpPool over an empty batch)
        assert sess.run(None, {"x": np.zeros((0, 3, 2, 4), np.float32)})[0].shape[0] == 0
    ok = sess.run(None, {"x": np.ones((1, 3, 2, 4), np.float32)})[0]
    assert ok.shape[:2] == (1, 3) and np.isfinite(ok).all()


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_extreme_over_an_empty_axis_is_a_shape_error(op):
    m = _model([helper.make_node(op, ["x"], ["y"], name="arg", axis=1)],
               [_vi("x", ["n", "k", 3])], [_vi("y", None, T.INT64)])
    sess = cannc.compile(m, cores=1)
    with pytest.raises(cannc.ShapeError, match="'arg'.*axis 1, which is empty"):
        sess.run(None, {"x": np.zeros((2, 0, 3), np.float32)})
    np.testing.assert_array_equal(sess.run(None, {"x": np.eye(3, dtype=np.float32)[None]})[0],
                                  [[[0, 1, 2]]] if op == "ArgMax" else [[[1, 0, 0]]])


@pytest.mark.parametrize("shapes", [{"x": ("a", 4)}, {"x": 5}, [1], {"x": (2.5, 4)},
                                    {"x": (-1, 4)}, {"x": "24"}])
def test_bad_shapes_argument_is_an_input_error(shapes):
    with pytest.raises(cannc.InputError):
        cannc.compile(_relu(["n", 4]), cores=1, shapes=shapes)
    with pytest.raises(cannc.InputError):
        cannc.check(_relu(["n", 4]), shapes=shapes)


def test_unwritable_artifact_path_is_a_cache_error(tmp_path):
    s = cannc.compile(_relu(["n", 4]), cores=1)
    with pytest.raises(cannc.CacheError, match="cannot write"):
        s.save(tmp_path / "no" / "such" / "dir" / "m.cnc")


# -- what the mutator found, kept ------------------------------------------------------------

@pytest.mark.parametrize("stem", sorted(str(p.with_suffix("")) for p in
                                        REGRESSIONS.glob("*.json")),
                         ids=lambda s: Path(s).name)
def test_reproducer(stem):
    outcome, detail = run_case(load_reproducer(stem))
    assert outcome in ("ok", "error"), detail


# -- a short campaign (< 30 s): each case in a worker process, under a timeout -----------------

def test_short_campaign(tmp_path):
    rep = campaign(seed=20261201, seconds=15, timeout=60, save_dir=str(tmp_path))
    assert rep.cases >= 20
    assert not rep.failures, "\n".join(f"case {i}: {o}: {d}" for i, o, d in rep.failures)
