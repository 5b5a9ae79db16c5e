"""Resize's innermost dim a vector of outputs at a time (codegen/lower/movement.py): where
every tap's sources for a block of outputs lie within a vector of the source row
(upsampling), a vector load permuted by a table; elsewhere (downsampling) one element at
a time. Both against onnxruntime, over the modes, factors, row lengths that end inside a
vector, rows cut into column chunks on two cores, and 4-byte integers."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import model_of, ort_run, restrict_host_to_avx2
from onnx import helper, numpy_helper

import cannc

R = np.random.default_rng(0)


def _run(x, sizes, cores=1, **attrs):
    et = helper.np_dtype_to_tensor_dtype(x.dtype)
    m = model_of([helper.make_node("Resize", ["x", "", "", "sz"], ["y"], **attrs)],
                 [helper.make_tensor_value_info("x", et, list(x.shape))],
                 [helper.make_tensor_value_info("y", et, None)],
                 [numpy_helper.from_array(np.array(sizes, np.int64), "sz")])
    sess = cannc.compile(m, cores=cores)
    got = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ort_run(m, {"x": x})[0], rtol=1e-4, atol=1e-5)
    return sess


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("src,dst", [
    ((1, 21, 14, 14), (1, 21, 224, 224)),     # DeepLabV3's x16
    ((2, 3, 7, 9), (2, 3, 20, 37)),           # non-integer factors, rows ending mid-vector
    ((1, 4, 5, 33), (1, 4, 11, 40)),          # a source row longer than a vector
    ((1, 2, 9, 40), (1, 2, 4, 13)),           # downsampling: sources spread past a vector
    ((3, 50), (3, 101)),
])
def test_resize_matches_onnxruntime(mode, src, dst):
    _run(R.standard_normal(src).astype(np.float32), dst, mode=mode)


@pytest.mark.parametrize("coord", ["half_pixel", "align_corners", "asymmetric",
                                   "pytorch_half_pixel"])
def test_coordinate_modes(coord):
    _run(R.standard_normal((1, 3, 6, 10)).astype(np.float32), (1, 3, 13, 29), mode="linear",
         coordinate_transformation_mode=coord)


def test_long_rows_on_two_cores():
    # one row of 1 x 1 x 2 x 40000 outputs is cut into column chunks, one per tile
    _run(R.standard_normal((1, 1, 2, 10000)).astype(np.float32), (1, 1, 2, 40000), cores=2,
         mode="linear")


def test_nearest_int32():
    _run(R.integers(-1000, 1000, (2, 3, 5, 7)).astype(np.int32), (2, 3, 11, 30),
         mode="nearest")


@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_avx2_kernels(monkeypatch, mode):
    # 8-lane vectors, vpermps of AVX2
    restrict_host_to_avx2(monkeypatch)
    _run(R.standard_normal((1, 3, 7, 9)).astype(np.float32), (1, 3, 20, 37), mode=mode)
