"""A synchronous run reads its inputs from the caller's arrays and writes its outputs into
the arrays it returns, where the memory plan allows (runtime.program.HostIO), and copies
where it does not. These tests check that the zero-copy path is taken, that it reads no
byte outside the caller's arrays (guard pages on either side), that the caller's arrays
are never written, and that the copy path still serves whatever is not eligible."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import guarded, guarded_feeds, in_threads, model_of, ort_run
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.runtime import program
from models import zoo


def _vi(name: str, shape, dt=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dt, shape)


def _program(sess):
    (prog,) = sess.programs.values()
    return prog


def _matmul_relu(n: int = 160):
    # (160 x 160 floats: 100 KiB, above PLACE_MIN_BYTES)
    w = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)
    m = model_of([helper.make_node("MatMul", ["x", "w"], ["t"]),
                  helper.make_node("Relu", ["t"], ["y"])],
                 [_vi("x", [n, n])], [_vi("y", [n, n])], [numpy_helper.from_array(w, "w")])
    x = np.random.default_rng(2).standard_normal((n, n)).astype(np.float32)
    return m, {"x": x}


def test_inputs_read_in_place_outputs_written_in_place():
    m, feeds = _matmul_relu()
    sess = cannc.compile(m, cores=2)
    prog = _program(sess)
    assert prog.host_io.inputs == {"x": "x"} and list(prog.host_io.outputs) == ["y"]
    want = ort_run(m, feeds)[0]
    # the arena's copy of x is poisoned: a run that read it would return NaNs
    ctx = prog.acquire()
    view = ctx.inputs["x"]
    view[...] = np.nan
    prog.release(ctx)
    x = guarded(feeds["x"])
    y1 = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(y1, want, rtol=1e-4, atol=1e-5)
    assert np.isnan(view).all(), "the input was copied into the arena"
    assert y1.ctypes.data % 64 == 0
    assert not np.shares_memory(y1, ctx.arena)
    # every run returns an array of its own; the caller's input is never written
    y2 = sess.run(None, {"x": -x})[0]
    np.testing.assert_allclose(y1, want, rtol=1e-4, atol=1e-5)
    assert not np.shares_memory(y1, y2)
    np.testing.assert_array_equal(x, feeds["x"])


def test_tables_point_at_the_arena_between_runs():
    """A released context is as it was made (the ORT EP and eager ops take contexts and
    keep them): no argument-table slot left pointing at a caller's array."""
    m, feeds = _matmul_relu()
    sess = cannc.compile(m, cores=2)
    prog = _program(sess)
    ctx = prog.acquire()
    before = ctx.table.copy()
    prog.release(ctx)
    sess.run(None, feeds)
    assert ctx.slots and np.array_equal(ctx.table, before)


@pytest.mark.parametrize("kind", ["strided", "misaligned", "readonly", "fortran"])
def test_arrays_that_are_not_read_in_place_are_copied(kind):
    m, feeds = _matmul_relu()
    sess = cannc.compile(m, cores=1)
    x = feeds["x"]
    if kind == "strided":
        big = np.zeros((160, 320), np.float32)
        big[:, ::2] = x
        x = big[:, ::2]
    elif kind == "misaligned":
        # (a float32 at a byte offset: numpy calls it unaligned)
        raw = np.zeros(160 * 160 * 4 + 1, np.uint8)
        x = raw[1:].view(np.float32).reshape(160, 160)
        x[...] = feeds["x"]
        assert not x.flags.aligned
    elif kind == "readonly":
        x = x.copy()
        x.flags.writeable = False
    else:
        x = np.asfortranarray(x)
    want = ort_run(m, feeds)[0]
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-5)


