"""Data-movement ops: cannc vs onnxruntime on single-node models (cores=2)."""

from __future__ import annotations

import numpy as np
import pytest

import cannc
from tests.helpers import check_op, single_node_model

RNG = np.random.default_rng(0)

DTYPES = [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int16, np.uint16,
          np.int32, np.uint32, np.int64, np.uint64, np.bool_]


def rand(shape, dtype=np.float32):
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return RNG.random(shape) > 0.5
    if dt.kind in "iu":
        lo = 0 if dt.kind == "u" else -100
        return RNG.integers(lo, 100, size=shape).astype(dt)
    return RNG.standard_normal(shape).astype(dt)


def i64(x):
    return np.asarray(x, dtype=np.int64)


# -- Transpose -------------------------------------------------------------------

@pytest.mark.parametrize("shape,perm", [
    ((2, 3, 4, 5), [0, 2, 1, 3]),           # [B,S,H,D] -> [B,H,S,D]: contiguous rows
    ((2, 17, 4, 32), [0, 2, 1, 3]),
    ((2, 3, 4, 5), [3, 1, 0, 2]),
    ((2, 3, 4, 5), None),                   # default: reversed
    ((37, 45), [1, 0]),                     # 2-D, ragged blocks
    ((64, 48), [1, 0]),                     # 2-D, whole blocks
    ((1, 20, 9, 7), [0, 2, 3, 1]),          # NCHW -> NHWC
    ((1, 9, 7, 20), [0, 3, 1, 2]),          # NHWC -> NCHW
    ((1, 1, 5), [2, 0, 1]),                 # size-1 dims
    ((3,), [0]),
    ((2, 32, 40, 8), [0, 3, 1, 2]),
])
def test_transpose_shapes(shape, perm):
    kw = {} if perm is None else {"perm": perm}
    check_op("Transpose", [rand(shape)], **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transpose_dtypes(dtype):
    check_op("Transpose", [rand((35, 40), dtype)], perm=[1, 0])
    check_op("Transpose", [rand((2, 3, 4), dtype)], perm=[2, 0, 1], opset=13)


@pytest.mark.parametrize("shape,perm", [
    ((37, 45), [1, 0]), ((64, 48), [1, 0]), ((1, 20, 9, 7), [0, 2, 3, 1]),
    ((2, 32, 40, 8), [0, 3, 1, 2]), ((4, 64, 8, 16), [0, 2, 1, 3])])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int8])
def test_transpose_avx2(monkeypatch, shape, perm, dtype):
    """Transposes in register blocks of 32 bytes' rows (8 floats), the AVX2 kernels."""
    from cannc.codegen import movement
    from tests.helpers import restrict_host_to_avx2
    restrict_host_to_avx2(monkeypatch)
    plan = movement._Plan(movement.transpose_piece(shape, perm), 4096, np.dtype(dtype).itemsize)
    assert plan.k == min(16, 32 // np.dtype(dtype).itemsize)
    check_op("Transpose", [rand(shape, dtype)], perm=perm)


@pytest.mark.parametrize("opset", [7, 13, 21])
def test_transpose_opsets_large(opset):
    # several tiles, both cores
    check_op("Transpose", [rand((96, 300))], perm=[1, 0], opset=opset)
    check_op("Transpose", [rand((4, 64, 8, 16))], perm=[0, 2, 1, 3], opset=opset)


# -- Concat / Split ----------------------------------------------------------------

@pytest.mark.parametrize("axis,opset", [(0, 7), (1, 11), (-1, 13), (2, 13), (-3, 13)])
def test_concat(axis, opset):
    a = rand((2, 3, 4))
    shp = list(a.shape)
    ax = axis % 3
    shp[ax] = 5
    b = rand(tuple(shp))
    shp[ax] = 1
    c = rand(tuple(shp))
    check_op("Concat", [a, b, c], axis=axis, opset=opset)


@pytest.mark.parametrize("dtype", [np.float16, np.int8, np.int64, np.bool_, np.float64])
def test_concat_dtypes_const_input(dtype):
    check_op("Concat", [rand((3, 70), dtype), rand((3, 5), dtype)], axis=1, const_inputs=[1])


def test_concat_large():
    check_op("Concat", [rand((8, 1000)), rand((8, 3000))], axis=1)
    check_op("Concat", [rand((3000, 8)), rand((2000, 8))], axis=0)


def test_split_opset7_attr():
    check_op("Split", [rand((6, 4))], n_outputs=3, opset=7, axis=0, split=[1, 2, 3])
    check_op("Split", [rand((6, 9))], n_outputs=3, opset=7, axis=1)


def test_split_opset11_negative_axis():
    check_op("Split", [rand((2, 6, 5))], n_outputs=2, opset=11, axis=-2, split=[4, 2])


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_, np.float16])
def test_split_opset13_input(dtype):
    check_op("Split", [rand((4, 10), dtype), i64([3, 7])], n_outputs=2, opset=13, axis=1,
             const_inputs=[1])


