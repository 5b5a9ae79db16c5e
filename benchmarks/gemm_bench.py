"""Benchmark cannc's generated fp32 GEMM against numpy (OpenBLAS) and onnxruntime.

    python benchmarks/gemm_bench.py                      # 1024^3 and transformer shapes
    python benchmarks/gemm_bench.py 1024x1024x1024 1x4096x1024 --reps 21
    python benchmarks/gemm_bench.py 512x512x512 --raw-b --trans-b
    python benchmarks/gemm_bench.py 1024x1024x1024 --tuning '{"KC": 128}'
    python benchmarks/gemm_bench.py 3136x64x576 --cores 2
    python benchmarks/gemm_bench.py --dynamic            # + the kernel for any M
    python benchmarks/gemm_bench.py 128x768x768 --b-copies 40   # B from memory, as in a model

Shapes are MxNxK. B is prepacked (a constant weight) unless --raw-b.
For every shape, one line with the median (and best) GFLOP/s of cannc (the whole
tile range on one thread, or split over --cores threads), its % of this core's
measured fp32 FMA peak (cannc.schedule.machine.measure_fma_peak), numpy with
OpenBLAS limited to the same number of threads, and an onnxruntime MatMul with a
constant B (intra_op_num_threads = --cores); all measured in the same process,
interleaved. --dynamic also times the shape-polymorphic kernel (compiled once for
N and K, M read at run time: what cannc compiles for a model with dynamic batch
or sequence) and its ratio to the static kernel. --b-copies N cycles every engine
through its own N copies of B, one per call (cannc's prepacked, numpy's arrays, N onnxruntime
sessions), so that B comes from memory as a model's weights do: each weight of a
BERT-base is read once per run and has left the caches by the next one (kernels
alone on a warm B read 5-10% faster than in such a model). The machines are shared and
noisy: compare medians of runs made side by side. --cores N starts N Python
threads per call (~0.1 ms), so it only says something about shapes that run for
several milliseconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

# 1024^3; BERT-base at sequence 128 (QKV/out projection, FFN up, FFN down) and a
# batch of 4 x 128; decode (one row); a conv-like tall-skinny GEMM
DEFAULT_SHAPES = ["1024x1024x1024", "128x768x768", "128x3072x768", "128x768x3072",
                  "512x768x768", "1x4096x1024", "3136x64x576"]

_p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
)
_p.add_argument("shapes", nargs="*", default=DEFAULT_SHAPES)
_p.add_argument("--reps", type=int, default=15, help="timed repetitions (median reported)")
_p.add_argument("--raw-b", action="store_true", help="B not prepacked (packed at run time)")
_p.add_argument("--trans-a", action="store_true")
_p.add_argument("--trans-b", action="store_true")
_p.add_argument("--bias", action="store_true", help="row-vector bias (like Gemm's C)")
_p.add_argument("--cores", type=int, default=1, help="threads (tile range split evenly)")
_p.add_argument("--speed-level", type=int, default=0, help="IR optimiser level (codegen is O3)")
_p.add_argument("--tuning", type=str, default=None, help="JSON dict of plan overrides")
_p.add_argument("--dynamic", action="store_true",
                help="also time the kernel for any M (runtime dims)")
_p.add_argument("--b-copies", type=int, default=1,
                help="cycle through this many copies of B, one per call (B from memory)")
_p.add_argument("--no-numpy", action="store_true")
_p.add_argument("--no-ort", action="store_true")
_p.add_argument("--peak", type=float, default=None,
                help="fp32 GFLOP/s of one core (default: measured)")
ARGS = _p.parse_args()

# limit OpenBLAS before numpy is imported
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = str(ARGS.cores)

import ctypes
import statistics
import time

import numpy as np
from llvmlite import ir

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cannc.codegen.gemm import (
    GEMM_DIMS,
    GemmSpec,
    dynamic_spec,
    emit_gemm,
    gemm_dims,
    gemm_num_tiles,
    gemm_plan,
    gemm_workspace_bytes,
    prepack_b,
    variant_plan,
)
from cannc.native.target import host, jit_kernel
from tests.helpers import aligned, run_concurrently, tile_ranges


def _ort_matmul(Aop: np.ndarray, Bop: np.ndarray, bias: np.ndarray | None):
    """A run() of an onnxruntime session computing Aop @ Bop (+ bias), B a constant."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("MatMul", ["a", "b"], ["y" if bias is None else "t"])]
    inits = [numpy_helper.from_array(np.ascontiguousarray(Bop), "b")]
    if bias is not None:
        nodes.append(helper.make_node("Add", ["t", "c"], ["y"]))
        inits.append(numpy_helper.from_array(bias, "c"))
    g = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info(
        "a", TensorProto.FLOAT, list(Aop.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = min(m.ir_version, 9)
    so = ort.SessionOptions()
    so.intra_op_num_threads = ARGS.cores
    so.inter_op_num_threads = 1
    s = ort.InferenceSession(onnx._serialize(m) if hasattr(onnx, "_serialize")
                             else m.SerializeToString(), so,
                             providers=["CPUExecutionProvider"])
    a = np.ascontiguousarray(Aop)
    return lambda: s.run(None, {"a": a})


def _kernel(spec: GemmSpec, tuning, ptr_sets, dims=()):
    """(run(), compile seconds, tiles) of the kernel of ``spec`` over its whole tile
    range; each run() takes the next of ``ptr_sets`` (argument pointers), in turn."""
    module = ir.Module()
    emit_gemm(module, "gemm", spec, tuning=tuning, dims_slot=len(ptr_sets[0]))
    t0 = time.perf_counter()
    fn = jit_kernel(module, "gemm", ARGS.speed_level)  # cannc's own compile pipeline
    ctime = time.perf_counter() - t0
    if spec.dyn:
        dims, T = gemm_dims(spec, dims[0], 1, tuning)
    else:
        T = gemm_num_tiles(spec, tuning)
    argvs = []
    for ptrs in ptr_sets:
        vals = list(ptrs) + list(dims)
        argvs.append((ctypes.c_void_p * len(vals))(*vals))
    wsb = gemm_workspace_bytes(spec, tuning)
    wss = [aligned((wsb // 4 + 16,)) for _ in range(ARGS.cores)]
    wsp = [w.ctypes.data for w in wss]
    ranges = tile_ranges(T, ARGS.cores)
    turn = itertools.cycle(argvs)

    def run():
        run_concurrently(fn, next(turn), ranges, wsp)

    run._keep = (argvs, wss)  # type: ignore[attr-defined]
    return run, ctime, T


def bench(shape: str, peak: float):
    M, N, K = (int(x) for x in shape.lower().split("x"))
    tuning = json.loads(ARGS.tuning) if ARGS.tuning else None
    spec = GemmSpec(
        M,
        N,
        K,
        trans_a=ARGS.trans_a,
        trans_b=ARGS.trans_b,
        b_prepacked=not ARGS.raw_b,
        bias=ARGS.bias,
        bias_col_stride=1,
    )
    rng = np.random.default_rng(0)
    A = aligned((K, M) if ARGS.trans_a else (M, K))
    A[...] = rng.standard_normal(A.shape)
    B = aligned((N, K) if ARGS.trans_b else (K, N))
    B[...] = rng.standard_normal(B.shape)
    bias = aligned((N,))
    bias[...] = rng.standard_normal(N)
    C = aligned((M, N))
    copies = max(1, ARGS.b_copies)
    keep = []      # (every copy lives until the timing is done)

    def b_copies(src):
        """``copies`` buffers holding src: each engine cycles through its own, so that
        none reads a B another engine has just brought into the caches."""
        out = [aligned(src.shape) for _ in range(copies)]
        for o in out:
            o[...] = src
        keep.append(out)
        return out

    kb = prepack_b(spec, B) if spec.b_prepacked else B

    def ptr_sets(c):
        return [[A.ctypes.data, Bk.ctypes.data] + ([bias.ctypes.data] if spec.bias else [])
                + [c.ctypes.data] for Bk in b_copies(kb)]

    run_cannc, ctime, T = _kernel(spec, tuning, ptr_sets(C))
    runs = {"cannc": run_cannc}
    if ARGS.dynamic and not ARGS.trans_a:
        Cd = aligned((M, N))    # (alive as long as the kernel writes it)
        runs["dynamic"], _, _ = _kernel(dynamic_spec(spec), None, ptr_sets(Cd), (M,))

    Aop = A.T if ARGS.trans_a else A
    Bop = B.T if ARGS.trans_b else B
    Bops = [Bc.T if ARGS.trans_b else Bc for Bc in b_copies(B)] if copies > 1 else [Bop]
    Cn = aligned((M, N))
    np_turn = itertools.cycle(Bops)

    def run_numpy():
        np.matmul(Aop, next(np_turn), out=Cn)
        if spec.bias:
            np.add(Cn, bias, out=Cn)

    if not ARGS.no_numpy:
        runs["numpy"] = run_numpy
    if not ARGS.no_ort:
        ort_turn = itertools.cycle([_ort_matmul(Aop, Bo, bias if spec.bias else None)
                                    for Bo in Bops])
        runs["ort"] = lambda: next(ort_turn)()

    flop = 2.0 * M * N * K
    # calibrate the number of inner calls so that one sample takes >= ~20 ms
    run_cannc()
    t0 = time.perf_counter()
    run_cannc()
    one = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(0.02 / one))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in runs.values():
        r()
    for _ in range(ARGS.reps):
        for name, r in runs.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                r()
            times[name].append((time.perf_counter() - t0) / inner)
    ref = Aop.astype(np.float64) @ Bop.astype(np.float64) + (bias if spec.bias else 0)
    err = float(np.abs(C - ref).max() / max(1.0, np.abs(ref).max()))
    g = {k: flop / statistics.median(v) / 1e9 for k, v in times.items()}
    best = {k: flop / min(v) / 1e9 for k, v in times.items()}
    line = (f"{shape:>16}  cannc {g['cannc']:6.1f} (best {best['cannc']:6.1f}) GFLOP/s "
            f"{100 * g['cannc'] / (peak * ARGS.cores):5.1f}% of peak")
    if "dynamic" in g:
        ds = dynamic_spec(spec)
        dp = variant_plan(gemm_plan(ds), gemm_dims(ds, M)[0][GEMM_DIMS.index("variant")])
        line += (f"  dynamic {g['dynamic']:6.1f} (x{g['dynamic'] / g['cannc']:4.2f}, "
                 f"{dp.MR}x{dp.NR})")
    for k in ("numpy", "ort"):
        if k in g:
            line += f"  {k} {g[k]:6.1f} (x{g['cannc'] / g[k]:4.2f})"
    plan = gemm_plan(spec, tuning)
    line += (
        f"  | compile {ctime * 1e3:5.1f} ms  tiles {T}  relerr {err:.1e}  "
        f"[MR={plan.MR} NR={plan.NR} KC={plan.KC} MC={plan.MC} NC={plan.NC} "
        f"pack_a={plan.pack_a} b={plan.b_mode} grid={plan.mt}x{plan.nt}]"
    )
    print(line, flush=True)


if __name__ == "__main__":
    if ARGS.peak:
        peak = ARGS.peak
    else:
        from cannc.schedule.machine import measure_fma_peak

        peak = measure_fma_peak()
    print(
        f"cores={ARGS.cores} prepacked_b={not ARGS.raw_b} trans_a={ARGS.trans_a} "
        f"trans_b={ARGS.trans_b} bias={ARGS.bias} reps={ARGS.reps} b_copies={ARGS.b_copies} "
        f"cpu={host().cpu} "
        f"fp32 peak {peak:.1f} GFLOP/s/core (measured FMA chains); "
        "(xR): cannc / that, dynamic / static"
    )
    for s in ARGS.shapes:
        bench(s, peak)
