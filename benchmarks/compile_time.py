"""Compile time of a BERT-base-sized encoder: cold, warm, and a new input shape.

    python benchmarks/compile_time.py [--model PATH.onnx] [--layers 12] [--runs 3]
                                      [--json OUT.json]
    python benchmarks/compile_time.py --zoo mlp mobilenet gpt [--runs 3] [--json OUT.json]

Without --model it builds the zoo BERT at BERT-base size (hidden 768, 12 heads,
intermediate 3072, vocab 30522; --layers of them). Every measurement runs in a
fresh Python process (so nothing is cached in memory) against a fresh cache
directory for "cold" and the same directory again for "warm":

- cold: `cannc.compile(path)` + the first run at batch 1, seq 128 (code generated);
- warm: the same in a new process with the caches filled: a hit of the program cache
  (cannc.compiler.snapshot: nothing parsed or compiled);
- warm, objects only: the same with the program cache off (CANNC_PROGRAM_CACHE=0): the
  model parsed and every pass run, the code from the object cache and lowering memo;
- ORT: onnxruntime.InferenceSession(path) in a fresh process (its "compile");
- new shape: in the objects-only process, the first run at seq 77 and at batch 4 (no
  code should be generated: the counters of node lowerings and LLVM compiles
  are printed before and after; in the warm process these shapes, which the cold one
  ran, are program-cache hits too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import numpy as np
    import cannc
    from cannc.compiler import codegen_counts
    t1 = time.perf_counter()
    sess = cannc.compile(sys.argv[1])
    t2 = time.perf_counter()
    def feeds(b, s):
        ids = np.ones((b, s), np.int64)
        return {i.name: ids for i in sess.get_inputs()}
    sess.run(None, feeds(1, 128))
    t3 = time.perf_counter()
    c0 = codegen_counts()
    sess.run(None, feeds(1, 77))
    t4 = time.perf_counter()
    sess.run(None, feeds(4, 128))
    t5 = time.perf_counter()
    sess.run(None, feeds(4, 128))
    t6 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "compile_s": t2 - t1, "first_run_s": t3 - t2,
                      "counts_after_first": c0, "new_seq_first_run_s": t4 - t3,
                      "new_batch_first_run_s": t5 - t4, "steady_run_s": t6 - t5,
                      "counts_end": codegen_counts()}))
""")


ORT_CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import onnxruntime as ort
    t1 = time.perf_counter()
    ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
    print(json.dumps({"import_s": t1 - t0, "compile_s": time.perf_counter() - t1}))
""")


GENERIC_CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import numpy as np
    import cannc
    t1 = time.perf_counter()
    sess = cannc.compile(sys.argv[1])
    t2 = time.perf_counter()
    feeds = dict(np.load(sys.argv[1] + ".inputs.npz"))
    sess.run(None, feeds)
    print(json.dumps({"import_s": t1 - t0, "compile_s": t2 - t1,
                      "first_run_s": time.perf_counter() - t2}))
""")


def zoo_rows(names: list[str], runs: int, tmp: str) -> dict[str, list[dict]]:
    """Cold, warm (a program-cache hit), objects-only and onnxruntime session times of
    zoo models (their example inputs for the first run), each in a fresh process."""
    sys.path.insert(0, str(ROOT))
    from models import zoo
    out: dict[str, list[dict]] = {}
    for name in names:
        m = zoo.build(name)
        path = os.path.join(tmp, f"{name}.onnx")
        zoo.onnx.save(m, path)
        import numpy as np
        np.savez(path + ".inputs.npz", **zoo.example_inputs(m))
        rows = out[name] = []
        for i in range(runs):
            cache = os.path.join(tmp, f"cache-{name}{i}")
            r = {"cold": run_child(path, cache, GENERIC_CHILD),
                 "warm": run_child(path, cache, GENERIC_CHILD),
                 "warm_objects": run_child(path, cache, GENERIC_CHILD,
                                           CANNC_PROGRAM_CACHE="0"),
                 "ort": run_child(path, cache, ORT_CHILD)}
            rows.append(r)
            print(f"{name} run {i}: " + ", ".join(
                f"{k} {v['compile_s']:.3f} s" for k, v in r.items()), flush=True)
        med = {k: statistics.median(r[k]["compile_s"] for r in rows) for k in rows[0]}
        print(f"{name}: median cold {med['cold']:.2f} s, warm {med['warm']:.3f} s, objects "
              f"only {med['warm_objects']:.2f} s, ORT session {med['ort']:.3f} s: warm/ORT "
              f"{med['warm'] / med['ort']:.2f}; {_with_import(rows)}", flush=True)
    return out