def test_split_opset18_num_outputs():
    check_op("Split", [rand((7, 3))], n_outputs=3, opset=18, axis=0, num_outputs=3)
    check_op("Split", [rand((2, 8))], n_outputs=4, opset=18, axis=-1, num_outputs=4)


def test_split_large():
    check_op("Split", [rand((64, 600))], n_outputs=2, opset=13, axis=1)


# -- Slice ---------------------------------------------------------------------------

def test_slice_opset7_attrs():
    x = rand((5, 6, 7))
    check_op("Slice", [x], opset=7, starts=[1, 2], ends=[4, 100], axes=[0, 2])
    check_op("Slice", [x], opset=7, starts=[-3, 0, 1], ends=[-1, 6, -1])


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1, 0], [4, 7], [0, 2], [1, 2]),
    ([-1], [-1000], [1], [-1]),                         # full reverse, clamped end
    ([10], [0], [2], [-3]),                             # clamped start, step -3
    ([0, 1, 2], [5, 6, 7], [0, 1, 2], [2, 3, 2]),
    ([2], [2**62], [-1], [1]),                           # huge end, negative axis
    ([4, -2], [0, 0], [0, -1], [-2, -1]),
    ([3], [3], [0], [1]),                               # empty
])
@pytest.mark.parametrize("opset", [10, 13])
def test_slice_inputs(starts, ends, axes, steps, opset):
    x = rand((5, 6, 7))
    check_op("Slice", [x, i64(starts), i64(ends), i64(axes), i64(steps)], opset=opset,
             const_inputs=[1, 2, 3, 4])


@pytest.mark.parametrize("dtype", [np.float16, np.int8, np.int64, np.bool_])
def test_slice_dtypes(dtype):
    x = rand((4, 100), dtype)
    check_op("Slice", [x, i64([1, 90]), i64([3, 2]), i64([0, 1]), i64([1, -1])], opset=13,
             const_inputs=[1, 2, 3, 4])


def test_slice_no_axes_steps():
    check_op("Slice", [rand((6, 5)), i64([1, 1]), i64([5, 4])], opset=13, const_inputs=[1, 2])


# -- Gather ------------------------------------------------------------------------

@pytest.mark.parametrize("opset", [7, 11, 13])
def test_gather_embedding(opset):
    table = rand((50, 32))
    ids = RNG.integers(0 if opset < 11 else -50, 50, size=(2, 7)).astype(np.int64)
    check_op("Gather", [table, ids], axis=0, opset=opset, const_inputs=[0])


@pytest.mark.parametrize("axis", [0, 1, -1, 2])
@pytest.mark.parametrize("itype", [np.int32, np.int64])
def test_gather_axes(axis, itype):
    x = rand((4, 5, 6))
    dim = x.shape[axis]
    idx = RNG.integers(-dim, dim, size=(3, 2)).astype(itype)
    check_op("Gather", [x, idx], axis=axis, opset=13)


