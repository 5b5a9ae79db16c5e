"""Conv taps that read only padding are not computed (passes/patterns.py prune_conv_taps):
a tap that reads padding for every output position is dropped from the kernel; where
the taps read change along the output the conv is cut into bands (DeepLabV3's ASPP).
Results match onnxruntime either way."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import model_of, ort_run, pass_graph, run_pass
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.passes import patterns
from cannc.schedule import machine

F32 = np.float32
R = np.random.default_rng(0)


def _conv(x_shape, w_shape, bias=True, **attrs):
    w = (R.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(F32)
    inits = {"w": w}
    ins = ["x", "w"]
    if bias:
        inits["b"] = R.standard_normal(w_shape[0]).astype(F32)
        ins.append("b")
    nodes = [helper.make_node("Conv", ins, ["c"], name="conv", **attrs),
             helper.make_node("Relu", ["c"], ["y"])]
    return nodes, inits


def _model(x_shape, w_shape, **attrs):
    nodes, inits = _conv(x_shape, w_shape, **attrs)
    return model_of(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                    [numpy_helper.from_array(a, n) for n, a in inits.items()])


def _after(x_shape, w_shape, **attrs):
    nodes, inits = _conv(x_shape, w_shape, **attrs)
    return run_pass("prune_conv_taps", pass_graph(nodes, {"x": (F32, x_shape)}, ["y"], inits))


def _check(x_shape, w_shape, **attrs):
    m = _model(x_shape, w_shape, **attrs)
    x = R.standard_normal(x_shape).astype(F32)
    got = cannc.compile(m, cores=1).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ort_run(m, {"x": x})[0], rtol=1e-4, atol=1e-5)


@pytest.fixture
def cut_favoured(monkeypatch):
    """A machine whose memory is fast against its FMAs: cutting a conv into bands (fewer
    products, its weights read once per band) is the cheaper plan, whatever this host,
    and kernels cost nothing to launch."""
    cm = machine.cpu_model()
    fast = dataclasses.replace(cm, peak_gflops_core=10.0, dram_gbps=1000.0)
    monkeypatch.setattr(patterns, "cpu_model", lambda: fast)
    monkeypatch.setattr(patterns, "KERNEL_COST", 0.0)


def test_dilation_past_the_map_is_a_1x1_conv():
    # DeepLabV3's ASPP at dilation 36 on a 14x14 map: only the centre tap reads the input
    r = _after((1, 16, 14, 14), (8, 16, 3, 3), dilations=[36, 36], pads=[36, 36, 36, 36])
    assert r.changed and r.after.ops == ["Conv", "Relu"]
    conv = r.graph.node("conv")
    assert conv.attrs["kernel_shape"] == [1, 1] and conv.attrs["pads"] == [0, 0, 0, 0]
    assert conv.attrs["dilations"] == [1, 1]
    w = r.graph.constants[conv.inputs[1]]
    np.testing.assert_array_equal(w, r.before.constants["w"][:, :, 1:2, 1:2])
    _check((1, 16, 14, 14), (8, 16, 3, 3), dilations=[36, 36], pads=[36, 36, 36, 36])


def test_one_dim_pruned_keeps_the_other():
    # rows: dilation 20 reaches past 9 rows (centre tap only); columns: all three read
    r = _after((1, 8, 9, 30), (4, 8, 3, 3), dilations=[20, 2], pads=[20, 2, 20, 2])
    conv = r.graph.node("conv")
    assert conv.attrs["kernel_shape"] == [1, 3]
    assert conv.attrs["pads"] == [0, 2, 0, 2] and conv.attrs["dilations"] == [1, 2]
    _check((1, 8, 9, 30), (4, 8, 3, 3), dilations=[20, 2], pads=[20, 2, 20, 2])


@pytest.mark.parametrize("attrs", [
    {"pads": [1, 1, 1, 1]},                                  # every tap reads the input
    {"dilations": [2, 2], "pads": [2, 2, 2, 2]},
    {"strides": [2, 2], "pads": [1, 1, 1, 1]},
])
def test_ordinary_convs_stay(attrs):
    r = _after((1, 8, 14, 14), (4, 8, 3, 3), **attrs)
    assert not r.changed and r.after.ops == ["Conv", "Relu"]


def test_bands_when_cheaper(cut_favoured):
    # dilation 12 on 14x14: rows and columns each fall in three bands (0-1, 2-11, 12-13)
    r = _after((1, 32, 14, 14), (16, 32, 3, 3), dilations=[12, 12], pads=[12, 12, 12, 12])
    ops = r.after.ops
    assert ops.count("Conv") == 9 and ops.count("Concat") == 4 and "Slice" in ops
    convs = [n for n in r.graph.nodes() if n.op_type == "Conv"]
    assert all(n.attrs["pads"] == [0, 0, 0, 0] for n in convs)
    assert sorted(n.attrs["kernel_shape"] for n in convs).count([1, 1]) == 1   # the centre
    # the products left: 18 of 42 (tap, position) pairs per dim
    taps = sum(int(np.prod(r.graph.values[n.outputs[0]].shape[2:]))
               * int(np.prod(n.attrs["kernel_shape"])) for n in convs)
    assert taps == 18 * 18
    _check((1, 32, 14, 14), (16, 32, 3, 3), dilations=[12, 12], pads=[12, 12, 12, 12])


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((2, 8, 13, 17), (6, 8, 3, 3), {"dilations": [9, 11], "pads": [9, 11, 9, 11]}),
    ((1, 8, 15, 15), (6, 8, 3, 3), {"dilations": [8, 8], "pads": [8, 8, 8, 8],
                                     "strides": [2, 2]}),
    ((1, 8, 12, 12), (8, 2, 3, 3), {"dilations": [7, 7], "pads": [7, 3, 5, 7], "group": 4}),
    ((1, 6, 20), (4, 6, 5), {"dilations": [8], "pads": [16, 16]}),
    ((1, 8, 10, 10), (4, 8, 3, 3), {"dilations": [6, 6], "pads": [6, 6, 6, 6],
                                     "bias": False}),
])
def test_bands_match_onnxruntime(cut_favoured, x_shape, w_shape, attrs):
    r = _after(x_shape, w_shape, **attrs)
    assert r.changed
    _check(x_shape, w_shape, **attrs)


def test_a_costly_cut_is_not_taken(monkeypatch):
    # slow memory: nine bands would read the weights 25 times over, against 9 taps' once
    cm = machine.cpu_model()
    monkeypatch.setattr(patterns, "cpu_model",
                        lambda: dataclasses.replace(cm, peak_gflops_core=1e4, dram_gbps=1.0))
    r = _after((1, 32, 14, 14), (16, 32, 3, 3), dilations=[12, 12], pads=[12, 12, 12, 12])
    assert not r.changed


def test_bands_in_an_old_opset_model(cut_favoured):
    # the crops are Slices of opset 13 (starts/ends as inputs) in a model of opset 9,
    # whose own Slices take them as attributes
    shape, wshape, attrs = (1, 16, 14, 14), (8, 16, 3, 3), {"dilations": [12, 12],
                                                         "pads": [12, 12, 12, 12]}
    nodes, inits = _conv(shape, wshape, **attrs)
    m = model_of(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                 [numpy_helper.from_array(a, n) for n, a in inits.items()], opset=9)
    x = R.standard_normal(shape).astype(F32)
    sess = cannc.compile(m, cores=1)
    assert "Slice" in {t for k in sess.inspect()["kernels"] for t in k["op_types"]}
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(m, {"x": x})[0],
                               rtol=1e-4, atol=1e-5)


def test_the_bands_stand_for_the_conv(cut_favoured):
    # every band's Conv names the ONNX node: its precision, keep_fp32, the profiles
    m = _model((1, 32, 14, 14), (16, 32, 3, 3), dilations=[12, 12], pads=[12, 12, 12, 12])
    x = R.standard_normal((1, 32, 14, 14)).astype(F32)
    for keep, want in (((), "bf16"), (("conv",), "fp32")):
        sess = cannc.compile(m, cores=1, precision="bf16", keep_fp32=keep)
        sess.run(None, {"x": x})
        assert sess.precision_map()["conv"] == want
        convs = [k for k in sess.inspect()["kernels"] if "Conv" in k["op_types"]]
        assert len(convs) == 9 and all("conv" in k["nodes"] for k in convs)
