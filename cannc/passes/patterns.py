"""Pattern fusions: exporter idioms rewritten into the single ops they stand for.

Each is a `Rule` (passes/rules.py): pattern + check + rewrite; a check that fails
logs its reason in graph.meta["fusion_log"], so "why didn't this fuse?" is answered
by `cannc inspect`. These rules match exporter idioms, so they name the ops of their
pattern; a switched-off rule (`fusion={"layernorm": False}`) does not even match.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..ir.attnspec import AttnSpec
from ..ir.graph import Graph, Node
from ..ir.types import TensorType
from ..schedule.machine import cpu_model
from .manager import PassContext, graph_pass
from .rules import Refusal, Rule


def reduce_axes(graph: Graph, n: Node) -> list[int] | None:
    """The axes of a Reduce* node (attribute or constant input), normalised; None if unknown."""
    rank = len(graph.values[n.inputs[0]].shape)
    if "axes" in n.attrs:
        axes = list(n.attrs["axes"])
    elif len(n.inputs) > 1 and n.inputs[1]:
        c = graph.constants.get(n.inputs[1])
        if c is None:
            return None
        axes = [int(a) for a in c.reshape(-1)]
    else:
        return list(range(rank))
    return sorted(a % rank for a in axes)


def _single_use(graph: Graph, v: str, allowed: set[str]) -> bool:
    return v not in graph.outputs and set(graph.consumers(v)) <= allowed


def _scalar_const(graph: Graph, v: str) -> float | None:
    c = graph.constants.get(v)
    if c is None or c.size != 1:
        return None
    return float(c.reshape(-1)[0])


def _other(n: Node, v: str) -> str:
    return n.inputs[1] if n.inputs[0] == v else n.inputs[0]


def _only_consumer(graph: Graph, v: str, op_types: tuple[str, ...]) -> Node | None:
    cons = graph.consumers(v)
    if len(cons) != 1 or v in graph.outputs:
        return None
    n = graph.node(cons[0])
    return n if n.op_type in op_types else None


@graph_pass("fuse_layernorm")
def fuse_layernorm(graph: Graph, ctx: PassContext) -> bool:
    """ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div(/Mul/Add) -> LayerNormalization."""
    return LAYERNORM.run(graph, None, ctx)


def _layernorm_pattern(graph: Graph, _: None, mean: Node):
    if mean.op_type != "ReduceMean":
        return None
    found = _match_layernorm(graph, mean)
    return None if found == "" else (mean, found)


def _layernorm_check(graph: Graph, _: None, m) -> Refusal | None:
    mean, found = m
    return Refusal(found, ((mean.name, "(layernorm pattern)"),)) \
        if isinstance(found, str) else None


def _layernorm_rewrite(graph: Graph, _: None, m) -> None:
    mean, (nodes, x, eps, gamma, beta, axis, out) = m
    rank = len(graph.values[x].shape)
    norm_shape = tuple(graph.values[x].shape[axis:])
    dt = graph.values[x].dtype
    if gamma is None:
        gamma = f"{mean.name}::ln_gamma"
        graph.set_constant(gamma, np.ones(norm_shape, dt))
    if beta is None:
        beta = f"{mean.name}::ln_beta"
        graph.set_constant(beta, np.zeros(norm_shape, dt))
    order = graph.g.nodes[nodes[0].name]["order"]
    for n in nodes:
        graph.remove_node(n.name)
    graph.add_node(Node(name=f"{mean.name}::LayerNormalization", op_type="LayerNormalization",
                        inputs=(x, gamma, beta), outputs=(out,),
                        attrs={"axis": axis - rank, "epsilon": eps,
                               "fused_from": [n.name for n in nodes],
                               "fused_ops": [n.op_type for n in nodes]}, opset=17,
                        ), order=order)


LAYERNORM: Rule = Rule("layernorm", _layernorm_pattern, _layernorm_check, _layernorm_rewrite)


def _match_layernorm(graph: Graph, mean: Node):
    x = mean.inputs[0]
    rank = len(graph.values[x].shape)
    axes = reduce_axes(graph, mean)
    if axes is None or not axes or axes != list(range(axes[0], rank)):
        return ""  # not a normalisation over trailing axes: not this pattern
    if mean.attrs.get("keepdims", 1) != 1:
        return "ReduceMean without keepdims"
    m = mean.outputs[0]
    sub = _only_consumer(graph, m, ("Sub",))
    if sub is None or sub.inputs != (x, m):
        return ""
    d = sub.outputs[0]
    cons = [graph.node(c) for c in graph.consumers(d)]
    sq = next((c for c in cons if c.op_type == "Pow" or (c.op_type == "Mul" and
                                                         c.inputs == (d, d))), None)
    div = next((c for c in cons if c.op_type == "Div" and c.inputs[0] == d), None)
    if sq is None or div is None or len(cons) != 2 or d in graph.outputs:
        return "the centred value feeds other nodes than the variance and the division"
    if sq.op_type == "Pow" and _scalar_const(graph, sq.inputs[1]) != 2.0:
        return "Pow exponent is not the constant 2"
    mean2 = _only_consumer(graph, sq.outputs[0], ("ReduceMean",))
    if mean2 is None or reduce_axes(graph, mean2) != axes or mean2.attrs.get("keepdims", 1) != 1:
        return "the variance is not a ReduceMean over the same axes"
    add = _only_consumer(graph, mean2.outputs[0], ("Add",))
    if add is None:
        return "no epsilon Add after the variance"
    eps = _scalar_const(graph, _other(add, mean2.outputs[0]))
    if eps is None:
        return "epsilon is not a scalar constant"
    sqrt = _only_consumer(graph, add.outputs[0], ("Sqrt",))
    if sqrt is None or div.inputs[1] != sqrt.outputs[0] or not _single_use(
            graph, sqrt.outputs[0], {div.name}):
        return "the standard deviation is not Sqrt(var + eps) used only by the division"
    nodes = [mean, sub, sq, mean2, add, sqrt, div]
    out, gamma, beta = div.outputs[0], None, None
    norm_shape = tuple(graph.values[x].shape[axes[0]:])
    mul = _only_consumer(graph, out, ("Mul",))
    if mul is not None:
        g = _other(mul, out)
        gc = graph.constants.get(g)
        if gc is not None and _fits(gc.shape, norm_shape):
            gamma = g
            nodes.append(mul)
            out = mul.outputs[0]
            add2 = _only_consumer(graph, out, ("Add",))
            if add2 is not None:
                bn = _other(add2, out)
                bc = graph.constants.get(bn)
                if bc is not None and _fits(bc.shape, norm_shape):
                    beta = bn
                    nodes.append(add2)
                    out = add2.outputs[0]
    for n in nodes[:-1]:
        for o in n.outputs:
            if o in graph.outputs:
                return f"intermediate '{o}' is a graph output"
    if gamma is not None and graph.constants[gamma].shape != norm_shape:
        graph.set_constant(gamma, np.broadcast_to(graph.constants[gamma], norm_shape).copy())
    if beta is not None and graph.constants[beta].shape != norm_shape:
        graph.set_constant(beta, np.broadcast_to(graph.constants[beta], norm_shape).copy())
    return nodes, x, eps, gamma, beta, axes[0], out


def _fits(shape: tuple[int, ...], norm_shape: tuple[int, ...]) -> bool:
    shape = tuple(shape)
    while shape and shape[0] == 1 and len(shape) > len(norm_shape):
        shape = shape[1:]
    return len(shape) <= len(norm_shape) and all(
        a in (1, b) for a, b in zip(shape[::-1], norm_shape[::-1]))


@graph_pass("fuse_gelu")
def fuse_gelu(graph: Graph, ctx: PassContext) -> bool:
    """x * 0.5 * (1 + Erf(x / sqrt2)) (BERT's exported gelu: Div or Mul by 1/sqrt2, Erf,
    Add 1, the two Muls in either order) -> Gelu (approximate='none'): one vector
    function (codegen/vmath gelu_erf) instead of a division and a two-branch erf."""
    return GELU.run(graph, None, ctx)


def _near(c: float | None, want: float) -> bool:
    return c is not None and abs(c - want) <= 2e-7 * abs(want)


def _gelu_pattern(graph: Graph, _: None, erf: Node):
    if erf.op_type != "Erf":
        return None
    scale = graph.producer(erf.inputs[0])
    if scale is None or scale.op_type not in ("Div", "Mul") or not _single_use(
            graph, erf.inputs[0], {erf.name}):
        return None
    x = None
    for i in ((0,) if scale.op_type == "Div" else (0, 1)):
        c = _scalar_const(graph, scale.inputs[1 - i])
        if _near(c, math.sqrt(2.0) if scale.op_type == "Div" else math.sqrt(0.5)):
            x = scale.inputs[i]
    add = _only_consumer(graph, erf.outputs[0], ("Add",))
    if x is None or add is None or not _near(_scalar_const(graph, _other(add, erf.outputs[0])),
                                             1.0):
        return None
    # (x * (1 + erf)) * 0.5, or (x * 0.5) * (1 + erf)
    m1 = _only_consumer(graph, add.outputs[0], ("Mul",))
    if m1 is None:
        return None
    other = _other(m1, add.outputs[0])
    if other == x:
        m2 = _only_consumer(graph, m1.outputs[0], ("Mul",))
        if m2 is None or not _near(_scalar_const(graph, _other(m2, m1.outputs[0])), 0.5):
            return None
        nodes = [scale, erf, add, m1, m2]
        out = m2.outputs[0]
    else:
        half = graph.producer(other)
        if half is None or half.op_type != "Mul" or x not in half.inputs or not _near(
                _scalar_const(graph, _other(half, x)), 0.5) or not _single_use(
                graph, other, {m1.name}):
            return None
        nodes = [half, scale, erf, add, m1]
        out = m1.outputs[0]
    xt, ot = graph.values[x], graph.values[out]
    if tuple(xt.shape) != tuple(ot.shape) or np.dtype(xt.dtype) != np.dtype(ot.dtype) or \
            np.dtype(xt.dtype).kind != "f":
        return None
    return nodes, x, out


def _gelu_check(graph: Graph, _: None, m) -> Refusal | None:
    nodes, _x, _out = m
    for n in nodes[:-1]:
        if n.outputs[0] in graph.outputs:
            return Refusal(f"intermediate '{n.outputs[0]}' is a graph output",
                           ((n.name, "(gelu pattern)"),))
    return None


def _gelu_rewrite(graph: Graph, _: None, m) -> None:
    nodes, x, out = m
    erf = next(n for n in nodes if n.op_type == "Erf")
    order = min(graph.g.nodes[n.name]["order"] for n in nodes)
    for n in nodes:
        graph.remove_node(n.name)
    graph.add_node(Node(name=f"{erf.name}::Gelu", op_type="Gelu", inputs=(x,), outputs=(out,),
                        attrs={"approximate": "none",
                               "fused_from": [n.name for n in nodes],
                               "fused_ops": [n.op_type for n in nodes]}, opset=20),
                   order=order)


GELU: Rule = Rule("gelu", _gelu_pattern, _gelu_check, _gelu_rewrite)


@graph_pass("fold_conv_bn")
def fold_conv_bn(graph: Graph, ctx: PassContext) -> bool:
    """Conv -> BatchNormalization (inference, constant parameters): fold the BN into the
    convolution's weights and bias at compile time; the BN node disappears. A remaining
    float32 BN with constant parameters (after a Concat, a pool...: DenseNet's
    pre-activations) becomes x * k + t per channel (rule ``bn_affine``), which the
    elementwise fusion joins with its neighbours (a ReLU after it: one pass, not two)."""
    changed = CONV_BN.run(graph, None, ctx)
    return BN_AFFINE.run(graph, None, ctx) or changed


@graph_pass("prune_conv_taps")
def prune_conv_taps(graph: Graph, ctx: PassContext) -> bool:
    """Conv taps that read only padding are not computed.

    A tap that reads padding for every output position is dropped from the kernel (its
    weights sliced, the pads shrunk by as much): DeepLabV3's ASPP conv at dilation 36 on
    a 14x14 map is a 1x1 conv. Where the taps that read the input change along the
    output (dilation 12 on 14x14: rows 0-1 read taps 1-2, rows 2-11 tap 1 only, 12-13
    taps 0-1) and most of the work would be products with the padding, the output is
    cut into those bands, one Conv each over its crop of the input (Slice) with its taps
    and no padding, joined by Concats (written in place). Exact but for the order of
    the sums: only products with the zero padding are left out."""
    changed = False
    for n in list(graph.nodes()):
        if n.op_type == "Conv" and _prune_conv(graph, n):
            changed = True
    return changed


# A conv is cut into bands only where that leaves at most TAP_SPLIT_WORK of its products
# (the rest are with padding; a 3x3 with pads 1 on 14x14 has 95% of its products on the
# input, and Winograd may take it whole) and the estimate of the cut is lower: each
# region's products at the measured FMA peak, its weights and input crop at the measured
# memory bandwidth (a conv with padding-heavy taps is small in the output and large in
# the weights: DeepLabV3's 960 -> 256 3x3 is 8.8 MB on a 14x14 map), KERNEL_COST seconds
# a kernel launched
KERNEL_COST = 5e-6
MAX_TAP_REGIONS = 9
TAP_SPLIT_WORK = 0.6


def _tap_bands(size: int, out: int, k: int, s: int, d: int, pb: int
               ) -> list[tuple[int, int, int, int]] | None:
    """The output positions of one spatial dim in runs [y0, y1) that read the input
    through the same taps [k0, k1): (y0, y1, k0, k1) per run; None when some position's
    taps are not one contiguous range or read nothing."""
    bands: list[list[int]] = []
    for y in range(out):
        valid = [t for t in range(k) if 0 <= y * s - pb + t * d < size]
        if not valid or valid[-1] - valid[0] + 1 != len(valid):
            return None
        k0, k1 = valid[0], valid[-1] + 1
        if bands and bands[-1][2:] == [k0, k1]:
            bands[-1][1] = y + 1
        else:
            bands.append([y, y + 1, k0, k1])
    return [(a, b, c, e) for a, b, c, e in bands]


# one region's extent in one spatial dim: output [y0, y1), taps [k0, k1), pads (pb, pe),
# input crop [r0, r1)
Band = tuple[int, int, int, int, int, int, int, int]


def _dim_options(size: int, out: int, k: int, s: int, d: int, pb: int, pe: int
                 ) -> tuple[list[Band], list[Band] | None] | None:
    """One spatial dim kept whole (the taps any position reads, the pads shrunk by the
    taps cut) and cut into bands (None when it is one band), or None."""
    bands = _tap_bands(size, out, k, s, d, pb)
    if bands is None:
        return None
    k0, k1 = min(b[2] for b in bands), max(b[3] for b in bands)
    pb2, pe2 = pb - k0 * d, pe - (k - k1) * d
    if pb2 < 0 or pe2 < 0 or (size + pb2 + pe2 - (k1 - k0 - 1) * d - 1) // s + 1 != out:
        k0, k1, pb2, pe2 = 0, k, pb, pe
    whole = [(0, out, k0, k1, pb2, pe2, 0, size)]
    if len(bands) == 1:
        return whole, None
    cut = [(y0, y1, a, b, 0, 0, y0 * s - pb + a * d, (y1 - 1) * s - pb + (b - 1) * d + 1)
           for y0, y1, a, b in bands]
    return whole, cut


def _prune_conv(graph: Graph, n: Node) -> bool:
    w = graph.constants.get(n.inputs[1]) if len(n.inputs) > 1 else None
    x, y = graph.values.get(n.inputs[0]), graph.values.get(n.outputs[0])
    if (w is None or x is None or y is None or not x.is_static or not y.is_static
            or n.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET")):
        return False
    nsp = w.ndim - 2
    if nsp < 1 or len(x.shape) != nsp + 2 or len(y.shape) != nsp + 2:
        return False
    ks = [int(v) for v in w.shape[2:]]
    strides = [int(v) for v in n.attrs.get("strides", [1] * nsp)]
    dil = [int(v) for v in n.attrs.get("dilations", [1] * nsp)]
    pads = [int(v) for v in n.attrs.get("pads", [0] * (2 * nsp))]
    if len(strides) != nsp or len(dil) != nsp or len(pads) != 2 * nsp:
        return False
    if not any(pads):               # without padding every tap reads the input everywhere
        return False
    opts = []
    for i in range(nsp):
        o = _dim_options(int(x.shape[2 + i]), int(y.shape[2 + i]), ks[i], strides[i], dil[i],
                         pads[i], pads[nsp + i])
        if o is None:
            return False
        opts.append(o)
    cm = cpu_model()
    flops = 2 * int(x.shape[0]) * int(np.prod(w.shape[:2]))   # per output position and tap
    wbytes = w.itemsize * int(np.prod(w.shape[:2]))            # weights per tap
    xbytes = 2 * x.dtype.itemsize * int(x.shape[0]) * int(x.shape[1])  # crop copy per position
    peak, bw = cm.peak_gflops_core * 1e9, cm.dram_gbps * 1e9

    def cost(plan: list[list[Band]]) -> float:
        t = 0.0
        for reg in itertools.product(*plan):
            taps = int(np.prod([b[3] - b[2] for b in reg]))
            px = int(np.prod([b[1] - b[0] for b in reg]))
            t += flops * px * taps / peak + wbytes * taps / bw + KERNEL_COST
            crop = [b[7] - b[6] for b in reg]
            if crop != [int(v) for v in x.shape[2:]]:
                t += xbytes * int(np.prod(crop)) / bw + KERNEL_COST
        return t

    def products(plan: list[list[Band]]) -> int:
        return sum(int(np.prod([(b[3] - b[2]) * (b[1] - b[0]) for b in reg]))
                   for reg in itertools.product(*plan))

    whole = [o[0] for o in opts]
    plans = [(cost(whole), 0, whole)]
    limit = TAP_SPLIT_WORK * products(whole)
    for cuts in itertools.product(*[[o[0]] + ([o[1]] if o[1] else []) for o in opts]):
        if (int(np.prod([len(c) for c in cuts])) <= MAX_TAP_REGIONS
                and products(list(cuts)) <= limit):
            plans.append((cost(list(cuts)), len(plans), list(cuts)))
    best = min(plans)[2]
    full = [(0, int(y.shape[2 + i]), 0, ks[i], pads[i], pads[nsp + i], 0, int(x.shape[2 + i]))
            for i in range(nsp)]
    if [c[0] for c in best] == full and all(len(c) == 1 for c in best):
        return False
    _cut_conv(graph, n, w, best, dil)
    return True


def _cut_conv(graph: Graph, n: Node, w: np.ndarray, plan: list[list[Band]],
              dil: list[int]) -> None:
    """The conv as one Conv per product of the dims' bands (its crop of the input, its
    taps and pads), the regions joined by Concats along each spatial dim, innermost
    first. One region keeps the node's name and input; several each stand for the ONNX
    node (fused_from: the precision policy, keep_fp32 and the profiles name it)."""
    nsp = len(plan)
    x, y = n.inputs[0], n.outputs[0]
    xt, yt = graph.values[x], graph.values[y]
    order = graph.g.nodes[n.name]["order"]
    graph.remove_node(n.name)
    seq = itertools.count(1)
    single = all(len(p) == 1 for p in plan)

    def add(op: str, inputs: tuple[str, ...], out: str, shape: list[int], **attrs: object
            ) -> str:
        k = next(seq)
        graph.values[out] = TensorType(yt.dtype if op != "Slice" else xt.dtype, tuple(shape))
        name = n.name if single else f"{n.name}::{op.lower()}{k}"
        graph.add_node(Node(name=name, op_type=op, inputs=inputs, outputs=(out,),
                            attrs=dict(attrs) if op != "Conv" else {**n.attrs, **attrs},
                            opset=n.opset if op == "Conv" else max(13, graph.opsets.get("", 13))),
                       order=order if single else order - 0.5 + k * 1e-4)
        return out

    def region(reg: list[Band], out: str) -> str:
        src = x
        crop = [(b[6], b[7]) for b in reg]
        if crop != [(0, int(d)) for d in xt.shape[2:]]:
            k = next(seq)
            names = [f"{n.name}::crop{k}_{w_}" for w_ in ("starts", "ends", "axes")]
            for nm, v in zip(names, ([a for a, _ in crop], [e for _, e in crop],
                                     list(range(2, 2 + nsp)))):
                graph.set_constant(nm, np.array(v, dtype=np.int64))
            src = add("Slice", (x, *names), f"{n.name}::crop{k}",
                      [int(xt.shape[0]), int(xt.shape[1])] + [e - a for a, e in crop])
        wname = f"{n.name}::w_taps{next(seq)}"
        graph.set_constant(wname, w[(slice(None), slice(None),
                                     *(slice(b[2], b[3]) for b in reg))])
        shape = [int(yt.shape[0]), int(yt.shape[1])] + [b[1] - b[0] for b in reg]
        origin = {} if single else {"fused_from": list(n.attrs.get("fused_from", [n.name])),
                                    "fused_ops": list(n.attrs.get("fused_ops", ["Conv"]))}
        return add("Conv", (src, wname, *n.inputs[2:]), out, shape, **origin,
                   kernel_shape=[b[3] - b[2] for b in reg],
                   pads=[b[4] for b in reg] + [b[5] for b in reg],
                   dilations=[1 if b[3] - b[2] == 1 else dil[i] for i, b in enumerate(reg)])

    def build(i: int, chosen: list[Band], out: str) -> str:
        if i == nsp:
            return region(chosen, out)
        if len(plan[i]) == 1:
            return build(i + 1, chosen + [plan[i][0]], out)
        parts = [build(i + 1, chosen + [b], f"{out}::band{i}_{j}")
                 for j, b in enumerate(plan[i])]
        shape = [int(v) for v in graph.values[parts[0]].shape]
        shape[2 + i] = sum(int(graph.values[p].shape[2 + i]) for p in parts)
        return add("Concat", tuple(parts), out, shape, axis=2 + i)

    build(0, [], y)


def _conv_bn_pattern(graph: Graph, _: None, bn: Node) -> tuple[Node, Node] | None:
    if bn.op_type != "BatchNormalization":
        return None
    conv = graph.producer(bn.inputs[0])
    return (conv, bn) if conv is not None and conv.op_type == "Conv" else None


def _conv_bn_check(graph: Graph, _: None, m: tuple[Node, Node]) -> Refusal | None:
    conv, bn = m
    why = _conv_bn_reason(graph, conv, bn)
    return Refusal(why, ((conv.name, bn.name),)) if why else None


def _conv_bn_rewrite(graph: Graph, _: None, m: tuple[Node, Node]) -> None:
    conv, bn = m
    x = bn.inputs[0]
    scale, b, mean, var = (graph.constants[v].astype(np.float64) for v in bn.inputs[1:5])
    eps = float(bn.attrs.get("epsilon", 1e-5))
    w = graph.constants[conv.inputs[1]].astype(np.float64)
    cb = (graph.constants[conv.inputs[2]].astype(np.float64)
          if len(conv.inputs) > 2 and conv.inputs[2] else np.zeros(w.shape[0]))
    s = scale / np.sqrt(var + eps)
    dt = graph.values[x].dtype
    w2 = (w * s.reshape((-1,) + (1,) * (w.ndim - 1))).astype(dt)
    b2 = ((cb - mean) * s + b).astype(dt)
    wname, bname = f"{conv.name}::w_bn", f"{conv.name}::b_bn"
    graph.set_constant(wname, w2)
    graph.set_constant(bname, b2)
    y = bn.outputs[0]
    attrs = dict(conv.attrs)
    attrs["fused_from"] = [conv.name, bn.name]
    attrs["fused_ops"] = ["Conv", "BatchNormalization"]
    new = conv.replace(inputs=(conv.inputs[0], wname, bname), outputs=(y,), attrs=attrs,
                       proto=None)
    graph.remove_node(bn.name)
    graph.replace_node(conv.name, new)


CONV_BN: Rule = Rule("conv_bn", _conv_bn_pattern, _conv_bn_check, _conv_bn_rewrite)


def _bn_inference_reason(graph: Graph, bn: Node) -> str | None:
    """Why BN is not an inference BatchNormalization with constant, spatial parameters
    (that conv_bn and bn_affine can fold), or None."""
    if any(o for o in bn.outputs[1:]):
        return "BatchNormalization in training mode (extra outputs)"
    if bn.attrs.get("training_mode", 0):
        return "BatchNormalization in training mode"
    if not all(v in graph.constants for v in bn.inputs[1:5]):
        return "BatchNormalization parameters are not constant"
    if bn.opset < 9 and bn.attrs.get("spatial", 1) == 0:
        return "non-spatial BatchNormalization"
    return None


def _conv_bn_reason(graph: Graph, conv: Node, bn: Node) -> str | None:
    x = bn.inputs[0]
    if x in graph.outputs or graph.consumers(x) != [bn.name]:
        return f"the convolution's output '{x}' is also used elsewhere"
    why = _bn_inference_reason(graph, bn)
    if why:
        return why
    if conv.inputs[1] not in graph.constants or (
            len(conv.inputs) > 2 and conv.inputs[2] and conv.inputs[2] not in graph.constants):
        return "the convolution's weights are not constant"
    c = graph.constants[conv.inputs[1]].shape[0]
    if any(graph.constants[v].shape != (c,) for v in bn.inputs[1:5]):
        return "BatchNormalization parameters do not match the output channels"
    return None


def _bn_affine_pattern(graph: Graph, _: None, bn: Node) -> Node | None:
    return bn if bn.op_type == "BatchNormalization" else None


def _bn_affine_check(graph: Graph, _: None, bn: Node) -> Refusal | None:
    why = _bn_affine_reason(graph, bn)
    return Refusal(why, ((bn.name, bn.name),)) if why else None


def _bn_affine_reason(graph: Graph, bn: Node) -> str | None:
    why = _bn_inference_reason(graph, bn)
    if why:
        return why
    t = graph.values.get(bn.inputs[0])
    if t is None or np.dtype(t.dtype) != np.float32 or len(t.shape) < 2:
        return "per-channel affine form for float32 inputs of rank >= 2 only"
    c = int(t.shape[1])
    if any(graph.constants[v].reshape(-1).shape != (c,) for v in bn.inputs[1:5]):
        return "BatchNormalization parameters do not match the channels"
    return None


def _bn_affine_rewrite(graph: Graph, _: None, bn: Node) -> None:
    x, y = bn.inputs[0], bn.outputs[0]
    scale, b, mean, var = (graph.constants[v].astype(np.float64).reshape(-1)
                           for v in bn.inputs[1:5])
    eps = float(bn.attrs.get("epsilon", 1e-5))
    k = scale / np.sqrt(var + eps)
    shape = (k.size,) + (1,) * (len(graph.values[x].shape) - 2)
    kname, tname, mid = f"{bn.name}::k", f"{bn.name}::t", f"{bn.name}::xk"
    graph.set_constant(kname, k.astype(np.float32).reshape(shape))
    graph.set_constant(tname, (b - mean * k).astype(np.float32).reshape(shape))
    graph.values[mid] = graph.values[y]
    order = graph.g.nodes[bn.name]["order"]
    graph.remove_node(bn.name)
    fused = {"fused_from": [bn.name], "fused_ops": ["BatchNormalization"]}
    graph.add_node(Node(name=f"{bn.name}::mul", op_type="Mul", inputs=(x, kname),
                        outputs=(mid,), attrs=dict(fused), opset=14), order=order)
    graph.add_node(Node(name=f"{bn.name}::add", op_type="Add", inputs=(mid, tname),
                        outputs=(y,), attrs=dict(fused), opset=14), order=order + 0.5)


BN_AFFINE: Rule = Rule("bn_affine", _bn_affine_pattern, _bn_affine_check, _bn_affine_rewrite)


# ---------------------------------------------------------------------------
# scaled dot-product attention
# ---------------------------------------------------------------------------


def _dense_strides(shape: tuple[int, ...]) -> list[int]:
    st, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        st[d] = acc
        acc *= int(shape[d])
    return st


def _reshaped_strides(shape: tuple[int, ...], strides: list[int],
                      new: tuple[int, ...]) -> list[int] | None:
    """The strides of a view (shape, strides) reshaped to `new` in place (row-major), or
    None where the reshape would need a copy. Axes of size 1 take the stride they would
    have if dense with the axes inside them."""
    old = [(int(n), int(st)) for n, st in zip(shape, strides) if n != 1]
    nd = [(k, int(n)) for k, n in enumerate(new) if n != 1]
    out: list[int | None] = [None] * len(new)
    i = j = 0
    while i < len(old) and j < len(nd):
        i2, j2, po, pn = i + 1, j + 1, old[i][0], nd[j][1]
        while po != pn:
            if po < pn and i2 < len(old):
                po *= old[i2][0]
                i2 += 1
            elif pn < po and j2 < len(nd):
                pn *= nd[j2][1]
                j2 += 1
            else:
                return None
        if any(old[k][1] != old[k + 1][0] * old[k + 1][1] for k in range(i, i2 - 1)):
            return None             # the old axes merged here are not contiguous
        st = old[i2 - 1][1]
        for k in range(j2 - 1, j - 1, -1):
            out[nd[k][0]] = st
            st *= nd[k][1]
        i, j = i2, j2
    if i != len(old) or j != len(nd):
        return None
    inner = 1
    for k in range(len(new) - 1, -1, -1):
        if out[k] is None:
            out[k] = inner
        inner = out[k] * int(new[k])
    return [int(x) for x in out]


def _logical_strides(graph: Graph, v: str, absorbed: list[Node]) -> tuple[str, list[int]]:
    """v as a strided view of a value `base` (dense): through a chain of single-use
    Transposes and Reshapes that keep it a view (the head split and merge, torch's
    [B,H,S,D] -> [B*H,S,D] -> [B*H,D,S] -> [B,H,D,S] around a transposed K). Returns (base,
    v's strides in base's elements); the nodes read through join `absorbed`."""
    chain: list[Node] = []
    cur = v
    while True:
        p = graph.producer(cur)
        if p is None or p.op_type not in ("Transpose", "Reshape") \
                or len(graph.consumers(cur)) != 1 or cur in graph.outputs:
            break
        chain.append(p)
        cur = p.inputs[0]
    base = cur
    shape = tuple(int(d) for d in graph.values[base].shape)
    strides = _dense_strides(shape)
    kept: list[Node] = []
    for p in reversed(chain):          # from the base out
        out = tuple(int(d) for d in graph.values[p.outputs[0]].shape)
        if p.op_type == "Transpose":
            perm = p.attrs.get("perm") or list(range(len(shape)))[::-1]
            strides = [strides[int(a) % len(shape)] for a in perm]
        else:
            st = _reshaped_strides(shape, strides, out)
            if st is None:             # a copy: the view starts again from this value
                base, strides, kept = p.outputs[0], _dense_strides(out), []
                shape = out
                continue
            strides = st
        shape = out
        kept.append(p)
    absorbed.extend(kept)
    return base, strides


def _as4(strides: list[int], shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(b, h, s, d) strides and sizes of a rank-3 or rank-4 operand."""
    if len(shape) == 4:
        return tuple(strides), tuple(shape)
    return (strides[0], 0, strides[1], strides[2]), (shape[0], 1, shape[1], shape[2])


