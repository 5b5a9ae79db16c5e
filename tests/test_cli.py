"""The `cannc` command line, called in-process: each verb on the zoo mlp and on small graphs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.cli import main
from cannc.errors import CanncError
from models import zoo
from tests.helpers import ort_run

ROOT = Path(__file__).resolve().parents[1]


def _model(nodes, inputs, outputs, inits=(), opsets=(("", 17),)) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    m.ir_version = 9
    onnx.checker.check_model(m)
    return m


def _save(m: onnx.ModelProto, path: Path) -> str:
    onnx.save(m, str(path))
    return str(path)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> str:
    return str(zoo.save("mlp", tmp_path_factory.mktemp("zoo")))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    """x[batch, 64] -> MatMul + Add -> Relu -> Gemm -> Mul: elementwise ops + contractions."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("W1", (64, 128)), ("B1", (128,)), ("W2", (128, 16)))]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "B1"], ["h2"], name="add1"),
             helper.make_node("Relu", ["h2"], ["h3"], name="relu1"),
             helper.make_node("Gemm", ["h3", "W2"], ["y"], name="gemm2"),
             helper.make_node("Mul", ["y", "y"], ["z"], name="square")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
               [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 16])], inits)
    return _save(m, tmp_path_factory.mktemp("small") / "small.onnx")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> str:
    """Float, int64 and bool inputs sharing the symbolic dim 'n'."""
    T = TensorProto
    nodes = [helper.make_node("Add", ["a", "a"], ["a2"], name="fadd"),
             helper.make_node("Add", ["i", "i"], ["i2"], name="iadd"),
             helper.make_node("Not", ["b"], ["nb"], name="not"),
             helper.make_node("Neg", ["a"], ["dead"], name="dead_neg")]  # nothing reads it
    m = _model(nodes, [helper.make_tensor_value_info("a", T.FLOAT, ["n", 4]),
                       helper.make_tensor_value_info("i", T.INT64, ["n"]),
                       helper.make_tensor_value_info("b", T.BOOL, ["n", 2])],
               [helper.make_tensor_value_info("a2", T.FLOAT, ["n", 4]),
                helper.make_tensor_value_info("i2", T.INT64, ["n"]),
                helper.make_tensor_value_info("nb", T.BOOL, ["n", 2])])
    return _save(m, tmp_path_factory.mktemp("mixed") / "mixed.onnx")


@pytest.fixture(scope="module")
def unsupported(tmp_path_factory) -> str:
    """Two Det nodes (no lowering) and a custom-domain op, beside a Shape/Constant chain."""
    T = TensorProto
    nodes = [helper.make_node("Det", ["x"], ["d1"], name="det_a"),
             helper.make_node("Det", ["x"], ["d2"], name="det_b"),
             helper.make_node("Add", ["d1", "d2"], ["dd"], name="add0"),
             helper.make_node("Shape", ["x"], ["s"], name="shape0"),
             helper.make_node("Constant", [], ["c"], name="const0",
                              value=numpy_helper.from_array(np.array([-1], np.int64))),
             helper.make_node("Reshape", ["x", "c"], ["flat"], name="reshape0"),
             helper.make_node("FancyOp", ["flat"], ["o"], name="fancy0", domain="com.acme")]
    m = _model(nodes, [helper.make_tensor_value_info("x", T.FLOAT, [3, 3])],
               [helper.make_tensor_value_info("dd", T.FLOAT, []),
                helper.make_tensor_value_info("o", T.FLOAT, [9]),
                helper.make_tensor_value_info("s", T.INT64, [2])],
               opsets=(("", 17), ("com.acme", 1)))
    return _save(m, tmp_path_factory.mktemp("unsupported") / "unsupported.onnx")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- compile / run -------------------------------------------------------------------------

def test_compile_then_run_cnc_with_check(mlp, tmp_path, capsys):
    cnc = str(tmp_path / "mlp.cnc")
    rc, out, err = _run(capsys, "compile", mlp, "-o", cnc, "--cores", "2", "--shape", "x=3x256")
    assert rc == 0, err
    for phrase in ("kernel(s)", "x=3x256", "hit(s)", "miss(es)", "arena", "weights"):
        assert phrase in out
    rc, out, err = _run(capsys, "run", cnc, "--check", "--cores", "2")
    assert rc == 0, err
    assert "x=3x256" in out               # the shapes the artifact was compiled for
    assert "includes compiling" not in out  # loaded, not recompiled
    assert "logits" in out and "float32[3, 10]" in out
    assert "PASS" in out and "FAIL" not in out


