"""Every fusion: fused and unfused execution agree with each other and with onnxruntime;
kernel counts fall; refusals are logged with their reason."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from helpers import ort_run
from onnx import TensorProto, helper, numpy_helper

import cannc

R = np.random.default_rng(0)
F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, F, s) for n, s in outputs],
                          [numpy_helper.from_array(np.asarray(a, np.float32), n)
                           for n, a in inits])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _compare(model, feeds, **kw):
    """Run fused and unfused, compare both with onnxruntime; return (fused, unfused) sessions."""
    exp = ort_run(model, feeds)
    fused = cannc.compile(model, cores=2, shapes={k: v.shape for k, v in feeds.items()}, **kw)
    plain = cannc.compile(model, cores=2, shapes={k: v.shape for k, v in feeds.items()},
                          fusion=False)
    for sess in (fused, plain):
        for g, e in zip(sess.run(None, feeds), exp):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
    return fused, plain


def _kernels(sess):
    (prog,) = sess.programs.values()
    return prog.spec.kernels


def _log(sess):
    (prog,) = sess.programs.values()
    return prog.spec.graph.meta.get("fusion_log", [])


def test_elementwise_chain_is_one_kernel():
    m = _model([helper.make_node("Add", ["x", "b"], ["t1"]),
                helper.make_node("Mul", ["t1", "s"], ["t2"]),
                helper.make_node("Relu", ["t2"], ["t3"]),
                helper.make_node("Sigmoid", ["t3"], ["y"])],
               [("x", [4, 100])], [("y", [4, 100])],
               [("b", R.standard_normal(100)), ("s", np.float32(0.5))])
    fused, plain = _compare(m, {"x": R.standard_normal((4, 100)).astype(np.float32)})
    assert len(_kernels(fused)) == 1 and len(_kernels(plain)) == 4
    assert _kernels(fused)[0].nodes == ["Add_0", "Mul_1", "Relu_2", "Sigmoid_3"] or \
        len(_kernels(fused)[0].nodes) == 4


def test_intermediate_used_outside_is_kept():
    m = _model([helper.make_node("Add", ["x", "x"], ["t1"]),
                helper.make_node("Tanh", ["t1"], ["y1"]),
                helper.make_node("ReduceSum", ["t1"], ["y2"], keepdims=1)],
               [("x", [3, 50])], [("y1", [3, 50]), ("y2", [1, 1])])
    fused, _ = _compare(m, {"x": R.standard_normal((3, 50)).astype(np.float32)})
    k = _kernels(fused)
    assert len(k) == 2 and set(k[0].outputs) == {"t1", "y1"}


def test_shape_mismatch_is_logged():
    m = _model([helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=1),
                helper.make_node("Exp", ["m"], ["e"]),
                helper.make_node("Add", ["e", "x"], ["y"])],
               [("x", [3, 50])], [("y", [3, 50])], opset=13)
    fused, _ = _compare(m, {"x": R.standard_normal((3, 50)).astype(np.float32)})
    reasons = [d.reason for d in _log(fused)]
    assert any("shapes differ" in r for r in reasons), reasons


@pytest.mark.parametrize("act", ["gelu_erf", "gelu_tanh", "relu", "residual"])
def test_matmul_bias_activation_epilogue(act):
    K, N = 64, 96
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["h"])]
    inits = [("w", R.standard_normal((K, N)) / 8), ("b", R.standard_normal(N))]
    if act == "gelu_erf":
        nodes += [helper.make_node("Div", ["h", "sq2"], ["d"]),
                  helper.make_node("Erf", ["d"], ["e"]),
                  helper.make_node("Add", ["e", "one"], ["e1"]),
                  helper.make_node("Mul", ["h", "e1"], ["g"]),
                  helper.make_node("Mul", ["g", "half"], ["y"])]
        inits += [("sq2", np.float32(1.4142135)), ("one", np.float32(1)), ("half", np.float32(.5))]
    elif act == "gelu_tanh":
        nodes += [helper.make_node("Pow", ["h", "three"], ["p"]),
                  helper.make_node("Mul", ["p", "c"], ["pc"]),
                  helper.make_node("Add", ["h", "pc"], ["s"]),
                  helper.make_node("Mul", ["s", "k"], ["sk"]),
                  helper.make_node("Tanh", ["sk"], ["t"]),
                  helper.make_node("Add", ["t", "one"], ["t1"]),
                  helper.make_node("Mul", ["h", "t1"], ["g"]),
                  helper.make_node("Mul", ["g", "half"], ["y"])]
        inits += [("three", np.float32(3)), ("c", np.float32(0.044715)),
                  ("k", np.float32(0.7978846)),
                  ("one", np.float32(1)), ("half", np.float32(.5))]
    elif act == "relu":
        nodes += [helper.make_node("Relu", ["h"], ["y"])]
    else:
        nodes += [helper.make_node("Add", ["h", "r"], ["y"])]
    inputs = [("x", [2, 13, K])] + ([("r", [2, 13, N])] if act == "residual" else [])
    m = _model(nodes, inputs, [("y", [2, 13, N])], inits)
    feeds = {"x": R.standard_normal((2, 13, K)).astype(np.float32)}
    if act == "residual":
        feeds["r"] = R.standard_normal((2, 13, N)).astype(np.float32)
    fused, plain = _compare(m, feeds)
    k = _kernels(fused)
    assert len(k) == 1, [x.op_types for x in k]
    assert k[0].op_types[0] == "MatMul" and "epilogue" in k[0].notes
    assert len(_kernels(plain)) == len(nodes)


def test_gemm_epilogue_refused_when_result_escapes():
    m = _model([helper.make_node("MatMul", ["x", "w"], ["mm"]),
                helper.make_node("Relu", ["mm"], ["y1"]),
                helper.make_node("Transpose", ["mm"], ["y2"])],
               [("x", [8, 16])], [("y1", [8, 24]), ("y2", [24, 8])],
               [("w", R.standard_normal((16, 24)))])
    fused, _ = _compare(m, {"x": R.standard_normal((8, 16)).astype(np.float32)})
    assert len(_kernels(fused)) == 3
    assert any(d.rule == "gemm_epilogue" and "Transpose" in d.reason for d in _log(fused))


def test_gemm_op_with_bias_and_epilogue():
    m = _model([helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=1, alpha=0.5),
                helper.make_node("Clip", ["g", "lo", "hi"], ["y"])],
               [("x", [5, 16])], [("y", [5, 24])],
               [("w", R.standard_normal((24, 16))), ("b", R.standard_normal(24)),
                ("lo", np.float32(0)), ("hi", np.float32(0.6))])
    fused, _ = _compare(m, {"x": R.standard_normal((5, 16)).astype(np.float32)})
    assert len(_kernels(fused)) == 1


def _decomposed_layernorm(gamma=True):
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]),
             helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["p"]),
             helper.make_node("ReduceMean", ["p"], ["v"], axes=[-1]),
             helper.make_node("Add", ["v", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["s"]),
             helper.make_node("Div", ["d", "s"], ["n" if gamma else "y"])]
    inits = [("two", np.float32(2)), ("eps", np.float32(1e-12))]
    if gamma:
        nodes += [helper.make_node("Mul", ["n", "g"], ["ng"]),
                  helper.make_node("Add", ["ng", "b"], ["y"])]
        inits += [("g", R.standard_normal(48)), ("b", R.standard_normal(48))]
    return _model(nodes, [("x", [2, 7, 48])], [("y", [2, 7, 48])], inits, opset=13)


@pytest.mark.parametrize("gamma", [True, False])
def test_decomposed_layernorm_becomes_one_op(gamma):
    m = _decomposed_layernorm(gamma)
    fused, plain = _compare(m, {"x": R.standard_normal((2, 7, 48)).astype(np.float32) * 3})
    k = _kernels(fused)
    assert len(k) == 1 and k[0].op_types[0] == "ReduceMean" and len(k[0].nodes) == len(m.graph.node)
    assert len(_kernels(plain)) > 4


def test_switches_by_rule_and_by_file(tmp_path):
    m = _decomposed_layernorm()
    feeds = {"x": R.standard_normal((2, 7, 48)).astype(np.float32)}
    off = cannc.compile(m, cores=1, shapes={"x": (2, 7, 48)}, fusion={"layernorm": False})
    assert len(_kernels(off)) > 1
    f = tmp_path / "switch.json"
    f.write_text(json.dumps({"layernorm": False, "elementwise": False}))
    off2 = cannc.compile(m, cores=1, shapes={"x": (2, 7, 48)}, fusion=str(f))
    assert len(_kernels(off2)) > len(_kernels(off)) - 1
    np.testing.assert_allclose(off2.run(None, feeds)[0], off.run(None, feeds)[0], rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(cannc.CanncError, match="unknown fusion rule"):
        cannc.compile(m, fusion={"nonsense": True})


def test_zoo_bert_fusion_reduces_kernels_and_traffic():
    from models import zoo

    model = zoo.build("bert")
    shapes = {"input_ids": (2, 32), "attention_mask": (2, 32)}
    fused = cannc.compile(model, cores=1, shapes=shapes)
    plain = cannc.compile(model, cores=1, shapes=shapes, fusion=False)
    rf, rp = fused.inspect(without_fusion=False), plain.inspect()
    assert rf["num_kernels"] * 2 <= rp["num_kernels"]
    assert rf["intermediate_bytes_written"] <= 0.6 * rp["intermediate_bytes_written"]
    assert rf["fusion"]["not_fused"], "refusals are reported"
    feeds = zoo.example_inputs(model, batch=2, seq=32)
    for a, b in zip(fused.run(None, feeds), plain.run(None, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_export_fused_graph(tmp_path):
    from cannc.export import fused_graph
    m = _decomposed_layernorm()
    sess = cannc.compile(m, cores=1, shapes={"x": (2, 7, 48)})
    (prog,) = sess.programs.values()
    g = fused_graph(prog.spec)
    assert [n.domain for n in g.graph.node] == ["cannc"]
    onnx.save(g, str(tmp_path / "f.onnx"))


def _conv_model(act, depthwise=False, residual=False, bn=True):
    C, M = (8, 8) if depthwise else (5, 12)
    g = C if depthwise else 1
    nodes = [helper.make_node("Conv", ["x", "w", "cb"], ["c"], pads=[1, 1, 1, 1], group=g)]
    inits = [("w", R.standard_normal((M, C // g, 3, 3)) / 4), ("cb", R.standard_normal(M))]
    cur = "c"
    if bn:
        nodes.append(helper.make_node("BatchNormalization", [cur, "s", "bb", "mu", "var"], ["n"]))
        inits += [("s", R.random(M) + .5), ("bb", R.standard_normal(M)),
                  ("mu", R.standard_normal(M) * .1), ("var", R.random(M) + .5)]
        cur = "n"
    if residual:
        nodes.append(helper.make_node("Add", [cur, "r"], ["a"]))
        cur = "a"
    if act == "relu":
        nodes.append(helper.make_node("Relu", [cur], ["y"]))
    elif act == "clip":
        nodes.append(helper.make_node("Clip", [cur, "lo", "hi"], ["y"]))
        inits += [("lo", np.float32(0)), ("hi", np.float32(6))]
    elif act == "hardswish":
        nodes.append(helper.make_node("HardSwish", [cur], ["y"]))
    elif act == "chanscale":
        nodes.append(helper.make_node("Mul", [cur, "cs"], ["y"]))
        inits += [("cs", R.standard_normal((M, 1, 1)))]
    inputs = [("x", [2, C, 9, 7])] + ([("r", [2, M, 9, 7])] if residual else [])
    return _model(nodes, inputs, [("y", [2, M, 9, 7])], inits), M


@pytest.mark.parametrize("act,depthwise,residual", [
    ("relu", False, False), ("relu", False, True), ("clip", True, False),
    ("hardswish", False, False), ("chanscale", False, True), ("relu", True, True)])
def test_conv_bn_epilogue(act, depthwise, residual):
    m, M = _conv_model(act, depthwise, residual)
    C = 8 if depthwise else 5
    feeds = {"x": R.standard_normal((2, C, 9, 7)).astype(np.float32)}
    if residual:
        feeds["r"] = R.standard_normal((2, M, 9, 7)).astype(np.float32)
    fused, plain = _compare(m, feeds)
    k = _kernels(fused)
    assert len(k) == 1, [x.op_types for x in k]
    assert k[0].op_types[:2] == ["Conv", "BatchNormalization"]
    assert len(_kernels(plain)) == len(m.graph.node)


def test_conv_bn_not_folded_when_conv_output_escapes():
    m, _ = _conv_model("relu")
    m.graph.output.append(helper.make_tensor_value_info("c", F, [2, 12, 9, 7]))
    fused, _ = _compare(m, {"x": R.standard_normal((2, 5, 9, 7)).astype(np.float32)})
    assert any(d.rule == "conv_bn" and "also used" in d.reason for d in _log(fused))


def _bn_model(rank=4, after="Concat", act="Relu", C=6):
    """A BatchNormalization with constant parameters that no Conv precedes (DenseNet's
    Concat -> BN -> ReLU), followed by an activation."""
    shape = [2, C // 2, 5, 7][:rank] if rank > 2 else [3, C // 2]
    full = [shape[0], C] + shape[2:]
    p = (np.abs(R.standard_normal(C)) + 0.5, R.standard_normal(C), R.standard_normal(C),
         np.abs(R.standard_normal(C)) + 0.1)
    nodes = [helper.make_node("Concat", ["a", "b"], ["c"], axis=1) if after == "Concat"
             else helper.make_node("Relu", ["a"], ["c"]),
             helper.make_node("BatchNormalization", ["c", "sc", "bi", "mu", "va"], ["n"],
                              epsilon=1e-3),
             helper.make_node(act, ["n"], ["y"])]
    inputs = [("a", shape if after == "Concat" else full)] + \
        ([("b", shape)] if after == "Concat" else [])
    inits = list(zip(["sc", "bi", "mu", "va"], p))
    return _model(nodes, inputs, [("y", full)], inits), inputs


@pytest.mark.parametrize("rank,after,act", [(4, "Concat", "Relu"), (3, "Relu", "Sigmoid"),
                                            (2, "Concat", "Relu")])
def test_bn_affine_joins_the_elementwise_group(rank, after, act):
    m, inputs = _bn_model(rank, after, act)
    feeds = {n: R.standard_normal(s).astype(np.float32) for n, s in inputs}
    fused, plain = _compare(m, feeds)
    ops = [k.op_types for k in _kernels(fused)]
    # the BN and the activation: one kernel (after a Relu, that one too)
    assert ["BatchNormalization", "BatchNormalization", act] in [o[-3:] for o in ops], ops
    assert len(ops) == (2 if after == "Concat" else 1), ops
    off = cannc.compile(m, cores=2, shapes={k: v.shape for k, v in feeds.items()},
                        fusion={"bn_affine": False})
    assert ["BatchNormalization"] in [k.op_types for k in _kernels(off)]
    assert len(_kernels(off)) > len(ops)


def test_bn_affine_refuses_runtime_parameters():
    m, inputs = _bn_model()
    m.graph.input.append(helper.make_tensor_value_info("mu", F, [6]))
    del m.graph.initializer[2]
    feeds = {n: R.standard_normal(s).astype(np.float32) for n, s in inputs}
    feeds["mu"] = R.standard_normal(6).astype(np.float32)
    fused, _ = _compare(m, feeds)
    assert any(d.rule == "bn_affine" and "not constant" in d.reason for d in _log(fused))


def _attention_model(mask="add", merge=True, scale_op="Div", k_layout="transpose", S=9, H=2,
                     D=8, B=2, nan_guard=False):
    """Head split (Reshape+Transpose), QKᵀ, scale, mask, Softmax, ·V, head merge;
    `nan_guard`: the probabilities through Where(IsNaN(p), 0, p), as torch's dynamo
    export of scaled_dot_product_attention writes them."""
    I64 = TensorProto.INT64
    hid = H * D
    nodes, inits = [], [("shape4", np.array([B, S, H, D], np.int64))]
    for n in "qkv":
        nodes.append(helper.make_node("Reshape", [n, "shape4"], [f"{n}4"]))
    nodes.append(helper.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]))
    nodes.append(helper.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]))
    if k_layout == "transpose":
        nodes.append(helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]))
    elif k_layout == "bh3d":  # torch's dynamo export: through [B*H, S, D] and back
        nodes.append(helper.make_node("Transpose", ["k4"], ["kh"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Reshape", ["kh", "shape3"], ["k3"]))
        nodes.append(helper.make_node("Transpose", ["k3"], ["k3t"], perm=[0, 2, 1]))
        nodes.append(helper.make_node("Reshape", ["k3t", "shape4t"], ["kt"]))
        inits += [("shape3", np.array([B * H, S, D], np.int64)),
                  ("shape4t", np.array([B, H, D, S], np.int64))]
    else:  # [B,H,S,D] then swap the last two
        nodes.append(helper.make_node("Transpose", ["k4"], ["kh"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]))
    if scale_op == "sqrt_qk":   # torch's scaled_dot_product_attention export
        nodes.append(helper.make_node("Mul", ["qh", "rs"], ["qs"]))
        nodes.append(helper.make_node("Mul", ["kt", "rs"], ["ks"]))
        nodes.append(helper.make_node("MatMul", ["qs", "ks"], ["ss"]))
        inits.append(("rs", np.float32(np.sqrt(1 / np.sqrt(D)))))
    else:
        nodes.append(helper.make_node("MatMul", ["qh", "kt"], ["sc"]))
    if scale_op == "sqrt_qk":
        pass
    elif scale_op == "Div":
        nodes.append(helper.make_node("Div", ["sc", "sq"], ["ss"]))
        inits.append(("sq", np.float32(np.sqrt(D))))
    else:
        nodes.append(helper.make_node("Mul", ["sc", "sq"], ["ss"]))
        inits.append(("sq", np.float32(1 / np.sqrt(D))))
    inputs = [(n, [B, S, hid]) for n in "qkv"]
    extra_inputs = []
    if mask == "add":
        nodes.append(helper.make_node("Add", ["ss", "m"], ["sm_in"]))
        inputs.append(("m", [B, 1, 1, S]))
    elif mask == "where_causal":
        causal = np.tril(np.ones((S, S), bool))[None, None]
        inits.append(("causal", causal))
        nodes.append(helper.make_node("Where", ["causal", "ss", "neg"], ["sm_in"]))
        inits.append(("neg", np.float32(-1e9)))
    elif mask == "where_inverted":
        nodes.append(helper.make_node("Equal", ["mi", "zero"], ["eq"]))
        nodes.append(helper.make_node("Where", ["eq", "neg", "ss"], ["sm_in"]))
        inits += [("zero", np.int64(0)), ("neg", np.float32(np.finfo(np.float32).min))]
        extra_inputs.append(helper.make_tensor_value_info("mi", I64, [B, 1, 1, S]))
    else:
        nodes.append(helper.make_node("Identity", ["ss"], ["sm_in"]))
    if nan_guard:
        nodes.append(helper.make_node("Softmax", ["sm_in"], ["p0"], axis=-1))
        nodes.append(helper.make_node("IsNaN", ["p0"], ["isnan"]))
        nodes.append(helper.make_node("Where", ["isnan", "fzero", "p0"], ["p"]))
        inits.append(("fzero", np.float32(0)))
    else:
        nodes.append(helper.make_node("Softmax", ["sm_in"], ["p"], axis=-1))
    nodes.append(helper.make_node("MatMul", ["p", "vh"], ["ctx"]))
    out_shape = [B, H, S, D]
    if merge:
        nodes.append(helper.make_node("Transpose", ["ctx"], ["y"], perm=[0, 2, 1, 3]))
        out_shape = [B, S, H, D]
    else:
        nodes.append(helper.make_node("Identity", ["ctx"], ["y"]))
    g = helper.make_graph(
        nodes, "attn", [helper.make_tensor_value_info(n, F, s) for n, s in inputs] + extra_inputs,
        [helper.make_tensor_value_info("y", F, out_shape)],
        [numpy_helper.from_array(np.asarray(a), n) for n, a in inits])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("mask,merge,scale_op,k_layout", [
    ("add", True, "Div", "transpose"), ("none", False, "Mul", "swap"),
    ("where_causal", True, "Div", "swap"), ("where_inverted", True, "Mul", "transpose"),
    ("add", True, "sqrt_qk", "transpose")])
def test_attention_is_one_kernel(mask, merge, scale_op, k_layout):
    B, S, H, D = 2, 9, 2, 8
    m = _attention_model(mask, merge, scale_op, k_layout, S, H, D, B)
    feeds = {n: R.standard_normal((B, S, H * D)).astype(np.float32) for n in "qkv"}
    if mask == "add":
        feeds["m"] = np.where(R.random((B, 1, 1, S)) > 0.3, 0, -10000).astype(np.float32)
    if mask == "where_inverted":
        mi = (R.random((B, 1, 1, S)) > 0.3).astype(np.int64)
        mi[..., 0] = 1
        feeds["mi"] = mi
    fused, plain = _compare(m, feeds)
    att = [k for k in _kernels(fused) if "attention" in k.notes]
    assert len(att) == 1
    assert "Softmax" in att[0].op_types and att[0].op_types.count("MatMul") == 2
    assert ("Transpose" in att[0].op_types) and len(_kernels(fused)) <= 2


def test_attention_with_torchs_nan_guard_is_one_kernel():
    """torch.onnx.export(dynamo=True) of scaled_dot_product_attention: Q and Kᵀ scaled by
    sqrt(scale) each, an additive mask, and Where(IsNaN(p), 0, p) after the Softmax. One
    kernel; a batch item whose keys are all masked (-inf) gives 0, as onnxruntime
    computes the graph, not NaN."""
    B, S, H, D = 2, 9, 2, 8
    m = _attention_model("add", True, "sqrt_qk", "transpose", S, H, D, B, nan_guard=True)
    feeds = {n: R.standard_normal((B, S, H * D)).astype(np.float32) for n in "qkv"}
    mask = np.where(R.random((B, 1, 1, S)) > 0.3, 0, -np.inf).astype(np.float32)
    mask[0, ..., 0] = 0
    mask[1] = -np.inf                   # batch item 1: every key masked
    feeds["m"] = mask
    fused, plain = _compare(m, feeds)
    att = [k for k in _kernels(fused) if "attention" in k.notes]
    assert len(att) == 1 and {"IsNaN", "Where", "Softmax"} <= set(att[0].op_types)
    (y,) = fused.run(None, feeds)
    assert (y[1] == 0).all() and np.isfinite(y).all()


@pytest.mark.parametrize("B", [1, 2])
def test_attention_reads_k_through_torchs_3d_transpose(B):
    """torch's dynamo export transposes K as [B,H,S,D] -> [B*H,S,D] -> [B*H,D,S] ->
    [B,H,D,S]. The attention reads K through those Reshapes and Transposes where they
    stay views of one buffer: at B = 1 all of them (one kernel for the whole attention);
    at B = 2 merging B and H of the head-split K would need a copy, so that Transpose
    stays a kernel and the rest is read through."""
    S, H, D = 9, 2, 8
    m = _attention_model("add", True, "sqrt_qk", "bh3d", S, H, D, B, nan_guard=True)
    feeds = {n: R.standard_normal((B, S, H * D)).astype(np.float32) for n in "qkv"}
    feeds["m"] = np.where(R.random((B, 1, 1, S)) > 0.3, 0, -np.inf).astype(np.float32)
    feeds["m"][..., 0] = 0
    fused, _ = _compare(m, feeds)
    ks = _kernels(fused)
    (att,) = [k for k in ks if "attention" in k.notes]
    # the head splits of Q, K and V (3 Reshapes), and K's way through [B*H, ...] (2)
    assert att.op_types.count("Reshape") == (5 if B == 1 else 3)
    assert len(ks) == (1 if B == 1 else 2), [k.op_types for k in ks]
    if B == 2:
        assert [k.op_types for k in ks if k is not att] == [["Transpose"]]


def test_reshaped_strides_agree_with_numpy():
    """patterns._reshaped_strides (a strided view reshaped in place, or None) against
    numpy's own in-place reshape of transposed views, values compared through the
    strides it gives."""
    from cannc.passes.patterns import _reshaped_strides

    rng = np.random.default_rng(5)
    for _ in range(400):
        shape = tuple(int(x) for x in rng.integers(1, 4, rng.integers(1, 5)))
        a = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
        v = a.transpose(rng.permutation(len(shape)))
        n, new = v.size, []
        while n > 1:
            d = int(rng.choice([f for f in range(2, n + 1) if n % f == 0]))
            new.append(d)
            n //= d
        if rng.random() < 0.5:
            new.insert(int(rng.integers(0, len(new) + 1)), 1)
        new = tuple(new) or (1,)
        got = _reshaped_strides(v.shape, [s // 8 for s in v.strides], new)
        try:
            w = v.view()
            w.shape = new          # numpy refuses where a copy is needed
        except AttributeError:
            assert got is None, (v.shape, v.strides, new)
            continue
        assert got is not None, (v.shape, v.strides, new)
        x = np.lib.stride_tricks.as_strided(a, new, [g * 8 for g in got])
        np.testing.assert_array_equal(x, v.reshape(new))


def test_attention_switch_off_logs_nothing_fused():
    m = _attention_model()
    sess = cannc.compile(m, cores=1, shapes={"q": (2, 9, 16), "k": (2, 9, 16), "v": (2, 9, 16),
                                             "m": (2, 1, 1, 9)}, fusion={"attention": False})
    assert not any("attention" in k.notes for k in _kernels(sess))


@pytest.mark.parametrize("mask_kind", ["add", "where", "none"])
def test_softmax_with_scale_and_mask_is_one_kernel(mask_kind):
    S = 37
    nodes = [helper.make_node("Div", ["x", "t"], ["s"])]
    inits = [("t", np.float32(1.7))]
    inputs = [("x", [2, 3, 5, S])]
    extra = []
    if mask_kind == "add":
        nodes.append(helper.make_node("Add", ["s", "m"], ["z"]))
        inputs.append(("m", [2, 1, 1, S]))
    elif mask_kind == "where":
        nodes.append(helper.make_node("Where", ["c", "s", "neg"], ["z"]))
        inits.append(("neg", np.float32(-1e4)))
        extra.append(helper.make_tensor_value_info("c", TensorProto.BOOL, [1, 1, 5, S]))
    else:
        nodes.append(helper.make_node("Relu", ["s"], ["z"]))
    nodes.append(helper.make_node("Softmax", ["z"], ["y"], axis=-1))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, s) for n, s in inputs]
                          + extra, [helper.make_tensor_value_info("y", F, [2, 3, 5, S])],
                          [numpy_helper.from_array(np.asarray(a, np.float32), n) for n, a in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": R.standard_normal((2, 3, 5, S)).astype(np.float32) * 3}
    if mask_kind == "add":
        feeds["m"] = np.where(R.random((2, 1, 1, S)) > 0.3, 0, -10000).astype(np.float32)
    if mask_kind == "where":
        feeds["c"] = R.random((1, 1, 5, S)) > 0.3
    fused, plain = _compare(m, feeds)
    k = _kernels(fused)
    assert len(k) == 1 and k[0].op_types[-1] == "Softmax" and "prologue" in k[0].notes