def _peel_scalar_scale(graph: Graph, v: str, absorbed: list[Node]) -> tuple[str, float]:
    """v == x * c (or x / c) for a scalar constant c, used only here: (x, c)."""
    p = graph.producer(v)
    if p is None or p.op_type not in ("Mul", "Div") or v in graph.outputs \
            or len(graph.consumers(v)) != 1:
        return v, 1.0
    for i in ((0, 1) if p.op_type == "Mul" else (0,)):
        c = _scalar_const(graph, p.inputs[1 - i])
        if c is not None and c != 0 and tuple(graph.values[p.inputs[i]].shape) == tuple(
                graph.values[v].shape):
            absorbed.append(p)
            return p.inputs[i], (c if p.op_type == "Mul" else 1.0 / c)
    return v, 1.0


@graph_pass("fuse_attention")
def fuse_attention(graph: Graph, ctx: PassContext) -> bool:
    """MatMul(Q, Kᵀ) -> scale -> mask -> Softmax -> MatMul(·, V), with the head split/merge
    Transposes around it, becomes one FusedAttention kernel (online softmax, no score
    matrix in memory)."""
    return ATTENTION.run(graph, None, ctx)


def _attention_pattern(graph: Graph, _: None, mm: Node):
    if mm.op_type != "MatMul":
        return None
    found = _match_attention(graph, mm)
    return None if found is None else (mm, found)


