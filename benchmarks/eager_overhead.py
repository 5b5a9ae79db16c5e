"""Per-call overhead of eager ops (cannc.ops): beside NumPy, Session.run and the bare kernel.

    python benchmarks/eager_overhead.py [--runs 3000] [--warmup 200] [--json out.json]

For each case (op, shapes) it times, with cannc.ops.benchmark (median / p10 / p90 of
single calls, microseconds):

- numpy: the NumPy expression of the op (the reference, for scale);
- kernel: the compiled program's dispatcher called on a prepared argument table (what
  native code costs, with the ctypes call itself);
- cannc.ops: the eager call as users make it (cache lookup, checks, output allocation,
  table patch, launch);
- Session.run: the same compiled one-node graph run through the session (feed checks,
  program lookup, copy in, copy out).

overhead = cannc.ops - kernel is what the eager face adds above the kernel.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from cannc import ops
from cannc.ops import _eager


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float32])(x)


def cases() -> list[tuple[str, object, object, tuple]]:
    r = np.random.default_rng(0)

    def f(*s: int) -> np.ndarray:
        return r.standard_normal(s).astype(np.float32)

    x8, w8 = f(8, 8), f(8, 8)
    x64, w64 = f(64, 64), f(64, 64)
    x256, w256 = f(256, 256), f(256, 256)
    v = f(1024)
    s4 = f(4, 1024)
    ln_x, ln_s, ln_b = f(16, 768), f(768), f(768)

    def np_softmax(a: np.ndarray) -> np.ndarray:
        e = np.exp(a - a.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def np_ln(a: np.ndarray, s: np.ndarray, b: np.ndarray) -> np.ndarray:
        mu = a.mean(-1, keepdims=True)
        return (a - mu) / np.sqrt(a.var(-1, keepdims=True) + 1e-5) * s + b

    return [
        ("matmul 8x8", ops.matmul, np.matmul, (x8, w8)),
        ("matmul 64x64", ops.matmul, np.matmul, (x64, w64)),
        ("matmul 256x256", ops.matmul, np.matmul, (x256, w256)),
        ("add 1024", ops.add, np.add, (v, v)),
        ("relu 1024", ops.relu, lambda a: np.maximum(a, 0), (v,)),
        ("gelu 1024", ops.gelu, lambda a: 0.5 * a * (1 + _erf(a / np.sqrt(2))), (v,)),
        ("softmax 4x1024", ops.softmax, np_softmax, (s4,)),
        ("layer_norm 16x768", ops.layer_norm, np_ln, (ln_x, ln_s, ln_b)),
    ]


def kernel_only(fn: object, args: tuple) -> tuple[object, object, object]:
    """The compiled program's launch alone, on a table patched by one real call."""
    fn(*args)
    sig = tuple((a.dtype, a.shape) for a in args)
    entry = next(e for k, e in reversed(_eager._CACHE.items()) if k[3] == sig)
    fast = entry.fast
    out = fast(list(args))          # the outputs stay alive while the table points at them
    slot = fast._pool[-1]
    return (lambda: fast._launch(slot)), out, entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    print(f"{'case':20s} {'numpy':>9s} {'kernel':>9s} {'cannc.ops':>10s} {'Session.run':>12s}"
          f" {'overhead':>9s}   (median us; p10-p90 of cannc.ops)")
    for name, fn, ref, args in cases():
        y = fn(*args)
        np.testing.assert_allclose(np.asarray(y, np.float32), ref(*args), rtol=1e-4, atol=1e-4)
        launch, keep, entry = kernel_only(fn, args)
        sess = entry.session
        feeds = dict(zip(sess.graph.inputs, args))
        b = {"numpy": ops.benchmark(ref, *args, warmup=a.warmup, runs=a.runs),
             "kernel": ops.benchmark(launch, warmup=a.warmup, runs=a.runs),
             "cannc.ops": ops.benchmark(fn, *args, warmup=a.warmup, runs=a.runs),
             "Session.run": ops.benchmark(sess.run, None, feeds, warmup=a.warmup,
                                          runs=a.runs)}
        del keep
        us = {k: v.median * 1e6 for k, v in b.items()}
        over = us["cannc.ops"] - us["kernel"]
        c = b["cannc.ops"]
        print(f"{name:20s} {us['numpy']:9.2f} {us['kernel']:9.2f} {us['cannc.ops']:10.2f} "
              f"{us['Session.run']:12.2f} {over:9.2f}   ({c.p10 * 1e6:.2f}-{c.p90 * 1e6:.2f})")
        rows.append({"case": name, **{k: v.to_dict() for k, v in b.items()},
                     "overhead_us": over})
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