@pytest.mark.parametrize("dtype", [np.float16, np.int8, np.int64, np.bool_, np.float64])
def test_gather_dtypes(dtype):
    check_op("Gather", [rand((10, 3), dtype), i64([[0, 9], [-1, 4]])], axis=0)
    check_op("Gather", [rand((10, 3), dtype), i64([2, 0, -3])], axis=1)


def test_gather_scalar_index_and_large():
    check_op("Gather", [rand((5, 8)), np.array(3, dtype=np.int64)], axis=0)
    check_op("Gather", [rand((5, 8)), np.array(-2, dtype=np.int64)], axis=1)
    check_op("Gather", [rand((1000, 64)), RNG.integers(0, 1000, size=(4, 64)).astype(np.int64)],
             axis=0)
    check_op("Gather", [rand((64, 1000)), RNG.integers(0, 1000, size=(300,)).astype(np.int32)],
             axis=1)


def test_gather_out_of_range_reads_zeros():
    # onnxruntime rejects these; cannc must neither crash nor read outside the table
    table = rand((6, 4))
    ids = i64([[0, 6, -7], [1000000, -1, 2**40]])
    m, feeds = single_node_model("Gather", [table, ids], axis=0, opset=13)
    sess = cannc.compile(m, cores=2, shapes={k: v.shape for k, v in feeds.items()})
    got = sess.run(None, feeds)[0]
    ok = np.array([[1, 0, 0], [0, 1, 0]], dtype=bool)
    expect = np.where(ok[..., None], table[np.clip(ids, -6, 5)], 0)
    np.testing.assert_array_equal(got, expect)
    ids = i64([7, -1, -8])
    m, feeds = single_node_model("Gather", [table, ids], axis=1, opset=13)
    got = cannc.compile(m, cores=2).run(None, feeds)[0]
    np.testing.assert_array_equal(got, np.stack([np.zeros(6), table[:, 3], np.zeros(6)], 1)
                                  .astype(np.float32))


# -- GatherElements / GatherND -------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("opset", [11, 13])
def test_gather_elements(axis, opset):
    x = rand((4, 5, 6))
    ishape = [3, 4, 5]
    dim = x.shape[axis]
    idx = RNG.integers(-dim, dim, size=ishape).astype(np.int64)
    check_op("GatherElements", [x, idx], axis=axis, opset=opset)


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_elements_constant_folded(axis):
    """Both inputs constant: the folder computes it (indices narrower than the data on
    the other axis, as torch.gather of position ids from an expanded [1, 512] buffer)."""
    x = np.arange(2 * 512, dtype=np.int64).reshape(2, 512) if axis == 1 else rand((9, 4))
    idx = (np.arange(64, dtype=np.int64)[None] if axis == 1
           else RNG.integers(-9, 9, size=(5, 3)).astype(np.int64))
    check_op("GatherElements", [x, idx], axis=axis, const_inputs=[0, 1])


@pytest.mark.parametrize("dtype", [np.int8, np.float16, np.bool_])
def test_gather_elements_dtypes(dtype):
    idx = RNG.integers(0, 7, size=(3, 7)).astype(np.int32)
    check_op("GatherElements", [rand((3, 7), dtype), idx], axis=1)


@pytest.mark.parametrize("dshape,ishape,bd,opset", [
    ((4, 5, 6), (3, 2), 0, 11),       # slices of 6
    ((4, 5, 6), (2, 3, 3), 0, 12),    # elements
    ((4, 5, 6), (4, 1), 1, 12),       # batch_dims 1
    ((2, 5, 6, 3), (2, 4, 2), 1, 13),
    ((4, 5), (2, 1), 0, 13),
])
def test_gather_nd(dshape, ishape, bd, opset):
    x = rand(dshape)
    q = ishape[-1]
    dims = dshape[bd:bd + q]
    idx = np.stack([RNG.integers(-d, d, size=ishape[:-1]) for d in dims], -1).astype(np.int64)
    kw = {"batch_dims": bd} if opset >= 12 else {}
    check_op("GatherND", [x, idx], opset=opset, **kw)


