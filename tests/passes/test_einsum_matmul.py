"""A two-operand float32 Einsum that is a batched matrix product becomes Transposes and
Reshapes around a MatMul (passes/legalize.py legalize_einsum); other equations keep the
loop nest. Results match onnxruntime either way."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import model_of, ort_run, pass_graph, run_pass
from onnx import helper

import cannc

F32 = np.float32
R = np.random.default_rng(0)


def _node(eq):
    return helper.make_node("Einsum", ["a", "b"], ["y"], equation=eq, name="es")


def _check(eq, sa, sb, dtype=F32):
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    m = model_of([_node(eq)], [helper.make_tensor_value_info("a", et, sa),
                               helper.make_tensor_value_info("b", et, sb)],
                 [helper.make_tensor_value_info("y", et, None)])
    feeds = {"a": R.standard_normal(sa).astype(dtype), "b": R.standard_normal(sb).astype(dtype)}
    sess = cannc.compile(m, cores=1)
    np.testing.assert_allclose(sess.run(None, feeds)[0], ort_run(m, feeds)[0],
                               rtol=1e-4, atol=1e-5)
    # the ops the session lowered (a kernel names the ONNX node it stands for: Einsum)
    return {n.op_type for sp in sess.specializations for n in sp.graph.nodes()}


CASES = [
    # MaxViT's attention: Q @ Kᵀ and P @ V per (batch, grid, head)
    ("BGHID,BGHJD->BGHIJ", (1, 4, 2, 7, 8), (1, 4, 2, 9, 8), ["Transpose", "MatMul"]),
    ("BGHIJ,BGHJD->BGHID", (1, 4, 2, 7, 9), (1, 4, 2, 9, 8), ["MatMul"]),
    ("ij,jk->ik", (5, 6), (6, 7), ["MatMul"]),
    ("ij,kj->ik", (5, 6), (7, 6), ["Transpose", "MatMul"]),
    ("bik,bkj->bji", (3, 5, 6), (3, 6, 7), ["MatMul", "Transpose"]),
    ("abcd,cdf->abf", (2, 3, 4, 5), (4, 5, 6), ["Reshape", "Reshape", "MatMul", "Reshape"]),
    ("i,j->ij", (5,), (7,), ["Reshape", "Reshape", "MatMul"]),                       # outer
    ("i,i->", (5,), (5,), ["Reshape", "Reshape", "MatMul", "Reshape"]),              # dot
    ("...ij,...jk->...ik", (2, 3, 4, 5), (2, 3, 5, 6), ["MatMul"]),
]


@pytest.mark.parametrize("eq,sa,sb,ops", CASES, ids=[c[0] for c in CASES])
def test_matmul_equations(eq, sa, sb, ops):
    r = run_pass("legalize_einsum", pass_graph([_node(eq)], {"a": (F32, sa), "b": (F32, sb)},
                                               ["y"]))
    assert r.changed and sorted(r.after.ops) == sorted(ops)
    assert "Einsum" not in _check(eq, sa, sb)


@pytest.mark.parametrize("eq,sa,sb", [
    ("ii,ij->j", (4, 4), (4, 5)),          # a diagonal
    ("ij,jk->k", (4, 5), (5, 6)),          # i summed within one operand
    ("ij,ij->ij", (4, 5), (1, 5)),         # broadcasting
])
def test_other_equations_keep_the_loop_nest(eq, sa, sb):
    r = run_pass("legalize_einsum", pass_graph([_node(eq)], {"a": (F32, sa), "b": (F32, sb)},
                                               ["y"]))
    assert not r.changed
    assert "Einsum" in _check(eq, sa, sb)


def test_integer_einsum_keeps_the_loop_nest():
    assert "Einsum" in _check("ij,jk->ik", (3, 4), (4, 5), dtype=np.int32)


def test_the_matmul_stands_for_the_einsum():
    # the precision policy, keep_fp32 and the profiles name the ONNX node, not the MatMul
    m = model_of([_node("bij,bjk->bik")],
                 [helper.make_tensor_value_info("a", 1, [2, 32, 64]),
                  helper.make_tensor_value_info("b", 1, [2, 64, 48])],
                 [helper.make_tensor_value_info("y", 1, None)])
    feeds = {"a": R.standard_normal((2, 32, 64)).astype(F32),
             "b": R.standard_normal((2, 64, 48)).astype(F32)}
    for keep, want in (((), "bf16"), (("es",), "fp32")):
        sess = cannc.compile(m, cores=1, precision="bf16", keep_fp32=keep)
        sess.run(None, feeds)
        assert sess.precision_map() == {"es": want}
        assert [k["nodes"] for k in sess.inspect()["kernels"]] == [["es"]]
