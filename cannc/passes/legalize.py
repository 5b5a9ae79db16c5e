"""Legalisation: rewrite nodes into forms the kernels support, without changing results."""

from __future__ import annotations

import math

import numpy as np

from ..ir.epilogue import matmul_dims
from ..ir.graph import Graph, Node
from ..ir.ops.attention_op import (
    K_IN,
    NONPAD_IN,
    PAST_K_IN,
    PAST_LEN_ATTR,
    PAST_V_IN,
    V_IN,
    feature_problem,
)
from ..ir.ops.misc import parse_einsum
from ..ir.types import TensorType
from .manager import PassContext, graph_pass


@graph_pass("legalize_matmul_broadcast")
def legalize_matmul_broadcast(graph: Graph, ctx: PassContext) -> bool:
    """MatMul whose batch dims broadcast partially within one operand (e.g. [2,1,M,K] @
    [3,K,N]): materialise the broadcast with an Expand so the GEMM sees one batch stride."""
    changed = False
    for n in list(graph.nodes()):
        if n.op_type != "MatMul":
            continue
        a, b = graph.values[n.inputs[0]], graph.values[n.inputs[1]]
        if not (a.is_static and b.is_static) or len(a.shape) < 2 or len(b.shape) < 2:
            continue
        batch, M, K, N, ab, bb = matmul_dims(tuple(a.shape), tuple(b.shape))
        new_inputs = list(n.inputs)
        for i, (t, tb) in enumerate(((a, ab), (b, bb))):
            if tb == batch or all(d == 1 for d in tb):
                continue
            target = tuple(batch) + tuple(t.shape[-2:])
            shp_name = f"{n.name}::expand_shape{i}"
            out_name = f"{n.name}::expanded{i}"
            graph.set_constant(shp_name, np.array(target, dtype=np.int64))
            graph.values[out_name] = TensorType(t.dtype, target)
            graph.add_node(Node(name=f"{n.name}::expand{i}", op_type="Expand",
                                inputs=(n.inputs[i], shp_name), outputs=(out_name,),
                                opset=graph.opsets.get("", 13)),
                           order=graph.g.nodes[n.name]["order"] - 0.5)
            new_inputs[i] = out_name
        if tuple(new_inputs) != n.inputs:
            graph.replace_node(n.name, n.replace(inputs=tuple(new_inputs), proto=None))
            changed = True
    return changed