def _attention_check(graph: Graph, _: None, m) -> Refusal | None:
    _mm, found = m
    if isinstance(found, tuple) and len(found) == 3 and isinstance(found[0], str):
        prod, cons, why = found
        return Refusal(why, ((prod, cons),))
    return None


def _attention_rewrite(graph: Graph, _: None, m) -> None:
    mm, (nodes, inputs, out, spec) = m
    order = graph.g.nodes[mm.name]["order"]
    body_names = [n.name for n in nodes]
    for n in nodes:
        graph.remove_node(n.name)
    graph.add_node(Node(name=f"attention::{mm.name}", op_type="FusedAttention",
                        inputs=tuple(inputs), outputs=(out,), domain="cannc", opset=1,
                        attrs={"spec": spec, "fused_from": body_names,
                               "fused_ops": [n.op_type for n in nodes]}), order=order)


ATTENTION: Rule = Rule("attention", _attention_pattern, _attention_check, _attention_rewrite)


def _nan_guard(graph: Graph, probs: str) -> list[Node]:
    """[IsNaN, Where] of ``Where(IsNaN(p), 0, p)`` read by nothing else, as torch's
    scaled_dot_product_attention export (dynamo) guards the softmax's probabilities p
    (a fully masked row is NaN, then 0); [] where p is not guarded so."""
    cons = [graph.node(c) for c in graph.consumers(probs)]
    if len(cons) != 2 or probs in graph.outputs:
        return []
    isnan = next((n for n in cons if n.op_type == "IsNaN"), None)
    where = next((n for n in cons if n.op_type == "Where"), None)
    if isnan is None or where is None or _only_consumer(graph, isnan.outputs[0],
                                                        ("Where",)) is not where:
        return []
    if where.inputs[0] != isnan.outputs[0] or where.inputs[2] != probs \
            or _scalar_const(graph, where.inputs[1]) != 0.0:
        return []
    return [isnan, where]


