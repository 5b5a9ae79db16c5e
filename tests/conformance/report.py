"""Conformance report: run every official ONNX node test case through cannc and print
pass / fail / expected-fail counts per op type and in total.

    python tests/conformance/report.py                  # every case
    python tests/conformance/report.py -k gather        # cases whose name contains 'gather'
    python tests/conformance/report.py --failures       # also list each failing case + error
    python tests/conformance/report.py --json out.json  # machine-readable results

Each case runs like tests/conformance/test_onnx_node.py runs it (same backend, same
comparison), in worker processes, so a crash in native code costs one case, not the
report. A case counts as:

  pass      every output matches the reference
  xfail     it fails and is listed (KNOWN_FAILURES, or an op missing from the registry)
  FAIL      it fails and is not listed (a bug, or a missing KNOWN_FAILURES entry)
  XPASS     it passes but is listed (the list must be updated)

"CNN/transformer ops" are the ops of CORE_OPS below: the ops that real convolutional
networks and transformers are built of (the subset the conformance issue tracks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# The ops of real CNNs and transformers (image classifiers, detectors' backbones,
# segmentation nets, BERT/GPT/ViT-style encoders and decoders, their exporters' glue).
CORE_OPS = frozenset("""
Abs Add And ArgMax ArgMin Attention AveragePool BatchNormalization Cast CastLike Ceil Celu Clip
Concat Constant ConstantOfShape Conv ConvTranspose Cos CumSum DepthToSpace DequantizeLinear Div
Dropout DynamicQuantizeLinear Einsum Elu Equal Erf Exp Expand Flatten Floor GRU Gather
GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalMaxPool Greater GreaterOrEqual
GroupNormalization HardSigmoid HardSwish Hardmax Identity InstanceNormalization IsInf IsNaN LRN LSTM
LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax LpNormalization MatMul MatMulInteger
Max MaxPool Mean Min Mish Mod Mul Neg Not OneHot Or PRelu Pad Pow QLinearConv QLinearMatMul
QuantizeLinear RMSNormalization RNN Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp
ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize
RotaryEmbedding ScatterElements ScatterND Selu Shape Sigmoid Sign Sin Size Slice Softmax Softplus
Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Swish Tanh Tile TopK Transpose Trilu Unsqueeze
Upsample Where Xor
""".split())


def case_ops(case) -> list[str]:
    return sorted({n.op_type for n in case.model.graph.node})


_ALIASES = {"batchnorm": "BatchNormalization", "instancenorm": "InstanceNormalization",
            "sce": "SoftmaxCrossEntropyLoss", "nllloss": "NegativeLogLikelihoodLoss",
            "training_dropout": "Dropout", "basic_conv": "Conv", "layer_norm": "LayerNormalization",
            "group_norm": "GroupNormalization", "rms_norm": "RMSNormalization",
            "basic_deform_conv": "DeformConv", "deform_conv": "DeformConv",
            "quantizelinear": "QuantizeLinear", "dequantizelinear": "DequantizeLinear",
            "simple_rnn": "RNN", "rnn_seq": "RNN", "gru": "GRU", "lstm": "LSTM",
            "cast_e8m0": "Cast", "cast_no_saturate": "Cast", "tfidfvectorizer": "TfIdfVectorizer",
            "ai_onnx_ml": None, "mvn": "MeanVarianceNormalization", "shape": "Shape",
            "sequence_model": None, "strnorm": "StringNormalizer",
            "strnormalizer": "StringNormalizer",
            "reduce_log_sum_exp": "ReduceLogSumExp", "logsoftmax": "LogSoftmax",
            "log_softmax": "LogSoftmax", "convtranspose": "ConvTranspose"}
_NAMES: dict[str, str] | None = None


def _op_names() -> dict[str, str]:
    global _NAMES
    if _NAMES is None:
        import re

        import onnx
        names: dict[str, str] = {}
        for sch in onnx.defs.get_all_schemas_with_history():
            op = sch.name
            snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", op).lower()
            names.setdefault(snake, op)
            names.setdefault(op.lower(), op)
        names.update({k: v for k, v in _ALIASES.items() if v})
        _NAMES = names
    return _NAMES


def case_op(case) -> str:
    """The op a case tests, from its name (test_reduce_sum_keepdims -> ReduceSum: the
    longest op name the case name starts with), else from its graph."""
    names = _op_names()
    body = case.name[len("test_"):] if case.name.startswith("test_") else case.name
    best = None
    for key, op in names.items():
        if body == key or body.startswith(key + "_"):
            if best is None or len(key) > len(best[0]):
                best = (key, op)
    if best is not None:
        return best[1]
    ops = [n.op_type for n in case.model.graph.node]
    if len(set(ops)) == 1:
        return ops[0]
    glue = {"Constant", "Cast", "Identity", "Reshape", "Shape", "Unsqueeze", "Squeeze",
            "Concat", "Gather", "Slice", "ConstantOfShape"}
    main = [o for o in ops if o not in glue] or ops
    return Counter(main).most_common(1)[0][0]


def _classify(msg: str) -> str:
    """A short category for a failure message."""
    m = msg
    if "ops not in cannc" in m or "no such op in cannc" in m:
        return "missing op"
    if "dtype" in m and "not supported" in m:
        return "unsupported dtype"
    if "UnsupportedOpError" in m or "cannot be compiled" in m:
        return "unsupported op variant"
    if "ShapeError" in m or "depends on data" in m or "data-dependent" in m:
        return "data-dependent shape"
    if "Mismatch" in m or "Not equal" in m or "not equal" in m or "AssertionError" in m:
        return "wrong result"
    if "crashed" in m:
        return "crash"
    return "error"


def run_one(case) -> tuple[str, str]:
    """('pass' | 'fail', message) for one case, run as the pytest test runs it."""
    import numpy as np  # noqa: F401
    import test_onnx_node as T
    try:
        T.run_case(case)
        return "pass", ""
    except BaseException as e:
        tb = traceback.format_exception_only(type(e), e)
        return "fail", "".join(tb).strip()[:2000]


def _worker(names: list[str], out_path: str) -> None:
    import warnings
    warnings.simplefilter("ignore")
    import test_onnx_node as T
    by_name = {c.name: c for c in T._cases()}
    with open(out_path, "a") as f:
        for nm in names:
            f.write(json.dumps({"start": nm}) + "\n")
            f.flush()
            t0 = time.perf_counter()
            status, msg = run_one(by_name[nm])
            f.write(json.dumps({"name": nm, "status": status, "msg": msg,
                                "secs": time.perf_counter() - t0}) + "\n")
            f.flush()


def _run_chunk(names: list[str], tmpdir: Path, idx: int) -> dict[str, dict]:
    """Run names in a subprocess; restart after a crash, charging the crash to one case."""
    results: dict[str, dict] = {}
    todo = list(names)
    attempt = 0
    while todo:
        out = tmpdir / f"chunk{idx}_{attempt}.jsonl"
        attempt += 1
        cmd = [sys.executable, __file__, "--worker", str(out)]
        p = subprocess.run(cmd, input="\n".join(todo), text=True, capture_output=True,
                           env=dict(os.environ, PYTHONWARNINGS="ignore"))
        started = None
        if out.exists():
            for line in out.read_text().splitlines():
                r = json.loads(line)
                if "start" in r:
                    started = r["start"]
                else:
                    results[r["name"]] = r
                    started = None
        done = set(results)
        if p.returncode != 0 and started is not None and started not in done:
            results[started] = {"name": started, "status": "fail", "secs": 0.0,
                                "msg": f"worker crashed (exit {p.returncode}): "
                                       f"{p.stderr.strip()[-500:]}"}
        elif p.returncode != 0 and started is None and not (set(todo) - set(results)) == set():
            # died between cases: report the remaining ones as crashed to avoid a loop
            for nm in todo:
                results.setdefault(nm, {"name": nm, "status": "fail", "secs": 0.0,
                                        "msg": f"worker crashed: {p.stderr.strip()[-500:]}"})
        todo = [n for n in todo if n not in results]
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only cases whose name contains this")
    ap.add_argument("-j", type=int, default=2, help="worker processes")
    ap.add_argument("--failures", action="store_true", help="list failing cases")
    ap.add_argument("--all-ops", action="store_true", help="a row per op, even all-pass ones")
    ap.add_argument("--json", help="write every case's result here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker([ln for ln in sys.stdin.read().splitlines() if ln], a.worker)
        return 0

    import tempfile
    import warnings
    warnings.simplefilter("ignore")
    import test_onnx_node as T

    cases = [c for c in T._cases() if a.k in c.name]
    missing = {c.name: T._missing_ops(c) for c in cases}
    runnable = [c.name for c in cases if not missing[c.name]]
    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as td:
        # interleave so that chunks get similar work
        chunks = [runnable[i::a.j] for i in range(a.j)]
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(a.j) as ex:
            for r in ex.map(lambda ic: _run_chunk(ic[1], Path(td), ic[0]), enumerate(chunks)):
                results.update(r)
    wall = time.perf_counter() - t0

    per_op: dict[str, Counter] = defaultdict(Counter)
    total, core = Counter(), Counter()
    reasons: Counter = Counter()
    rows = []
    for c in cases:
        op = case_op(c)
        listed = c.name in T.KNOWN_FAILURES
        if missing[c.name]:
            st, msg = "xfail", "ops not in cannc: " + ", ".join(missing[c.name])
            cat = "missing op"
        else:
            r = results[c.name]
            ok = r["status"] == "pass"
            msg = r.get("msg", "")
            if listed:
                st = "XPASS" if ok else "xfail"
                msg = T.KNOWN_FAILURES[c.name] if not ok else "listed but passes"
                cat = T.reason_category(T.KNOWN_FAILURES[c.name]) if not ok else ""
            else:
                st = "pass" if ok else "FAIL"
                cat = "" if ok else _classify(msg)
        if st == "xfail":
            reasons[cat] += 1
        per_op[op][st] += 1
        total[st] += 1
        if op in CORE_OPS:
            core[st] += 1
        rows.append({"name": c.name, "op": op, "status": st, "category": cat, "msg": msg,
                     "secs": results.get(c.name, {}).get("secs", 0.0)})

    def fmt(cn: Counter) -> str:
        n = sum(cn.values())
        return (f"{n:5d} cases: {cn['pass']:5d} pass  {cn['xfail']:4d} xfail  "
                f"{cn['FAIL']:4d} FAIL  {cn['XPASS']:3d} XPASS")

    print(f"{'op':32s} {'cases':>5s} {'pass':>5s} {'xfail':>5s} {'FAIL':>5s} {'XPASS':>5s}")
    for op in sorted(per_op):
        cn = per_op[op]
        if not a.all_ops and cn["pass"] == sum(cn.values()):
            continue
        print(f"{op:32s} {sum(cn.values()):5d} {cn['pass']:5d} {cn['xfail']:5d} "
              f"{cn['FAIL']:5d} {cn['XPASS']:5d}{'  *' if op in CORE_OPS else ''}")
    n_allpass = sum(1 for cn in per_op.values() if cn["pass"] == sum(cn.values()))
    print(f"({n_allpass} ops pass every case{'' if a.all_ops else ' and are not listed'}; "
          "* = CNN/transformer op)")
    print()
    print("expected failures by reason:")
    for cat, n in reasons.most_common():
        print(f"  {n:5d}  {cat}")
    print()
    print("all                  " + fmt(total))
    print("CNN/transformer ops  " + fmt(core))
    print(f"wall {wall:.1f} s for {len(runnable)} runnable cases, {a.j} workers")
    slow = sorted(rows, key=lambda r: -r["secs"])[:8]
    print("slowest: " + ", ".join(f"{r['name']} {r['secs']:.1f}s" for r in slow))
    if a.failures:
        print()
        for r in rows:
            if r["status"] in ("FAIL", "XPASS"):
                first = r["msg"].strip().splitlines()
                print(f"{r['status']} {r['name']} [{r['category']}]: "
                      f"{' | '.join(first[-3:])[:400]}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 1 if total["FAIL"] or total["XPASS"] else 0


if __name__ == "__main__":
    sys.exit(main())
