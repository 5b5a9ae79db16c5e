"""Concats written in place (cannc.compiler.planning.concat_in_place): the producers of a
Concat's pieces write straight into its output buffer and no Concat kernel runs. Every
case here is checked against onnxruntime, with the rule on and off."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import cannc
from tests.helpers import assert_matches_ort, model_of


def _fp(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _spec(model, feeds, **opts):
    sess = cannc.compile(model, cores=2, **opts)
    sess.run(None, feeds)
    (prog,) = sess.programs.values()
    return prog.spec


def _concat_kernels(spec):
    return [k for k in spec.kernels if k.op_types == ["Concat"]]


def _conv(name, x, cin, cout, k, rng, inits):
    w = numpy_helper.from_array((rng.standard_normal((cout, cin, k, k))
                                 / np.sqrt(cin * k * k)).astype(np.float32), f"{name}_w")
    inits.append(w)
    return helper.make_node("Conv", [x, w.name], [name], pads=[k // 2] * 4)


def _fire(batch):
    """SqueezeNet's fire module: a squeeze conv, two expand convs, their Concat."""
    rng = np.random.default_rng(0)
    inits = []
    nodes = [_conv("s", "x", 16, 8, 1, rng, inits), helper.make_node("Relu", ["s"], ["sr"]),
             _conv("e1", "sr", 8, 16, 1, rng, inits), helper.make_node("Relu", ["e1"], ["e1r"]),
             _conv("e3", "sr", 8, 16, 3, rng, inits), helper.make_node("Relu", ["e3"], ["e3r"]),
             helper.make_node("Concat", ["e1r", "e3r"], ["cat"], axis=1, name="the_concat"),
             _conv("y", "cat", 32, 8, 1, rng, inits)]
    m = model_of(nodes, [_fp("x", [batch, 16, 12, 12])], [_fp("y", None)], inits)
    feeds = {"x": rng.standard_normal((batch, 16, 12, 12)).astype(np.float32)}
    return m, feeds


def test_fire_module_concat_runs_no_kernel():
    m, feeds = _fire(1)
    assert_matches_ort(m, feeds)
    spec = _spec(m, feeds)
    assert not _concat_kernels(spec)
    assert spec.memory.in_place == ("the_concat",)
    # the expand convs write into the two halves of the concat's buffer
    half = 16 * 12 * 12 * 4
    assert set(spec.memory.placed.values()) == {("cat", 0), ("cat", half)}
    off = spec.memory.offsets["cat"]
    assert off % 64 == 0 and off + 2 * half <= spec.memory.arena_bytes
    assert cannc.compile(m).inspect()["memory"]["concats_in_place"] == ["the_concat"]
    # switched off, the Concat is a kernel again
    spec = _spec(m, feeds, fusion={"concat_in_place": False})
    assert len(_concat_kernels(spec)) == 1 and not spec.memory.placed
    assert_matches_ort(m, feeds, fusion={"concat_in_place": False})


def test_batch_two_keeps_the_concat_kernel():
    # with 2 images the pieces interleave in the output: not contiguous
    m, feeds = _fire(2)
    assert_matches_ort(m, feeds)
    assert len(_concat_kernels(_spec(m, feeds))) == 1


def test_dense_block_nests_every_concat_in_one_buffer():
    """DenseNet: layer k concatenates every earlier feature map; each Concat's buffer is
    the front of the next one's."""
    rng = np.random.default_rng(1)
    inits: list = []
    nodes = [_conv("x0", "x", 8, 16, 3, rng, inits)]
    feats = ["x0"]
    for i in range(1, 5):
        cin = 16 * i
        src = "x0" if i == 1 else f"c{i - 1}"
        nodes += [helper.make_node("Relu", [src], [f"r{i}"]),
                  _conv(f"f{i}", f"r{i}", cin, 16, 3, rng, inits)]
        feats.append(f"f{i}")
        nodes.append(helper.make_node("Concat", list(feats), [f"c{i}"], axis=1,
                                      name=f"concat{i}"))
    nodes.append(helper.make_node("ReduceMean", ["c4"], ["y"], axes=[2, 3], keepdims=0))
    m = model_of(nodes, [_fp("x", [1, 8, 9, 9])], [_fp("y", None)], inits, opset=17)
    feeds = {"x": rng.standard_normal((1, 8, 9, 9)).astype(np.float32)}
    assert_matches_ort(m, feeds)
    spec = _spec(m, feeds)
    assert not _concat_kernels(spec)
    piece = 16 * 81 * 4
    placed = spec.memory.placed
    assert {v: placed[v] for v in ("x0", "f1", "f2", "f3", "f4")} == {
        f: ("c4", i * piece) for i, f in enumerate(("x0", "f1", "f2", "f3", "f4"))}
    assert placed["c1"] == placed["c2"] == placed["c3"] == ("c4", 0)


