"""Shape-polymorphic attention: one compile, many batch sizes and sequence lengths.

Each model is one attention block in a form the fusion pass turns into a
FusedAttention kernel (head split, QKᵀ, scale, mask, Softmax, ·V, head merge);
its inputs have symbolic batch / sequence dims. ``check_runtime_dims`` compiles
it once, runs it at every size below (1, odd sizes, sizes that are not
multiples of the 16-lane vectors or of the 16-row / 64-key tiles) and asserts
that no run after the first lowers or compiles anything, and that every result
matches onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers import check_runtime_dims

F32_MIN = float(np.finfo(np.float32).min)


@pytest.fixture(autouse=True)
def _cold_memo(tmp_path, monkeypatch):
    """A fresh lowering memo: entries an earlier process left on disk for each size
    would hide a kernel that is lowered again at every size."""
    monkeypatch.setenv("CANNC_CACHE_DIR", str(tmp_path / "cache"))
# (batch, sequence): the first run generates the code, the others must not
SIZES = [(1, 1), (2, 7), (3, 33), (1, 128), (2, 70), (1, 17)]


def _model(mask: str = "add", H: int = 2, D: int = 16, k_layout: str = "transpose",
           merge: bool = True, cross: bool = False) -> onnx.ModelProto:
    """q [B,Sq,H*D], k/v [B,Sk,H*D] -> attention -> [B,Sq,H*D] (or [B,H,Sq,D]).

    mask: 'none'; 'add' (float m [B,1,1,Sk] added); 'add_full' (float m [B,1,Sq,Sk]);
    'where' (bool m [B,1,1,Sk], Where(m, scores, lowest)); 'where_inv' (bool m,
    Where(m, lowest, scores)); 'causal' (a [1,1,N,N] bool buffer sliced to the
    last Sq rows and first Sk columns, as GPT-2 exports it)."""
    E = H * D
    nodes = [helper.make_node("Reshape", [n, "split"], [f"{n}4"]) for n in "qkv"]
    inits = [numpy_helper.from_array(np.array([0, 0, H, D], np.int64), "split")]
    nodes.append(helper.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]))
    nodes.append(helper.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]))
    if k_layout == "transpose":
        nodes.append(helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]))
    else:
        nodes.append(helper.make_node("Transpose", ["k4"], ["kh"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]))
    nodes.append(helper.make_node("MatMul", ["qh", "kt"], ["sc"]))
    nodes.append(helper.make_node("Div", ["sc", "sqrt_d"], ["ss"]))
    inits.append(numpy_helper.from_array(np.array(np.sqrt(D), np.float32), "sqrt_d"))
    sq, sk = ("sq", "sk") if cross else ("seq", "seq")
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, ["batch", sq, E]),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, ["batch", sk, E]),
              helper.make_tensor_value_info("v", TensorProto.FLOAT, ["batch", sk, E])]
    lowest = numpy_helper.from_array(np.array(F32_MIN, np.float32), "lowest")
    if mask == "none":
        nodes.append(helper.make_node("Identity", ["ss"], ["sm_in"]))
    elif mask in ("add", "add_full"):
        shape = ["batch", 1, 1, sk] if mask == "add" else ["batch", 1, sq, sk]
        inputs.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, shape))
        nodes.append(helper.make_node("Add", ["ss", "m"], ["sm_in"]))
    elif mask in ("where", "where_inv"):
        inputs.append(helper.make_tensor_value_info("m", TensorProto.BOOL, ["batch", 1, 1, sk]))
        args = ["m", "ss", "lowest"] if mask == "where" else ["m", "lowest", "ss"]
        nodes.append(helper.make_node("Where", args, ["sm_in"]))
        inits.append(lowest)
    elif mask == "causal":
        N = 256
        inits.append(numpy_helper.from_array(np.tril(np.ones((N, N), bool))[None, None], "buf"))
        inits.append(lowest)
        inits += [numpy_helper.from_array(np.array([a], np.int64), n)
                  for a, n in ((1, "one"), (2, "two"), (3, "three"), (0, "zero"))]
        nodes += [
            helper.make_node("Shape", ["q"], ["qshape"]),
            helper.make_node("Gather", ["qshape", "one"], ["q_len"]),
            helper.make_node("Shape", ["k"], ["kshape"]),
            helper.make_node("Gather", ["kshape", "one"], ["k_len"]),
            helper.make_node("Sub", ["k_len", "q_len"], ["start"]),
            helper.make_node("Slice", ["buf", "start", "k_len", "two"], ["rows"]),
            helper.make_node("Slice", ["rows", "zero", "k_len", "three"], ["cm"]),
            helper.make_node("Where", ["cm", "ss", "lowest"], ["sm_in"]),
        ]
    else:
        raise ValueError(mask)
    nodes.append(helper.make_node("Softmax", ["sm_in"], ["p"], axis=-1))
    nodes.append(helper.make_node("MatMul", ["p", "vh"], ["o"]))
    if merge:
        nodes.append(helper.make_node("Transpose", ["o"], ["om"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Reshape", ["om", "merge"], ["y"]))
        inits.append(numpy_helper.from_array(np.array([0, 0, E], np.int64), "merge"))
    else:
        nodes.append(helper.make_node("Identity", ["o"], ["y"]))
    out = helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, ["batch", sq, E] if merge else ["batch", H, sq, D])
    g = helper.make_graph(nodes, "attention", inputs, [out], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _feeds(model: onnx.ModelProto, B: int, Sq: int, Sk: int | None = None,
           seed: int = 0) -> dict[str, np.ndarray]:
    Sk = Sq if Sk is None else Sk
    rng = np.random.default_rng(seed + 1000 * B + Sq + 7 * Sk)
    sizes = {"batch": B, "seq": Sq, "sq": Sq, "sk": Sk}
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else sizes[d.dim_param]
                 for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == TensorProto.BOOL:
            keep = rng.random(shape) < 0.7
            keep[..., 0] = True     # a row with every key masked differs (uniform vs NaN)
            feeds[vi.name] = keep
        elif vi.name == "m":
            # a key-padding style additive mask: 0 or -10000
            feeds[vi.name] = np.where(rng.random(shape) < 0.75, 0.0, -10000.0).astype(np.float32)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _attention_kernels(sess) -> list:
    """The FusedAttention kernels of every specialisation the session ran."""
    return [k for prog in sess.programs.values() for k in prog.spec.kernels
            if "attention" in k.notes]


@pytest.mark.parametrize("mask", ["none", "add", "add_full", "where", "where_inv"])
def test_one_compile_many_sizes(mask):
    m = _model(mask)
    sess = check_runtime_dims(m, [_feeds(m, B, S) for B, S in SIZES])
    att = _attention_kernels(sess)
    assert len(att) == len(SIZES), "every size runs one fused attention kernel"
    assert len({k.symbol for k in att}) == 1, "one kernel serves every size"
    assert {k.dims[:3] for k in att} == {(B, S, S) for B, S in SIZES}


@pytest.mark.parametrize("k_layout,merge", [("kh_then_swap", True), ("transpose", False)])
def test_layouts(k_layout, merge):
    m = _model("add", H=3, D=24, k_layout=k_layout, merge=merge)
    check_runtime_dims(m, [_feeds(m, B, S) for B, S in SIZES[:4]])


def test_head_dim_not_a_vector_multiple():
    m = _model("where", H=1, D=40)
    check_runtime_dims(m, [_feeds(m, B, S) for B, S in [(2, 5), (1, 1), (3, 66)]])


def test_cross_attention_sq_ne_sk():
    m = _model("add", cross=True)
    sizes = [(1, 1, 1), (2, 7, 30), (3, 33, 5), (1, 1, 129), (2, 80, 80)]
    check_runtime_dims(m, [_feeds(m, B, Sq, Sk) for B, Sq, Sk in sizes])


def test_causal_buffer_slice():
    m = _model("causal")
    check_runtime_dims(m, [_feeds(m, B, S) for B, S in SIZES])


def test_causal_decode_rows():
    """Causal with fewer queries than keys (the last rows of the buffer)."""
    m = _model("causal", cross=True)
    sizes = [(1, 3, 10), (2, 1, 17), (1, 20, 20), (3, 9, 64)]
    check_runtime_dims(m, [_feeds(m, B, Sq, Sk) for B, Sq, Sk in sizes])
