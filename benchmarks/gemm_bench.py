"""Benchmark cannc's generated fp32 GEMM against numpy (OpenBLAS).

    python benchmarks/gemm_bench.py                      # default shapes
    python benchmarks/gemm_bench.py 1024x1024x1024 1x4096x1024 --reps 20
    python benchmarks/gemm_bench.py 512x512x512 --raw-b --trans-b
    python benchmarks/gemm_bench.py 1024x1024x1024 --tuning '{"KC": 128}'
    python benchmarks/gemm_bench.py 3136x64x576 --cores 2

Shapes are MxNxK. B is prepacked (a constant weight) unless --raw-b.
Prints the median (and best) GFLOP/s of cannc (whole tile range on one thread, or
split over --cores threads) and of numpy with OpenBLAS limited to the same
number of threads, both measured in the same process, interleaved. The
machines are shared and noisy: compare medians of runs made side by side.
--cores N starts N Python threads per call (~0.1 ms), so it only says
something about shapes that run for several milliseconds.
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
    "shapes", nargs="*", default=["1024x1024x1024", "256x768x3072", "1x4096x1024", "3136x64x576"]
)
_p.add_argument("--reps", type=int, default=15, help="timed repetitions (median reported)")
_p.add_argument("--raw-b", action="store_true", help="B not prepacked (packed at run time)")
_p.add_argument("--trans-a", action="store_true")
_p.add_argument("--trans-b", action="store_true")
_p.add_argument("--bias", action="store_true", help="row-vector bias (like Gemm's C)")
_p.add_argument("--cores", type=int, default=1, help="threads (tile range split evenly)")
_p.add_argument("--speed-level", type=int, default=0, help="IR optimiser level (codegen is O3)")
_p.add_argument("--tuning", type=str, default=None, help="JSON dict of plan overrides")
_p.add_argument("--no-numpy", action="store_true")
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
    GemmSpec,
    emit_gemm,
    gemm_num_tiles,
    gemm_plan,
    gemm_workspace_bytes,
    prepack_b,
)
from cannc.codegen.target import host, jit_kernel
from tests.helpers import aligned, run_concurrently, tile_ranges


def bench(shape: str):
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
    Bk = B
    if spec.b_prepacked:
        packed = prepack_b(spec, B)
        Bk = aligned(packed.shape)
        Bk[...] = packed
    module = ir.Module()
    emit_gemm(module, "gemm", spec, tuning=tuning)
    t0 = time.perf_counter()
    fn = jit_kernel(module, "gemm", ARGS.speed_level)  # cannc's own compile pipeline
    ctime = time.perf_counter() - t0
    T = gemm_num_tiles(spec, tuning)
    ptrs = (
        [A.ctypes.data, Bk.ctypes.data]
        + ([bias.ctypes.data] if spec.bias else [])
        + [C.ctypes.data]
    )
    argv = (ctypes.c_void_p * len(ptrs))(*ptrs)
    wsb = gemm_workspace_bytes(spec, tuning)
    wss = [aligned((wsb // 4 + 16,)) for _ in range(ARGS.cores)]
    wsp = [w.ctypes.data for w in wss]
    cores = ARGS.cores
    ranges = tile_ranges(T, cores)

    def run_cannc():
        run_concurrently(fn, argv, ranges, wsp)

    Aop = A.T if ARGS.trans_a else A
    Bop = B.T if ARGS.trans_b else B
    Cn = aligned((M, N))

    def run_numpy():
        np.matmul(Aop, Bop, out=Cn)
        if spec.bias:
            np.add(Cn, bias, out=Cn)

    flop = 2.0 * M * N * K
    # calibrate the number of inner calls so that one sample takes >= ~20 ms
    run_cannc()
    t0 = time.perf_counter()
    run_cannc()
    one = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(0.02 / one))
    tc, tn = [], []
    for _ in range(ARGS.reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            run_cannc()
        tc.append((time.perf_counter() - t0) / inner)
        if not ARGS.no_numpy:
            t0 = time.perf_counter()
            for _ in range(inner):
                run_numpy()
            tn.append((time.perf_counter() - t0) / inner)
    ref = Aop.astype(np.float64) @ Bop.astype(np.float64) + (bias if spec.bias else 0)
    err = float(np.abs(C - ref).max() / max(1.0, np.abs(ref).max()))
    gc = flop / statistics.median(tc) / 1e9
    line = f"{shape:>16}  cannc {gc:6.1f} (best {flop / min(tc) / 1e9:6.1f}) GFLOP/s"
    if tn:
        gn = flop / statistics.median(tn) / 1e9
        line += f"  numpy {gn:6.1f} (best {flop / min(tn) / 1e9:6.1f})  ratio {gc / gn:5.2f}"
    plan = gemm_plan(spec, tuning)
    line += (
        f"  | compile {ctime * 1e3:5.1f} ms  tiles {T}  relerr {err:.1e}  "
        f"[MR={plan.MR} NR={plan.NR} KC={plan.KC} MC={plan.MC} pack_a={plan.pack_a} "
        f"b={plan.b_mode} grid={plan.mt}x{plan.nt}]"
    )
    print(line, flush=True)


if __name__ == "__main__":
    print(
        f"cores={ARGS.cores} prepacked_b={not ARGS.raw_b} trans_a={ARGS.trans_a} "
        f"trans_b={ARGS.trans_b} bias={ARGS.bias} reps={ARGS.reps} cpu={host().cpu}"
    )
    for s in ARGS.shapes:
        bench(s)