# -- ScatterElements / ScatterND ----------------------------------------------------------

def _perm_indices(shape, axis, dim):
    """Indices without duplicates along `axis` (so 'none' is well defined)."""
    idx = np.empty(shape, dtype=np.int64)
    for pos in np.ndindex(*[s for d, s in enumerate(shape) if d != axis]):
        p = list(pos)
        vals = RNG.permutation(dim)[: shape[axis]]
        sl = p[:axis] + [slice(None)] + p[axis:]
        idx[tuple(sl)] = vals
    return idx


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("opset", [11, 13])
def test_scatter_elements(axis, opset):
    x = rand((5, 6, 4))
    shape = [3, 4, 2]
    idx = _perm_indices(shape, axis % 3, x.shape[axis])
    idx = np.where(RNG.random(shape) > 0.5, idx - x.shape[axis], idx)   # negatives
    check_op("ScatterElements", [x, idx, rand(shape)], axis=axis, opset=opset)


@pytest.mark.parametrize("reduction,opset", [("add", 16), ("mul", 16), ("max", 18), ("min", 18)])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_scatter_elements_reduction(reduction, opset, dtype):
    x = rand((4, 5), dtype)
    idx = RNG.integers(0, 4, size=(6, 5)).astype(np.int64)   # duplicates on purpose
    check_op("ScatterElements", [x, idx, rand((6, 5), dtype)], axis=0, opset=opset,
             reduction=reduction)


def test_scatter_deprecated_and_large():
    x = rand((4, 5))
    check_op("Scatter", [x, _perm_indices([2, 5], 0, 4), rand((2, 5))], axis=0, opset=9)
    x = rand((100, 80))
    idx = _perm_indices([100, 30], 1, 80)
    check_op("ScatterElements", [x, idx, rand((100, 30))], axis=1, opset=13)


@pytest.mark.parametrize("opset", [11, 13, 16])
def test_scatter_nd(opset):
    x = rand((6, 5, 4))
    idx = i64([[[1], [4]], [[-1], [0]]])                 # slices [5,4]
    check_op("ScatterND", [x, idx, rand((2, 2, 5, 4))], opset=opset)
    idx = i64([[0, 1, 2], [5, 4, 3], [2, -2, 0]])        # elements
    check_op("ScatterND", [x, idx, rand((3,))], opset=opset)


@pytest.mark.parametrize("reduction,opset", [("add", 16), ("mul", 16), ("max", 18), ("min", 18)])
def test_scatter_nd_reduction(reduction, opset):
    x = rand((6, 5))
    idx = i64([[1], [3], [1]])
    check_op("ScatterND", [x, idx, rand((3, 5))], opset=opset, reduction=reduction)


def test_scatter_nd_large_int():
    x = rand((200, 40), np.int64)
    idx = RNG.permutation(200)[:50].reshape(50, 1).astype(np.int64)
    check_op("ScatterND", [x, idx, rand((50, 40), np.int64)], opset=13)


# -- Expand / Tile -----------------------------------------------------------------------

@pytest.mark.parametrize("ishape,shape", [
    ((3, 1), (2, 3, 4)), ((1, 5), (4, 5)), ((5,), (3, 1, 5)), ((2, 1, 3), (2, 4, 3)),
    ((1,), (7,)), ((3, 1), (1, 1)), ((64, 1), (64, 300)),
])
@pytest.mark.parametrize("opset", [8, 13])
def test_expand(ishape, shape, opset):
    check_op("Expand", [rand(ishape), i64(shape)], opset=opset, const_inputs=[1])


@pytest.mark.parametrize("dtype", [np.int8, np.float16, np.bool_, np.int64])
def test_expand_dtypes(dtype):
    check_op("Expand", [rand((1, 3), dtype), i64([4, 3])], const_inputs=[1])


@pytest.mark.parametrize("shape,reps", [((2, 3), (2, 3)), ((2, 1, 3), (1, 4, 1)),
                                        ((5,), (3,)), ((3, 4), (1, 1)), ((1, 70), (100, 2))])
