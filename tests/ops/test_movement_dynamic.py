"""Shape-polymorphic data movement (Split, Concat, Transpose, Expand, Tile, Gather):
compiled once, run at other batch sizes and sequence lengths with no code
generation (ABI.md "Runtime dimensions"), against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_runtime_dims, single_node_model
from onnx import TensorProto, helper, numpy_helper
from test_elementwise_dynamic import dynamic, model_of, vi

from cannc.codegen.movement import Piece, contiguous_strides, pieces_tiling

R = np.random.default_rng(11)
SIZES = [(2, 5), (1, 7), (3, 1), (1, 1), (5, 33), (2, 1029)]


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


def test_split_last_axis_qkv():
    """[B, S, 3H] -> three [B, S, H] (a fused QKV projection's split)."""
    H = 24
    m, _ = single_node_model("Split", [f32(2, 5, 3 * H)], n_outputs=3, axis=2, num_outputs=3,
                             opset=18)
    m = dynamic(m, {"in0": {0: "batch", 1: "seq"}})
    check_runtime_dims(m, [{"in0": f32(b, s, 3 * H)} for b, s in SIZES])


@pytest.mark.parametrize("axis", [2, 1, 0])
def test_concat(axis):
    """Two runtime [B, S, H] tensors (different H) concatenated on every axis."""
    def sh(b, s, h):
        return (b, s, h)

    x_h, y_h = (8, 19) if axis == 2 else (8, 8)
    nodes = [helper.make_node("Concat", ["x", "y"], ["out"], axis=axis)]
    m = model_of(nodes, [vi("x", TensorProto.FLOAT, ["batch", "seq", x_h]),
                         vi("y", TensorProto.FLOAT, ["batch", "seq", y_h])],
                 [vi("out", TensorProto.FLOAT, [None, None, None])])
    check_runtime_dims(m, [{"x": f32(*sh(b, s, x_h)), "y": f32(*sh(b, s, y_h))}
                           for b, s in SIZES])


def test_transpose_heads():
    """[B, S, NH, D] -> [B, NH, S, D] (attention heads), and an int64 copy of it. A
    sequence of 1 merges B with NH (another merged rank: another kernel), so it is
    checked on its own."""
    NH, D = 3, 20
    sizes = [(b, s) for b, s in SIZES if s > 1] + [(1, 2), (3, 2)]
    m, _ = single_node_model("Transpose", [f32(2, 5, NH, D)], perm=[0, 2, 1, 3])
    m = dynamic(m, {"in0": {0: "batch", 1: "seq"}})
    check_runtime_dims(m, [{"in0": f32(b, s, NH, D)} for b, s in sizes])
    check_runtime_dims(m, [{"in0": f32(b, 1, NH, D)} for b in (3, 1)])
    m, _ = single_node_model("Transpose", [np.zeros((2, 5, NH, D), np.int64)], perm=[0, 2, 1, 3])
    m = dynamic(m, {"in0": {0: "batch", 1: "seq"}})
    check_runtime_dims(m, [{"in0": R.integers(0, 99, (b, s, NH, D))} for b, s in sizes])


def test_expand_and_tile_with_constant_shapes():
    """Expand [B, 1, H] by a constant [1, 4, 1]; Tile [B, S] by constant repeats [1, 3]."""
    H = 17
    nodes = [helper.make_node("Expand", ["x", "shape"], ["e"]),
             helper.make_node("Tile", ["y", "reps"], ["t"])]
    inits = [numpy_helper.from_array(np.array([1, 4, 1], np.int64), "shape"),
             numpy_helper.from_array(np.array([1, 3], np.int64), "reps")]
    m = model_of(nodes, [vi("x", TensorProto.FLOAT, ["batch", 1, H]),
                         vi("y", TensorProto.FLOAT, ["batch", "seq"])],
                 [vi("e", TensorProto.FLOAT, [None, 4, H]),
                  vi("t", TensorProto.FLOAT, [None, None])], inits)
    check_runtime_dims(m, [{"x": f32(b, 1, H), "y": f32(b, s)} for b, s in SIZES])


def test_slices_with_constant_parameters():
    """Rotary embeddings' slices (constant starts/ends/axes/steps): the two halves of the
    last axis, a [max_pos, D] cos table cut to the sequence length (its end from Shape: a
    constant once specialised) and every other element of the last axis. Each runs at
    every size with the code of the first; the two halves (different starts) share their
    kernel. (A reversed axis keeps a static kernel per shape: runtime dims are
    unsigned.)"""
    D = 64
    c = {k: numpy_helper.from_array(np.array(v, np.int64), k) for k, v in
         {"zero": [0], "half": [D // 2], "big": [2 ** 62], "last": [-1], "one": [1],
          "ax2": [2], "two": [2]}.items()}
    nodes = [helper.make_node("Slice", ["x", "zero", "half", "last", "one"], ["x1"]),
             helper.make_node("Slice", ["x", "half", "big", "last", "one"], ["x2"]),
             helper.make_node("Shape", ["x"], ["shp"], start=1, end=2),
             helper.make_node("Slice", ["cos", "zero", "shp"], ["cos_s"]),
             helper.make_node("Slice", ["x", "one", "big", "ax2", "two"], ["odd"])]
    m = model_of(nodes, [vi("x", TensorProto.FLOAT, ["batch", "seq", D]),
                         vi("cos", TensorProto.FLOAT, [300, D])],
                 [vi(o, TensorProto.FLOAT, None) for o in ("x1", "x2", "cos_s", "odd")],
                 list(c.values()))
    sizes = [(b, s) for b, s in SIZES if s <= 300]
    sess = check_runtime_dims(m, [{"x": f32(b, s, D), "cos": f32(300, D)} for b, s in sizes])
    kernels = [k for spec in sess.specializations for k in spec.kernels]
    assert all(k.shape_polymorphic for k in kernels)
    for spec in sess.specializations:
        halves = {k.symbol for k in spec.kernels if k.outputs[0] in ("x1", "x2")}
        assert len(halves) == 1, halves


def test_gather_embedding_and_pooler():
    """Word embeddings (ids [B, S] into a constant [V, H] table, some out of range) and the
    pooler's first token (Gather of index 0 along axis 1)."""
    V, H = 50, 40
    table = f32(V, H)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0),
             helper.make_node("Gather", ["emb", "zero"], ["cls"], axis=1)]
    inits = [numpy_helper.from_array(table, "table"),
             numpy_helper.from_array(np.array(0, np.int64), "zero")]
    m = model_of(nodes, [vi("ids", TensorProto.INT64, ["batch", "seq"])],
                 [vi("emb", TensorProto.FLOAT, [None, None, H]),
                  vi("cls", TensorProto.FLOAT, [None, H])], inits)
    feeds = []
    for b, s in SIZES:
        ids = R.integers(-V, V, (b, s)).astype(np.int64)
        feeds.append({"ids": ids})
    check_runtime_dims(m, feeds)


