"""Reduced-precision fused attention against the float32 kernel, one thread.

    python benchmarks/attention_lowp_bench.py                 # 1x12x128x64 and 1x12x512x64
    python benchmarks/attention_lowp_bench.py 8x12x128x64 --reps 30
    python benchmarks/attention_lowp_bench.py --bert      # K as [B,H,D,S], padding mask

Shapes are BxHxSxD (self-attention, dense [B,H,S,D] Q, K, V and O, scale 1/8, no
mask; with --bert K is stored transposed [B,H,D,S] and an additive [B,1,1,S] mask of
the operands' type is added, a quarter of the keys at -10000).

Variants, timed interleaved in one process (medians of --reps calls of the whole tile
range on one thread; the machines are shared and noisy):

* fp32: the float32 kernel;
* bf16 dp: bf16 Q, K, V, O with vdpbf16ps (tuning dot='bf16'; needs avx512bf16);
* bf16 amx / f32->bf16 amx: Q K^T and P V on AMX tiles (dot='amx'; where
  `amx.amx_usable()` says yes), bf16 or float32 operands;
* bf16 wide: bf16 operands widened to float32 (dot='f32');
* f32->bf16 dp: float32 Q, K, V, O with precision bf16 (converted on load);
* fp16: float16 operands, float32 FMA;
* host bf16: bf16 operands with the host's default choice (what a compiled model runs).

Accuracy: max |O - O_fp32| over the fp32 kernel's output of the same (rounded) inputs.
GFLOP/s count 4*B*H*S*S*D.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from llvmlite import ir

from cannc.codegen.amx import amx_usable
from cannc.codegen.attention import (
    attention_num_tiles,
    attention_precision_note,
    attention_workspace_bytes,
    emit_attention,
)
from cannc.ir.attnspec import AttnSpec
from cannc.native.target import host, jit_kernel
from cannc.runtime.memory import aligned_empty

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def aligned(shape, dt):
    n = int(np.prod(shape))
    return aligned_empty(n * np.dtype(dt).itemsize, 64).view(dt)[:n].reshape(shape)


class Variant:
    def __init__(self, shape, dts, prec, tuning, data, bert=False):
        B, H, S, D = shape
        kw = {}
        if bert:
            kw = dict(k_transposed=True, mask="add", mask_dtype=dts[0],
                      mask_strides=(S, 0, 0, 1))
        self.spec = AttnSpec.dense(B, H, S, S, D, dtypes=dts, precision=prec, scale=0.125,
                                   **kw)
        self.tuning = tuning
        self.bufs = [aligned(shape, NP[d]) for d in dts]
        for buf, x in zip(self.bufs[:3], data):
            buf[...] = x.astype(NP[buf.dtype.name])
        if bert:
            self.bufs[1] = np.ascontiguousarray(self.bufs[1].transpose(0, 1, 3, 2))
            m = np.zeros((B, S), NP[dts[0]])
            m[:, S - S // 4:] = -10000
            self.bufs.insert(3, m)
        mod = ir.Module()
        emit_attention(mod, "a", self.spec, tuning=tuning)
        self.kernel = jit_kernel(mod, "a", 0)
        self.tiles = attention_num_tiles(self.spec, tuning)
        self.ws = aligned((attention_workspace_bytes(self.spec, tuning) // 4 + 16,), np.float32)
        self.argv = (ctypes.c_void_p * len(self.bufs))(*(b.ctypes.data for b in self.bufs))
        self.note = attention_precision_note(self.spec, tuning)

    def __call__(self):
        self.kernel(self.argv, 0, self.tiles, self.ws.ctypes.data)

    def out(self):
        return self.bufs[-1].astype(np.float64)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="*", default=["1x12x128x64", "1x12x512x64"])
    ap.add_argument("--reps", type=int, default=0, help="default: 60 (S <= 256) or 15")
    ap.add_argument("--bert", action="store_true", help="K as [B,H,D,S], a padding mask")
    a = ap.parse_args()
    bf = ("bfloat16",) * 4
    f32 = ("float32",) * 4
    for text in a.shapes:
        shape = tuple(int(x) for x in text.split("x"))
        B, H, S, D = shape
        rng = np.random.default_rng(0)
        raw = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
        rounded = [x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in raw]
        variants = {"fp32": Variant(shape, f32, "fp32", None, raw, a.bert),
                    "fp32 (bf16 data)": Variant(shape, f32, "fp32", None, rounded, a.bert)}
        if host().has("avx512bf16"):
            variants["bf16 dp"] = Variant(shape, bf, "bf16", {"dot": "bf16"}, raw, a.bert)
            variants["f32->bf16 dp"] = Variant(shape, f32, "bf16", {"dot": "bf16"}, raw, a.bert)
        if amx_usable() is None:
            variants["bf16 amx"] = Variant(shape, bf, "bf16", {"dot": "amx"}, raw, a.bert)
            variants["f32->bf16 amx"] = Variant(shape, f32, "bf16", {"dot": "amx"}, raw,
                                                a.bert)
        variants["bf16 wide"] = Variant(shape, bf, "bf16", {"dot": "f32"}, raw, a.bert)
        variants["host bf16"] = Variant(shape, bf, "bf16", None, raw, a.bert)
        variants["fp16"] = Variant(shape, ("float16",) * 4, "fp16", None, raw, a.bert)
        reps = a.reps or (60 if S <= 256 else 15)
        times = {k: [] for k in variants}
        for v in variants.values():
            v()
        for _ in range(reps):
            for k, v in variants.items():
                t = time.perf_counter()
                v()
                times[k].append(time.perf_counter() - t)
        flops = 4 * B * H * S * S * D
        base = np.median(times["fp32"])
        ref32, refbf = variants["fp32"].out(), variants["fp32 (bf16 data)"].out()
        print(f"{text} one thread, median of {reps} (cpu {host().cpu})")
        for k, v in variants.items():
            m = np.median(times[k])
            ref = ref32 if k in ("fp32", "fp16", "fp32 (bf16 data)") else refbf
            err = np.abs(v.out() - ref).max()
            print(f"  {k:17s} {m * 1e6:9.1f} us {flops / m / 1e9:7.1f} GFLOP/s "
                  f"x{base / m:5.2f}  max|err| {err:.2e}  [{v.note}]")


if __name__ == "__main__":
    main()
