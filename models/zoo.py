"""Reproducible ONNX model zoo for cannc tests and benchmarks.

Every model is built from a seed with ``onnx.helper`` + numpy only (no PyTorch),
but the graphs are written the way ``torch.onnx.export`` writes them for the
corresponding PyTorch / HuggingFace modules: torch-style node and tensor names
(``/encoder/layer.0/attention/self/query/MatMul``, ``onnx::MatMul_1001``),
small constants as ``Constant`` nodes, weights as initializers, shape
arithmetic as ``Shape -> Gather -> Unsqueeze -> Concat -> Reshape`` chains,
unfused BatchNormalization, decomposed GELU, and so on.

All weights come from ``np.random.default_rng(seed)`` and are scaled
(He / LeCun style) so activations stay O(1) and the outputs are numerically
meaningful.  Building the same model with the same seed and options gives a
byte-identical ``ModelProto``.

API::

    ZOO: dict[str, Callable[..., onnx.ModelProto]]   # name -> builder(seed=0, **opts)
    build(name, seed=0, **kw) -> onnx.ModelProto
    save(name, out_dir, seed=0, **kw) -> Path        # writes NAME.onnx (skips if unchanged)
    example_inputs(model_or_name, batch=1, seq=16, seed=0) -> dict[str, np.ndarray]
    summary(model) -> dict                            # node count, op histogram, io

CLI::

    python -m models.zoo --out DIR [--name NAME ...] [--seed N] [--opset N] [--summary]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "DEFAULT_OPSET",
    "ZOO",
    "build",
    "save",
    "example_inputs",
    "summary",
    "mlp",
    "resnet",
    "mobilenet",
    "bert",
    "gpt",
]

DEFAULT_OPSET = 17
DEFAULT_SEQ = 16
PRODUCER_NAME = "cannc-zoo"
ZOO_VERSION = "1"  # bump when a builder's output changes on purpose

_F32_MIN = float(np.finfo(np.float32).min)  # torch.finfo(torch.float32).min


# --------------------------------------------------------------------------
# Graph builder
# --------------------------------------------------------------------------


class _GraphBuilder:
    """Tiny helper that emits torch.onnx-style nodes with deterministic names."""

    def __init__(self, seed: int, opset: int, *, min_opset: int, model: str):
        if not isinstance(opset, (int, np.integer)) or isinstance(opset, bool):
            raise TypeError(f"opset must be an int, got {opset!r}")
        opset = int(opset)
        if opset < min_opset:
            raise ValueError(f"{model}: opset {opset} < minimum supported {min_opset}")
        if opset > onnx.defs.onnx_opset_version():
            raise ValueError(
                f"{model}: opset {opset} > newest known to onnx "
                f"{onnx.defs.onnx_opset_version()}"
            )
        self.seed = int(seed)
        self.rng = np.random.default_rng(self.seed)
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.params: dict[str, np.ndarray] = {}  # initializers, in creation order
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._scope: list[str] = []
        self._node_counts: dict[str, int] = {}
        self._tensor_names: set[str] = set()
        self._anon = 1000  # torch numbers folded constants like onnx::MatMul_1234
        self._bn_stats: dict[str, tuple[str, str]] = {}  # BN node output -> (mean, var) params

    # -- naming -------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, *names: str) -> Iterator[None]:
        self._scope.extend(names)
        try:
            yield
        finally:
            del self._scope[len(self._scope) - len(names):]

    def _node_name(self, op_type: str) -> str:
        base = "/" + "/".join([*self._scope, op_type])
        n = self._node_counts.get(base, 0)
        self._node_counts[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def pname(self, leaf: str) -> str:
        """Parameter name in torch state-dict style.

        Torch scope segments of container children repeat the parent's name
        (``/layer1/layer1.0/conv1``) while the state-dict key does not
        (``layer1.0.conv1.weight``), so a segment that extends the previous one
        replaces it.
        """
        parts: list[str] = []
        for seg in self._scope:
            if parts and seg.startswith(parts[-1] + "."):
                parts[-1] = seg
            else:
                parts.append(seg)
        return ".".join([*parts, leaf])

    def _claim(self, name: str) -> str:
        if name in self._tensor_names:
            raise ValueError(f"duplicate tensor name {name!r}")
        self._tensor_names.add(name)
        return name

    # -- graph I/O ------------------------------------------------------------
    def input(self, name: str, elem_type: int, shape: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(self._claim(name), elem_type, list(shape)))
        return name

    def output(self, tensor: str, name: str, elem_type: int, shape: Sequence[int | str]) -> str:
        """Expose ``tensor`` (a node output) as graph output ``name``, renaming it."""
        if tensor != name:
            self._claim(name)
            for node in self.nodes:
                for i, t in enumerate(node.input):
                    if t == tensor:
                        node.input[i] = name
                for i, t in enumerate(node.output):
                    if t == tensor:
                        node.output[i] = name
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    # -- parameters -------------------------------------------------------------
    def param(self, name: str, arr: np.ndarray) -> str:
        self.params[self._claim(name)] = np.ascontiguousarray(arr)
        return name

    def anon_param(self, op_type: str, arr: np.ndarray) -> str:
        """A constant-folded weight, named like torch does (``onnx::MatMul_1001``)."""
        self._anon += 1
        return self.param(f"onnx::{op_type}_{self._anon}", arr)

    def normal(self, shape: Sequence[int], std: float, mean: float = 0.0) -> np.ndarray:
        return (mean + std * self.rng.standard_normal(tuple(shape))).astype(np.float32)

    def uniform(self, shape: Sequence[int], lo: float, hi: float) -> np.ndarray:
        return self.rng.uniform(lo, hi, tuple(shape)).astype(np.float32)

    # -- nodes ------------------------------------------------------------------
    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, **attrs):
        name = self._node_name(op_type)
        outs = [self._claim(f"{name}_output_{i}") for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype=np.float32) -> str:
        arr = np.asarray(value, dtype=dtype)
        return self.op("Constant", [], value=numpy_helper.from_array(arr))

    def i64(self, value) -> str:
        return self.const(value, np.int64)

    # -- opset-dependent helpers -------------------------------------------------
    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", [x, self.i64(list(axes))])
        return self.op("Unsqueeze", [x], axes=list(axes))

    def reduce_mean(self, x: str, axes: Sequence[int], keepdims: int = 1) -> str:
        if self.opset >= 18:
            return self.op("ReduceMean", [x, self.i64(list(axes))], keepdims=keepdims)
        return self.op("ReduceMean", [x], axes=list(axes), keepdims=keepdims)

    def split(self, x: str, sizes: Sequence[int], axis: int) -> list[str]:
        if self.opset >= 13:
            return self.op("Split", [x, self.i64(list(sizes))], n_out=len(sizes), axis=axis)
        return self.op("Split", [x], n_out=len(sizes), axis=axis, split=list(sizes))

    def shape_dim(self, x: str, index: int) -> str:
        """``x.size(index)`` as torch traces it: Shape -> Gather(scalar) (0-d int64)."""
        return self.op("Gather", [self.op("Shape", [x]), self.i64(index)], axis=0)

    # -- common layers -------------------------------------------------------------
    def linear(self, x: str, scope: str, fin: int, fout: int, *, std: float | None = None,
               bias_first: bool = True, bias_std: float = 0.02) -> str:
        """nn.Linear on an N-d input as torch exports it: MatMul(x, W^T) + Add."""
        with self.scope(scope):
            w = self.anon_param("MatMul", self.normal((fin, fout),
                                                      std if std is not None else fin ** -0.5))
            b = self.param(self.pname("bias"), self.normal((fout,), bias_std))
            y = self.op("MatMul", [x, w])
            return self.op("Add", [b, y] if bias_first else [y, b])

    def gelu_erf(self, x: str) -> str:
        """nn.GELU() as exported by torch: x * (erf(x / sqrt2) + 1) * 0.5."""
        d = self.op("Div", [x, self.const(1.4142135381698608)])
        e = self.op("Erf", [d])
        a = self.op("Add", [e, self.const(1.0)])
        m = self.op("Mul", [x, a])
        return self.op("Mul", [m, self.const(0.5)])

    def gelu_tanh(self, x: str) -> str:
        """HF NewGELUActivation: 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3)))."""
        half = self.op("Mul", [self.const(0.5), x])
        cube = self.op("Pow", [x, self.const(3.0)])
        c = self.op("Mul", [self.const(0.044715), cube])
        inner = self.op("Add", [x, c])
        s = self.op("Mul", [self.const(math.sqrt(2.0 / math.pi)), inner])
        t = self.op("Tanh", [s])
        a = self.op("Add", [self.const(1.0), t])
        return self.op("Mul", [half, a])

    def layer_norm(self, x: str, dim: int, eps: float, *, decomposed: bool,
                   gamma_std: float = 0.1, beta_std: float = 0.05) -> str:
        gamma = self.param(self.pname("weight"), self.normal((dim,), gamma_std, mean=1.0))
        beta = self.param(self.pname("bias"), self.normal((dim,), beta_std))
        if not decomposed and self.opset >= 17:
            return self.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=float(eps))
        # torch.onnx (opset < 17) decomposition of F.layer_norm
        mean = self.reduce_mean(x, [-1])
        d = self.op("Sub", [x, mean])
        sq = self.op("Pow", [d, self.const(2.0)])
        var = self.reduce_mean(sq, [-1])
        ve = self.op("Add", [var, self.const(eps)])
        sd = self.op("Sqrt", [ve])
        n = self.op("Div", [d, sd])
        m = self.op("Mul", [n, gamma])
        return self.op("Add", [m, beta])

    def conv(self, x: str, cin: int, cout: int, k: int, stride: int = 1, pad: int = 0,
             group: int = 1, bias: bool = False) -> str:
        fan_in = (cin // group) * k * k
        w = self.param(self.pname("weight"),
                       self.normal((cout, cin // group, k, k), math.sqrt(2.0 / fan_in)))
        ins = [x, w]
        if bias:
            ins.append(self.param(self.pname("bias"), self.normal((cout,), 0.05)))
        return self.op("Conv", ins, dilations=[1, 1], group=group, kernel_shape=[k, k],
                       pads=[pad] * 4, strides=[stride, stride])

    def batch_norm(self, x: str, c: int) -> str:
        """Eval-mode BN.  Running stats are placeholders until :meth:`calibrate`."""
        scale = self.param(self.pname("weight"), self.uniform((c,), 0.7, 1.3))
        bias = self.param(self.pname("bias"), self.normal((c,), 0.1))
        mean = self.param(self.pname("running_mean"), np.zeros((c,), np.float32))
        var = self.param(self.pname("running_var"), np.ones((c,), np.float32))
        y = self.op("BatchNormalization", [x, scale, bias, mean, var], epsilon=1e-5, momentum=0.9)
        self._bn_stats[y] = (mean, var)
        return y

    def calibrate(self, feeds: dict[str, np.ndarray],
                  classifier: tuple[str, str, str] | None = None) -> None:
        """Calibrate a CNN on ``feeds`` with a numpy forward pass, like training would.

        * BN running stats are set from the batch statistics of each BN's input
          (plus a little noise), so activations stay O(1) whatever the depth/width.
        * ``classifier=(features, weight, bias)``: the Gemm (transB=1) weight and
          bias are rescaled so the logits respond O(1) to differences between
          images (features standardised over the calibration batch), instead of
          every random image giving nearly the same logits.
        Runs the graph in order with a tiny numpy interpreter and stops as soon
        as everything needed has been computed.
        """
        pending = set(self._bn_stats)
        if classifier is not None:
            pending.add(classifier[0])
        env: dict[str, np.ndarray] = dict(self.params)
        env.update({k: np.asarray(v, np.float32) for k, v in feeds.items()})
        for node in self.nodes:
            if not pending:
                break
            ins = [env[t] if t else None for t in node.input]
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            y = _NP_OPS[node.op_type](ins, attrs)
            out = node.output[0]
            if out in self._bn_stats:  # recompute with calibrated stats
                mu = ins[0].mean(axis=(0, 2, 3), dtype=np.float64)
                var = ins[0].var(axis=(0, 2, 3), dtype=np.float64)
                mean_name, var_name = self._bn_stats[out]
                c = mu.shape[0]
                self.params[mean_name] = (
                    mu + 0.05 * np.sqrt(var) * self.rng.standard_normal(c)).astype(np.float32)
                self.params[var_name] = (var * self.rng.uniform(0.85, 1.15, c)).astype(np.float32)
                ins[3], ins[4] = self.params[mean_name], self.params[var_name]
                y = _NP_OPS[node.op_type](ins, attrs)
                pending.discard(out)
            env[out] = y
            pending.discard(out)
        if pending:
            raise RuntimeError(f"calibration did not reach {sorted(pending)}")
        if classifier is not None:
            feat_name, w_name, b_name = classifier
            f = env[feat_name].reshape(env[feat_name].shape[0], -1).astype(np.float64)
            mu, sd = f.mean(axis=0), f.std(axis=0) + 1e-3
            w = self.params[w_name] / sd[None, :]
            self.params[w_name] = w.astype(np.float32)
            self.params[b_name] = (self.params[b_name] - w @ mu).astype(np.float32)

    # -- finish -------------------------------------------------------------------
    def model(self, graph_name: str, doc: str, meta: dict[str, object]) -> onnx.ModelProto:
        inits = [numpy_helper.from_array(arr, name) for name, arr in self.params.items()]
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs,
                                  initializer=inits)
        opsets = [helper.make_opsetid("", self.opset)]
        model = helper.make_model(
            graph,
            opset_imports=opsets,
            ir_version=helper.find_min_ir_version_for(opsets),
            producer_name=PRODUCER_NAME,
            producer_version=ZOO_VERSION,
            doc_string=doc,
        )
        props = {"zoo_name": graph_name, "seed": self.seed, "opset": self.opset}
        props.update(meta)
        helper.set_model_props(model, {k: str(v) for k, v in props.items()})
        return model


# Minimal numpy reference ops for BN calibration (NCHW, float32).

def _np_conv(ins, attrs):
    from numpy.lib.stride_tricks import sliding_window_view

    x, w = ins[0], ins[1]
    k = attrs["kernel_shape"][0]
    s = attrs.get("strides", [1, 1])[0]
    p = attrs.get("pads", [0, 0, 0, 0])[0]
    group = attrs.get("group", 1)
    x = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    win = sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::s, ::s]  # N,C,Ho,Wo,k,k
    n, c, ho, wo = win.shape[:4]
    o, cg = w.shape[:2]
    win = win.reshape(n, group, cg, ho, wo, k, k)
    wg = w.reshape(group, o // group, cg, k, k)
    y = np.einsum("ngchwij,gocij->ngohw", win, wg, optimize=True).reshape(n, o, ho, wo)
    if len(ins) > 2 and ins[2] is not None:
        y = y + ins[2][None, :, None, None]
    return y.astype(np.float32)


def _np_maxpool(ins, attrs):
    from numpy.lib.stride_tricks import sliding_window_view

    k = attrs["kernel_shape"][0]
    s = attrs.get("strides", [1, 1])[0]
    p = attrs.get("pads", [0, 0, 0, 0])[0]
    x = np.pad(ins[0], ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-np.inf)
    return sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::s, ::s].max(axis=(-2, -1))


def _np_batchnorm(ins, attrs):
    x, scale, bias, mean, var = ins
    sh = (1, -1, 1, 1)
    inv = scale / np.sqrt(var + attrs.get("epsilon", 1e-5))
    return ((x - mean.reshape(sh)) * inv.reshape(sh) + bias.reshape(sh)).astype(np.float32)


_NP_OPS: dict[str, Callable] = {
    "Constant": lambda ins, a: numpy_helper.to_array(a["value"]),
    "Conv": _np_conv,
    "BatchNormalization": _np_batchnorm,
    "Relu": lambda ins, a: np.maximum(ins[0], 0),
    "Clip": lambda ins, a: np.clip(ins[0], ins[1], ins[2]),
    "HardSwish": lambda ins, a: ins[0] * np.clip(ins[0] / 6 + 0.5, 0, 1),
    "MaxPool": _np_maxpool,
    "GlobalAveragePool": lambda ins, a: ins[0].mean(axis=(2, 3), keepdims=True),
    "Add": lambda ins, a: ins[0] + ins[1],
}

_CALIB_BATCH = 16


def _check_decomposed(value) -> str:
    if value in ("mixed", True, False):
        return {True: "all", False: "none"}.get(value, value)  # type: ignore[arg-type]
    if value in ("all", "none"):
        return value
    raise ValueError("decomposed_layernorm must be True, False, 'mixed', 'all' or 'none', "
                     f"got {value!r}")


# --------------------------------------------------------------------------
# 1. MLP
# --------------------------------------------------------------------------


def mlp(seed: int = 0, *, opset: int = DEFAULT_OPSET, in_features: int = 256,
        hidden: Sequence[int] = (1024, 1024), num_classes: int = 10) -> onnx.ModelProto:
    """x[batch, 256] -> (MatMul+Add, GELU(erf)) x2 -> MatMul+Add -> logits[batch, 10]."""
    g = _GraphBuilder(seed, opset, min_opset=13, model="mlp")
    h = g.input("x", TensorProto.FLOAT, ["batch", in_features])
    dims = [in_features, *hidden, num_classes]
    n = len(dims) - 1
    for i, (fin, fout) in enumerate(zip(dims[:-1], dims[1:])):
        last = i == n - 1
        # He init before GELU, LeCun for the classifier.
        std = math.sqrt((1.0 if last else 2.0) / fin)
        h = g.linear(h, f"fc{i + 1}", fin, fout, std=std, bias_first=False, bias_std=0.05)
        if not last:
            with g.scope(f"act{i + 1}"):
                h = g.gelu_erf(h)
    g.output(h, "logits", TensorProto.FLOAT, ["batch", num_classes])
    return g.model("mlp", "MLP 256-1024-1024-10 with erf GELU (nn.GELU export form).",
                   {"in_features": in_features, "num_classes": num_classes})


# --------------------------------------------------------------------------
# 2. ResNet
# --------------------------------------------------------------------------


def _basic_block(g: _GraphBuilder, x: str, cin: int, cout: int, stride: int) -> str:
    with g.scope("conv1"):
        h = g.conv(x, cin, cout, 3, stride, 1)
    with g.scope("bn1"):
        h = g.batch_norm(h, cout)
    with g.scope("relu"):
        h = g.op("Relu", [h])
    with g.scope("conv2"):
        h = g.conv(h, cout, cout, 3, 1, 1)
    with g.scope("bn2"):
        h = g.batch_norm(h, cout)
    shortcut = x
    if stride != 1 or cin != cout:
        with g.scope("downsample"):
            with g.scope("downsample.0"):
                shortcut = g.conv(x, cin, cout, 1, stride, 0)
            with g.scope("downsample.1"):
                shortcut = g.batch_norm(shortcut, cout)
    h = g.op("Add", [h, shortcut])
    with g.scope("relu"):
        return g.op("Relu", [h])


def resnet(seed: int = 0, *, opset: int = DEFAULT_OPSET, channels: Sequence[int] = (32, 64),
           blocks_per_stage: int = 1, num_classes: int = 10,
           image_size: int = 64) -> onnx.ModelProto:
    """ResNet-18-style CNN (torchvision layout, unfused BN)."""
    g = _GraphBuilder(seed, opset, min_opset=13, model="resnet")
    x = g.input("input", TensorProto.FLOAT, ["batch", 3, image_size, image_size])
    c0 = channels[0]
    with g.scope("conv1"):
        h = g.conv(x, 3, c0, 7, 2, 3)
    with g.scope("bn1"):
        h = g.batch_norm(h, c0)
    with g.scope("relu"):
        h = g.op("Relu", [h])
    with g.scope("maxpool"):
        h = g.op("MaxPool", [h], ceil_mode=0, dilations=[1, 1], kernel_shape=[3, 3],
                 pads=[1, 1, 1, 1], strides=[2, 2])
    cin = c0
    for s, cout in enumerate(channels):
        with g.scope(f"layer{s + 1}"):
            for b in range(blocks_per_stage):
                stride = 2 if (s > 0 and b == 0) else 1
                with g.scope(f"layer{s + 1}.{b}"):
                    h = _basic_block(g, h, cin, cout, stride)
                cin = cout
    with g.scope("avgpool"):
        h = feats = g.op("GlobalAveragePool", [h])
    h = g.op("Flatten", [h], axis=1)
    with g.scope("fc"):
        w = g.param("fc.weight", g.normal((num_classes, cin), cin ** -0.5))
        b = g.param("fc.bias", g.normal((num_classes,), 0.05))
        h = g.op("Gemm", [h, w, b], alpha=1.0, beta=1.0, transB=1)
    g.output(h, "logits", TensorProto.FLOAT, ["batch", num_classes])
    g.calibrate({x: g.normal((_CALIB_BATCH, 3, image_size, image_size), 1.0)},
                classifier=(feats, w, b))
    return g.model("resnet", "ResNet-style CNN: conv7x7/s2+BN+ReLU+maxpool, basic blocks "
                   f"{list(channels)} (stride-2 block with 1x1 projection), GAP, Gemm.",
                   {"image_size": image_size, "num_classes": num_classes})


# --------------------------------------------------------------------------
# 3. MobileNetV2
# --------------------------------------------------------------------------


def _conv_bn(g: _GraphBuilder, x: str, cin: int, cout: int, k: int, stride: int = 1,
             group: int = 1, act: str | None = "relu6") -> str:
    """torchvision Conv2dNormActivation: scopes .0 conv, .1 BN, .2 activation."""
    prefix = g._scope[-1]
    with g.scope(f"{prefix}.0"):
        h = g.conv(x, cin, cout, k, stride, (k - 1) // 2, group=group)
    with g.scope(f"{prefix}.1"):
        h = g.batch_norm(h, cout)
    if act == "relu6":
        with g.scope(f"{prefix}.2"):
            h = g.op("Clip", [h, g.const(0.0), g.const(6.0)])
    elif act == "hardswish":
        with g.scope(f"{prefix}.2"):
            h = g.op("HardSwish", [h])
    return h


def mobilenet(seed: int = 0, *, opset: int = DEFAULT_OPSET, num_classes: int = 10,
              image_size: int = 64, stem_channels: int = 16, last_channels: int = 128,
              setting: Sequence[tuple[int, int, int, int]] = ((1, 16, 1, 1), (4, 24, 2, 2),
                                                              (4, 32, 2, 2)),
              ) -> onnx.ModelProto:
    """MobileNetV2-style net. ``setting`` rows are (expand t, out channels c, repeats n,
    stride s)."""
    g = _GraphBuilder(seed, opset, min_opset=14, model="mobilenet")  # HardSwish needs 14
    x = g.input("input", TensorProto.FLOAT, ["batch", 3, image_size, image_size])
    idx = 0
    with g.scope("features"):
        with g.scope(f"features.{idx}"):
            h = _conv_bn(g, x, 3, stem_channels, 3, 2)
        idx += 1
        cin = stem_channels
        for t, c, n, s in setting:
            for r in range(n):
                stride = s if r == 0 else 1
                hidden = cin * t
                with g.scope(f"features.{idx}", "conv"):
                    y = x_in = h
                    j = 0
                    if t != 1:
                        with g.scope(f"conv.{j}"):
                            y = _conv_bn(g, y, cin, hidden, 1)
                        j += 1
                    with g.scope(f"conv.{j}"):
                        y = _conv_bn(g, y, hidden, hidden, 3, stride, group=hidden)  # depthwise
                    j += 1
                    with g.scope(f"conv.{j}"):
                        w = g.conv(y, hidden, c, 1)
                    with g.scope(f"conv.{j + 1}"):
                        y = g.batch_norm(w, c)  # linear bottleneck: no activation
                if stride == 1 and cin == c:
                    with g.scope(f"features.{idx}"):
                        y = g.op("Add", [x_in, y])
                h = y
                cin = c
                idx += 1
        with g.scope(f"features.{idx}"):
            h = _conv_bn(g, h, cin, last_channels, 1, act="hardswish")
    h = feats = g.op("GlobalAveragePool", [h])
    # x.reshape(x.shape[0], -1)
    bsz = g.unsqueeze(g.shape_dim(h, 0), [0])
    shape = g.op("Concat", [bsz, g.i64([-1])], axis=0)
    h = g.op("Reshape", [h, shape])
    with g.scope("classifier", "classifier.1"):
        w = g.param("classifier.1.weight",
                    g.normal((num_classes, last_channels), last_channels ** -0.5))
        b = g.param("classifier.1.bias", g.normal((num_classes,), 0.05))
        h = g.op("Gemm", [h, w, b], alpha=1.0, beta=1.0, transB=1)
    g.output(h, "logits", TensorProto.FLOAT, ["batch", num_classes])
    g.calibrate({x: g.normal((_CALIB_BATCH, 3, image_size, image_size), 1.0)},
                classifier=(feats, w, b))
    return g.model("mobilenet", "MobileNetV2-style net: inverted residuals (1x1 expand, 3x3 "
                   "depthwise, 1x1 project), BN, ReLU6 as Clip, HardSwish head, GAP, Reshape, "
                   "Gemm.",
                   {"image_size": image_size, "num_classes": num_classes})


# --------------------------------------------------------------------------
# Transformer helpers
# --------------------------------------------------------------------------


def _split_heads(g: _GraphBuilder, x: str, heads: int, head_dim: int, perm: Sequence[int]) -> str:
    """x.view(x.size()[:-1] + (heads, head_dim)).permute(perm)."""
    b = g.unsqueeze(g.shape_dim(x, 0), [0])
    s = g.unsqueeze(g.shape_dim(x, 1), [0])
    shape = g.op("Concat", [b, s, g.i64([heads]), g.i64([head_dim])], axis=0)
    r = g.op("Reshape", [x, shape])
    return g.op("Transpose", [r], perm=list(perm))


def _merge_heads(g: _GraphBuilder, x: str, hidden: int) -> str:
    """x.permute(0, 2, 1, 3).contiguous().view(x.size()[:-2] + (hidden,))."""
    t = g.op("Transpose", [x], perm=[0, 2, 1, 3])
    b = g.unsqueeze(g.shape_dim(t, 0), [0])
    s = g.unsqueeze(g.shape_dim(t, 1), [0])
    shape = g.op("Concat", [b, s, g.i64([hidden])], axis=0)
    return g.op("Reshape", [t, shape])


# --------------------------------------------------------------------------
# 4. BERT
# --------------------------------------------------------------------------


def bert(seed: int = 0, *, opset: int = DEFAULT_OPSET, vocab_size: int = 1000, hidden: int = 128,
         num_layers: int = 2, num_heads: int = 4, intermediate: int = 512, max_position: int = 128,
         type_vocab_size: int = 2, eps: float = 1e-12, decomposed_layernorm="mixed",
         mask_mode: str = "mixed") -> onnx.ModelProto:
    """BERT encoder as HF BertModel exports (torch.onnx, opset 14-17).

    decomposed_layernorm: "mixed" (default; embeddings LayerNorm decomposed into
        ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add, encoder ones as
        LayerNormalization), True/"all", False/"none".  With opset < 17 every
        LayerNorm is decomposed (LayerNormalization does not exist there).
    mask_mode: "additive" ((1 - Cast(mask)) * -10000 added to the scores),
        "where" (Where(Equal(mask, 0), finfo.min, scores)), or "mixed"
        (default: layer 0 additive, later layers Where).
    """
    if hidden % num_heads:
        raise ValueError("hidden must be divisible by num_heads")
    if mask_mode not in ("additive", "where", "mixed"):
        raise ValueError(f"mask_mode must be 'additive', 'where' or 'mixed', got {mask_mode!r}")
    ln_mode = _check_decomposed(decomposed_layernorm)
    head_dim = hidden // num_heads
    g = _GraphBuilder(seed, opset, min_opset=14, model="bert")
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "seq"])

    # ---- embeddings ---------------------------------------------------------
    with g.scope("embeddings"):
        pos_buf = g.param("embeddings.position_ids",
                          np.arange(max_position, dtype=np.int64)[None, :])
        tt_buf = g.param("embeddings.token_type_ids", np.zeros((1, max_position), np.int64))
        seq = g.unsqueeze(g.shape_dim(ids, 1), [0])
        # self.token_type_ids[:, :seq_length].expand(batch, seq_length)
        tt = g.op("Slice", [tt_buf, g.i64([0]), seq, g.i64([1]), g.i64([1])])
        tt = g.op("Expand", [tt, g.op("Shape", [ids])])
        # self.position_ids[:, 0:seq_length]
        pos = g.op("Slice", [pos_buf, g.i64([0]), seq, g.i64([1]), g.i64([1])])
        with g.scope("word_embeddings"):
            wte = g.param("embeddings.word_embeddings.weight", g.normal((vocab_size, hidden), 0.5))
            e = g.op("Gather", [wte, ids])
        with g.scope("token_type_embeddings"):
            tte = g.param("embeddings.token_type_embeddings.weight",
                          g.normal((type_vocab_size, hidden), 0.2))
            t = g.op("Gather", [tte, tt])
        e = g.op("Add", [e, t])
        with g.scope("position_embeddings"):
            wpe = g.param("embeddings.position_embeddings.weight",
                          g.normal((max_position, hidden), 0.3))
            p = g.op("Gather", [wpe, pos])
        e = g.op("Add", [e, p])
        with g.scope("LayerNorm"):
            h = g.layer_norm(e, hidden, eps, decomposed=ln_mode in ("mixed", "all"))

    # ---- extended attention masks (built once, shared by the layers) -----------
    m4 = g.unsqueeze(g.unsqueeze(mask, [1]), [2])  # [batch, 1, 1, seq]
    additive = where_cond = None
    if mask_mode in ("additive", "mixed"):
        mf = g.op("Cast", [m4], to=TensorProto.FLOAT)
        inv = g.op("Sub", [g.const(1.0), mf])
        additive = g.op("Mul", [inv, g.const(-10000.0)])
    if mask_mode == "where" or (mask_mode == "mixed" and num_layers > 1):
        where_cond = g.op("Equal", [m4, g.i64(0)])

    # ---- encoder ------------------------------------------------------------------
    ln_decomposed = ln_mode == "all"
    for i in range(num_layers):
        use_where = mask_mode == "where" or (mask_mode == "mixed" and i > 0)
        with g.scope("encoder", f"layer.{i}"):
            with g.scope("attention"):
                with g.scope("self"):
                    q = g.linear(h, "query", hidden, hidden)
                    k = g.linear(h, "key", hidden, hidden)
                    v = g.linear(h, "value", hidden, hidden)
                    q = _split_heads(g, q, num_heads, head_dim, [0, 2, 1, 3])
                    kt = _split_heads(g, k, num_heads, head_dim, [0, 2, 3, 1])  # K^T, fused permute
                    v = _split_heads(g, v, num_heads, head_dim, [0, 2, 1, 3])
                    sc = g.op("MatMul", [q, kt])
                    sc = g.op("Div", [sc, g.const(math.sqrt(head_dim))])
                    if use_where:
                        sc = g.op("Where", [where_cond, g.const(_F32_MIN), sc])
                    else:
                        sc = g.op("Add", [sc, additive])
                    pr = g.op("Softmax", [sc], axis=-1)
                    ctx = g.op("MatMul", [pr, v])
                    ctx = _merge_heads(g, ctx, hidden)
                with g.scope("output"):
                    a = g.linear(ctx, "dense", hidden, hidden)
                    a = g.op("Add", [a, h])
                    with g.scope("LayerNorm"):
                        h = g.layer_norm(a, hidden, eps, decomposed=ln_decomposed)
            with g.scope("intermediate"):
                f = g.linear(h, "dense", hidden, intermediate)
                with g.scope("intermediate_act_fn"):
                    f = g.gelu_erf(f)
            with g.scope("output"):
                f = g.linear(f, "dense", intermediate, hidden)
                f = g.op("Add", [f, h])
                with g.scope("LayerNorm"):
                    h = g.layer_norm(f, hidden, eps, decomposed=ln_decomposed)
    last_hidden = h

    # ---- pooler ---------------------------------------------------------------------
    with g.scope("pooler"):
        first = g.op("Gather", [last_hidden, g.i64(0)], axis=1)  # hidden_states[:, 0]
        with g.scope("dense"):
            w = g.param("pooler.dense.weight", g.normal((hidden, hidden), hidden ** -0.5))
            b = g.param("pooler.dense.bias", g.normal((hidden,), 0.05))
            pooled = g.op("Gemm", [first, w, b], alpha=1.0, beta=1.0, transB=1)
        with g.scope("activation"):
            pooled = g.op("Tanh", [pooled])

    g.output(last_hidden, "last_hidden_state", TensorProto.FLOAT, ["batch", "seq", hidden])
    g.output(pooled, "pooler_output", TensorProto.FLOAT, ["batch", hidden])
    return g.model("bert", f"BERT-style encoder: {num_layers} layers, hidden {hidden}, "
                   f"{num_heads} heads, "
                   f"FFN {intermediate}, erf GELU, mask_mode={mask_mode}, layernorm={ln_mode}.",
                   {"vocab_size": vocab_size, "max_position": max_position, "hidden": hidden})


# --------------------------------------------------------------------------
# 5. GPT-2
# --------------------------------------------------------------------------


def gpt(seed: int = 0, *, opset: int = DEFAULT_OPSET, vocab_size: int = 512, hidden: int = 128,
        num_layers: int = 2, num_heads: int = 4, max_position: int = 128, eps: float = 1e-5,
        mask_dtype: str = "bool", decomposed_layernorm=False) -> onnx.ModelProto:
    """GPT-2 LM (HF GPT2LMHeadModel export layout, no KV cache).

    mask_dtype: dtype of the causal ``bias`` buffer, "bool" (newer HF) or "uint8"
        (older HF; sliced then Cast to bool).
    decomposed_layernorm: as for :func:`bert` (default False: LayerNormalization ops;
        forced decomposed for opset < 17).
    """
    if hidden % num_heads:
        raise ValueError("hidden must be divisible by num_heads")
    if mask_dtype not in ("bool", "uint8"):
        raise ValueError(f"mask_dtype must be 'bool' or 'uint8', got {mask_dtype!r}")
    ln_mode = _check_decomposed(decomposed_layernorm)
    head_dim = hidden // num_heads
    g = _GraphBuilder(seed, opset, min_opset=14, model="gpt")
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    tril = np.tril(np.ones((max_position, max_position), dtype=np.bool_))[None, None]
    if mask_dtype == "uint8":
        tril = tril.astype(np.uint8)

    with g.scope("transformer"):
        seq = g.shape_dim(ids, 1)  # input_shape[-1]
        # input_ids.view(-1, input_shape[-1])
        shape = g.op("Concat", [g.i64([-1]), g.unsqueeze(seq, [0])], axis=0)
        ids2 = g.op("Reshape", [ids, shape])
        # torch.arange(0, input_shape[-1], dtype=torch.long).unsqueeze(0)
        pos = g.op("Range", [g.i64(0), seq, g.i64(1)])
        pos = g.unsqueeze(pos, [0])
        with g.scope("wte"):
            wte_w = g.normal((vocab_size, hidden), hidden ** -0.5)
            wte = g.param("transformer.wte.weight", wte_w)
            te = g.op("Gather", [wte, ids2])
        with g.scope("wpe"):
            wpe = g.param("transformer.wpe.weight",
                          g.normal((max_position, hidden), 0.5 * hidden ** -0.5))
            pe = g.op("Gather", [wpe, pos])
        h = g.op("Add", [te, pe])
        for i in range(num_layers):
            with g.scope(f"h.{i}"):
                residual = h
                with g.scope("ln_1"):
                    x = g.layer_norm(h, hidden, eps, decomposed=ln_mode == "all")
                with g.scope("attn"):
                    qkv = g.linear(x, "c_attn", hidden, 3 * hidden)
                    q, k, v = g.split(qkv, [hidden] * 3, axis=2)
                    q = _split_heads(g, q, num_heads, head_dim, [0, 2, 1, 3])
                    k = _split_heads(g, k, num_heads, head_dim, [0, 2, 1, 3])
                    v = _split_heads(g, v, num_heads, head_dim, [0, 2, 1, 3])
                    kt = g.op("Transpose", [k], perm=[0, 1, 3, 2])  # key.transpose(-1, -2)
                    w = g.op("MatMul", [q, kt])
                    w = g.op("Div", [w, g.const(math.sqrt(head_dim))])
                    # causal_mask = self.bias[:, :, key_length - query_length:key_length,
                    #                         :key_length]
                    bias = g.param(g.pname("bias"), tril)
                    q_len = g.shape_dim(q, 2)
                    k_len = g.shape_dim(k, 2)
                    start = g.op("Sub", [k_len, q_len])
                    k_len_u = g.unsqueeze(k_len, [0])
                    cm = g.op("Slice",
                              [bias, g.unsqueeze(start, [0]), k_len_u, g.i64([2]), g.i64([1])])
                    cm = g.op("Slice", [cm, g.i64([0]), k_len_u, g.i64([3]), g.i64([1])])
                    if mask_dtype == "uint8":
                        cm = g.op("Cast", [cm], to=TensorProto.BOOL)
                    w = g.op("Where", [cm, w, g.const(_F32_MIN)])
                    w = g.op("Softmax", [w], axis=-1)
                    a = g.op("MatMul", [w, v])
                    a = _merge_heads(g, a, hidden)
                    a = g.linear(a, "c_proj", hidden, hidden)
                h = g.op("Add", [a, residual])
                residual = h
                with g.scope("ln_2"):
                    x = g.layer_norm(h, hidden, eps, decomposed=ln_mode in ("all", "mixed"))
                with g.scope("mlp"):
                    f = g.linear(x, "c_fc", hidden, 4 * hidden)
                    with g.scope("act"):
                        f = g.gelu_tanh(f)
                    f = g.linear(f, "c_proj", 4 * hidden, hidden)
                h = g.op("Add", [residual, f])
        with g.scope("ln_f"):
            h = g.layer_norm(h, hidden, eps, decomposed=ln_mode == "all")
    with g.scope("lm_head"):
        # Tied to wte; torch constant-folds the transpose into a new initializer.
        lm_w = g.anon_param("MatMul", np.ascontiguousarray(wte_w.T))
        logits = g.op("MatMul", [h, lm_w])
    g.output(logits, "logits", TensorProto.FLOAT, ["batch", "seq", vocab_size])
    return g.model("gpt", f"GPT-2-style LM: {num_layers} blocks, hidden {hidden}, "
                   f"{num_heads} heads, "
                   f"fused qkv + Split, causal {mask_dtype} buffer sliced + Where, tanh GELU, "
                   f"layernorm={ln_mode}, tied lm head to vocab {vocab_size}.",
                   {"vocab_size": vocab_size, "max_position": max_position, "hidden": hidden})


# --------------------------------------------------------------------------
# Registry and public API
# --------------------------------------------------------------------------

ZOO: dict[str, Callable[..., onnx.ModelProto]] = {
    "mlp": mlp,
    "resnet": resnet,
    "mobilenet": mobilenet,
    "bert": bert,
    "gpt": gpt,
}


def build(name: str, seed: int = 0, **kw) -> onnx.ModelProto:
    """Build zoo model ``name`` from ``seed`` (size/variant options as keyword args)."""
    try:
        builder = ZOO[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; known: {sorted(ZOO)}") from None
    return builder(seed=seed, **kw)


def save(name: str, out_dir: str | os.PathLike, seed: int = 0, **kw) -> Path:
    """Write ``out_dir/NAME.onnx`` and return its path.

    If the file already holds exactly the same bytes it is left untouched
    (mtime preserved), so build systems keyed on mtime don't rebuild.  Writes are
    atomic (temp file + rename).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.onnx"
    data = build(name, seed=seed, **kw).SerializeToString()
    try:
        if path.stat().st_size == len(data) and path.read_bytes() == data:
            return path
    except FileNotFoundError:
        pass
    # Unique temp name in the same directory (so the rename is atomic); plain
    # open() so the file gets the usual umask-derived permissions.
    tmp = out / f".{name}.{os.getpid()}.{threading.get_ident()}.onnx.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def _meta(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def _vocab_size(model: onnx.ModelProto, input_name: str) -> int:
    meta = _meta(model)
    if "vocab_size" in meta:
        return int(meta["vocab_size"])
    # Fallback for foreign models: smallest embedding table gathered from.
    inits = {t.name: t for t in model.graph.initializer}
    rows = [inits[n.input[0]].dims[0] for n in model.graph.node
            if n.op_type == "Gather" and n.input[0] in inits and len(inits[n.input[0]].dims) == 2]
    if not rows:
        raise ValueError(f"cannot determine the id range of integer input {input_name!r}")
    return int(min(rows))


