"""Shape-polymorphic GEMMs (MatMul, Gemm, FusedGemm): compiled once, run at other batch
sizes and sequence lengths (M, and the batch count of a batched MatMul) with no code
generation (ABI.md "Runtime dimensions"), against onnxruntime."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
from helpers import check_runtime_dims, model_of, single_node_model, with_dynamic_dims
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.codegen.gemm import GEMM_DIMS
from cannc.codegen.lower.contraction import gemm_tiling
from cannc.compiler import codegen_counts
from cannc.ir.graph import Node
from cannc.ir.types import TensorType

R = np.random.default_rng(11)
# (batch, seq): the first compiles; then 1, odd sizes, sizes that are not multiples of
# the vector width (16), of the micro-tile's rows (6) or of a row block
SIZES = [(2, 5), (1, 1), (1, 2), (3, 1), (1, 3), (3, 7), (1, 17), (5, 13), (4, 33), (2, 131)]


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


dynamic = with_dynamic_dims


def vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def gemm_kernels(sess: cannc.Session) -> list:
    return [k for sp in sess.specializations for k in sp.kernels
            if "MatMul" in k.op_types or "Gemm" in k.op_types]


def assert_one_dynamic_kernel(sess: cannc.Session, runs: int) -> None:
    """Every run used the same GEMM code, with the runtime dims of its own M."""
    ks = gemm_kernels(sess)
    assert len(ks) == runs, [k.op_types for k in ks]
    assert len({k.symbol for k in ks}) == 1
    assert all(len(k.dims) == len(GEMM_DIMS) for k in ks)
    assert len({k.dims[0] for k in ks}) > 1      # M differed


# -- MatMul [B, S, K] x [K, N] with a constant weight: M = B*S --------------------------


@pytest.mark.parametrize("K,N", [(64, 96), (70, 100), (33, 3), (16, 512), (200, 17)],
                         ids=lambda v: str(v))
def test_matmul_const_weight(K, N):
    m, _ = single_node_model("MatMul", [f32(2, 5, K), f32(K, N)], const_inputs=[1])
    m = dynamic(m, {"in0": {0: "batch", 1: "seq"}})
    sess = check_runtime_dims(m, [{"in0": f32(b, s, K)} for b, s in SIZES])
    assert_one_dynamic_kernel(sess, len(SIZES))


def test_matmul_2d_rows():
    K, N = 48, 80
    m, _ = single_node_model("MatMul", [f32(9, K), f32(K, N)], const_inputs=[1])
    m = dynamic(m, {"in0": {0: "rows"}})
    check_runtime_dims(m, [{"in0": f32(r, K)} for r in (9, 1, 2, 4, 5, 6, 7, 12, 100, 301)])


def test_matmul_weight_is_an_input():
    """B not a constant: packed per block in the workspace."""
    K, N = 40, 70
    m, _ = single_node_model("MatMul", [f32(2, 5, K), f32(K, N)])
    m = dynamic(m, {"in0": {0: "batch", 1: "seq"}})
    w = f32(K, N)
    check_runtime_dims(m, [{"in0": f32(b, s, K), "in1": w} for b, s in SIZES])


def test_batched_matmul_both_inputs():
    """[B, H, S, D] x [B, H, D, T]: the batch count B*H and M = S at run time."""
    H, D, T = 2, 24, 20
    m, _ = single_node_model("MatMul", [f32(2, H, 5, D), f32(2, H, D, T)])
    m = dynamic(m, {"in0": {0: "batch", 2: "seq"}, "in1": {0: "batch"}})
    feeds = [{"in0": f32(b, H, s, D), "in1": f32(b, H, D, T)} for b, s in SIZES[:7]]
    sess = check_runtime_dims(m, feeds)
    assert_one_dynamic_kernel(sess, len(feeds))


def test_batched_matmul_const_batched_weight():
    """[G, S, K] x constant [G, K, N]: the weight of each of G groups prepacked."""
    G, K, N = 3, 20, 40
    m, _ = single_node_model("MatMul", [f32(G, 5, K), f32(G, K, N)], const_inputs=[1])
    m = dynamic(m, {"in0": {1: "seq"}})
    check_runtime_dims(m, [{"in0": f32(G, s, K)} for s in (5, 1, 2, 7, 18, 67)])


def test_batched_matmul_broadcast_a():
    """[S, K] x [B, K, N]: A is the same for every batch item."""
    K, N = 16, 36
    m, _ = single_node_model("MatMul", [f32(5, K), f32(2, K, N)])
    m = dynamic(m, {"in0": {0: "seq"}, "in1": {0: "batch"}})
    feeds = [{"in0": f32(s, K), "in1": f32(b, K, N)} for b, s in ((2, 5), (3, 1), (2, 9), (5, 2))]
    check_runtime_dims(m, feeds)


# -- Gemm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("trans_b,bias,alpha,beta", [
    (1, "row", 1.0, 1.0), (0, "row", 0.5, 2.0), (1, "full", 1.0, 1.0), (0, "col", 1.0, -1.0),
    (1, None, 2.0, 1.0), (0, "scalar", 1.0, 0.0)])
def test_gemm(trans_b, bias, alpha, beta):
    K, N = 50, 72
    w = f32(N, K) if trans_b else f32(K, N)
    cshape = {"row": [N], "full": ["rows", N], "col": ["rows", 1], "scalar": [1]}.get(bias)
    inputs = [vi("a", ["rows", K])]
    names = ["a", "w"]
    if bias:
        inputs.append(vi("c", cshape))
        names.append("c")
    node = helper.make_node("Gemm", names, ["y"], transB=trans_b, alpha=alpha, beta=beta)
    m = model_of([node], inputs, [vi("y", ["rows", N])], [numpy_helper.from_array(w, "w")])
    feeds = []
    for r in (5, 1, 2, 3, 7, 13, 64, 200):
        f = {"a": f32(r, K)}
        if bias:
            f["c"] = f32(*[r if d == "rows" else d for d in cshape])
        feeds.append(f)
    sess = check_runtime_dims(m, feeds)
    assert_one_dynamic_kernel(sess, len(feeds))


# -- FusedGemm: GEMM + epilogue ----------------------------------------------------------


def test_fused_gemm_epilogue_operands():
    """MatMul + bias row + Relu + residual (full) * a per-row column: one FusedGemm
    whose operands are indexed with the runtime M."""
    K, N = 64, 80
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("Add", ["y", "bias"], ["z"]),
             helper.make_node("Relu", ["z"], ["r"]),
             helper.make_node("Add", ["r", "res"], ["o"]),
             helper.make_node("Mul", ["o", "colv"], ["out"])]
    m = model_of(nodes, [vi("x", ["b", "s", K]), vi("res", ["b", "s", N]),
                         vi("colv", ["b", "s", 1])], [vi("out", ["b", "s", N])],
                 [numpy_helper.from_array(f32(K, N), "w"),
                  numpy_helper.from_array(f32(N), "bias")])
    feeds = [{"x": f32(b, s, K), "res": f32(b, s, N), "colv": f32(b, s, 1)} for b, s in SIZES]
    sess = check_runtime_dims(m, feeds)
    ks = gemm_kernels(sess)
    assert all(k.op_types == ["MatMul", "Add", "Relu", "Add", "Mul"] for k in ks), ks
    assert_one_dynamic_kernel(sess, len(SIZES))


def test_fused_gemm_bias_gelu_transformer_ffn():
    """The FFN of a transformer block: Gemm-like MatMul + bias + Gelu, then MatMul + bias +
    residual; N not a multiple of 16."""
    H, F = 40, 136
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Gelu", ["hb"], ["g"]),
             helper.make_node("MatMul", ["g", "w2"], ["o"]),
             helper.make_node("Add", ["o", "b2"], ["ob"]),
             helper.make_node("Add", ["ob", "x"], ["out"])]
    m = model_of(nodes, [vi("x", ["b", "s", H])], [vi("out", ["b", "s", H])],
                 [numpy_helper.from_array(0.2 * f32(H, F), "w1"),
                  numpy_helper.from_array(f32(F), "b1"),
                  numpy_helper.from_array(0.2 * f32(F, H), "w2"),
                  numpy_helper.from_array(f32(H), "b2")])
    m.opset_import[0].version = 20   # Gelu
    check_runtime_dims(m, [{"x": f32(b, s, H)} for b, s in SIZES], rtol=1e-4, atol=1e-4)


def test_fused_gemm_batched_row_bias():
    H, D, T = 2, 16, 24
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"]),
             helper.make_node("Add", ["s", "bias"], ["out"])]
    m = model_of(nodes, [vi("q", ["b", H, "s", D]), vi("k", ["b", H, D, T])],
                 [vi("out", ["b", H, "s", T])], [numpy_helper.from_array(f32(T), "bias")])
    feeds = [{"q": f32(b, H, s, D), "k": f32(b, H, D, T)} for b, s in SIZES[:7]]
    check_runtime_dims(m, feeds)


# -- the tiling function ------------------------------------------------------------------


def _matmul_tiling(a_shape, b_shape):
    n = Node(name="mm", op_type="MatMul", inputs=["a", "b"], outputs=["y"])
    ts = [TensorType(np.dtype(np.float32), tuple(a_shape)),
          TensorType(np.dtype(np.float32), tuple(b_shape))]
    return gemm_tiling(n, ts, [])


def test_tiling_key_has_no_runtime_dim():
    t1 = _matmul_tiling((2, 5, 64), (64, 96))
    t2 = _matmul_tiling((7, 301, 64), (64, 96))
    assert t1.key == t2.key
    assert (t1.dims[0], t2.dims[0]) == (10, 7 * 301)
    assert t2.num_tiles > 1 and t2.flops == 2 * 7 * 301 * 64 * 96
    assert _matmul_tiling((2, 5, 64), (64, 97)).key != t1.key        # N is static
    assert _matmul_tiling((2, 5, 65), (65, 96)).key != t1.key        # so is K
    b1 = _matmul_tiling((2, 3, 5, 16), (2, 3, 16, 8))
    b2 = _matmul_tiling((4, 3, 9, 16), (4, 3, 16, 8))
    assert b1.key == b2.key and (b1.dims[:2], b2.dims[:2]) == ((5, 6), (9, 12))


def test_static_fallback_for_transposed_a():
    """Gemm with transA: A's leading dimension is M, emitted statically (tiling None)."""
    a, w = f32(30, 7), f32(30, 20)
    n = Node(name="g", op_type="Gemm", inputs=["a", "w"], outputs=["y"], attrs={"transA": 1})
    ts = [TensorType(np.dtype(np.float32), a.shape), TensorType(np.dtype(np.float32), w.shape)]
    assert gemm_tiling(n, ts, []) is None
    from helpers import check_op
    check_op("Gemm", [a, w], const_inputs=[1], transA=1)


