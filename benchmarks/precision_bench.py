"""Reduced precision, speed and accuracy: cannc fp32/bf16/fp16 beside onnxruntime fp32 and
OpenVINO f32/bf16, each engine in its own process.

    python benchmarks/precision_bench.py [--models minilm gpt2 resnet18 mlp | A.onnx ...]
        [--model-dir /tmp/torch_out] [--batch 1] [--seq 128] [--threads 1]
        [--warmup 5] [--runs 30] [--rounds 1] [--engines cannc ort openvino]
        [--precisions fp32 bf16 fp16] [--openvino-python /work/ovenv/bin/python]
        [--timeout 1800] [--out benchmarks/results/precision.json]

Models: names resolve in --model-dir (PyTorch exports with random weights from
benchmarks/export_torch_models.py: minilm = a MiniLM-sized sentence-transformer encoder
with mean pooling, bert = BERT-base, gpt2 = a GPT-2-small decoder, resnet18, mobilenet);
"mlp" is built here (models.zoo.mlp at 1024-4096-4096-1024, erf GELU); a path to an .onnx
file is taken as it is. Symbolic dims named batch/seq take --batch/--seq (any other symbolic
dim: batch if it is the first, else seq); integer ids are uniform in the range of the
embedding table they index, masks are ones, float inputs standard normal. The parent
generates the inputs once per model (.npz) and hands the same file to every worker.

Workers: one subprocess per engine x model x precision, all with the same thread count
(cannc: cores=THREADS; onnxruntime: intra_op_num_threads, ORT_ENABLE_ALL; OpenVINO:
INFERENCE_NUM_THREADS, PERFORMANCE_HINT LATENCY, the model reshaped to the input shapes).
cannc and onnxruntime run in this interpreter, OpenVINO in --openvino-python (a benchmark
rival only, never a cannc dependency; skipped with a note where it is absent). A worker
compiles, runs once (timed as the first run), warms up, then times --runs runs of one
inference each; it returns its times as JSON and its outputs as .npz. With --rounds R every
worker runs R times, interleaved with the others, and the times are pooled (drift on a
shared machine then hits every engine alike).

Reported per row: median, p10 and p90 (ms); accuracy of every output against onnxruntime
fp32 (max abs error, max rel error = max |d| / max(|ref|, 1e-3 max|ref|) so entries near
zero do not dominate, cosine similarity; the issue's bar is cosine >= 0.999 on every
output); speed-ups (> 1: the row is faster) of each reduced-precision row over cannc fp32,
onnxruntime fp32 and OpenVINO bf16, and their geometric means over the models. Timings on a
shared machine are noisy: compare ratios measured in one run, and repeat.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

ENGINES = ("cannc", "ort", "openvino")
PRECISIONS = ("fp32", "bf16", "fp16")
# which precisions each engine runs (onnxruntime's CPU provider has no real bf16/fp16 path)
ENGINE_PRECISIONS = {"cannc": ("fp32", "bf16", "fp16"), "ort": ("fp32",),
                     "openvino": ("fp32", "bf16")}
OV_HINT = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
MODEL_FILES = {"minilm": "minilm.onnx", "bert": "bert_base.onnx", "gpt2": "gpt2.onnx",
               "resnet18": "resnet18.onnx", "mobilenet": "mobilenet_v2.onnx"}
DEFAULT_MODELS = ["minilm", "gpt2", "resnet18", "mlp"]
COSINE_BAR = 0.999
UNAVAILABLE = "precision option not available"
# the speed references of a reduced-precision row: (engine, precision)
REFERENCES = {"cannc_fp32": ("cannc", "fp32"), "ort_fp32": ("ort", "fp32"),
              "openvino_bf16": ("openvino", "bf16")}


# ---------------------------------------------------------------------------
# pure parts: arguments, statistics, accuracy (tests/test_precision_bench.py)
# ---------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                    help=f"names ({', '.join([*MODEL_FILES, 'mlp'])}) or .onnx paths")
    ap.add_argument("--model-dir", default="/tmp/torch_out")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    ap.add_argument("--openvino-python", default="/work/ovenv/bin/python")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "precision.json"))
    args = ap.parse_args(argv)
    for name in ("batch", "seq", "threads", "runs", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def time_stats(times_ms: list[float]) -> dict[str, float]:
    """Median, p10, p90, min and count of per-run times in ms."""
    t = np.asarray(times_ms, dtype=np.float64)
    if t.size == 0:
        raise ValueError("no times")
    return {"median_ms": float(np.median(t)), "p10_ms": float(np.percentile(t, 10)),
            "p90_ms": float(np.percentile(t, 90)), "min_ms": float(t.min()), "n": int(t.size)}


def accuracy(out: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """One output against its reference, in float64: max abs error, max rel error (relative
    to max(|ref|, 1e-3 * max|ref|) elementwise) and cosine similarity of the flattened
    tensors. Identical tensors have cosine 1 (also all-zero ones); a shape mismatch or a
    non-finite value is reported, not hidden."""
    a = np.asarray(out).astype(np.float64)
    b = np.asarray(ref).astype(np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape {a.shape} != reference shape {b.shape}")
    if a.size == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "cosine": 1.0, "finite": True}
    finite = bool(np.isfinite(a).all())
    d = np.abs(a - b)
    scale = float(np.abs(b).max())
    floor = np.maximum(np.abs(b), 1e-3 * scale) if scale > 0 else np.ones_like(b)
    rel = d / floor
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 and nb == 0.0:
        cos = 1.0
    elif na == 0.0 or nb == 0.0 or not finite:
        cos = 0.0 if finite else float("nan")
    else:
        cos = float(np.dot(a.ravel(), b.ravel()) / (na * nb))
    return {"max_abs": float(d.max()), "max_rel": float(rel.max()), "cosine": cos,
            "finite": finite}


def accuracy_all(outs: dict[str, np.ndarray], refs: dict[str, np.ndarray]) -> dict:
    """Every reference output compared; the worst figures over outputs, and whether every
    output meets the cosine bar."""
    per = {}
    for name, ref in refs.items():
        if name not in outs:
            raise ValueError(f"output {name!r} missing (have {sorted(outs)})")
        per[name] = accuracy(outs[name], ref)
    cos = [p["cosine"] for p in per.values()]
    worst_cos = min(cos) if cos else 1.0
    return {"outputs": per,
            "max_abs": max((p["max_abs"] for p in per.values()), default=0.0),
            "max_rel": max((p["max_rel"] for p in per.values()), default=0.0),
            "cosine": worst_cos,
            "meets_bar": all(c >= COSINE_BAR for c in cos) and not any(math.isnan(c)
                                                                        for c in cos)}


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def speedups(rows: list[dict]) -> None:
    """Adds row["speedup"] = {reference: reference median / row median} to every successful
    row of a model (>1: the row is faster), against cannc fp32, onnxruntime fp32 and
    OpenVINO bf16 where those rows succeeded. The row itself is no reference of itself."""
    by = {}
    for r in rows:
        if r.get("status") == "ok":
            by[(r["model"], r["engine"], r["precision"])] = r["time"]["median_ms"]
    for r in rows:
        if r.get("status") != "ok":
            continue
        sp = {}
        for ref_name, (eng, prec) in REFERENCES.items():
            if (eng, prec) == (r["engine"], r["precision"]):
                continue
            ref = by.get((r["model"], eng, prec))
            if ref is not None:
                sp[ref_name] = ref / r["time"]["median_ms"]
        r["speedup"] = sp


def geomeans(rows: list[dict]) -> dict[str, dict[str, float | int]]:
    """Per engine/precision row kind and reference: the geometric mean of the speed-ups over
    the models where both ran, with the count."""
    out: dict[str, dict[str, float | int]] = {}
    kinds = sorted({(r["engine"], r["precision"]) for r in rows if r.get("speedup")})
    for eng, prec in kinds:
        g = {}
        for ref_name in REFERENCES:
            xs = [r["speedup"][ref_name] for r in rows
                  if (r["engine"], r["precision"]) == (eng, prec) and ref_name in r.get(
                      "speedup", {})]
            m = geomean(xs)
            if m is not None:
                g[ref_name] = m
                g[ref_name + "_n"] = len(xs)
        if g:
            out[f"{eng}_{prec}"] = g
    return out


def verdict(rows: list[dict], geo: dict) -> dict[str, dict]:
    """The issue's bars per reduced-precision cannc row kind that ran: geomean speed-up >= 1.6
    over cannc fp32, >= 1.0 over OpenVINO bf16, cosine >= COSINE_BAR on every output of
    every model (None where a figure is missing)."""
    out = {}
    for prec in ("bf16", "fp16"):
        mine = [r for r in rows if r["engine"] == "cannc" and r["precision"] == prec
                and r.get("status") == "ok"]
        if not mine:
            continue
        g = geo.get(f"cannc_{prec}", {})
        accs = [r.get("accuracy") for r in mine]
        out[prec] = {
            "vs_cannc_fp32_ge_1.6": (g["cannc_fp32"] >= 1.6) if "cannc_fp32" in g else None,
            "vs_openvino_bf16_ge_1.0": (g["openvino_bf16"] >= 1.0) if "openvino_bf16" in g
            else None,
            "cosine_all_models": None if any(a is None for a in accs) else all(
                a["meets_bar"] for a in accs),
            "models": len(mine)}
    return out


def plan(engines: list[str], precisions: list[str]) -> list[tuple[str, str]]:
    """The (engine, precision) workers to run per model, onnxruntime fp32 first (it is the
    accuracy reference and always runs)."""
    todo = [("ort", "fp32")]
    for eng in ENGINES:
        if eng not in engines:
            continue
        for prec in ENGINE_PRECISIONS[eng]:
            if prec in precisions and (eng, prec) not in todo:
                todo.append((eng, prec))
    return todo


def symbolic_dim(name: str, index: int, batch: int, seq: int) -> int:
    n = name.lower()
    if n in ("batch", "batch_size", "n", "b"):
        return batch
    if n in ("seq", "sequence", "sequence_length", "seq_len", "seqlen", "t"):
        return seq
    return batch if index == 0 else seq


# ---------------------------------------------------------------------------
# the parent: models and inputs
# ---------------------------------------------------------------------------

def build_mlp(path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import onnx

    from models import zoo
    onnx.save(zoo.mlp(in_features=1024, hidden=(4096, 4096), num_classes=1024), str(path))


def resolve_model(name: str, model_dir: str, tmp: Path) -> tuple[str, Path | None, str]:
    """(label, path or None, note)."""
    if name.endswith(".onnx"):
        p = Path(name)
        return p.stem, (p if p.exists() else None), "" if p.exists() else f"{p} not found"
    if name == "mlp":
        p = tmp / "mlp.onnx"
        if not p.exists():
            build_mlp(p)
        return name, p, ""
    if name not in MODEL_FILES:
        raise SystemExit(f"unknown model {name!r}: one of {', '.join([*MODEL_FILES, 'mlp'])} "
                         "or a path to an .onnx file")
    p = Path(model_dir) / MODEL_FILES[name]
    if not p.exists():
        return name, None, (f"{p} not found (python benchmarks/export_torch_models.py "
                            f"{model_dir} {name})")
    return name, p, ""


def _id_range(model, input_name: str) -> int:
    """The number of rows of the embedding tables an integer input indexes (the smallest,
    following Cast/Unsqueeze/Reshape on the way), else 2 for a mask-like input, else 100."""
    inits = {t.name: t for t in model.graph.initializer}
    consts = {}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = n.attribute[0].t
    tables = {**consts, **inits}
    frontier, seen, rows = {input_name}, set(), []
    while frontier:
        v = frontier.pop()
        seen.add(v)
        for n in model.graph.node:
            if v not in n.input:
                continue
            if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == v \
                    and n.input[0] in tables and len(tables[n.input[0]].dims) >= 1:
                rows.append(int(tables[n.input[0]].dims[0]))
            elif n.op_type in ("Cast", "Unsqueeze", "Reshape", "Flatten", "Squeeze",
                               "Identity") and n.input[0] == v:
                frontier |= set(n.output) - seen
    if rows:
        return min(rows)
    return 2 if "mask" in input_name.lower() else 100


def make_inputs(model, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The inputs of an ONNX model: ids in range, masks of ones, floats standard normal."""
    from onnx import helper
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        tt = inp.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        shape = [d.dim_value if d.HasField("dim_value") else
                 symbolic_dim(d.dim_param, i, batch, seq) for i, d in enumerate(tt.shape.dim)]
        if dtype.kind in "iu" and "mask" in inp.name.lower():
            arr = np.ones(shape, dtype)
        elif dtype.kind in "iu":
            arr = rng.integers(0, _id_range(model, inp.name), size=shape).astype(dtype)
        elif dtype == np.bool_:
            arr = np.ones(shape, np.bool_)
        else:
            arr = rng.standard_normal(shape).astype(dtype)
        feeds[inp.name] = arr
    return feeds