def _match_attention(graph: Graph, mm: Node):
    dts = {np.dtype(graph.values[v].dtype).name for v in mm.inputs}
    if len(dts) != 1 or not dts <= {"float32", "float16", "bfloat16"}:
        return None          # the kernel converts bf16/fp16 on load (codegen/attention.py)
    dt = dts.pop()
    qv, ktv = mm.inputs
    pre: list[Node] = []
    pre_scale = 1.0
    # torch's scaled_dot_product_attention export scales Q and Kᵀ by sqrt(scale) each
    qv, f = _peel_scalar_scale(graph, qv, pre)
    pre_scale *= f
    ktv, f = _peel_scalar_scale(graph, ktv, pre)
    pre_scale *= f
    qs, kts = graph.values[qv].shape, graph.values[ktv].shape
    if len(qs) not in (3, 4) or len(kts) != len(qs):
        return None
    scores = mm.outputs[0]
    chain: list[Node] = [mm]
    cur = scores
    scale, mask, mask_kind, fill = 1.0, None, "none", None

    def next_node(v: str, ops: tuple[str, ...]) -> Node | None:
        return _only_consumer(graph, v, ops)

    n = next_node(cur, ("Div", "Mul"))
    if n is not None and n.inputs[0] == cur:
        c = _scalar_const(graph, n.inputs[1])
        if c is not None and c != 0:
            scale = 1.0 / c if n.op_type == "Div" else c
            chain.append(n)
            cur = n.outputs[0]
    n = next_node(cur, ("Add", "Where"))
    if n is not None and n.op_type == "Add":
        other = _other(n, cur)
        if np.dtype(graph.values[other].dtype).name == dt:
            mask, mask_kind = other, "add"
            chain.append(n)
            cur = n.outputs[0]
    elif n is not None and n.op_type == "Where" and cur in n.inputs[1:]:
        keep_if_true = n.inputs[1] == cur
        f = _scalar_const(graph, n.inputs[2] if keep_if_true else n.inputs[1])
        cdt = np.dtype(graph.values[n.inputs[0]].dtype)
        if f is not None and (cdt == np.bool_ or (keep_if_true and cdt.name == dt)):
            mask, mask_kind, fill = n.inputs[0], "where", f
            if not keep_if_true:
                mask = ("not", mask)   # Where(cond, fill, scores): keep where cond is false
            chain.append(n)
            cur = n.outputs[0]
    sm = next_node(cur, ("Softmax",))
    if sm is None:
        return None  # not attention (a plain batched MatMul)
    rank = len(graph.values[cur].shape)
    axis = sm.attrs.get("axis", -1 if sm.opset >= 13 else 1)
    if axis % rank != rank - 1:
        return (chain[-1].name, sm.name, "Softmax is not over the last axis")
    chain.append(sm)
    probs = sm.outputs[0]
    guard = _nan_guard(graph, probs)
    if guard:
        chain += guard
        probs = guard[-1].outputs[0]
    pv = next_node(probs, ("MatMul",))
    if pv is None or pv.inputs[0] != probs:
        return (sm.name, "(attention)", "the probabilities do not feed a MatMul with V")
    chain.append(pv)
    for n in chain[:-1]:
        if n.outputs[0] in graph.outputs:
            return (n.name, "(attention)", f"intermediate '{n.outputs[0]}' is a graph output")
    vv = pv.inputs[1]
    absorbed: list[Node] = []
    qbase, qst = _logical_strides(graph, qv, absorbed)
    kbase, ktst = _logical_strides(graph, ktv, absorbed)
    vbase, vst = _logical_strides(graph, vv, absorbed)
    q4, qsz = _as4(qst, tuple(qs))
    kt4, ktsz = _as4(ktst, tuple(kts))
    v4, vsz = _as4(vst, tuple(graph.values[vv].shape))
    B, H, Sq, D = qsz
    Sk = ktsz[3]
    Dv = vsz[3]
    if ktsz[0] != B or ktsz[1] != H or ktsz[2] != D or vsz[:3] != (B, H, Sk):
        return (mm.name, pv.name, "Q, K and V batch/head dims differ (broadcast attention)")
    k4 = (kt4[0], kt4[1], kt4[3], kt4[2])         # K[b,h,s,d] from Kᵀ[b,h,d,s]
    out = pv.outputs[0]
    ost = _dense_strides((B, H, Sq, Dv)) if len(qs) == 4 else None
    o4 = tuple(ost) if ost is not None else (Sq * Dv, 0, Dv, 1)
    # a merge-heads Transpose [B,H,S,D] -> [B,S,H,D] after it is absorbed into the store
    t = next_node(out, ("Transpose",))
    if t is not None and len(qs) == 4 and list(t.attrs.get("perm", [])) == [0, 2, 1, 3]:
        chain.append(t)
        out = t.outputs[0]
        o4 = (Sq * H * Dv, Dv, H * Dv, 1)
    mstr = (0, 0, 0, 0)
    mdt = "float32"
    negate = isinstance(mask, tuple)
    if negate:
        mask = mask[1]
    if mask is not None:
        ms = tuple(graph.values[mask].shape)
        full = (B, H, Sq, Sk) if len(qs) == 4 else (B, Sq, Sk)
        ms = (1,) * (len(full) - len(ms)) + ms
        if any(a not in (1, b) for a, b in zip(ms, full)):
            return (mask, chain[1].name, f"mask shape {list(ms)} does not broadcast to the scores")
        dense = _dense_strides(ms)
        st = [0 if a == 1 else s for a, s in zip(ms, dense)]
        mstr = tuple(st) if len(st) == 4 else (st[0], 0, st[1], st[2])
        mdt = "bool" if np.dtype(graph.values[mask].dtype) == np.bool_ else dt
    spec = AttnSpec(B=B, H=H, Sq=Sq, Sk=Sk, D=D, Dv=Dv, q_strides=q4, k_strides=k4,
                    v_strides=v4, o_strides=o4, scale=float(scale * pre_scale), mask=mask_kind,
                    mask_strides=mstr, mask_dtype=mdt,
                    fill=float(fill) if fill is not None else -3.4028234663852886e38,
                    zero_nan_rows=bool(guard))
    if negate:
        inv = f"{mask}::not"
        if inv not in graph.values:
            graph.values[inv] = graph.values[mask]
            graph.add_node(Node(name=f"{chain[0].name}::mask_not", op_type="Not",
                                inputs=(mask,), outputs=(inv,), opset=graph.opsets.get("", 13)),
                           order=graph.g.nodes[chain[0].name]["order"] - 0.5)
        mask = inv
    inputs = [qbase, kbase, vbase] + ([mask] if mask is not None else [])
    return pre + absorbed + chain, inputs, out, spec