@graph_pass("legalize_attention")
def legalize_attention(graph: Graph, ctx: PassContext) -> bool:
    """ONNX Attention into the form its fused kernel takes (ir/ops/attention_op.py):

    - past_key / past_value: Concat(past, K) along the sequence (K of a 3-D node first
      split into heads: Reshape + Transpose) gives present_key / present_value (the
      node's outputs when requested) and becomes the node's K / V; the past length
      stays in the attribute cannc_past_len (the causal offset). present_* requested
      without a past are K / V in [B, heads, S, d] (Identity, or Reshape + Transpose).

    float16 / bfloat16 nodes stay as they are: the kernel converts Q, K, V, a float mask
    and Y on load / store and computes the softmax in float32 (as exact as any
    softmax_precision asks); the attention op rounds sqrt(scale) to the input type as the
    reference does.

    Nodes with a feature the kernel lacks (softcap, qk_matmul_output, ...) are left
    alone, so that the support check reports them as they are."""
    changed = False
    for n in list(graph.nodes()):
        if n.op_type != "Attention" or n.domain not in ("", "ai.onnx"):
            continue
        qt = graph.values.get(n.inputs[0])
        if qt is None or not qt.is_static or feature_problem(n, qt.dtype):
            continue
        ins = list(n.inputs) + [""] * (7 - len(n.inputs))
        outs = list(n.outputs) + [""] * (4 - len(n.outputs))
        past = bool(ins[PAST_K_IN] or ins[PAST_V_IN])
        if past and not (ins[PAST_K_IN] and ins[PAST_V_IN]) or past and ins[NONPAD_IN]:
            continue                      # invalid: the support check names it
        cache = past or bool(outs[1] or outs[2])
        if cache and not _attention_cache_shapes_ok(graph, n, ins, past):
            continue
        if not cache:
            continue
        opset = graph.opsets.get("", 23)
        order = graph.g.nodes[n.name]["order"]
        attrs = dict(n.attrs)
        added: list[Node] = []

        def add(op: str, inputs: tuple, out: str, t: TensorType, added=added, n=n,
                opset=opset, **kw) -> str:
            graph.values[out] = t
            added.append(Node(name=f"{n.name}::{op.lower()}{len(added)}", op_type=op,
                              inputs=inputs, outputs=(out,), attrs=kw, opset=opset))
            return out

        if cache:
            P = int(graph.values[ins[PAST_K_IN]].shape[2]) if past else 0
            for x_in, p_in, o_idx in ((K_IN, PAST_K_IN, 1), (V_IN, PAST_V_IN, 2)):
                x = ins[x_in]
                xt = graph.values[x]
                if len(xt.shape) == 4:
                    B, H, _, d = (int(s) for s in xt.shape)
                else:
                    H = int(attrs["kv_num_heads"])
                    B, d = int(xt.shape[0]), int(xt.shape[2]) // H
                if len(xt.shape) == 3:
                    S = int(xt.shape[1])
                    shp = f"{n.name}::heads_shape{x_in}"
                    graph.set_constant(shp, np.array([B, S, H, d], np.int64))
                    x = add("Reshape", (x, shp), f"{n.name}::heads{x_in}",
                            TensorType(xt.dtype, (B, S, H, d)))
                    x = add("Transpose", (x,), f"{n.name}::bhsd{x_in}",
                            TensorType(xt.dtype, (B, H, S, d)), perm=[0, 2, 1, 3])
                S = int(graph.values[x].shape[2])
                present = outs[o_idx] or f"{n.name}::present{x_in}"
                if past:
                    add("Concat", (ins[p_in], x), present,
                        TensorType(xt.dtype, (B, H, P + S, d)), axis=2)
                elif outs[o_idx]:
                    add("Identity", (x,), present, TensorType(xt.dtype, (B, H, S, d)))
                else:
                    present = x
                ins[x_in], ins[p_in], outs[o_idx] = present, "", ""
            attrs[PAST_LEN_ATTR] = P
        while len(ins) > 3 and not ins[-1]:
            ins.pop()
        while len(outs) > 1 and not outs[-1]:
            outs.pop()
        graph.remove_node(n.name)
        for k, a in enumerate(added):
            graph.add_node(a, order=order - 0.5 + k * 1e-3)
        graph.add_node(n.replace(inputs=tuple(ins), outputs=tuple(outs), attrs=attrs, proto=None),
                       order=order)
        changed = True
    return changed


def _attention_cache_shapes_ok(graph: Graph, n: Node, ins: list[str], past: bool) -> bool:
    """K/V (3-D with kv_num_heads, or 4-D) and past_key/past_value agree on batch, heads and
    head sizes, so that the Concat along the sequence is the reference's."""
    for x_in, p_in in ((1, 4), (2, 5)):
        xt = graph.values.get(ins[x_in])
        if xt is None or not xt.is_static or len(xt.shape) not in (3, 4):
            return False
        if len(xt.shape) == 3:
            H = int(n.attrs.get("kv_num_heads", 0) or 0)
            if H < 1 or int(xt.shape[2]) % H:
                return False
            B, d = int(xt.shape[0]), int(xt.shape[2]) // H
        else:
            B, H, _, d = (int(s) for s in xt.shape)
        if past:
            pt = graph.values.get(ins[p_in])
            if pt is None or not pt.is_static or tuple(int(s) for s in pt.shape[:2]) != (B, H) \
                    or len(pt.shape) != 4 or int(pt.shape[3]) != d \
                    or np.dtype(pt.dtype) != np.dtype(xt.dtype):
                return False
    return not past or graph.values[ins[4]].shape[2] == graph.values[ins[5]].shape[2]


@graph_pass("legalize_einsum")
def legalize_einsum(graph: Graph, ctx: PassContext) -> bool:
    """A two-operand float32 Einsum that is a (batched) matrix product -- every letter in
    both operands and the output (batch), in both operands only (summed), or in one
    operand and the output (free) -- becomes Transposes and Reshapes around a MatMul,
    which runs on the GEMM instead of Einsum's scalar loop nest (MaxViT's attention:
    'BGHID,BGHJD->BGHIJ' is Q @ Kᵀ). Other equations keep the loop nest."""
    changed = False
    for n in list(graph.nodes()):
        if n.op_type == "Einsum" and len(n.inputs) == 2:
            changed |= _einsum_as_matmul(graph, n)
    return changed