@pytest.mark.parametrize("opset", [7, 13])
def test_tile(shape, reps, opset):
    check_op("Tile", [rand(shape), i64(reps)], opset=opset, const_inputs=[1])


@pytest.mark.parametrize("dtype", [np.uint8, np.bool_, np.float64])
def test_tile_dtypes(dtype):
    check_op("Tile", [rand((2, 3), dtype), i64([3, 2])], const_inputs=[1])


# -- Pad ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad_opset7_attrs(mode):
    check_op("Pad", [rand((3, 4, 5))], opset=7, mode=mode, pads=[0, 1, 2, 1, 2, 0], value=1.5)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("opset", [11, 13])
def test_pad_inputs(mode, opset):
    x = rand((1, 3, 6, 7))
    check_op("Pad", [x, i64([0, 0, 2, 3, 0, 0, 1, 2])], opset=opset, mode=mode,
             const_inputs=[1])


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_axes_opset19(mode):
    x = rand((2, 5, 6))
    check_op("Pad", [x, i64([2, 1, 3, 2]), None, i64([-1, 1])], opset=19, mode=mode,
             const_inputs=[1, 3])


def test_pad_wrap_big():
    x = rand((2, 3))
    check_op("Pad", [x, i64([4, 5, 3, 7])], opset=19, mode="wrap", const_inputs=[1])


def test_pad_constant_value_runtime_and_const():
    x = rand((4, 5))
    check_op("Pad", [x, i64([1, 2, 0, 1]), np.array(3.25, np.float32)], opset=13,
             const_inputs=[1])
    check_op("Pad", [x, i64([1, 2, 0, 1]), np.array(-2.0, np.float32)], opset=13,
             const_inputs=[1, 2])


def test_pad_negative():
    x = rand((5, 6))
    check_op("Pad", [x, i64([-1, 2, 1, -3])], opset=13, const_inputs=[1])
    check_op("Pad", [x, i64([-2, 0, 0, -1])], opset=13, const_inputs=[1])


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.float16, np.float64,
                                   np.uint8])
def test_pad_dtypes(dtype):
    x = rand((3, 4), dtype)
    check_op("Pad", [x, i64([1, 1, 2, 2]), np.array(7, dtype)], opset=13, const_inputs=[1, 2])
    check_op("Pad", [x, i64([0, 2, 0, 3])], opset=13, mode="reflect", const_inputs=[1])


def test_pad_large_nchw():
    check_op("Pad", [rand((2, 8, 30, 30)), i64([0, 0, 1, 1, 0, 0, 1, 1])], opset=13,
             const_inputs=[1])
    check_op("Pad", [rand((2, 8, 30, 30)), i64([0, 0, 3, 3, 0, 0, 3, 3])], opset=13,
             mode="reflect", const_inputs=[1])


# -- DepthToSpace / SpaceToDepth --------------------------------------------------------

@pytest.mark.parametrize("mode,opset", [(None, 7), ("DCR", 11), ("CRD", 11), ("CRD", 13)])
def test_depth_to_space(mode, opset):
    kw = {} if mode is None else {"mode": mode}
    check_op("DepthToSpace", [rand((2, 8, 3, 4))], opset=opset, blocksize=2, **kw)
    check_op("DepthToSpace", [rand((1, 18, 5, 20))], opset=opset, blocksize=3, **kw)


@pytest.mark.parametrize("opset", [7, 13])
def test_space_to_depth(opset):
    check_op("SpaceToDepth", [rand((2, 3, 4, 6))], opset=opset, blocksize=2)
    check_op("SpaceToDepth", [rand((1, 2, 32, 48), np.int8)], opset=opset, blocksize=4)


# -- Trilu -------------------------------------------------------------------------------

@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 2, -1, -10, 100])
def test_trilu(upper, k):
    x = rand((2, 5, 7))
    if k is None:
        check_op("Trilu", [x], opset=14, upper=upper)
    else:
        check_op("Trilu", [x, i64(k)], opset=14, upper=upper, const_inputs=[1])


