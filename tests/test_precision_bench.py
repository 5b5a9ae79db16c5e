"""The pure parts of benchmarks/precision_bench.py: arguments, statistics, accuracy metrics,
speed-ups and inputs. No model is compiled and no worker is started."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "precision_bench.py"
_spec = importlib.util.spec_from_file_location("precision_bench", _PATH)
pb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pb)


def test_parse_args_defaults_and_errors():
    a = pb.parse_args([])
    assert a.models == ["minilm", "gpt2", "resnet18", "mlp"]
    assert (a.batch, a.seq, a.threads) == (1, 128, 1)
    assert a.engines == ["cannc", "ort", "openvino"]
    assert a.precisions == ["fp32", "bf16", "fp16"]
    a = pb.parse_args(["--models", "mlp", "x.onnx", "--threads", "2", "--precisions", "bf16",
                       "--openvino-python", "/nowhere/python", "--runs", "3"])
    assert a.models == ["mlp", "x.onnx"] and a.threads == 2 and a.runs == 3
    assert a.openvino_python == "/nowhere/python" and a.precisions == ["bf16"]
    for bad in (["--threads", "0"], ["--runs", "0"], ["--warmup", "-1"],
                ["--precisions", "int8"], ["--engines", "tvm"]):
        with pytest.raises(SystemExit):
            pb.parse_args(bad)


def test_plan_runs_the_reference_first_and_only_real_paths():
    assert pb.plan(["cannc", "ort", "openvino"], ["fp32", "bf16", "fp16"]) == [
        ("ort", "fp32"), ("cannc", "fp32"), ("cannc", "bf16"), ("cannc", "fp16"),
        ("openvino", "fp32"), ("openvino", "bf16")]
    # onnxruntime fp32 is the accuracy reference: always there; no ORT bf16 row
    assert pb.plan(["cannc"], ["bf16"]) == [("ort", "fp32"), ("cannc", "bf16")]


def test_accuracy_metrics():
    ref = np.array([[1.0, -2.0], [4.0, 0.0]], np.float32)
    a = pb.accuracy(ref.copy(), ref)
    assert a == {"max_abs": 0.0, "max_rel": 0.0, "cosine": pytest.approx(1.0), "finite": True}
    out = ref + np.array([[0.5, 0.0], [0.0, 0.002]], np.float32)
    a = pb.accuracy(out, ref)
    assert a["max_abs"] == pytest.approx(0.5)
    # 0.5 / |1| = 0.5; the zero entry is measured against 1e-3 * max|ref| = 0.004: 0.5
    assert a["max_rel"] == pytest.approx(0.5, rel=1e-5)
    r64, o64 = ref.astype(np.float64).ravel(), out.astype(np.float64).ravel()
    cos = r64 @ o64 / (np.linalg.norm(r64) * np.linalg.norm(o64))
    assert a["cosine"] == pytest.approx(cos, rel=1e-12) and a["cosine"] < 1.0
    assert pb.accuracy(-ref, ref)["cosine"] == pytest.approx(-1.0)
    z = np.zeros(3, np.float32)
    assert pb.accuracy(z, z)["cosine"] == 1.0
    assert pb.accuracy(np.ones(3), z)["cosine"] == 0.0
    bad = pb.accuracy(np.array([np.nan, 1.0]), np.array([1.0, 1.0]))
    assert not bad["finite"] and math.isnan(bad["cosine"])
    with pytest.raises(ValueError, match="shape"):
        pb.accuracy(np.zeros((2, 3)), np.zeros((3, 2)))


def test_accuracy_of_bf16_rounding_meets_the_bar_and_noise_does_not():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((64, 384)).astype(np.float32)
    rounded = ref.astype(ml_dtypes.bfloat16).astype(np.float32)
    acc = pb.accuracy_all({"out": rounded}, {"out": ref})
    assert acc["meets_bar"] and acc["cosine"] > 0.99999
    assert 0 < acc["max_abs"] <= 2.0 ** -8 * np.abs(ref).max()
    noisy = ref + rng.standard_normal(ref.shape).astype(np.float32)
    acc = pb.accuracy_all({"out": rounded, "b": ref}, {"out": noisy, "b": ref})
    assert not acc["meets_bar"] and acc["cosine"] < 0.8       # the worst output counts
    with pytest.raises(ValueError, match="missing"):
        pb.accuracy_all({}, {"out": ref})


def test_time_stats_speedups_geomeans():
    s = pb.time_stats([float(x) for x in range(1, 11)])
    assert s["median_ms"] == 5.5 and s["min_ms"] == 1.0 and s["n"] == 10
    assert s["p10_ms"] == pytest.approx(1.9) and s["p90_ms"] == pytest.approx(9.1)
    with pytest.raises(ValueError):
        pb.time_stats([])

    def row(model, eng, prec, ms, status="ok"):
        return {"model": model, "engine": eng, "precision": prec, "status": status,
                "time": {"median_ms": ms}}
    rows = [row("a", "ort", "fp32", 10.0), row("a", "cannc", "fp32", 8.0),
            row("a", "cannc", "bf16", 4.0), row("a", "openvino", "bf16", 5.0),
            row("b", "ort", "fp32", 20.0), row("b", "cannc", "fp32", 20.0),
            row("b", "cannc", "bf16", 5.0),
            {"model": "b", "engine": "openvino", "precision": "bf16", "status": "skipped"}]
    pb.speedups(rows)
    assert rows[2]["speedup"] == {"cannc_fp32": 2.0, "ort_fp32": 2.5, "openvino_bf16": 1.25}
    assert rows[6]["speedup"] == {"cannc_fp32": 4.0, "ort_fp32": 4.0}
    assert "cannc_fp32" not in rows[1]["speedup"]            # no reference of itself
    g = pb.geomeans(rows)["cannc_bf16"]
    assert g["cannc_fp32"] == pytest.approx(math.sqrt(8.0)) and g["cannc_fp32_n"] == 2
    assert g["openvino_bf16"] == pytest.approx(1.25) and g["openvino_bf16_n"] == 1
    assert pb.geomean([]) is None and pb.geomean([2.0, 8.0]) == pytest.approx(4.0)


def test_make_inputs_ids_in_range_masks_ones_dims():
    emb = numpy_helper.from_array(np.zeros((37, 4), np.float32), "emb")
    g = helper.make_graph(
        [helper.make_node("Cast", ["ids"], ["ids32"], to=TensorProto.INT32),
         helper.make_node("Gather", ["emb", "ids32"], ["h"]),
         helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
         helper.make_node("Unsqueeze", ["m", "ax"], ["m3"]),
         helper.make_node("Mul", ["h", "m3"], ["y0"]),
         helper.make_node("Add", ["y0", "x"], ["y"])], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "L", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])],
        [emb, numpy_helper.from_array(np.array([2], np.int64), "ax")])
    m = helper.make_model(g)
    f = pb.make_inputs(m, batch=3, seq=50, seed=1)
    assert f["ids"].shape == (3, 50) and f["ids"].dtype == np.int64
    assert f["ids"].min() >= 0 and f["ids"].max() < 37 and f["ids"].max() > 20
    assert (f["attention_mask"] == 1).all() and f["attention_mask"].shape == (3, 50)
    assert f["x"].shape == (3, 50, 4) and f["x"].dtype == np.float32     # N: batch, L: seq
    assert "emb" not in f and "ax" not in f
    again = pb.make_inputs(m, batch=3, seq=50, seed=1)
    assert all((again[k] == f[k]).all() for k in f)                      # one seed, one input


def test_fmt_and_savable():
    assert pb._fmt(None, "9.3f") == "        -" and pb._fmt(1.5, "6.2f") == "  1.50"
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.ones(3, ml_dtypes.bfloat16)
    assert pb._to_savable(a).dtype == np.float32
    assert pb._to_savable(np.ones(2, np.int64)).dtype == np.int64


def test_verdict_applies_the_issues_bars():
    def row(model, prec, ms, cos):
        return {"model": model, "engine": "cannc", "precision": prec, "status": "ok",
                "time": {"median_ms": ms},
                "accuracy": None if cos is None else {"meets_bar": cos >= pb.COSINE_BAR}}
    rows = [row("a", "fp32", 10.0, 1.0), row("a", "bf16", 5.0, 0.9995),
            row("b", "fp32", 10.0, 1.0), row("b", "bf16", 8.0, 0.99)]
    pb.speedups(rows)
    v = pb.verdict(rows, pb.geomeans(rows))
    assert set(v) == {"bf16"}                     # no fp16 row ran
    # geomean sqrt(2 * 1.25) = 1.58 < 1.6; model b misses the cosine bar; no OpenVINO row
    assert v["bf16"] == {"vs_cannc_fp32_ge_1.6": False, "vs_openvino_bf16_ge_1.0": None,
                         "cosine_all_models": False, "models": 2}
    rows[3]["time"]["median_ms"] = 5.0
    rows[3]["accuracy"]["meets_bar"] = True
    pb.speedups(rows)
    v = pb.verdict(rows, pb.geomeans(rows))["bf16"]
    assert v["vs_cannc_fp32_ge_1.6"] and v["cosine_all_models"]