def example_inputs(model_or_name: str | onnx.ModelProto, batch: int = 1, seq: int = DEFAULT_SEQ,
                   seed: int = 0) -> dict[str, np.ndarray]:
    """Valid random inputs for a zoo model (or any model with batch/seq dims).

    * ``input_ids``-like int inputs: uniform in ``[0, vocab_size)``;
    * ``*mask*`` int inputs: right-padded 0/1 masks, each row has >= 1 one and
      row 0 is all ones;
    * float inputs: standard normal (images, features).
    Symbolic dims named "batch" / "seq" (or "b" / "s", and the like) take ``batch`` /
    ``seq``.
    """
    model = build(model_or_name) if isinstance(model_or_name, str) else model_or_name
    if batch < 1 or seq < 1:
        raise ValueError("batch and seq must be >= 1")
    max_pos = _meta(model).get("max_position")
    if max_pos is not None and seq > int(max_pos):
        raise ValueError(f"seq {seq} exceeds the model's max_position {max_pos}")
    rng = np.random.default_rng(seed)
    init_names = {t.name for t in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        if inp.name in init_names:
            continue
        tt = inp.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        shape = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                shape.append(d.dim_value)
            elif d.dim_param in ("batch", "batch_size", "N", "b", "B"):
                shape.append(batch)
            elif d.dim_param in ("seq", "sequence", "sequence_length", "seq_len", "s", "S"):
                shape.append(seq)
            else:
                raise ValueError(f"input {inp.name!r}: unknown symbolic dim {d.dim_param!r}")
        if np.issubdtype(dtype, np.integer) and "mask" in inp.name:
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            n = shape[-1] if shape else 1
            lengths = rng.integers(1, n + 1, size=rows)
            lengths[0] = n
            arr = (np.arange(n)[None, :] < lengths[:, None]).astype(dtype).reshape(shape)
        elif np.issubdtype(dtype, np.integer):
            arr = rng.integers(0, _vocab_size(model, inp.name), size=shape).astype(dtype)
        elif dtype == np.bool_:
            arr = rng.integers(0, 2, size=shape).astype(np.bool_)
        else:
            arr = rng.standard_normal(shape).astype(dtype)
        feeds[inp.name] = arr
    return feeds


def summary(model: onnx.ModelProto) -> dict:
    """Node count, op-type histogram, opset, parameters and I/O of a model."""

    def io(vis):
        out = {}
        for v in vis:
            tt = v.type.tensor_type
            dims = [d.dim_param if d.dim_param else d.dim_value for d in tt.shape.dim]
            out[v.name] = (TensorProto.DataType.Name(tt.elem_type).lower(), dims)
        return out

    ops = Counter(n.op_type for n in model.graph.node)
    return {
        "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "ir_version": model.ir_version,
        "nodes": len(model.graph.node),
        "ops": dict(sorted(ops.items())),
        "params": int(sum(np.prod(t.dims, dtype=np.int64) for t in model.graph.initializer)),
        "inputs": io(model.graph.input),
        "outputs": io(model.graph.output),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.zoo", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory (created if missing)")
    ap.add_argument("--name", action="append", choices=sorted(ZOO),
                    help="model to write (repeatable; default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--opset", type=int, default=None,
                    help=f"opset for every model written (default {DEFAULT_OPSET})")
    ap.add_argument("--summary", action="store_true", help="print node/op statistics")
    args = ap.parse_args(argv)
    kw = {} if args.opset is None else {"opset": args.opset}
    for name in args.name or list(ZOO):
        path = save(name, args.out, seed=args.seed, **kw)
        print(path)
        if args.summary:
            s = summary(onnx.load(str(path)))
            print(f"  opset={s['opset']} nodes={s['nodes']} params={s['params']}")
            print(f"  inputs={s['inputs']}")
            print(f"  outputs={s['outputs']}")
            print(f"  ops={s['ops']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
