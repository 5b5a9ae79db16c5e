"""bf16 / fp16 GEMM kernels against the fp32 one: GFLOP/s, one thread, B prepacked.

    python benchmarks/gemm_lowp_bench.py                       # 1024^3, BERT FFN shapes, GEMV
    python benchmarks/gemm_lowp_bench.py 1024x1024x1024 --dp force --reps 21

Shapes are MxNxK. Variants: fp32; bf16 with A and C bf16; bf16 with A and C fp32 (A
converted on load); fp16 storage with A and C fp16. --dp: 'auto' (vdpbf16ps where it
beats fp32 FMA, cannc's choice), 'force' (vdpbf16ps on any CPU that has it), 'off'.
Kernels run interleaved; the median (and best) of --reps timed batches is reported.
The machines are shared and noisy: compare medians of runs made side by side.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from llvmlite import ir

from cannc.codegen import gemm
from cannc.codegen.gemm import (
    GemmSpec,
    emit_gemm,
    gemm_num_tiles,
    gemm_workspace_bytes,
    np_elem,
    precision_note,
    prepack_b,
)
from cannc.native.target import jit_kernel

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("shapes", nargs="*",
               default=["1024x1024x1024", "128x768x3072", "128x3072x768", "1x4096x1024"])
p.add_argument("--reps", type=int, default=11)
p.add_argument("--dp", choices=["auto", "force", "off"], default="auto")
args = p.parse_args()
if args.dp == "force":
    gemm.use_dpbf16 = gemm.host_dpbf16
elif args.dp == "off":
    gemm.use_dpbf16 = lambda: False


def _aligned(n: int, dt) -> np.ndarray:
    dt = np.dtype(dt)
    raw = np.zeros(n * dt.itemsize + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off:off + n * dt.itemsize].view(dt)


def kernel(spec: GemmSpec):
    m = ir.Module()
    emit_gemm(m, "g", spec)
    k = jit_kernel(m, "g", speed_level=0)
    rng = np.random.default_rng(0)
    A = _aligned(spec.M * spec.K, np_elem(spec.a_type))
    A[:] = rng.standard_normal(A.size).astype(A.dtype)
    packed = prepack_b(spec, rng.standard_normal((spec.K, spec.N)).astype(np.float32))
    B = _aligned(packed.size, packed.dtype)
    B[:] = packed
    C = _aligned(spec.M * spec.N, np_elem(spec.c_type))
    ws = _aligned(max(16, gemm_workspace_bytes(spec)), np.uint8)
    argv = (ctypes.c_void_p * 3)(A.ctypes.data, B.ctypes.data, C.ctypes.data)
    T = gemm_num_tiles(spec)

    def run():
        k(argv, 0, T, ws.ctypes.data)
    run.keep = (A, B, C, ws)
    return run


for shape in args.shapes:
    M, N, K = (int(x) for x in shape.split("x"))
    specs = {
        "fp32": GemmSpec(M, N, K, b_prepacked=True),
        "bf16 A,C bf16": GemmSpec(M, N, K, b_prepacked=True, a_type="bfloat16",
                                  b_type="bfloat16", c_type="bfloat16", compute="bf16"),
        "bf16 A,C fp32": GemmSpec(M, N, K, b_prepacked=True, b_type="bfloat16",
                                  compute="bf16"),
        "fp16 A,C fp16": GemmSpec(M, N, K, b_prepacked=True, a_type="float16",
                                  b_type="float16", c_type="float16", compute="fp16"),
    }
    runs = {n: kernel(s) for n, s in specs.items()}
    flops = 2 * M * N * K
    inner = max(1, int(2e8 // flops))   # calls per timed batch (~0.1 s at 2 GFLOP/s)
    times: dict[str, list[float]] = {n: [] for n in runs}
    for r in runs.values():
        r()
    for _ in range(args.reps):
        for n, r in runs.items():
            t = time.perf_counter()
            for _ in range(inner):
                r()
            times[n].append((time.perf_counter() - t) / inner)
    base = float(np.median(times["fp32"]))
    for n, ts in times.items():
        med = float(np.median(ts))
        print(f"{shape:>16} {n:14} median {flops / med / 1e9:7.1f} GFLOP/s  "
              f"best {flops / min(ts) / 1e9:7.1f}  x{base / med:4.2f} fp32  "
              f"[{precision_note(specs[n]) or 'fp32'}]", flush=True)
