"""1 -> 2 AI Cores on compute-heavy models, cannc and onnxruntime side by side.

    python benchmarks/scaling_bench.py [--runs 10]

Models: a ResNet-18-style CNN (64..512 channels, 2 blocks per stage, 112x112,
batch 8) and a BERT-base-width encoder (768 hidden, 12 heads, 4 layers, batch 4,
sequence 128), both from models/zoo.py. Prints medians at 1 and 2 threads, the
speed-up of each, and the cannc/onnxruntime ratio. Run it on a quiet machine:
anything else running halves the second core.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cannc
from cannc.sidebyside import bench_interleaved, ort_session
from models import zoo


def cases():
    cnn = zoo.resnet(channels=(64, 128, 256, 512), blocks_per_stage=2, image_size=112)
    yield "resnet18-style b8 112x112", cnn, zoo.example_inputs(cnn, batch=8)
    enc = zoo.bert(hidden=768, num_layers=4, num_heads=12, intermediate=3072,
                   vocab_size=30522, max_position=512)
    yield "bert-base-width 4 layers b4 s128", enc, zoo.example_inputs(enc, batch=4, seq=128)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    for name, model, feeds in cases():
        res = {}
        for cores in (1, 2):
            sess = cannc.compile(model, cores=cores, shapes={k: v.shape for k, v in feeds.items()})
            ort = ort_session(model.SerializeToString(), cores, spinning=False)
            res[cores] = bench_interleaved(sess, ort, feeds, 3, args.runs)
        c1, c2 = (res[c]["cannc"]["median_ms"] for c in (1, 2))
        o1, o2 = (res[c]["ort"]["median_ms"] for c in (1, 2))
        print(f"{name}: cannc {c1:.2f} -> {c2:.2f} ms (x{c1 / c2:.2f}); onnxruntime "
              f"{o1:.2f} -> {o2:.2f} ms (x{o1 / o2:.2f}); cannc/ort {c1 / o1:.3f} at 1 thread, "
              f"{c2 / o2:.3f} at 2")


if __name__ == "__main__":
    main()