def test_trilu_runtime_k_and_dtypes():
    check_op("Trilu", [rand((6, 4)), i64(1)], opset=14, upper=1)
    check_op("Trilu", [rand((6, 4)), i64(-2)], opset=14, upper=0)
    check_op("Trilu", [rand((3, 40, 40), np.int64)], opset=14, upper=0)
    check_op("Trilu", [rand((64, 130), np.bool_)], opset=14)


# -- OneHot ------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("opset", [9, 11])
def test_onehot(axis, opset):
    lo = 0 if opset < 11 else -5
    idx = RNG.integers(lo, 5, size=(3, 4)).astype(np.int64)
    vals = np.array([0.5, 2.0], np.float32)
    check_op("OneHot", [idx, np.array([5], np.int64), vals], axis=axis, opset=opset,
             const_inputs=[1, 2])


def test_onehot_runtime_values_and_types():
    idx = RNG.integers(-3, 7, size=(2, 5)).astype(np.int64)   # some out of range
    check_op("OneHot", [idx, np.array(6, np.int64), np.array([0, 1], np.int64)], opset=11,
             const_inputs=[1])
    idx = RNG.integers(-3, 7, size=(2, 5)).astype(np.int32)
    check_op("OneHot", [idx, np.array(6, np.int32), np.array([2, 5], np.float32)], opset=11,
             const_inputs=[1], axis=0)
    idx = RNG.integers(0, 10, size=(200,)).astype(np.float32)
    check_op("OneHot", [idx, np.array(10.0, np.float32), np.array([-1, 3], np.float32)],
             opset=11, const_inputs=[1, 2])


# -- SpaceToDepth / DepthToSpace, newest opset (ORT has no kernel: onnx.reference) -----------

@pytest.mark.parametrize("op,mode", [("SpaceToDepth", "DCR"), ("SpaceToDepth", "CRD"),
                                     ("DepthToSpace", "DCR"), ("DepthToSpace", "CRD")])
def test_depth_space_opset28(op, mode):
    from onnx.reference import ReferenceEvaluator
    x = rand((2, 8, 4, 6))
    m, feeds = single_node_model(op, [x], opset=28, blocksize=2, mode=mode)
    got = cannc.compile(m, cores=2).run(None, feeds)[0]
    np.testing.assert_array_equal(got, ReferenceEvaluator(m).run(None, feeds)[0])


# -- Resize / Upsample -------------------------------------------------------------------------

def _f32(x):
    return np.asarray(x, dtype=np.float32)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scales", [[1, 1, 2, 2], [1, 1, 0.5, 0.5], [1, 1, 1.5, 3],
                                    [1, 1, 0.6, 1.7]])
def test_resize_opset10(mode, scales):
    check_op("Resize", [rand((1, 2, 6, 5)), _f32(scales)], opset=10, mode=mode, const_inputs=[1])


@pytest.mark.parametrize("coord", ["half_pixel", "pytorch_half_pixel", "align_corners",
                                   "asymmetric", "tf_half_pixel_for_nn"])