def _einsum_as_matmul(graph: Graph, n: Node) -> bool:
    ts = [graph.values.get(v) for v in n.inputs]
    yt = graph.values.get(n.outputs[0])
    if (any(t is None or not t.is_static or np.dtype(t.dtype) != np.float32 for t in ts)
            or yt is None or not yt.is_static):
        return False
    eq = n.attrs.get("equation", "")
    eq = eq.decode() if isinstance(eq, bytes) else eq
    parsed = parse_einsum(eq, [len(t.shape) for t in ts])
    if isinstance(parsed, str):
        return False
    (ta, tb), out = parsed
    if any(len(set(t)) != len(t) for t in (ta, tb, out)):
        return False                       # diagonals
    size: dict[str, int] = {}
    for t, ty in zip((ta, tb), ts):
        for c, d in zip(t, ty.shape):
            if size.setdefault(c, int(d)) != int(d):
                return False               # broadcasting
    batch = [c for c in out if c in ta and c in tb]
    fa = [c for c in out if c in ta and c not in tb]
    fb = [c for c in out if c in tb and c not in ta]
    summed = [c for c in ta if c in tb and c not in out]
    if set(ta) | set(tb) != set(batch + fa + fb + summed) or set(out) != set(batch + fa + fb):
        return False                       # a letter summed within one operand
    order = graph.g.nodes[n.name]["order"]
    seq = iter(range(1, 1 << 20))
    dt = ts[0].dtype

    def add(op: str, inputs: tuple[str, ...], shape: list[int], out_name: str | None = None,
            **attrs: object) -> str:
        k = next(seq)
        name = out_name or f"{n.name}::{op.lower()}{k}"
        graph.values[name] = TensorType(dt, tuple(shape))
        graph.add_node(Node(name=f"{n.name}::{op.lower()}{k}", op_type=op, inputs=inputs,
                            outputs=(name,), attrs=dict(attrs),
                            opset=max(13, graph.opsets.get("", 13))),
                       order=order - 0.5 + k * 1e-4)
        return name

    def arrange(v: str, term: str, letters: list[str], m: list[str], k: list[str]) -> str:
        """operand v (subscripts term) as batch + [prod(m), prod(k)]."""
        perm = [term.index(c) for c in letters + m + k]
        if perm != list(range(len(term))):
            v = add("Transpose", (v,), [size[c] for c in letters + m + k], perm=perm)
        shape = [size[c] for c in letters] + [math.prod(size[c] for c in m),
                                               math.prod(size[c] for c in k)]
        if [int(d) for d in graph.values[v].shape] != shape:
            sname = f"{n.name}::shape{next(seq)}"
            graph.set_constant(sname, np.array(shape, dtype=np.int64))
            v = add("Reshape", (v, sname), shape)
        return v

    graph.remove_node(n.name)
    a = arrange(n.inputs[0], ta, batch, fa, summed)
    b = arrange(n.inputs[1], tb, batch, summed, fb)
    bsz = [size[c] for c in batch]
    mm_shape = bsz + [math.prod(size[c] for c in fa), math.prod(size[c] for c in fb)]
    produced = batch + fa + fb
    final = [size[c] for c in produced]
    perm = [produced.index(c) for c in out]
    y = n.outputs[0]
    last_mm = final == mm_shape and perm == list(range(len(out)))
    v = add("MatMul", (a, b), mm_shape, y if last_mm else None,
            fused_from=list(n.attrs.get("fused_from", [n.name])), fused_ops=["Einsum"])
    if last_mm:
        return True
    if final != mm_shape:
        sname = f"{n.name}::shape{next(seq)}"
        graph.set_constant(sname, np.array(final, dtype=np.int64))
        v = add("Reshape", (v, sname), final, y if perm == list(range(len(out))) else None)
    if perm != list(range(len(out))):
        add("Transpose", (v,), [int(d) for d in yt.shape], y, perm=perm)
    return True
