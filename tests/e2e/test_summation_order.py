"""Rounding error of long fp32 reductions: the order the GEMM and conv kernels sum in.

A dot product of K fp32 terms summed in one FMA chain has a rounding error growing
with K; summed in chains of at most 256 (codegen/gemm.py SUBCHAIN, and K blocks begun
at zero, VecBuilder.add_partials) whose sums are then added -- MLAS's order -- the
error stays near a final rounding. Measured on Zen 4 (rms error / rms value of unit-
variance outputs): one chain over K = 4096 gives 1.3e-6, over K = 2048 8e-7; chains of
256 give 3e-7, as onnxruntime does. The bound below sits between the two, so a kernel
that sums a whole K block (or the whole K) in one chain again fails here.
"""

from __future__ import annotations

import numpy as np
import pytest

import cannc
from tests.helpers import single_node_model

BOUND = 4.5e-7   # rms error relative to the rms of the exact result


def _rel_rms_error(got: np.ndarray, exact: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got.astype(np.float64) - exact) ** 2))
                 / np.sqrt(np.mean(exact ** 2)))


@pytest.mark.parametrize("M,K,N", [(1, 4096, 1000), (256, 2048, 512), (128, 3072, 768)])
def test_matmul_long_k_sums_in_short_chains(M, K, N):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    model, feeds = single_node_model("MatMul", [x, w], const_inputs=[1])
    got = cannc.compile(model, cores=1).run(None, feeds)[0]
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert _rel_rms_error(got, exact) < BOUND


@pytest.mark.parametrize("C,M,HW", [(2048, 512, 7), (1024, 256, 14)])
def test_pointwise_conv_long_k_sums_in_short_chains(C, M, HW):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, C, HW, HW)).astype(np.float32)
    w = (rng.standard_normal((M, C, 1, 1)) / np.sqrt(C)).astype(np.float32)
    model, feeds = single_node_model("Conv", [x, w], const_inputs=[1])
    got = cannc.compile(model, cores=1).run(None, feeds)[0]
    exact = np.einsum("mc,nchw->nmhw", w[:, :, 0, 0].astype(np.float64), x.astype(np.float64))
    assert _rel_rms_error(got, exact) < BOUND
