"""Benchmark cannc's fused attention kernel against numpy and onnxruntime.

    python benchmarks/attention_bench.py                       # BERT-base shapes
    python benchmarks/attention_bench.py 8x12x128x64 1x12x512x64 --causal
    python benchmarks/attention_bench.py 8x12x384x64 --tuning '{"KB": 128}'
    python benchmarks/attention_bench.py 8x12x128x64 --cores 2
    python benchmarks/attention_bench.py 8x12x128x64 --k-bhsd --merged-out --poly

Shapes are BxHxSxD (self-attention, Sq = Sk = S, Dv = D). Inputs are laid out
as BERT exports them: Q [B,H,S,D], K already transposed [B,H,D,S], V
[B,H,S,D], an additive [B,1,1,S] key-padding mask (0 / -10000, a quarter of
the keys padded); with --causal a GPT-style [1,1,S,S] bool lower-triangular
mask applied with where(mask, S, float32 lowest) instead (cannc: causal=True).

With --poly the shape-polymorphic kernel (emitted for the AttnForm, reading B,
Sq, Sk and the open strides at run time: what a compiled model runs) is timed
too, interleaved with the static kernel (column "poly": static median / poly
median, >1 means the polymorphic kernel is faster).

Rivals, all single threaded unless --cores is given (and measured in the same
process, interleaved; medians of --reps runs):

* numpy: matmul, scale, mask, softmax (max, exp, sum, divide), matmul on
  float32 with OpenBLAS limited to --cores threads;
* onnxruntime running the unfused subgraph (MatMul, Div, Add | Where,
  Softmax, MatMul) with intra_op_num_threads = --cores.

cannc runs the whole tile range on one thread, or splits it over --cores
Python threads (~0.1 ms per call: only meaningful for multi-ms shapes).
GFLOP/s count 4*B*H*S*S*D (the two matmuls; causal: all of it, for comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
)
_p.add_argument(
    "shapes", nargs="*", default=["8x12x128x64", "8x12x256x64", "8x12x384x64", "8x12x512x64"]
)
_p.add_argument("--reps", type=int, default=15, help="timed repetitions (median reported)")
_p.add_argument("--causal", action="store_true", help="GPT-style causal mask instead of padding")
_p.add_argument("--cores", type=int, default=1, help="threads for every contender")
_p.add_argument("--speed-level", type=int, default=2, help="IR optimiser level (codegen is O3)")
_p.add_argument("--tuning", type=str, default=None, help="JSON dict of plan overrides")
_p.add_argument(
    "--k-bhsd",
    action="store_true",
    help="cannc reads K as [B,H,S,D] and packs K^T itself (rivals get K^T)",
)
_p.add_argument(
    "--merged-out",
    action="store_true",
    help="cannc writes O as [B,S,H,D] (merged heads; rivals [B,H,S,D])",
)
_p.add_argument("--poly", action="store_true", help="also time the shape-polymorphic kernel")
_p.add_argument("--no-ort", action="store_true")
_p.add_argument("--no-numpy", action="store_true")
ARGS = _p.parse_args()

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = str(ARGS.cores)

import ctypes
import statistics
import time

import numpy as np
from llvmlite import ir

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cannc.codegen.attention import (
    attention_num_tiles,
    attention_plan,
    attention_tiling,
    attention_workspace_bytes,
    emit_attention,
)
from cannc.ir.attnspec import AttnSpec
from cannc.native.target import jit_kernel
from tests.helpers import aligned, run_concurrently, tile_ranges

F32_LOWEST = float(np.finfo(np.float32).min)


def numpy_attention(q, kt, v, mask, scale, causal_keep):
    s = np.matmul(q, kt)
    s *= np.float32(scale)
    if causal_keep is not None:
        s = np.where(causal_keep, s, np.float32(F32_LOWEST))
    else:
        s += mask
    s -= s.max(-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(-1, keepdims=True)
    return np.matmul(s, v)


def ort_session(B, H, S, D, causal):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("q", f, [B, H, S, D]),
        helper.make_tensor_value_info("kt", f, [B, H, D, S]),
        helper.make_tensor_value_info("v", f, [B, H, S, D]),
    ]
    inits = [helper.make_tensor("sqrt_d", f, [], [float(np.sqrt(D))])]
    nodes = [
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Div", ["qk", "sqrt_d"], ["sc"]),
    ]
    if causal:
        inputs.append(helper.make_tensor_value_info("keep", TensorProto.BOOL, [1, 1, S, S]))
        inits.append(helper.make_tensor("lowest", f, [], [F32_LOWEST]))
        nodes.append(helper.make_node("Where", ["keep", "sc", "lowest"], ["ms"]))
    else:
        inputs.append(helper.make_tensor_value_info("mask", f, [B, 1, 1, S]))
        nodes.append(helper.make_node("Add", ["sc", "mask"], ["ms"]))
    nodes += [
        helper.make_node("Softmax", ["ms"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"]),
    ]
    graph = helper.make_graph(
        nodes, "attn", inputs, [helper.make_tensor_value_info("o", f, [B, H, S, D])], inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = ARGS.cores
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def bench(shape: str):
    B, H, S, D = (int(x) for x in shape.lower().split("x"))
    tuning = json.loads(ARGS.tuning) if ARGS.tuning else None
    causal = ARGS.causal
    scale = 1.0 / np.sqrt(D)
    rng = np.random.default_rng(0)
    q = aligned((B, H, S, D))
    q[...] = rng.standard_normal(q.shape)
    kt = aligned((B, H, D, S))
    kt[...] = rng.standard_normal(kt.shape)
    v = aligned((B, H, S, D))
    v[...] = rng.standard_normal(v.shape)
    mask = aligned((B, 1, 1, S))
    mask[...] = 0.0
    mask[..., S - S // 4 :] = -10000.0
    keep = np.tril(np.ones((S, S), bool))[None, None]
    o = aligned((B, H, S, D))

    kw = {"k_transposed": not ARGS.k_bhsd, "merged_heads_out": ARGS.merged_out, "scale": scale}
    if causal:
        spec = AttnSpec.dense(B, H, S, S, D, causal=True, **kw)
    else:
        spec = AttnSpec.dense(B, H, S, S, D, mask="add", mask_strides=(S, 0, 0, 1), **kw)
    k_in = np.ascontiguousarray(kt.transpose(0, 1, 3, 2)) if ARGS.k_bhsd else kt
    o_view = o.reshape(B, S, H, D).transpose(0, 2, 1, 3) if ARGS.merged_out else o
    module = ir.Module()
    emit_attention(module, "attn", spec, tuning=tuning)
    t0 = time.perf_counter()
    fn = jit_kernel(module, "attn", ARGS.speed_level)  # cannc's own compile pipeline
    ctime = time.perf_counter() - t0
    plan = attention_plan(spec, tuning)
    T = attention_num_tiles(spec, tuning)
    ptrs = [q.ctypes.data, k_in.ctypes.data, v.ctypes.data]
    if not causal:
        ptrs.append(mask.ctypes.data)
    ptrs.append(o.ctypes.data)
    argv = (ctypes.c_void_p * len(ptrs))(*ptrs)
    wsb = attention_workspace_bytes(spec, tuning)
    cores = ARGS.cores
    wss = [aligned((wsb // 4 + 16,)) for _ in range(cores)]
    wsp = [w.ctypes.data for w in wss]
    ranges = tile_ranges(T, cores)

    def run_cannc():
        run_concurrently(fn, argv, ranges, wsp)

    o_poly = aligned((B, H, S, D))
    if ARGS.poly:
        til = attention_tiling(spec, tuning)
        pmod = ir.Module()
        emit_attention(pmod, "attn_poly", til.form, tuning=tuning)
        pfn = jit_kernel(pmod, "attn_poly", ARGS.speed_level)
        pvals = ptrs[:-1] + [o_poly.ctypes.data] + list(til.dims)
        pargv = (ctypes.c_int64 * len(pvals))(*pvals)
        pws = [aligned((til.workspace_bytes // 4 + 16,)) for _ in range(cores)]
        pwsp = [w.ctypes.data for w in pws]
        pranges = tile_ranges(til.num_tiles, cores)

        def run_poly():
            run_concurrently(pfn, pargv, pranges, pwsp)

    run_np = lambda: numpy_attention(q, kt, v, mask, scale, keep if causal else None)
    feeds = {"q": q, "kt": kt, "v": v}
    if causal:
        feeds["keep"] = keep
    else:
        feeds["mask"] = mask
    contenders = [("cannc", run_cannc)]
    if ARGS.poly:
        contenders.append(("poly", run_poly))
    if not ARGS.no_numpy:
        contenders.append(("numpy", run_np))
    if not ARGS.no_ort:
        sess = ort_session(B, H, S, D, causal)
        contenders.append(("ort", lambda: sess.run(["o"], feeds)))

    # correctness against numpy (float32) before timing
    run_cannc()
    ref = run_np()
    err = float(np.max(np.abs(o_view - ref)))
    if ARGS.poly:
        run_poly()
        assert np.array_equal(o_poly, o), "the polymorphic kernel's result differs"
    times = {n: [] for n, _ in contenders}
    for _, f in contenders:
        f()  # warm-up
    for _ in range(ARGS.reps):
        for n, f in contenders:
            t0 = time.perf_counter()
            f()
            times[n].append(time.perf_counter() - t0)
    flops = 4.0 * B * H * S * S * D
    med = {n: statistics.median(ts) for n, ts in times.items()}
    row = f"{shape:>14} {'causal' if causal else 'pad-mask':>8}"
    row += " K[BHSD]" if ARGS.k_bhsd else ""
    row += f" {med['cannc'] * 1e3:8.3f} ms {flops / med['cannc'] / 1e9:6.1f} GF/s"
    if "poly" in med:
        row += f" | poly {med['poly'] * 1e3:8.3f} ms  x{med['cannc'] / med['poly']:5.3f}"
    for n in ("numpy", "ort"):
        if n in med:
            row += f" | {n} {med[n] * 1e3:8.3f} ms  x{med[n] / med['cannc']:5.2f}"
    row += (
        f" | tiles {T} MQ {plan.MQ} KB {plan.KB} ws {wsb // 1024} KiB"
        f" compile {ctime * 1e3:.0f} ms maxerr {err:.1e}"
    )
    print(row, flush=True)


def main():
    print(
        f"cores={ARGS.cores} reps={ARGS.reps} speed_level={ARGS.speed_level} "
        f"(xN = rival median / cannc median; >1 means cannc is faster)"
    )
    for s in ARGS.shapes:
        bench(s)


if __name__ == "__main__":
    main()