def machine_info() -> dict:
    sys.path.insert(0, str(ROOT))
    import llvmlite.binding as llvm

    from cannc.native.target import host
    from cannc.schedule.machine import model_name
    h = host()
    return {"cpu_model": model_name(), "llvm_cpu": llvm.get_host_cpu_name(),
            "features": {f: h.has(f) for f in ("avx512f", "avx512bf16", "avx512fp16",
                                               "amx-bf16", "amx-tile", "f16c")},
            "platform": platform.platform(), "python": platform.python_version()}


# ---------------------------------------------------------------------------
# workers (run as `python precision_bench.py --worker SPEC.json`)
# ---------------------------------------------------------------------------

def _to_savable(a) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind == "V" or a.dtype.name in ("bfloat16",) or a.dtype.name.startswith(
            "float8"):
        a = a.astype(np.float32)
    return a


def _timed(run, warmup: int, runs: int) -> tuple[float, list[float], object]:
    t = time.perf_counter()
    out = run()
    first = time.perf_counter() - t
    for _ in range(warmup):
        run()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - t))
    return first, times, out


def _worker_cannc(spec: dict, feeds: dict) -> tuple[dict, dict]:
    sys.path.insert(0, str(ROOT))
    import cannc
    from cannc import CanncError
    opts = {"cores": spec["threads"]}
    if spec["precision"] != "fp32":
        opts["precision"] = spec["precision"]
    t = time.perf_counter()
    try:
        sess = cannc.compile(spec["model"], **opts)
    except CanncError as e:
        msg = str(e)
        if "precision" in msg and "unknown option" in msg:
            return {"status": "skipped", "note": UNAVAILABLE}, {}
        raise
    compile_s = time.perf_counter() - t
    names = spec["output_names"]
    first, times, out = _timed(lambda: sess.run(None, feeds), spec["warmup"], spec["runs"])
    res = {"status": "ok", "compile_s": compile_s, "first_run_s": first, "times_ms": times,
           "version": cannc.__version__}
    try:   # how it ran: the node precisions and the kernels' precision notes
        rep = sess.inspect(without_fusion=False)
        prec = rep.get("precision")
        if isinstance(prec, dict):
            counts: dict[str, int] = {}
            for v in prec.values():
                counts[str(v)] = counts.get(str(v), 0) + 1
            res["node_precisions"] = counts
        notes: dict[str, int] = {}
        for k in rep.get("kernels", []):
            p = k.get("notes", {}).get("precision")
            if p:
                notes[str(p)] = notes.get(str(p), 0) + 1
        res["kernel_precision_notes"] = notes
        res["kernels"] = len(rep.get("kernels", []))
    except Exception as e:  # a report, not the measurement
        res["inspect_error"] = f"{type(e).__name__}: {e}"
    return res, dict(zip(names, out))