@pytest.mark.parametrize("nearest", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
def test_resize_nearest_modes(coord, nearest):
    x = rand((1, 2, 5, 7))
    check_op("Resize", [x, _f32([]), _f32([1, 1, 1.6, 0.7])], opset=11, mode="nearest",
             coordinate_transformation_mode=coord, nearest_mode=nearest, const_inputs=[1, 2])


@pytest.mark.parametrize("coord", ["half_pixel", "pytorch_half_pixel", "align_corners",
                                   "asymmetric"])
@pytest.mark.parametrize("opset", [11, 13])
def test_resize_linear_modes(coord, opset):
    x = rand((2, 3, 5, 7))
    roi = _f32([]) if opset == 11 else None
    check_op("Resize", [x, roi, _f32([1, 1, 2.0, 0.6])], opset=opset, mode="linear",
             coordinate_transformation_mode=coord, const_inputs=[1, 2])
    check_op("Resize", [x, roi, _f32([]), i64([2, 3, 9, 4])], opset=opset, mode="linear",
             coordinate_transformation_mode=coord, const_inputs=[1, 2, 3])


def test_resize_sizes_nearest_int_and_crop():
    x = rand((1, 3, 8, 8), np.uint8)
    check_op("Resize", [x, None, None, i64([1, 3, 16, 12])], opset=13, mode="nearest",
             const_inputs=[3])
    xf = rand((1, 1, 6, 6))
    roi = _f32([0, 0, 0.2, 0.1, 1, 1, 0.9, 1.2])
    for mode in ("nearest", "linear"):
        check_op("Resize", [xf, roi, _f32([1, 1, 1.5, 2])], opset=13, mode=mode,
                 coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-7.0,
                 const_inputs=[1, 2])


def test_resize_opset18_19_axes_policy():
    x = rand((1, 2, 6, 9))
    check_op("Resize", [x, None, _f32([2, 0.5])], opset=18, mode="linear", axes=[2, 3],
             const_inputs=[2])
    check_op("Resize", [x, None, None, i64([12, 12])], opset=18, mode="nearest", axes=[2, 3],
             keep_aspect_ratio_policy="not_larger", const_inputs=[3])
    check_op("Resize", [x, None, _f32([1, 1, 1.7, 0.8])], opset=19, mode="linear",
             coordinate_transformation_mode="half_pixel_symmetric", const_inputs=[2])


def test_resize_large_and_f64():
    check_op("Resize", [rand((2, 8, 32, 32)), None, _f32([1, 1, 2, 2])], opset=13, mode="linear",
             const_inputs=[2])
    # onnxruntime has no float64 Resize: compare with onnx.reference
    from onnx.reference import ReferenceEvaluator
    m, feeds = single_node_model("Resize", [rand((1, 2, 5, 5), np.float64), None,
                                            _f32([1, 1, 3, 0.6])], opset=13, mode="linear",
                                 const_inputs=[2])
    got = cannc.compile(m, cores=2).run(None, feeds)[0]
    np.testing.assert_allclose(got, ReferenceEvaluator(m).run(None, feeds)[0], rtol=1e-5,
                               atol=1e-6)  # coordinates in float32, like onnxruntime
    check_op("Resize", [rand((2, 8, 32, 32), np.float16), None, _f32([1, 1, 2, 2])], opset=13,
             mode="nearest", const_inputs=[2])


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample(mode):
    x = rand((1, 2, 4, 3))
    check_op("Upsample", [x], opset=7, mode=mode, scales=[1.0, 1.0, 2.0, 3.0])
    check_op("Upsample", [x, _f32([1, 1, 3, 2])], opset=9, mode=mode, const_inputs=[1])


# -- newest opsets, empty tensors, bfloat16 ------------------------------------------------

@pytest.mark.parametrize("opset", [21, 23, 24, 25])
def test_newest_opsets(opset):
    check_op("Transpose", [rand((3, 20, 17))], perm=[2, 0, 1], opset=opset)
    check_op("Pad", [rand((3, 4)), i64([1, 0, 2, 1])], opset=opset, mode="edge", const_inputs=[1])
    check_op("Pad", [rand((3, 4)), i64([1, 2]), np.array(1.5, np.float32), i64([1])],
             opset=opset, const_inputs=[1, 3])


def test_onehot_opset28():
    idx = RNG.integers(-4, 4, size=(3, 2)).astype(np.int64)
    check_op("OneHot", [idx, np.array(4, np.int64), np.array([0, 9], np.int64)], opset=28,
             const_inputs=[1, 2])


def test_empty_tensors():
    check_op("Concat", [rand((2, 0, 3)), rand((2, 4, 3)), rand((2, 0, 3))], axis=1)
    check_op("Gather", [rand((5, 3)), np.zeros((0,), np.int64)], axis=0)
    check_op("Transpose", [rand((0, 3))], perm=[1, 0])
    check_op("Tile", [rand((2, 3)), i64([0, 2])], const_inputs=[1])


def test_bfloat16_moves_bits():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from cannc.ir.types import NP_TO_ONNX
    if np.dtype(ml_dtypes.bfloat16) not in NP_TO_ONNX:
        pytest.skip("no bfloat16 mapping")
    x = rand((5, 18)).astype(ml_dtypes.bfloat16)
    m, feeds = single_node_model("Transpose", [x], perm=[1, 0])
    got = cannc.compile(m, cores=2).run(None, feeds)[0]
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got.view(np.uint16), x.T.view(np.uint16))