def test_run_inputs_from_files_and_save_outputs(small, tmp_path, capsys):
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    rc, out, err = _run(capsys, "run", small, "--input", f"x={tmp_path / 'x.npy'}",
                        "--save-outputs", str(tmp_path / "outs"), "--check")
    assert rc == 0, err
    assert "x=5x64" in out and "PASS" in out
    got = np.load(tmp_path / "outs" / "z.npy")
    np.testing.assert_allclose(got, ort_run(onnx.load(small), {"x": x})[0], rtol=1e-4,
                               atol=1e-4)


def test_run_random_int_bool_inputs_bind_symbolic_dims(mixed, capsys):
    # only 'a' is given a shape: 'n' = 3 must reach 'i' and 'b' too
    rc, out, err = _run(capsys, "run", mixed, "--shape", "a=3x4", "--int-high", "5", "--check")
    assert rc == 0, err
    assert "i=3" in out and "b=3x2" in out
    assert "int64[3]" in out and "bool[3, 2]" in out and "PASS" in out


def test_run_check_reports_mismatch_with_exit_1(small, capsys, monkeypatch):
    real = cannc.Session.run
    monkeypatch.setattr(cannc.Session, "run",
                        lambda self, names, feeds, *a: [o + 1e-2 for o in real(self, names, feeds)])
    rc, out, _ = _run(capsys, "run", small, "--check")
    assert rc == 1
    assert "FAIL" in out and "'z'" in out


def test_compile_dump_after(small, tmp_path, capsys):
    rc, out, err = _run(capsys, "compile", small, "-o", str(tmp_path / "s.cnc"),
                        "--dump-after", "dce")
    assert rc == 0, err
    assert "IR after pass 'dce'" in out and "# mm1" in out
    rc, _, err = _run(capsys, "compile", small, "-o", str(tmp_path / "s.cnc"),
                      "--dump-after", "no_such_pass")
    assert rc == 2 and "unknown pass" in err and "dce" in err


# -- inspect -------------------------------------------------------------------------------

def test_inspect_json_matches_session(mlp, capsys):
    rc, out, err = _run(capsys, "inspect", mlp, "--json", "--shape", "x=2x256")
    assert rc == 0, err
    rep = json.loads(out)
    for key in ("num_kernels", "intermediate_bytes_written", "kernels", "memory", "passes",
                "total_flops"):
        assert key in rep
    assert set(rep["memory"]) >= {"arena_bytes", "naive_bytes", "lower_bound_bytes",
                                  "weights_bytes"}
    sess = cannc.compile(mlp, shapes={"x": (2, 256)})
    spec = sess.specializations[0]
    assert rep["num_kernels"] == len(spec.kernels) == len(rep["kernels"])
    for k, ref in zip(rep["kernels"], spec.kernels):
        assert k["nodes"] == ref.nodes
        assert {"flops", "bytes_read", "bytes_written"} <= set(k)
    assert rep["total_flops"] == sum(k["flops"] for k in rep["kernels"])
    # the classifier GEMM alone: 2 * M * N * K
    assert rep["total_flops"] >= 2 * 2 * 256 * 1024
    # only the logits are a graph output; everything else written is an intermediate
    out_bytes = 2 * 10 * 4
    assert rep["intermediate_bytes_written"] == \
        sum(k["bytes_written"] for k in rep["kernels"]) - out_bytes
    mem = rep["memory"]
    assert mem["lower_bound_bytes"] <= mem["arena_bytes"] <= mem["naive_bytes"]
    assert mem["weights_bytes"] >= 4 * (256 * 1024 + 1024 * 1024 + 1024 * 10)
    # the MLP's GEMMs read their row count (M = batch) at run time
    gemms = [k for k in rep["kernels"] if "MatMul" in k["op_types"]]
    assert gemms and all(k["shape_polymorphic"] and 2 in k["runtime_dims"] for k in gemms)