def _worker_ort(spec: dict, feeds: dict) -> tuple[dict, dict]:
    sys.path.insert(0, str(ROOT))
    import onnxruntime as ort

    from cannc.sidebyside import ort_session
    t = time.perf_counter()
    sess = ort_session(spec["model"], spec["threads"])
    compile_s = time.perf_counter() - t
    names = [o.name for o in sess.get_outputs()]
    first, times, out = _timed(lambda: sess.run(None, feeds), spec["warmup"], spec["runs"])
    return ({"status": "ok", "compile_s": compile_s, "first_run_s": first, "times_ms": times,
             "version": ort.__version__}, dict(zip(names, out)))


def _worker_openvino(spec: dict, feeds: dict) -> tuple[dict, dict]:
    import openvino as ov
    core = ov.Core()
    t = time.perf_counter()
    m = core.read_model(spec["model"])
    m.reshape({i.get_any_name(): list(feeds[i.get_any_name()].shape) for i in m.inputs
               if i.get_any_name() in feeds})
    cfg = {"INFERENCE_NUM_THREADS": spec["threads"], "PERFORMANCE_HINT": "LATENCY",
           "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": OV_HINT[spec["precision"]]}
    c = core.compile_model(m, "CPU", cfg)
    compile_s = time.perf_counter() - t
    req = c.create_infer_request()
    inputs = {i.get_any_name(): feeds[i.get_any_name()] for i in c.inputs}
    first, times, res = _timed(lambda: req.infer(inputs), spec["warmup"], spec["runs"])
    outs = {}
    ports = list(c.outputs)
    for k, name in enumerate(spec["output_names"]):
        port = next((p for p in ports if name in p.get_names()), ports[k] if k < len(ports)
                    else None)
        outs[name] = np.array(res[port], copy=True)
    used = c.get_property("INFERENCE_PRECISION_HINT")
    used = used.get_type_name() if hasattr(used, "get_type_name") else str(used)
    return ({"status": "ok", "compile_s": compile_s, "first_run_s": first, "times_ms": times,
             "version": ov.__version__, "precision_used": used,
             "note": f"INFERENCE_PRECISION_HINT={OV_HINT[spec['precision']]} (ran {used})"},
            outs)


def worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    with np.load(spec["inputs"], allow_pickle=False) as z:
        feeds = {k: z[k] for k in z.files}
    fn = {"cannc": _worker_cannc, "ort": _worker_ort, "openvino": _worker_openvino}[
        spec["engine"]]
    try:
        res, outs = fn(spec, feeds)
        if outs:
            np.savez(spec["outputs"], **{k: _to_savable(v) for k, v in outs.items()})
    except Exception as e:  # the parent records it and goes on
        res = {"status": "error", "note": f"{type(e).__name__}: {str(e)[:500]}",
               "traceback": traceback.format_exc()[-4000:]}
    Path(spec["result"]).write_text(json.dumps(res))
    return 0


# ---------------------------------------------------------------------------
# the parent: running the workers and reporting
# ---------------------------------------------------------------------------

def run_worker(python: str, spec: dict, timeout: float, threads: int) -> dict:
    Path(spec["result"]).unlink(missing_ok=True)
    sp = Path(spec["result"]).with_suffix(".spec.json")
    sp.write_text(json.dumps(spec))
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    try:
        p = subprocess.run([python, str(Path(__file__).resolve()), "--worker", str(sp)],
                           env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "note": f"timed out after {timeout:g} s"}
    try:
        return json.loads(Path(spec["result"]).read_text())
    except (OSError, ValueError):
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"status": "error", "note": f"worker exited {p.returncode}: " + " | ".join(tail)}