def test_small_inputs_and_outputs_are_copied():
    """Below PLACE_MIN_BYTES a copy costs a run less than pointing the kernels at the
    caller's arrays: the arena's buffers serve, and each run returns arrays of its own."""
    m, feeds = _matmul_relu(32)
    sess = cannc.compile(m, cores=1)
    prog = _program(sess)
    assert not prog.host_io.inputs and not prog.host_io.outputs
    ctx = prog.acquire()
    prog.release(ctx)
    want = ort_run(m, feeds)[0]
    y1 = sess.run(None, feeds)[0]
    y2 = sess.run(None, {"x": -feeds["x"]})[0]
    np.testing.assert_allclose(y1, want, rtol=1e-4, atol=1e-5)
    assert not np.shares_memory(y1, ctx.arena) and not np.shares_memory(y1, y2)


def test_input_updated_in_place_is_copied_first():
    """Where the memory plan lets a kernel write over an input's buffer (unfused Relu ->
    Sigmoid: both written where x was), that input is copied in: the caller's array is
    left as it was."""
    n = 32768
    m = model_of([helper.make_node("Relu", ["x"], ["a"]),
                  helper.make_node("Sigmoid", ["a"], ["y"])],
                 [_vi("x", [n])], [_vi("y", [n])])
    x = guarded(np.random.default_rng(0).standard_normal(n).astype(np.float32))
    keep = x.copy()
    sess = cannc.compile(m, cores=1, fusion=False)
    prog = _program(sess)
    assert prog.plan.root("a") == "x" and not prog.host_io.inputs
    y = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(y, ort_run(m, {"x": keep})[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(x, keep)


def test_outputs_that_view_an_input_or_each_other_are_copies():
    n = 256
    m = model_of([helper.make_node("Reshape", ["x", "s"], ["y0"]),
                  helper.make_node("Relu", ["x"], ["t"]),
                  helper.make_node("Reshape", ["t", "s"], ["y1"]),
                  helper.make_node("Identity", ["t"], ["y2"])],
                 [_vi("x", [16, 16])], [_vi("y0", [n]), _vi("y1", [n]), _vi("y2", [16, 16])],
                 [numpy_helper.from_array(np.array([n], np.int64), "s")])
    x = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    sess = cannc.compile(m, cores=1)
    y0, y1, y2 = sess.run(None, {"x": guarded(x)})
    np.testing.assert_array_equal(y0, x.reshape(-1))
    np.testing.assert_array_equal(y1, np.maximum(x, 0).reshape(-1))
    np.testing.assert_array_equal(y2, np.maximum(x, 0))
    for a, b in ((y0, y1), (y1, y2), (y0, y2)):
        assert not np.shares_memory(a, b)
    y1[...] = 7
    assert not (y2 == 7).any()


def test_execute_still_refuses_an_array_of_another_dtype():
    m, feeds = _matmul_relu(32)
    sess = cannc.compile(m, cores=1)
    with pytest.raises(TypeError):
        _program(sess).execute({"x": feeds["x"].astype(np.float64)})


@pytest.mark.parametrize("name", ["mlp", "resnet", "mobilenet", "bert", "gpt"])
@pytest.mark.parametrize("before", [False, True])
def test_zoo_reads_nothing_outside_its_inputs(name, before, monkeypatch):
    """Every input of the zoo's models starts (ends) at a page no one may read: a kernel
    reading before (past) the caller's array faults (every input read in place, however
    small)."""
    monkeypatch.setattr(program, "PLACE_MIN_BYTES", 0)
    model = zoo.build(name)
    feeds = zoo.example_inputs(model, batch=2)
    want = ort_run(model, feeds)
    sess = cannc.compile(model, cores=2)
    g = guarded_feeds(feeds, before)
    got = sess.run(None, g)
    for a, e in zip(got, want):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-4)
    for k in feeds:
        np.testing.assert_array_equal(g[k], feeds[k])


def test_concurrent_runs_each_get_their_own_outputs():
    m, _ = _matmul_relu()
    sess = cannc.compile(m, cores=2)
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((160, 160)).astype(np.float32) for _ in range(4)]
    want = [ort_run(m, {"x": x})[0] for x in xs]

    def worker(i):
        for _ in range(20):
            np.testing.assert_allclose(sess.run(None, {"x": xs[i]})[0], want[i],
                                       rtol=1e-4, atol=1e-5)
    in_threads(worker, 4)
