"""Benchmark cannc's Conv / pool kernels against onnxruntime, one core each.

    python benchmarks/conv_bench.py                    # batch 1, every shape
    python benchmarks/conv_bench.py --batch 8
    python benchmarks/conv_bench.py --batch 1 8 --only 3x3 dw
    python benchmarks/conv_bench.py --cores 2          # both sides on 2 threads

Each shape is a single-node model (constant weights and bias), compiled with
``cannc.compile(model, cores=N)`` and run in onnxruntime with
``intra_op_num_threads=N``. Both sessions are timed in the same process,
interleaved call by call, through their Python ``run`` API (inputs copied in,
outputs copied out). Prints the median time of each, the GFLOP/s (for convs)
and the ratio ort/cannc (> 1: cannc is faster); "best-ratio" compares the
fastest calls (less sensitive to a busy machine) and "kernel ms" is the
median of cannc's kernels alone (``Program.launch``: no input/output copies).
Shapes: ResNet-18/50 and MobileNetV2 layers at 224x224.

    python benchmarks/conv_bench.py --winograd --batch 1 8   # Winograd vs implicit GEMM vs ort

``--winograd`` times, per ResNet-18 3x3 layer, three sessions side by side in
one process, interleaved call by call: cannc with the Winograd path forced,
cannc with it off (the implicit GEMM), and onnxruntime; kernel times are
``Program.launch`` medians (no input/output copies), ratios are of medians
("best": of the fastest calls, less sensitive to a busy machine); "auto" is
the path the default selection takes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import cannc
from tests.helpers import single_node_model

# name: (op, x shape (batch 1), w shape or None, attrs)
SHAPES = {
    "resnet conv1 7x7/2 3->64 @224": ("Conv", (1, 3, 224, 224), (64, 3, 7, 7),
                                      dict(strides=[2, 2], pads=[3, 3, 3, 3])),
    "resnet maxpool 3x3/2 @112": ("MaxPool", (1, 64, 112, 112), None,
                                  dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "resnet 3x3 64->64 @56": ("Conv", (1, 64, 56, 56), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1])),
    "resnet 3x3 128->128 @28": ("Conv", (1, 128, 28, 28), (128, 128, 3, 3),
                                dict(pads=[1, 1, 1, 1])),
    "resnet 3x3 256->256 @14": ("Conv", (1, 256, 14, 14), (256, 256, 3, 3),
                                dict(pads=[1, 1, 1, 1])),
    "resnet 3x3 512->512 @7": ("Conv", (1, 512, 7, 7), (512, 512, 3, 3), dict(pads=[1, 1, 1, 1])),
    "resnet 3x3/2 128->128 @56": ("Conv", (1, 128, 56, 56), (128, 128, 3, 3),
                                  dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "resnet 1x1 64->256 @56": ("Conv", (1, 64, 56, 56), (256, 64, 1, 1), {}),
    "resnet 1x1 256->64 @56": ("Conv", (1, 256, 56, 56), (64, 256, 1, 1), {}),
    "resnet 1x1 1024->256 @14": ("Conv", (1, 1024, 14, 14), (256, 1024, 1, 1), {}),
    "resnet 1x1/2 256->512 @56": ("Conv", (1, 256, 56, 56), (512, 256, 1, 1), dict(strides=[2, 2])),
    "mobilenet 3x3/2 3->32 @224": ("Conv", (1, 3, 224, 224), (32, 3, 3, 3),
                                   dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "mobilenet dw 3x3 32 @112": ("Conv", (1, 32, 112, 112), (32, 1, 3, 3),
                                 dict(group=32, pads=[1, 1, 1, 1])),
    "mobilenet dw 3x3/2 144 @56": ("Conv", (1, 144, 56, 56), (144, 1, 3, 3),
                                   dict(group=144, strides=[2, 2], pads=[1, 1, 1, 1])),
    "mobilenet dw 3x3 576 @14": ("Conv", (1, 576, 14, 14), (576, 1, 3, 3),
                                 dict(group=576, pads=[1, 1, 1, 1])),
    "mobilenet 1x1 24->144 @56": ("Conv", (1, 24, 56, 56), (144, 24, 1, 1), {}),
    "mobilenet 1x1 144->24 @56": ("Conv", (1, 144, 56, 56), (24, 144, 1, 1), {}),
    "mobilenet 1x1 960->320 @7": ("Conv", (1, 960, 7, 7), (320, 960, 1, 1), {}),
    "avgpool 2x2/2 256 @28": ("AveragePool", (1, 256, 28, 28), None,
                              dict(kernel_shape=[2, 2], strides=[2, 2])),
    "unet convT 2x2/2 256->128 @28": ("ConvTranspose", (1, 256, 28, 28), (256, 128, 2, 2),
                                      dict(strides=[2, 2])),
}


def conv_flops(op, xs, ws, out_shape) -> int:
    if ws is None:
        return 0
    if op == "ConvTranspose":
        return 2 * int(np.prod(xs)) * int(np.prod(ws[1:]))
    return 2 * int(np.prod(out_shape)) * int(np.prod(ws[1:]))


def bench(name, op, xs, ws, attrs, batch, cores, reps, min_seconds):
    rng = np.random.default_rng(0)
    xs = (batch,) + tuple(xs[1:])
    inputs = [rng.standard_normal(xs).astype(np.float32)]
    if ws is not None:
        fan_in = int(np.prod(ws[1:]))
        inputs.append((rng.standard_normal(ws) / np.sqrt(fan_in)).astype(np.float32))
        inputs.append(rng.standard_normal(ws[1] if op == "ConvTranspose" else ws[0])
                      .astype(np.float32))
    model, feeds = single_node_model(op, inputs, const_inputs=(1, 2), **attrs)

    so = ort.SessionOptions()
    so.intra_op_num_threads = cores
    so.inter_op_num_threads = 1
    s_ort = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    t0 = time.perf_counter()
    s_cnc = cannc.compile(model, cores=cores, shapes={k: v.shape for k, v in feeds.items()})
    compile_s = time.perf_counter() - t0

    ref = s_ort.run(None, feeds)[0]
    got = s_cnc.run(None, feeds)[0]
    ok = got.shape == ref.shape and np.allclose(got, ref, rtol=1e-3, atol=1e-3)
    for _ in range(3):  # warm up
        s_ort.run(None, feeds)
        s_cnc.run(None, feeds)
    prog = next(iter(s_cnc.programs.values()))   # the kernels alone, without input/output copies
    t_ort, t_cnc, t_krn = [], [], []
    start = time.perf_counter()
    while len(t_cnc) < reps or time.perf_counter() - start < min_seconds:
        a = time.perf_counter()
        s_cnc.run(None, feeds)
        b = time.perf_counter()
        s_ort.run(None, feeds)
        ctx = prog.acquire()  # the free execution context: it holds the inputs of the run above
        c = time.perf_counter()
        prog.launch(ctx)
        d = time.perf_counter()
        prog.release(ctx)
        t_cnc.append(b - a)
        t_ort.append(c - b)
        t_krn.append(d - c)
        if len(t_cnc) >= 20 * reps:
            break
    mc, mo = statistics.median(t_cnc), statistics.median(t_ort)
    flops = conv_flops(op, xs, ws, ref.shape)
    return dict(name=name, batch=batch, cannc=mc, ort=mo, kernel=statistics.median(t_krn),
                best_cannc=min(t_cnc), best_ort=min(t_ort),
                flops=flops, ok=ok, compile_s=compile_s, n=len(t_cnc))


WINOGRAD_SHAPES = {k: v for k, v in SHAPES.items()
                   if k.startswith("resnet 3x3 ") and "/2" not in k}


def _compile_mode(model, feeds, cores, mode):
    """cannc session with config.WINOGRAD = mode, lowered in a memo of its own (the
    lowering memo is keyed by the node, not by the switch)."""
    import tempfile

    from cannc import config
    old_mode, old_dir = config.WINOGRAD, os.environ.get("CANNC_CACHE_DIR")
    config.WINOGRAD = mode
    os.environ["CANNC_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"cannc-bench-wino-{mode}")
    try:
        return cannc.compile(model, cores=cores, shapes={k: v.shape for k, v in feeds.items()})
    finally:
        config.WINOGRAD = old_mode
        if old_dir is None:
            os.environ.pop("CANNC_CACHE_DIR", None)
        else:
            os.environ["CANNC_CACHE_DIR"] = old_dir


def _kernel_path(sess) -> str:
    return next(k for s in sess.specializations for k in s.kernels).notes.get("path", "?")


def bench_winograd(name, xs, ws, attrs, batch, cores, reps, min_seconds, act):
    rng = np.random.default_rng(0)
    xs = (batch,) + tuple(xs[1:])
    x = rng.standard_normal(xs).astype(np.float32)
    if act == "relu":
        x = np.maximum(x, 0)
    w = (rng.standard_normal(ws) * np.sqrt(2.0 / np.prod(ws[1:]))).astype(np.float32)
    bias = rng.standard_normal(ws[0]).astype(np.float32)
    model, feeds = single_node_model("Conv", [x, w, bias], const_inputs=(1, 2), **attrs)
    so = ort.SessionOptions()
    so.intra_op_num_threads = cores
    so.inter_op_num_threads = 1
    s_ort = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess = {m: _compile_mode(model, feeds, cores, m) for m in ("force", "off", "auto")}
    ref = s_ort.run(None, feeds)[0]
    errs = {}
    for m in ("force", "off"):
        got = sess[m].run(None, feeds)[0]
        errs[m] = float((np.abs(got - ref) / (1e-5 + 1e-4 * np.abs(ref))).max())
    progs = {m: next(iter(sess[m].programs.values())) for m in ("force", "off")}
    t = {"force": [], "off": [], "ort": []}

    def launch(m):
        prog = progs[m]
        ctx = prog.acquire()
        a = time.perf_counter()
        prog.launch(ctx)
        b = time.perf_counter()
        prog.release(ctx)
        return b - a

    for m in ("force", "off"):
        sess[m].run(None, feeds)
        launch(m)
    start = time.perf_counter()
    while len(t["ort"]) < reps or time.perf_counter() - start < min_seconds:
        t["force"].append(launch("force"))
        t["off"].append(launch("off"))
        a = time.perf_counter()
        s_ort.run(None, feeds)
        t["ort"].append(time.perf_counter() - a)
        if len(t["ort"]) >= 20 * reps:
            break
    med = {k: statistics.median(v) for k, v in t.items()}
    best = {k: min(v) for k, v in t.items()}
    return dict(med=med, best=best, errs=errs, path=_kernel_path(sess["force"]),
                auto=_kernel_path(sess["auto"]).split()[0],
                flops=2 * int(np.prod(ref.shape)) * int(np.prod(ws[1:])))


def main_winograd(args) -> None:
    print(f"cores={args.cores}; kernel medians of interleaved runs (ort: session.run); "
          f"x ~ {args.act}, He-init weights; err = max |d| / (1e-5 + 1e-4 |ort|) (<= 1 passes)")
    hdr = (f"{'layer':26s} {'N':>2s} {'wino ms':>8s} {'gemm ms':>8s} {'ort ms':>8s} "
           f"{'gemm/wino':>9s} {'ort/wino':>8s} {'best g/w':>8s} {'best o/w':>8s} "
           f"{'wino GF/s':>9s} "
           f"{'err':>5s} {'auto':>11s}  plan")
    print(hdr)
    print("-" * len(hdr))
    for batch in args.batch:
        for name, (_op, xs, ws, attrs) in WINOGRAD_SHAPES.items():
            if args.only and not any(s in name for s in args.only):
                continue
            r = bench_winograd(name, xs, ws, attrs, batch, args.cores, args.reps,
                               args.min_seconds, args.act)
            md, bs = r["med"], r["best"]
            print(f"{name:26s} {batch:2d} {md['force'] * 1e3:8.3f} {md['off'] * 1e3:8.3f} "
                  f"{md['ort'] * 1e3:8.3f} {md['off'] / md['force']:9.2f} "
                  f"{md['ort'] / md['force']:8.2f} {bs['off'] / bs['force']:8.2f} "
                  f"{bs['ort'] / bs['force']:8.2f} {r['flops'] / md['force'] / 1e9:9.1f} "
                  f"{r['errs']['force']:5.2f} {r['auto']:>11s}  {r['path']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--cores", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15, help="minimum timed calls per session")
    ap.add_argument("--min-seconds", type=float, default=0.5, help="minimum timing per shape")
    ap.add_argument("--only", nargs="*", default=[], help="substrings of shape names to run")
    ap.add_argument("--winograd", action="store_true",
                    help="ResNet-18 3x3 layers: Winograd vs implicit GEMM vs ort")
    ap.add_argument("--act", choices=["normal", "relu"], default="relu",
                    help="--winograd input distribution: N(0,1) or post-ReLU")
    args = ap.parse_args()
    if args.winograd:
        return main_winograd(args)

    print(f"cores={args.cores}  (ort intra_op_num_threads={args.cores}); "
          f"medians of interleaved calls;"
          f" ratio = ort / cannc (> 1: cannc faster)")
    hdr = f"{'shape':32s} {'N':>2s} {'cannc ms':>9s} {'ort ms':>9s} {'cannc GF/s':>10s} " \
          f"{'ort GF/s':>9s} {'ratio':>6s} {'best-ratio':>10s} {'kernel ms':>9s}"
    print(hdr)
    print("-" * len(hdr))
    ratios = []
    for batch in args.batch:
        for name, (op, xs, ws, attrs) in SHAPES.items():
            if args.only and not any(s in name for s in args.only):
                continue
            r = bench(name, op, xs, ws, attrs, batch, args.cores, args.reps, args.min_seconds)
            ratio = r["ort"] / r["cannc"]
            ratios.append(ratio)
            gf_c = f"{r['flops'] / r['cannc'] / 1e9:10.1f}" if r["flops"] else f"{'':10s}"
            gf_o = f"{r['flops'] / r['ort'] / 1e9:9.1f}" if r["flops"] else f"{'':9s}"
            print(f"{name:32s} {batch:2d} {r['cannc'] * 1e3:9.3f} {r['ort'] * 1e3:9.3f} "
                  f"{gf_c} {gf_o} "
                  f"{ratio:6.2f} {r['best_ort'] / r['best_cannc']:10.2f} {r['kernel'] * 1e3:9.3f}"
                  f"{'' if r['ok'] else '  MISMATCH'}", flush=True)
    if ratios:
        geo = float(np.exp(np.mean(np.log(ratios))))
        print(f"geometric mean ratio (ort / cannc): {geo:.2f}")


if __name__ == "__main__":
    main()