def _load_outputs(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _fmt(x, spec: str = "9.3f") -> str:
    """x formatted by spec ('9.3f': width 9), or '-' right-aligned to that width."""
    width = int(spec.split(".")[0]) if spec[:1].isdigit() else 0
    return "-".rjust(width) if x is None else format(x, spec)


def print_table(rows: list[dict], geo: dict) -> None:
    hdr = (f"{'model':<10} {'engine':<9} {'prec':<5} {'median':>9} {'p10':>9} {'p90':>9} "
           f"{'xC32':>6} {'xORT':>6} {'xOVbf':>6} {'max_abs':>9} {'max_rel':>9} "
           f"{'cosine':>9}  note")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        t = r.get("time", {})
        sp = r.get("speedup", {})
        acc = r.get("accuracy") or {}
        cos = acc.get("cosine")
        mark = "" if cos is None else (" " if acc.get("meets_bar") else "!")
        note = r.get("note", "")
        print(f"{r['model']:<10} {r['engine']:<9} {r['precision']:<5} "
              f"{_fmt(t.get('median_ms'), '9.3f')} {_fmt(t.get('p10_ms'), '9.3f')} "
              f"{_fmt(t.get('p90_ms'), '9.3f')} {_fmt(sp.get('cannc_fp32'), '6.2f')} "
              f"{_fmt(sp.get('ort_fp32'), '6.2f')} {_fmt(sp.get('openvino_bf16'), '6.2f')} "
              f"{_fmt(acc.get('max_abs'), '9.2e')} {_fmt(acc.get('max_rel'), '9.2e')} "
              f"{_fmt(cos, '9.6f')}{mark} {note}")
    print("times in ms; xC32/xORT/xOVbf: speed-up over cannc fp32 / onnxruntime fp32 / "
          f"OpenVINO bf16 (>1 faster); accuracy against onnxruntime fp32, '!' = cosine < "
          f"{COSINE_BAR}")
    for kind, g in geo.items():
        parts = [f"{ref} x{g[ref]:.2f} ({g[ref + '_n']} models)" for ref in REFERENCES
                 if ref in g]
        print(f"geomean {kind}: " + ", ".join(parts))
    for prec, v in verdict(rows, geo).items():
        def yn(x):
            return "n/a" if x is None else "yes" if x else "NO"
        print(f"bars, cannc {prec} ({v['models']} models): geomean >= 1.6x cannc fp32: "
              f"{yn(v['vs_cannc_fp32_ge_1.6'])}; >= OpenVINO bf16: "
              f"{yn(v['vs_openvino_bf16_ge_1.0'])}; cosine >= {COSINE_BAR} everywhere: "
              f"{yn(v['cosine_all_models'])}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    args = parse_args(argv)
    import onnx

    machine = machine_info()
    ov_python = args.openvino_python
    ov_note = ""
    if "openvino" in args.engines:
        if not Path(ov_python).exists():
            ov_note = f"OpenVINO skipped: {ov_python} not found"
        else:
            chk = subprocess.run([ov_python, "-c", "import openvino; print(openvino.__version__)"],
                                 capture_output=True, text=True)
            if chk.returncode != 0:
                ov_note = f"OpenVINO skipped: {ov_python} cannot import openvino"
            else:
                machine["openvino"] = chk.stdout.strip()
        if ov_note:
            print(ov_note)
    todo = plan(args.engines, args.precisions)
    print(f"CPU: {machine['cpu_model']} (LLVM {machine['llvm_cpu']}); threads {args.threads}; "
          f"batch {args.batch} seq {args.seq}; warmup {args.warmup}, runs {args.runs} x "
          f"rounds {args.rounds}", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="precision_bench_") as tmpd:
        tmp = Path(tmpd)
        for mname in args.models:
            label, path, note = resolve_model(mname, args.model_dir, tmp)
            if path is None:
                print(f"{label}: skipped, {note}")
                rows.append({"model": label, "engine": "-", "precision": "-",
                             "status": "skipped", "note": note})
                continue
            proto = onnx.load(str(path), load_external_data=False)
            feeds = make_inputs(proto, args.batch, args.seq, args.seed)
            out_names = [o.name for o in proto.graph.output]
            del proto
            inputs = tmp / f"{label}.inputs.npz"
            np.savez(inputs, **feeds)
            mrows = {}
            for rnd in range(args.rounds):
                for eng, prec in todo:
                    key = (eng, prec)
                    prev = mrows.get(key)
                    if prev is not None and prev["status"] != "ok":   # once is enough
                        continue
                    if eng == "openvino" and ov_note:
                        mrows[key] = {"status": "skipped", "note": ov_note}
                        continue
                    spec = {"engine": eng, "precision": prec, "model": str(path),
                            "inputs": str(inputs), "threads": args.threads,
                            "warmup": args.warmup, "runs": args.runs,
                            "output_names": out_names,
                            "outputs": str(tmp / f"{label}.{eng}.{prec}.out.npz"),
                            "result": str(tmp / f"{label}.{eng}.{prec}.r{rnd}.json")}
                    python = ov_python if eng == "openvino" else sys.executable
                    res = run_worker(python, spec, args.timeout, args.threads)
                    if prev is None:
                        res["outputs_file"] = spec["outputs"]
                        mrows[key] = res
                    elif res["status"] == "ok":
                        prev["times_ms"] += res["times_ms"]
                    else:
                        prev["note"] = (prev.get("note", "") + f" round {rnd}: "
                                        + res.get("note", "")).strip()
            ref_row = mrows.get(("ort", "fp32"), {})
            ref = _load_outputs(ref_row["outputs_file"]) if ref_row.get("status") == "ok" \
                else None
            if ref is None:
                print(f"  {label}: no accuracy figures, onnxruntime fp32 (the reference) "
                      "did not run")
            for (eng, prec), res in mrows.items():
                row = {"model": label, "engine": eng, "precision": prec,
                       "status": res["status"], "note": res.get("note", ""),
                       "shapes": {k: list(v.shape) for k, v in feeds.items()}}
                for k in ("compile_s", "first_run_s", "version", "precision_used",
                          "node_precisions", "kernel_precision_notes", "kernels",
                          "inspect_error", "traceback"):
                    if k in res:
                        row[k] = res[k]
                if res["status"] == "ok":
                    row["time"] = time_stats(res["times_ms"])
                    row["times_ms"] = res["times_ms"]
                    if ref is not None and (eng, prec) != ("ort", "fp32"):
                        try:
                            row["accuracy"] = accuracy_all(
                                _load_outputs(res["outputs_file"]), ref)
                        except (OSError, ValueError) as e:
                            row["accuracy_error"] = str(e)
                            row["note"] = (row["note"] + f" accuracy: {e}").strip()
                rows.append(row)
                t = row.get("time", {}).get("median_ms")
                print(f"  {label} {eng} {prec}: {row['status']}"
                      + (f" {t:.3f} ms" if t is not None else "")
                      + (f" ({row['note']})" if row["note"] else ""), flush=True)
    speedups(rows)
    geo = geomeans(rows)
    print()
    print_table(rows, geo)
    out = {"machine": machine, "settings": {k: v for k, v in vars(args).items()},
           "engines": [f"{e}_{p}" for e, p in todo], "rows": rows, "geomean_speedup": geo,
           "bars": verdict(rows, geo),
           "cosine_bar": COSINE_BAR, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