def test_inspect_human_table(small, capsys):
    rc, out, err = _run(capsys, "inspect", small, "--shape", "x=4x64")
    assert rc == 0, err
    header = out.splitlines()[1]
    for col in ("symbol", "nodes", "FLOPs", "read", "written", "tiles", "shapes|tiling",
                "pred µs", "notes"):
        assert col in header
    assert "any: " in out and "take their sizes at run time" in out
    assert "cannc_k_" in out and "gemm=" in out and "gemm2" in out
    assert "arena" in out and "lower bound" in out and "infer_and_fold" in out


# -- check ---------------------------------------------------------------------------------

def test_check_supported_model_lists_every_node(mlp, capsys):
    rc, out, err = _run(capsys, "check", mlp)
    assert rc == 0, err
    for n in onnx.load(mlp).graph.node:
        assert n.name in out
    assert "0 unsupported" in out


def test_check_marks_dead_nodes_and_shape_errors(mixed, tmp_path, capsys):
    rc, out, err = _run(capsys, "check", mixed, "--json")
    assert rc == 0, err
    rows = {r["name"]: r for r in json.loads(out)["nodes"]}
    assert rows["dead_neg"]["status"] == "unused" and rows["fadd"]["status"] == "ok"
    assert rows["iadd"]["input_dtypes"] == ["int64", "int64"]

    w = numpy_helper.from_array(np.ones((32, 4), np.float32), "W")
    m = _model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm_3")],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    rc, out, _ = _run(capsys, "check", _save(m, tmp_path / "mismatch.onnx"))
    assert rc == 1
    assert "compile-time shape inference fails: ShapeError: MatMul at node 'mm_3'" in out


def test_check_unsupported_lists_all_with_names(unsupported, capsys):
    rc, out, err = _run(capsys, "check", unsupported)
    assert rc == 1, err
    lines = {ln.split()[1]: ln for ln in out.splitlines()[2:] if ln.strip()[:1].isdigit()}
    for name in ("det_a", "det_b", "fancy0"):
        assert "UNSUPPORTED" in lines[name]
    assert "com.acme" in lines["fancy0"]
    assert "folded" in lines["shape0"] and "folded" in lines["const0"]
    assert "view" in lines["reshape0"] and "UNSUPPORTED" not in lines["add0"]
    assert "3 unsupported" in out

    rc, out, _ = _run(capsys, "check", unsupported, "--json")
    rep = json.loads(out)
    assert rc == 1 and rep["supported"] is False
    bad = {r["name"]: r for r in rep["nodes"] if r["status"] == "unsupported"}
    assert set(bad) == {"det_a", "det_b", "fancy0"}
    assert bad["fancy0"]["domain"] == "com.acme" and bad["det_a"]["opset"] == 17
    assert bad["det_a"]["input_dtypes"] == ["float32"] and bad["det_a"]["reason"]


def test_check_malformed_model_exit_2(tmp_path, capsys):
    p = tmp_path / "junk.onnx"
    p.write_bytes(b"\x08\x07 definitely not protobuf \xff\xff")
    rc, out, err = _run(capsys, "check", str(p))
    assert rc == 2 and out == ""
    assert err.startswith("error: cannot read the model") and "Traceback" not in err


# -- bench / ops / plumbing ----------------------------------------------------------------

def test_bench_prints_ratio(small, capsys):
    rc, out, err = _run(capsys, "bench", small, "--runs", "3", "--warmup", "1", "--cores", "1")
    assert rc == 0, err
    assert "ratio cannc/ort" in out and "median ms" in out and "onnxruntime" in out
    assert "each engine in its own process" in out and "ORT CPU" in out
    assert "cannc alone" in out and "agree" in out and "ORT+cannc" not in out