def test_ineligible_concats_stay_kernels():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((1, 16, 4, 4)).astype(np.float32)
    k = numpy_helper.from_array(a, "k")
    nodes = [helper.make_node("Neg", ["x"], ["p"]), helper.make_node("Exp", ["x"], ["q"]),
             # a graph input as a piece
             helper.make_node("Concat", ["x", "p"], ["c_input"], axis=1),
             # a constant as a piece
             helper.make_node("Concat", ["p", "k"], ["c_const"], axis=1),
             # the same piece twice
             helper.make_node("Concat", ["q", "q"], ["c_twice"], axis=1),
             # pieces not 64-byte multiples (3 floats a channel)
             helper.make_node("Neg", ["z"], ["zn"]), helper.make_node("Exp", ["z"], ["ze"]),
             helper.make_node("Concat", ["zn", "ze"], ["c_odd"], axis=1)]
    outs = ["c_input", "c_const", "c_twice", "c_odd"]
    m = model_of(nodes, [_fp("x", [1, 16, 4, 4]), _fp("z", [1, 1, 3])],
                 [_fp(o, None) for o in outs], [k])
    feeds = {"x": a, "z": rng.standard_normal((1, 1, 3)).astype(np.float32)}
    assert_matches_ort(m, feeds)
    assert len(_concat_kernels(_spec(m, feeds))) == 4


def test_conflicting_layouts_keep_the_second_concat():
    # cat1 = [x, y] places y right after x; cat2 = [x, w] would put w where y is
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Neg", ["i"], ["x"]), helper.make_node("Exp", ["i"], ["y"]),
             helper.make_node("Sin", ["i"], ["w"]),
             helper.make_node("Concat", ["x", "y"], ["cat1"], axis=1),
             helper.make_node("Concat", ["x", "w"], ["cat2"], axis=1),
             helper.make_node("Concat", ["y", "x"], ["cat3"], axis=1)]
    outs = ["cat1", "cat2", "cat3"]
    m = model_of(nodes, [_fp("i", [1, 16, 4, 4])], [_fp(o, None) for o in outs])
    feeds = {"i": rng.standard_normal((1, 16, 4, 4)).astype(np.float32)}
    assert_matches_ort(m, feeds)
    spec = _spec(m, feeds)
    assert len(_concat_kernels(spec)) == 2
    assert spec.memory.placed == {"x": ("cat1", 0), "y": ("cat1", 16 * 16 * 4)}


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_concat_graphs_match_onnxruntime(data):
    """Random DAGs of elementwise maps (which may take over a dying input's buffer),
    views and Concats over earlier values, some read again after they are concatenated:
    whatever the planner places in place, no live value is overwritten."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    nodes, inputs, feeds, inits = [], [], {}, []
    pool: list[tuple[str, int]] = []          # (value, channels)
    for i in range(data.draw(st.integers(3, 12))):
        kind = data.draw(st.sampled_from(["new", "map", "view", "concat", "concat"])
                         if len(pool) >= 2 else st.just("new"))
        v = f"v{i}"
        if kind == "new":
            c = data.draw(st.integers(1, 3))
            inputs.append(_fp(f"in{i}", [1, c, 4, 4]))
            feeds[f"in{i}"] = rng.standard_normal((1, c, 4, 4)).astype(np.float32)
            nodes.append(helper.make_node("Sin", [f"in{i}"], [v]))
        elif kind == "map":
            src, c = pool[data.draw(st.integers(0, len(pool) - 1))]
            nodes.append(helper.make_node(data.draw(st.sampled_from(["Neg", "Relu", "Cos"])),
                                          [src], [v]))
        elif kind == "view":
            src, c = pool[data.draw(st.integers(0, len(pool) - 1))]
            nodes += [helper.make_node("Flatten", [src], [f"{v}_flat"], axis=1),
                      helper.make_node("Reshape", [f"{v}_flat", f"{v}_shape"], [v])]
            inits.append(numpy_helper.from_array(np.array([1, c, 4, 4], np.int64), f"{v}_shape"))
        else:
            picks = data.draw(st.lists(st.integers(0, len(pool) - 1), min_size=2, max_size=4))
            srcs = [pool[p] for p in picks]
            nodes.append(helper.make_node("Concat", [s for s, _ in srcs], [v], axis=1))
            c = sum(c for _, c in srcs)
        pool.append((v, c))
    outs = sorted({v for v, _ in pool[-3:]} | {v for v, _ in pool if data.draw(st.booleans())})
    m = model_of(nodes, inputs, [_fp(o, None) for o in outs], inits)
    assert_matches_ort(m, feeds)


@pytest.mark.parametrize("cores", [1, 2])
def test_concat_output_is_a_graph_output(cores):
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Neg", ["i"], ["x"]), helper.make_node("Exp", ["i"], ["y"]),
             helper.make_node("Concat", ["x", "y"], ["cat"], axis=1),
             helper.make_node("Relu", ["x"], ["xr"])]
    m = model_of(nodes, [_fp("i", [1, 16, 4, 4])], [_fp("cat", None), _fp("xr", None)])
    feeds = {"i": rng.standard_normal((1, 16, 4, 4)).astype(np.float32)}
    assert_matches_ort(m, feeds, cores=cores)
    sess = cannc.compile(m, cores=cores)
    first = [o.copy() for o in sess.run(None, feeds)]
    feeds2 = {"i": rng.standard_normal((1, 16, 4, 4)).astype(np.float32)}
    sess.run(None, feeds2)
    np.testing.assert_array_equal(sess.run(None, feeds)[0], first[0])