def test_gather_long_rows_are_chunked():
    """Rows wider than a unit are split into column chunks (runtime row count)."""
    V, H = 6, 20000
    m, _ = single_node_model("Gather", [f32(V, H), np.zeros((2, 3), np.int64)],
                             const_inputs=[0], axis=0)
    m = dynamic(m, {"in1": {0: "batch", 1: "seq"}})
    check_runtime_dims(m, [{"in1": R.integers(-V, V, (b, s)).astype(np.int64)}
                           for b, s in [(2, 3), (1, 1), (3, 2)]])


def test_element_gather_is_shape_polymorphic():
    """An element gather (one column per index: [N, 1] data, indices [B, 1, 1, S], as a
    padding-mask lookup exports) runs at every size with the code of the first."""
    m, _ = single_node_model("Gather",
                             [np.zeros((9, 1), np.bool_), np.zeros((2, 1, 1, 3), np.int64)],
                             axis=0)
    m = dynamic(m, {"in0": {0: "n"}, "in1": {0: "batch", 3: "seq"}})
    feeds = []
    for (b, s), n in zip([(2, 3), (1, 1), (3, 33), (1, 129)], [9, 4, 99, 200]):
        feeds.append({"in0": R.integers(0, 2, (n, 1)).astype(np.bool_),
                      "in1": R.integers(-n, n, (b, 1, 1, s)).astype(np.int64)})
    check_runtime_dims(m, feeds)