# -- out-of-range runtime indices: never a crash, never a read outside the tensors ----------------

def _run(op, inputs, **kw):
    m, feeds = single_node_model(op, inputs, **kw)
    return cannc.compile(m, cores=2).run(None, feeds)[0]


def test_out_of_range_indices_are_safe():
    x = rand((4, 5))
    idx = i64([[9, 0, -1, -6, 2]])
    got = _run("GatherElements", [x, idx], axis=0, opset=13)
    expect = np.array([[0, x[0, 1], x[3, 2], 0, x[2, 4]]], np.float32)
    np.testing.assert_array_equal(got, expect)
    got = _run("GatherND", [x, i64([[1, 2], [4, 0], [-1, -7], [-4, -5]])], opset=13)
    np.testing.assert_array_equal(got, np.array([x[1, 2], 0, 0, x[0, 0]], np.float32))
    got = _run("GatherND", [x, i64([[3], [-9]])], opset=13)
    np.testing.assert_array_equal(got, np.stack([x[3], np.zeros(5, np.float32)]))
    # scatters skip what lands outside the data
    got = _run("ScatterElements", [x, i64([[1, 99, -1, -5, 0]]), np.ones((1, 5), np.float32)],
               axis=0, opset=13)
    expect = x.copy()
    expect[1, 0] = expect[3, 2] = expect[0, 4] = 1
    np.testing.assert_array_equal(got, expect)
    got = _run("ScatterND", [x, i64([[2], [4], [-5], [-1]]), np.ones((4, 5), np.float32)],
               opset=13)
    expect = x.copy()
    expect[2] = expect[3] = 1
    np.testing.assert_array_equal(got, expect)


# -- what stays unsupported says why ---------------------------------------------------------------

@pytest.mark.parametrize("attrs,why", [
    ({"mode": "cubic", "antialias": 1}, "antialias"),
    ({"mode": "linear", "antialias": 1}, "antialias"),
])
def test_resize_unsupported_reason(attrs, why):
    m, feeds = single_node_model("Resize", [rand((1, 1, 4, 4)), None, _f32([1, 1, 2, 2])],
                                 opset=18, const_inputs=[2], **attrs)
    with pytest.raises(cannc.errors.UnsupportedOpError, match=why):
        cannc.compile(m, cores=2)


@pytest.mark.parametrize("coord", ["half_pixel", "align_corners", "asymmetric"])
@pytest.mark.parametrize("exclude", [0, 1])
@pytest.mark.parametrize("scales", [[1, 1, 2, 1.5], [1, 1, 0.6, 0.8]])
def test_resize_cubic(coord, exclude, scales):
    check_op("Resize", [rand((1, 2, 5, 6)), _f32([]), _f32(scales)], opset=13, mode="cubic",
             coordinate_transformation_mode=coord, exclude_outside=exclude,
             cubic_coeff_a=-0.5, const_inputs=[1, 2])


def test_resize_linear_int_unsupported_reason():
    m, feeds = single_node_model("Resize", [rand((1, 1, 4, 4), np.int8), None,
                                            _f32([1, 1, 2, 2])], opset=13, const_inputs=[2],
                                 mode="linear")
    with pytest.raises(cannc.errors.UnsupportedOpError, match="linear mode on int8"):
        cannc.compile(m, cores=2)