def test_bench_json_every_engine_in_its_own_process(small, capsys, monkeypatch):
    import cannc.sidebyside as sbs
    pids = []
    real = sbs.run_worker

    def spy(engine, *a, **kw):
        rep = real(engine, *a, **kw)
        pids.append((engine, rep["pid"]))
        return rep
    monkeypatch.setattr(sbs, "run_worker", spy)
    rc, out, err = _run(capsys, "bench", small, "--runs", "3", "--warmup", "0", "--json",
                        "--shape", "x=2x64", "--ort-no-spin", "--rounds", "1")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["ratio"] > 0 and rep["runs"] == 3 and rep["ort_spinning"] is False
    assert set(rep["engines"]) == {"ort", "cannc"} and rep["input_shapes"] == {"x": [2, 64]}
    for eng in ("ort", "cannc"):
        r = rep[eng]
        assert r == rep["engines"][eng] and r["n"] == 3 and r["threads"] == rep["cores"]
        assert 0 < r["min_ms"] <= r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["checksums"][0]["name"] == "z" and r["checksums"][0]["shape"] == [2, 16]
    assert rep["ratios"]["ort"] == 1.0 and rep["ratios"]["cannc"] == rep["ratio"]
    assert rep["ort"]["spinning"] is False and rep["onnxruntime"] == rep["ort"]["version"]
    assert rep["outputs_agree"] is True and rep["outputs"]["cannc"]["ok"] is True
    assert rep["outputs"]["cannc"]["outputs"][0]["atol"] == 1e-5
    # each engine ran in a process of its own, not this one
    assert [e for e, _ in pids] == ["ort", "cannc"]
    assert len({p for _, p in pids} | {os.getpid()}) == 3


def test_bench_rounds_alternate_live_workers(small, capsys):
    rc, out, err = _run(capsys, "bench", small, "--runs", "5", "--warmup", "0", "--json",
                        "--rounds", "2", "--cores", "1")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["rounds"] == 2 and rep["outputs_agree"] is True
    for eng in ("ort", "cannc"):
        r = rep[eng]
        assert r["rounds"] == 2 and r["n"] == 5 and len(r["times_ms"]) == 5
        assert 0 < r["min_ms"] <= r["median_ms"]
    assert len({rep["ort"]["pid"], rep["cannc"]["pid"], os.getpid()}) == 3


def test_benchproc_serve_protocol():
    import io

    from cannc.benchproc import serve
    calls = []
    rep = serve({"engine": "x"}, lambda: calls.append(1), ["run 2\n", "run 1\n", "done\n"],
                io.StringIO())
    assert len(calls) == 2 + 1 + 2 and rep["n"] == 3 and rep["rounds"] == 2
    reply = io.StringIO()
    with pytest.raises(CanncError, match="expected 'run N' or 'done'"):
        serve({}, lambda: None, ["run 0\n"], reply)
    with pytest.raises(CanncError, match="closed the command pipe"):
        serve({}, lambda: None, ["run 1\n"], reply)
    assert json.loads(reply.getvalue())["times_ms"][0] >= 0


def test_served_worker_that_dies_names_engine_and_stderr(tmp_path):
    from cannc.sidebyside import ServedWorker, WorkerError
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '{\"status\": \"ready\"}'\nread line\n"
                    "echo 'Fatal Python error: Aborted' >&2\nexit 134\n")
    fake.chmod(0o755)
    w = ServedWorker("cannc", "m.onnx", "f.npz", threads=1, warmup=0, python=str(fake),
                     timeout=60)
    assert w.ready["status"] == "ready"
    with pytest.raises(WorkerError) as ei:
        w.run(3)
    w.close()
    assert "'cannc' (cannc alone) failed: exit code 134, no report" in str(ei.value)
    assert "Aborted" in str(ei.value)


def test_served_worker_that_hangs_times_out_with_its_stderr(tmp_path):
    from cannc.sidebyside import ServedWorker, WorkerError
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'loading the model' >&2\nsleep 30\n")
    fake.chmod(0o755)
    with pytest.raises(WorkerError) as ei:
        ServedWorker("ort", "m.onnx", "f.npz", threads=1, warmup=0, python=str(fake),
                     timeout=0.5)
    assert "timed out after 0.5 s" in str(ei.value) and "loading the model" in str(ei.value)


def test_bench_outputs_disagree_exit_1(small, capsys, monkeypatch):
    import cannc.sidebyside as sbs
    real = sbs.load_arrays

    def skewed(path):
        arrays = real(path)
        if "cannc" in Path(path).name:
            arrays = {k: v + 1.0 for k, v in arrays.items()}
        return arrays
    monkeypatch.setattr(sbs, "load_arrays", skewed)
    rc, out, err = _run(capsys, "bench", small, "--runs", "1", "--warmup", "0")
    assert rc == 1 and "DIFFER" in out and "values differ" in out
    assert "outputs differ" in err