def test_pieces_tiling_key_holds_no_extent():
    """Two Concat shapes that differ only in runtime extents share the key; the dims differ."""
    def pieces(b, s):
        out = (b, s, 27)
        ost = contiguous_strides(out)
        return [Piece(shape=[b, s, 8], dst=0, dst_strides=ost, src=0,
                      src_strides=contiguous_strides((b, s, 8))),
                Piece(shape=[b, s, 19], dst=0, dst_strides=ost, dst_base=8, src=1,
                      src_strides=contiguous_strides((b, s, 19)))]

    a, c = pieces_tiling(pieces(2, 5), 4), pieces_tiling(pieces(7, 300), 4)
    assert a.key == c.key and a.dims != c.dims
    assert pieces_tiling(pieces(0, 5), 4) is None


@pytest.mark.parametrize("axis", [1, 3])
def test_concat_of_many_inputs_walks_one_loop(axis):
    """DenseNet's concats: from LOOP_PIECES inputs on, one loop walks a table of the
    pieces (their input and output slots included), so the code does not grow with the
    number of inputs; every shape against onnxruntime, compiled once."""
    from cannc.codegen.movement import LOOP_PIECES
    chans = [64, 32, 32, 32, 32, 32, 32]
    names = [f"x{i}" for i in range(len(chans))]
    dims = (lambda c: ["batch", c, 7, 7]) if axis == 1 else (lambda c: ["batch", 5, 7, c])
    nodes = [helper.make_node("Concat", names, ["out"], axis=axis)]
    m = model_of(nodes, [vi(n, TensorProto.FLOAT, dims(c)) for n, c in zip(names, chans)],
                 [vi("out", TensorProto.FLOAT, [None] * 4)])
    shp = (lambda b, c: (b, c, 7, 7)) if axis == 1 else (lambda b, c: (b, 5, 7, c))
    sess = check_runtime_dims(m, [{n: f32(*shp(b, c)) for n, c in zip(names, chans)}
                                  for b in (2, 1, 5)])
    (k,) = [k for k in sess.specializations[0].kernels if list(k.op_types) == ["Concat"]]
    assert len(chans) >= LOOP_PIECES and "one loop" in str(k.notes.get("pieces")), k.notes


def test_piece_loop_key_is_the_same_for_any_number_of_pieces():
    def pieces(n):
        out = (2, 32 * n, 7, 7)
        ost = contiguous_strides(out)
        return [Piece(shape=[2, 32, 7, 7], dst=0, dst_strides=ost, dst_base=i * 32 * 49, src=i,
                      src_strides=contiguous_strides((2, 32, 7, 7))) for i in range(n)]

    three, many = pieces_tiling(pieces(3), 4), pieces_tiling(pieces(25), 4)
    assert three.key == many.key and three.key[0] == "piece_loop"
    assert many.dims[0] == 25 and len(many.dims) == 1 + 25 * (len(three.dims) - 1) // 3
    assert pieces_tiling(pieces(2), 4).key[0] == "pieces"      # below LOOP_PIECES: unrolled


def test_split_into_many_outputs_walks_one_loop():
    """The loop's table names each piece's output slot too: Split into five."""
    m, _ = single_node_model("Split", [f32(2, 5, 40)], n_outputs=5, axis=2, num_outputs=5,
                             opset=18)
    m = dynamic(m, {"in0": {0: "batch", 1: "seq"}})
    sess = check_runtime_dims(m, [{"in0": f32(b, s, 40)} for b, s in SIZES])
    notes = [str(k.notes.get("pieces")) for spec in sess.specializations for k in spec.kernels
             if list(k.op_types) == ["Split"]]
    assert notes and all("one loop" in n for n in notes), notes