def test_a_second_shape_generates_no_code():
    """The premise of check_runtime_dims, measured directly: a new M is only host work."""
    K, N = 32, 48
    m, _ = single_node_model("MatMul", [f32(3, K), f32(K, N)], const_inputs=[1])
    m = dynamic(m, {"in0": {0: "rows"}})
    sess = cannc.compile(m, cores=2)
    sess.run(None, {"in0": f32(3, K)})
    before = codegen_counts()
    x = f32(1000, K)
    (y,) = sess.run(None, {"in0": x})
    assert codegen_counts() == before
    w = numpy_helper.to_array(m.graph.initializer[0])
    np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-4)


# -- strip kernels shared between the GEMMs of a model -----------------------------------


def test_gemms_share_strip_kernels(tmp_path):
    """Two dynamic GEMMs call the same shared strip kernels: each library module is in
    the program's objects once, and travels in a saved artifact, which loads and runs."""
    K, N1, N2 = 64, 96, 80
    w1, w2 = f32(K, N1), f32(N1, N2)
    m = model_of([helper.make_node("MatMul", ["x", "w1"], ["h"]),
                  helper.make_node("Relu", ["h"], ["r"]),
                  helper.make_node("MatMul", ["r", "w2"], ["y"])],
                 [vi("x", ["batch", "seq", K])], [vi("y", None)],
                 [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    feeds = [{"x": f32(b, s, K)} for b, s in SIZES[:5]]
    sess = check_runtime_dims(m, feeds)
    spec = sess.specializations[0]
    ks = gemm_kernels(sess)[:2]
    assert len({k.symbol for k in ks}) == 2
    shared = set(ks[0].needs) & set(ks[1].needs)
    assert shared, [k.needs for k in ks]
    needs = {n for k in spec.kernels for n in k.needs}
    assert all(sym.startswith("cannc_lib_") and spec.objects[sym] for sym, _ in needs)
    path = tmp_path / "two.cnc"
    sess.save(path)
    with zipfile.ZipFile(path) as z:
        assert {f"objects/{key}.o" for _, key in needs} <= set(z.namelist())
    loaded = cannc.load(path, cores=1)
    for f in feeds:
        np.testing.assert_allclose(loaded.run(None, f)[0], sess.run(None, f)[0], rtol=1e-6,
                                   atol=1e-6)