def test_bench_failing_worker_is_a_clean_error(tmp_path, capsys):
    det = _model([helper.make_node("Det", ["x"], ["d"], name="det_a")],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                 [helper.make_tensor_value_info("d", TensorProto.FLOAT, [])])
    rc, out, err = _run(capsys, "bench", _save(det, tmp_path / "det.onnx"), "--runs", "1")
    assert rc == 2 and out == "" and "Traceback" not in err
    assert err.startswith("error: benchmark worker 'cannc' (cannc alone) failed: ")
    assert "det_a" in err and "Det" in err


def test_bench_worker_crash_names_engine_and_stderr(tmp_path):
    from cannc.sidebyside import WorkerError, run_worker
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'Fatal Python error: Segmentation fault' >&2\nexit 139\n")
    fake.chmod(0o755)
    with pytest.raises(WorkerError) as ei:
        run_worker("ort+cannc", "m.onnx", "f.npz", threads=1, warmup=0, runs=1,
                   python=str(fake))
    msg = str(ei.value)
    assert "'ort+cannc' (ORT+cannc) failed: exit code 139, no report" in msg
    assert "Segmentation fault" in msg and ei.value.engine == "ort+cannc"


def test_benchproc_worker_reports_one_json_line(small, tmp_path):
    from cannc.sidebyside import load_arrays, save_arrays
    feeds = {"x": np.ones((1, 64), np.float32)}
    save_arrays(tmp_path / "f.npz", feeds)
    p = subprocess.run([sys.executable, "-m", "cannc.benchproc", "--engine", "cannc",
                        "--model", small, "--feeds", str(tmp_path / "f.npz"), "--threads", "1",
                        "--warmup", "0", "--runs", "2", "--outputs", str(tmp_path / "o.npz")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 1
    rep = json.loads(lines[0])
    assert rep["status"] == "ok" and rep["engine"] == "cannc" and len(rep["times_ms"]) == 2
    got = load_arrays(tmp_path / "o.npz")["z"]
    assert np.allclose(got, ort_run(onnx.load(small), feeds)[0], rtol=1e-4, atol=1e-5)
    assert rep["checksums"][0]["sum"] == pytest.approx(float(got.astype(np.float64).sum()))
    p = subprocess.run([sys.executable, "-m", "cannc.benchproc", "--engine", "ort",
                        "--model", str(tmp_path / "absent.onnx"), "--feeds",
                        str(tmp_path / "f.npz"), "--threads", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    rep = json.loads(p.stdout)
    assert p.returncode == 1 and rep["status"] == "error" and "not found" in rep["error"]


def _ep_usable() -> str | None:
    """Why cannc's EP cannot be registered here (probed in a subprocess: a broken EP may
    abort the process), or None."""
    p = subprocess.run([sys.executable, "-c", "import cannc.ort as c; c.register()"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no message"])[-1]
        return f"cannc.ort cannot register here (exit {p.returncode}): {tail}"
    return None


def test_bench_ep_adds_ort_plus_cannc_with_assignment(small, capsys, monkeypatch):
    why = _ep_usable()
    if why:
        pytest.skip(why)
    rc, out, err = _run(capsys, "bench", small, "--runs", "2", "--warmup", "0", "--ep",
                        "--json", "--cores", "1")
    assert rc == 0, err
    rep = json.loads(out)
    assert set(rep["engines"]) == {"ort", "cannc", "ort+cannc"}
    a = rep["ort+cannc"]["assignment"]
    assert a["nodes"] > 0 and 0 < a["fraction"] <= 1 and a["cannc_nodes"] <= a["nodes"]
    assert "CanncExecutionProvider" in rep["ort+cannc"]["providers"]
    assert rep["outputs"]["ort+cannc"]["ok"] and rep["ratios"]["ort+cannc"] > 0
    # the table, from the same figures (no second run of three processes)
    import cannc.cli as cli
    monkeypatch.setattr(cli, "bench", lambda *a, **kw: {
        k: v for k, v in rep.items() if k not in ("model", "cores", "warmup", "runs")})
    rc, out, err = _run(capsys, "bench", small, "--runs", "2", "--warmup", "0", "--ep",
                        "--cores", "1")
    assert rc == 0, err
    a = rep["ort+cannc"]["assignment"]
    assert (f"{100 * a['fraction']:.1f}% of nodes ({a['cannc_nodes']}/{a['nodes']}) on "
            "CanncExecutionProvider") in out
    assert "ORT+cannc" in out and "ratio ORT+cannc/ORT CPU" in out and "cannc alone" in out


def test_bench_ep_refuses_options_the_ep_cannot_take(small, capsys):
    rc, out, err = _run(capsys, "bench", small, "--ep", "--no-fusion")
    assert rc == 2 and err.startswith("error: --ep:") and "Traceback" not in err


def test_ops(capsys):
    rc, out, _ = _run(capsys, "ops")
    assert rc == 0 and "MatMul" in out and "contraction" in out
    rc, out, _ = _run(capsys, "ops", "--json")
    assert {o["op"] for o in json.loads(out)} >= {"MatMul", "Gemm", "Add"}


def test_errors_print_message_and_exit_2(small, tmp_path, capsys):
    np.save(tmp_path / "x64.npy", np.zeros((2, 64), np.float64))
    cases = [
        (["run", str(tmp_path / "missing.onnx")], "model file not found"),
        (["run", small, "--input", f"x={tmp_path / 'x64.npy'}"], "has dtype float64"),
        (["run", small, "--input", f"y={tmp_path / 'x64.npy'}"], "unknown input(s) ['y']"),
        (["run", small, "--shape", "x=2x63"], "dimension 1 must be 64"),
        (["inspect", small, "--shape", "nope=1"], "unknown input(s) ['nope']"),
        (["run", small, "--input", f"x={tmp_path / 'absent.npy'}"], "cannot read input 'x'"),
    ]
    for argv, phrase in cases:
        rc, _, err = _run(capsys, *argv)
        assert rc == 2, argv
        assert err.startswith("error: ") and phrase in err, err
        assert "Traceback" not in err
    rc, _, err = _run(capsys, "--debug", "run", str(tmp_path / "missing.onnx"))
    assert rc == 2 and "Traceback" in err and "ModelError" in err


def test_usage_errors_and_version(capsys):
    assert main([]) == 2
    assert main(["run", "m.onnx", "--shape", "x=1xfoo"]) == 2
    assert main(["bench", "m.onnx", "--runs", "0"]) == 2
    assert "dims must be integers" in capsys.readouterr().err
    assert main(["--version"]) == 0
    assert cannc.__version__ in capsys.readouterr().out


def test_python_dash_m_cannc():
    r = subprocess.run([sys.executable, "-m", "cannc", "--version"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and cannc.__version__ in r.stdout


def test_float64_referee_judges_float32_disagreements(tmp_path):
    """Outputs that disagree beyond the float32 tolerance are judged against the model
    evaluated in float64 (initializers, Cast targets and Constant tensors widened): an
    engine whose error is float32 rounding is as close to it as onnxruntime's result; one
    off by more is not."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from cannc.sidebyside import float64_referee

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"]),
             helper.make_node("Constant", [], ["c"],
                              value=numpy_helper.from_array(np.float32([0.5]), "c")),
             helper.make_node("Mul", ["a", "c"], ["b"]),
             helper.make_node("Cast", ["b"], ["y"], to=TensorProto.FLOAT)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [8, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64])],
                          [numpy_helper.from_array(w, "w")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    exact = (x.astype(np.float64) @ w.astype(np.float64)) * 0.5
    f32 = ((x @ w) * np.float32(0.5)).astype(np.float32)
    r = float64_referee(str(path), {"x": x}, {"ort": {"y": f32}, "cannc": {"y": f32 + 1e-6}})
    assert r["available"] and r["cannc_as_close_as_ort"]
    assert r["engines"]["ort"]["max_abs"] == pytest.approx(np.abs(f32 - exact).max())
    r = float64_referee(str(path), {"x": x}, {"ort": {"y": f32}, "cannc": {"y": f32 + 1e-3}})
    assert not r["cannc_as_close_as_ort"]
    assert r["engines"]["cannc"]["max_abs"] > 100 * r["engines"]["ort"]["max_abs"]
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    assert not float64_referee(str(bad), {"x": x}, {"ort": {"y": f32}})["available"]
