"""AMX bf16 GEMM (codegen/amx.py) against cannc's fp32 GEMM (codegen/gemm.py), B
constant and prepacked, all tiles on one core (one thread; or split in halves over
two threads with --threads 2), median of many calls.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. python benchmarks/amx_bench.py [--reps 50]
        [--threads 1|2] [MxNxK ...]

The two kernels' calls are interleaved (a loaded machine slows both alike).
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time

import ml_dtypes
import numpy as np

from cannc.codegen import amx
from cannc.codegen.gemm import (
    GemmSpec,
    emit_gemm,
    gemm_num_tiles,
    gemm_workspace_bytes,
    prepack_b,
)
from cannc.native import target


def _ws(nbytes):
    buf = np.zeros(2 * nbytes + 256, np.uint8)   # one workspace per thread
    return buf, (buf.ctypes.data + 63) // 64 * 64


def _call(f, argv, T, ws, ws_bytes, threads):
    if threads == 1:
        f(argv, 0, T, ws)
        return
    ws2 = ws + (ws_bytes + 63) // 64 * 64
    t = threading.Thread(target=f, args=(argv, T // 2, T, ws2))
    t.start()
    f(argv, 0, T // 2, ws)
    t.join()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["1024x1024x1024", "128x3072x768",
                                                  "128x768x3072"])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, choices=(1, 2),
                    help="2: the tiles split in halves over two threads, as two cores")
    args = ap.parse_args()
    why = amx.amx_usable()
    if why:
        raise SystemExit(f"AMX not usable: {why}")
    rng = np.random.default_rng(0)
    for shp in args.shapes:
        M, N, K = map(int, shp.split("x"))
        spec = GemmSpec(M=M, N=N, K=K, b_prepacked=True)
        A = rng.standard_normal((M, K), dtype=np.float32)
        B = rng.standard_normal((K, N), dtype=np.float32)
        runs = {}
        abf = A.astype(ml_dtypes.bfloat16)
        for name, a, tun in (("amx bf16 (A fp32)", A, None), ("amx bf16 (A bf16)", abf, None),
                             ("amx (A bf16 in place)", abf, {"pack_a": False})):
            a_dt = a.dtype.name
            m = target.new_module("bench")
            amx.emit_amx_gemm(m, "k", spec, a_dtype=a_dt, tuning=tun)
            f = target.jit_kernel(m, "k")
            bp = amx.amx_prepack_b(spec, B)
            C = np.zeros((M, N), np.float32)
            argv = (ctypes.c_void_p * 3)(a.ctypes.data, bp.ctypes.data, C.ctypes.data)
            wsb = amx.amx_workspace_bytes(spec, a_dt, tun)
            buf, ws = _ws(wsb)
            runs[name] = (f, argv, amx.amx_num_tiles(spec, a_dt, tun), ws, wsb, (a, bp, C, buf))
        m = target.new_module("bench")
        emit_gemm(m, "k", spec)
        f = target.jit_kernel(m, "k")
        bp = prepack_b(spec, B)
        C = np.zeros((M, N), np.float32)
        argv = (ctypes.c_void_p * 3)(A.ctypes.data, bp.ctypes.data, C.ctypes.data)
        wsb = gemm_workspace_bytes(spec)
        buf, ws = _ws(wsb)
        runs["cannc fp32"] = (f, argv, gemm_num_tiles(spec), ws, wsb, (A, bp, C, buf))
        times = {k: [] for k in runs}
        for _ in range(3):
            for f, argv, T, ws, wsb, _keep in runs.values():
                _call(f, argv, T, ws, wsb, args.threads)
        for _ in range(args.reps):
            for k, (f, argv, T, ws, wsb, _keep) in runs.items():
                t = time.perf_counter()
                _call(f, argv, T, ws, wsb, args.threads)
                times[k].append(time.perf_counter() - t)
        flops = 2.0 * M * N * K
        base = np.median(times["cannc fp32"])
        for k, ts in times.items():
            med = np.median(ts)
            print(f"{shp:>16} {args.threads}T {k:<21} median {flops / med / 1e9:6.0f} GFLOP/s "
                  f"(best {flops / min(ts) / 1e9:6.0f})  x{base / med:4.2f} vs fp32", flush=True)


if __name__ == "__main__":
    main()