def run_child(path: str, cache: str, code: str = CHILD, **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CANNC_PROGRAM_CACHE"}
    env.update(CANNC_CACHE_DIR=cache, PYTHONPATH=str(ROOT), **env_extra)
    out = subprocess.run([sys.executable, "-c", code, path], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="an ONNX encoder with input_ids/attention_mask inputs")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3, help="cold/warm pairs (medians reported)")
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--zoo", nargs="+", metavar="NAME",
                    help="instead: compile times of these zoo models (mlp, mobilenet, gpt...)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cannc-compile-time-") as tmp:
        if args.zoo:
            found = zoo_rows(args.zoo, args.runs, tmp)
            if args.json:
                Path(args.json).write_text(json.dumps({**_machine(), "zoo": found},
                                                      indent=1) + "\n")
            return 0
        path = args.model
        if path is None:
            sys.path.insert(0, str(ROOT))
            from models import zoo
            m = zoo.bert(hidden=768, num_layers=args.layers, num_heads=12, intermediate=3072,
                         vocab_size=30522, max_position=512)
            path = os.path.join(tmp, "bert_base.onnx")
            zoo.onnx.save(m, path)
        size = os.path.getsize(path)
        rows = []
        for i in range(args.runs):
            cache = os.path.join(tmp, f"cache{i}")
            cold = run_child(path, cache)
            warm = run_child(path, cache)
            objs = run_child(path, cache, CANNC_PROGRAM_CACHE="0")
            onnxrt = run_child(path, cache, ORT_CHILD)
            rows.append({"cold": cold, "warm": warm, "warm_objects": objs, "ort": onnxrt})
            print(f"run {i}: cold compile {cold['compile_s']:.2f} s + first run "
                  f"{cold['first_run_s']:.2f} s | warm compile {warm['compile_s']:.2f} s + first "
                  f"run {warm['first_run_s']:.2f} s | objects only {objs['compile_s']:.2f} s + "
                  f"{objs['first_run_s']:.2f} s | ORT session {onnxrt['compile_s']:.2f} s | "
                  f"new seq {objs['new_seq_first_run_s']:.2f} s, "
                  f"new batch {objs['new_batch_first_run_s']:.2f} s (steady "
                  f"{objs['steady_run_s']:.2f} s); lowerings/LLVM compiles "
                  f"{objs['counts_after_first']} -> {objs['counts_end']}", flush=True)

        def med(which: str, key: str) -> float:
            return _median(rows, which, key)

        print(f"model {Path(path).name} ({size / 2**20:.0f} MiB): median cold compile "
              f"{med('cold', 'compile_s'):.2f} s (+ first run {med('cold', 'first_run_s'):.2f} s), "
              f"warm compile {med('warm', 'compile_s'):.2f} s (+ first run "
              f"{med('warm', 'first_run_s'):.2f} s), objects only "
              f"{med('warm_objects', 'compile_s'):.2f} s "
              f"(+ {med('warm_objects', 'first_run_s'):.2f} s); ORT session "
              f"{med('ort', 'compile_s'):.2f} s; a new sequence length's first run"
              f" {med('warm_objects', 'new_seq_first_run_s'):.2f} s, a new batch's "
              f"{med('warm_objects', 'new_batch_first_run_s'):.2f} s; {_with_import(rows)}")
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"model": Path(path).name, "model_mib": size / 2**20, **_machine(),
                 "rows": rows}, indent=1) + "\n")
    return 0


def _median(rows: list[dict], which: str, key: str) -> float:
    """The median over the runs of one measurement of one process kind."""
    return statistics.median(r[which][key] for r in rows)


def _with_import(rows: list[dict]) -> str:
    """A fresh process's import + warm compile against import + ORT session creation:
    what a user's script or `cannc run` waits for before its first run."""
    imp, warm = _median(rows, "warm", "import_s"), _median(rows, "warm", "compile_s")
    ort_imp, ort = _median(rows, "ort", "import_s"), _median(rows, "ort", "compile_s")
    return (f"import cannc {imp:.2f} s + warm compile = {imp + warm:.2f} s against import "
            f"onnxruntime {ort_imp:.2f} s + session = {ort_imp + ort:.2f} s")


def _machine() -> dict:
    sys.path.insert(0, str(ROOT))
    from cannc.native.target import host
    from cannc.schedule.machine import family_model, model_name
    return {"cpu_model": model_name(), "llvm_cpu": host().cpu,
            "cpu_family_model": family_model(), "cores": os.cpu_count()}


if __name__ == "__main__":
    raise SystemExit(main())
