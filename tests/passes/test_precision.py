"""Mixed precision: the pass's policy and rewrite, the options' errors, the accuracy guard,
save/load and the CLI. Kernel accuracy of the narrow contractions is tested by the codegen
tests; here the end-to-end results are checked against float32 by cosine and tolerance."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import pass_graph, run_pass
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.accuracy import output_error, search
from cannc.errors import CanncError, CompileError

R = np.random.default_rng(0)
F = TensorProto.FLOAT


def _mlp_nodes():
    return [helper.make_node("MatMul", ["x", "W1"], ["h1"], name="mm1"),
            helper.make_node("Add", ["h1", "b1"], ["h2"], name="bias1"),
            helper.make_node("Relu", ["h2"], ["h3"], name="relu"),
            helper.make_node("MatMul", ["h3", "W2"], ["h4"], name="mm2"),
            helper.make_node("Softmax", ["h4"], ["y"], name="sm", axis=-1)]


def _inits():
    return {"W1": (R.standard_normal((32, 48)) * 0.2).astype(np.float32),
            "b1": R.standard_normal(48).astype(np.float32),
            "W2": (R.standard_normal((48, 16)) * 0.2).astype(np.float32)}


def _model(nodes, inits, x_shape=("n", 32), y_shape=("n", 16), opset=17):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, list(x_shape))],
                          [helper.make_tensor_value_info("y", F, y_shape)],
                          [numpy_helper.from_array(a, k) for k, a in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


MLP = _model(_mlp_nodes(), _inits())


def _graph():
    return pass_graph(_mlp_nodes(), {"x": (np.float32, (4, 32))}, ["y"], _inits())


# -- the pass ------------------------------------------------------------------------

def test_fp32_is_the_default_and_changes_nothing():
    r = run_pass("mixed_precision", _graph())
    assert not r.changed
    assert r.before.ops == r.after.ops and r.before.values == r.after.values
    assert set(r.graph.meta["precision"].values()) == {"fp32"}


@pytest.mark.parametrize("precision,dtype", [("bf16", "bfloat16"), ("fp16", "float16")])
def test_policy_contractions_narrow_softmax_fp32_io_kept(precision, dtype):
    r = run_pass("mixed_precision", _graph(), precision=precision)
    g = r.graph
    assert r.changed
    assert g.meta["precision"] == {"mm1": precision, "bias1": precision, "relu": precision,
                                   "mm2": precision, "sm": "fp32"}
    # weights converted once, at compile time; the float32 originals are no longer read
    assert g.node("mm1").inputs[1] == f"W1::{precision}"
    assert g.constants[f"W1::{precision}"].dtype.name == dtype
    np.testing.assert_array_equal(g.constants[f"W1::{precision}"].astype(np.float32),
                                  g.constants["W1"].astype(dtype).astype(np.float32))
    # convert on load: the first MatMul reads the float32 input itself (no Cast in front)
    assert g.node("mm1").inputs[0] == "x" and g.node("mm1").attrs["cannc_precision"] == precision
    # convert on store: the MatMul before the float32 Softmax writes float32 itself
    assert np.dtype(g.values["h4"].dtype) == np.float32
    assert np.dtype(g.values["h3"].dtype).name == dtype
    assert [n.op_type for n in g.nodes()].count("Cast") == 0
    # the graph keeps its input and output types
    assert np.dtype(g.values["x"].dtype) == np.float32
    assert np.dtype(g.values["y"].dtype) == np.float32


def test_without_the_cast_rule_every_cast_is_a_node():
    g = run_pass("mixed_precision", _graph(), precision="bf16",
                 fusion={"precision_casts": False}).graph
    casts = [n for n in g.nodes() if n.op_type == "Cast"]
    assert len(casts) == 2              # x -> bf16 before mm1, h4 -> fp32 before Softmax
    assert g.node("mm1").inputs[0] == "x::bf16"


def test_keep_fp32_and_lists():
    g = run_pass("mixed_precision", _graph(), precision="bf16", keep_fp32=("mm1",)).graph
    # mm1 in float32: the elementwise ops after it follow it; mm2 is a contraction again
    assert g.meta["precision"] == {"mm1": "fp32", "bias1": "fp32", "relu": "fp32",
                                   "mm2": "bf16", "sm": "fp32"}
    g = run_pass("mixed_precision", _graph(), precision="bf16", deny=("MatMul",)).graph
    assert set(g.meta["precision"].values()) == {"fp32"}
    g = run_pass("mixed_precision", _graph(), precision="bf16", allow=("Softmax",)).graph
    assert g.meta["precision"]["sm"] == "bf16"
    assert np.dtype(g.values["y"].dtype) == np.float32        # output still float32


def test_graph_output_produced_narrow_keeps_its_name_and_type():
    nodes = _mlp_nodes()[:3]
    nodes[-1] = helper.make_node("Relu", ["h2"], ["y"], name="relu")
    g = pass_graph(nodes, {"x": (np.float32, (4, 32))}, ["y"],
                   {k: v for k, v in _inits().items() if k != "W2"})
    g = run_pass("mixed_precision", g, precision="bf16").graph
    assert g.outputs == ["y"] and np.dtype(g.values["y"].dtype) == np.float32
    assert g.producer("y").op_type == "Cast"


@pytest.mark.parametrize("opts,match", [
    ({"precision": "int8"}, "unknown precision 'int8'"),
    ({"precision": "bf16", "allow": ("NoSuchOp",)}, "unknown op type 'NoSuchOp'"),
    ({"precision": "bf16", "allow": ("Relu",), "deny": ("Relu",)}, "both"),
])
def test_pass_option_errors(opts, match):
    with pytest.raises(CompileError, match=match):
        run_pass("mixed_precision", _graph(), **opts)


@pytest.mark.parametrize("kw,match", [
    ({"precision": "fp8"}, "unknown precision 'fp8'; choose one of fp32, bf16, fp16"),
    ({"precision": "bf16", "precision_lists": {"never": ["Relu"]}}, "unknown precision list"),
    ({"precision": "bf16", "precision_lists": {"deny": ["Relux"]}}, "unknown op type 'Relux'"),
    ({"precision": "bf16", "keep_fp32": ["mm9"]}, "no node named 'mm9'"),
    ({"precision": "bf16", "accuracy": {"feeds": []}}, "non-empty list of feed dicts"),
    ({"precision": "bf16", "accuracy": {"feeds": [{}], "tol": 1}}, "unknown accuracy option"),
    ({"precision": "bf16", "accuracy": {"feeds": [{}], "metric": "l2"}}, "unknown accuracy metric"),
    ({"accuracy": {"feeds": [{"x": np.zeros((1, 32), np.float32)}]}}, "reduced precision"),
    ({"precision": "bf16", "accuracy": {"feeds": [{"x": np.zeros((1, 32), np.float32)},
                                                  {"x": np.zeros((1, 31), np.float32)}]}},
     r"accuracy\['feeds'\]\[1\]: input 'x' has shape \(1, 31\)"),
])
def test_compile_option_errors(kw, match):
    with pytest.raises(CanncError, match=match):
        cannc.compile(MLP, eager=False, **kw)


# -- end to end ----------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mlp_close_to_fp32_and_inspect_reports_every_node(precision):
    x = R.standard_normal((8, 32)).astype(np.float32)
    ref = cannc.compile(MLP).run(None, {"x": x})[0]
    s = cannc.compile(MLP, precision=precision)
    y = s.run(None, {"x": x})[0]
    assert y.dtype == np.float32
    e = output_error(y, ref)
    assert e["cosine"] > 0.999 and e["max_abs"] < 2e-2, e
    assert not np.array_equal(y, ref)             # really reduced
    rep = s.inspect({"x": (8, 32)}, without_fusion=False)
    assert rep["precision"] == {"mm1": precision, "bias1": precision, "relu": precision,
                                "mm2": precision, "sm": "fp32"}


def test_default_stays_fp32_exactly():
    x = R.standard_normal((8, 32)).astype(np.float32)
    a = cannc.compile(MLP).run(None, {"x": x})[0]
    b = cannc.compile(MLP, precision="fp32").run(None, {"x": x})[0]
    np.testing.assert_array_equal(a, b)
    assert set(cannc.compile(MLP).precision_map().values()) == {"fp32"}


def _planted():
    """mm1 -> +bias -> +3000 (planted: bf16 keeps ~3 significant digits of 3000+h) ->
    Transpose (a kernel of its own: the sum is stored) -> -3000 -> Relu -> mm2."""
    inits = {**_inits(), "big": np.array([3000.0], np.float32)}
    inits["W2"] = (R.standard_normal((48, 16)) * 0.2).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h1"], name="mm1"),
             helper.make_node("Add", ["h1", "b1"], ["h2"], name="bias1"),
             helper.make_node("Add", ["h2", "big"], ["h2b"], name="plant"),
             helper.make_node("Transpose", ["h2b"], ["t"], name="tr", perm=[1, 0]),
             helper.make_node("Sub", ["t", "big"], ["h2c"], name="unplant"),
             helper.make_node("Relu", ["h2c"], ["h3"], name="relu"),
             helper.make_node("Transpose", ["h3"], ["h3t"], name="tr2", perm=[1, 0]),
             helper.make_node("MatMul", ["h3t", "W2"], ["y"], name="mm2")]
    return _model(nodes, inits)


def test_guard_moves_only_the_planted_op():
    m = _planted()
    feeds = [{"x": R.standard_normal((8, 32)).astype(np.float32)} for _ in range(2)]
    plain = cannc.compile(m, precision="bf16")
    ref = cannc.compile(m)
    before = output_error(plain.run(None, feeds[0])[0], ref.run(None, feeds[0])[0])
    assert before["cosine"] < 0.99                   # the planted op really breaks bf16
    s = cannc.compile(m, precision="bf16", accuracy={"feeds": feeds, "rtol": 2e-2,
                                                     "atol": 2e-2})
    rep = s.accuracy_report
    assert rep["within_before"] is False and rep["within_after"] is True
    assert rep["moved_to_fp32"] == ["plant"]
    pm = s.precision_map()
    assert pm["plant"] == "fp32" and pm["mm1"] == "bf16" and pm["mm2"] == "bf16"
    for f in feeds:
        np.testing.assert_allclose(s.run(None, f)[0], ref.run(None, f)[0], rtol=2e-2,
                                   atol=2e-2)
    assert s.inspect({"x": (8, 32)}, without_fusion=False)["accuracy"] == rep


def test_guard_within_tolerance_moves_nothing():
    feeds = [{"x": R.standard_normal((4, 32)).astype(np.float32)}]
    s = cannc.compile(MLP, precision="bf16", accuracy={"feeds": feeds, "metric": "cosine",
                                                       "min_cosine": 0.99})
    assert s.accuracy_report["moved_to_fp32"] == [] and s.accuracy_report["trials"] == 1


def test_search_finds_each_culprit():
    cands = [f"n{i}" for i in range(40)]
    for culprits in ({"n3"}, {"n0", "n39"}, {"n7", "n8", "n30"}):
        seen: list[set[str]] = []

        def passes(keep, culprits=culprits, seen=seen):
            seen.append(keep)
            return culprits <= keep
        keep, trials, ok = search(cands, passes, budget=200)
        assert ok and set(keep) == culprits and trials == len(seen)
        assert trials <= 1 + len(culprits) * (1 + 6)


def test_save_load_keeps_precision_and_guard_choice(tmp_path):
    m = _planted()
    feeds = [{"x": R.standard_normal((8, 32)).astype(np.float32)}]
    s = cannc.compile(m, precision="bf16", shapes={"x": (8, 32)},
                      accuracy={"feeds": feeds, "rtol": 2e-2, "atol": 2e-2})
    s.save(tmp_path / "m.cnc")
    back = cannc.load(tmp_path / "m.cnc")
    np.testing.assert_array_equal(back.run(None, feeds[0])[0], s.run(None, feeds[0])[0])
    assert back.precision_map() == s.precision_map()
    assert back.accuracy_report == s.accuracy_report
    assert back.accuracy_report["moved_to_fp32"] == ["plant"]


def test_cli_compile_precision_with_accuracy_feeds(tmp_path, capsys):
    from cannc.cli import main
    onnx.save(_planted(), tmp_path / "p.onnx")
    np.savez(tmp_path / "f.npz", **{f"{i}/x": R.standard_normal((8, 32)).astype(np.float32)
                                    for i in range(2)})
    rc = main(["compile", str(tmp_path / "p.onnx"), "-o", str(tmp_path / "p.cnc"),
               "--precision", "bf16", "--shape", "x=8x32", "--accuracy-feeds",
               str(tmp_path / "f.npz"), "--rtol", "0.02", "--atol", "0.02"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "moved 1 node(s) to fp32 (plant)" in out and "precision: bf16" in out
    rc = main(["inspect", str(tmp_path / "p.cnc"), "--shape", "x=8x32"])
    assert rc == 0 and "fp32 5 node(s): plant, tr, unplant, relu, tr2" in capsys.readouterr().out


def test_bf16_new_sequence_lengths_generate_no_code():
    """Narrow GEMMs (AMX tiles where the CPU has them, else gemm.py) are shape-polymorphic
    like float32 ones: after the first shape, new batch/sequence sizes compile nothing."""
    from cannc.codegen.amx import amx_usable
    from cannc.compiler import codegen_counts

    nodes = _mlp_nodes()[:4]
    nodes[-1] = helper.make_node("MatMul", ["h3", "W2"], ["y"], name="mm2")
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["b", "s", 32])],
                          [helper.make_tensor_value_info("y", F, ["b", "s", 16])],
                          [numpy_helper.from_array(a, k) for k, a in _inits().items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    ref, s = cannc.compile(m), cannc.compile(m, precision="bf16")
    for i, shp in enumerate([(1, 7), (2, 33), (3, 70), (1, 129)]):
        x = R.standard_normal(shp + (32,)).astype(np.float32)
        before = codegen_counts()
        y = s.run(None, {"x": x})[0]
        if i:
            assert codegen_counts() == before, shp
        e = output_error(y, ref.run(None, {"x": x})[0])
        assert e["cosine"] > 0.9995 and e["max_abs"] < 3e-2, (shp, e)
    ks = s.inspect({"x": (2, 33, 32)}, without_fusion=False)["kernels"]
    assert [k["shape_polymorphic"] for k in ks] == [True, True]
    want = "bf16 AMX" if amx_usable() is None else "bf16"
    assert all(k["notes"]["precision"].startswith(want) for k in ks), ks


def test_cpu_without_bf16_instructions_runs_bf16_widened(tmp_path):
    """CANNC_ISA=avx512-nobf16 (no avx512_bf16, avx512_fp16, AMX): the bf16 model still
    runs, on fp32 FMA with bf16 widened in registers, and inspect says so."""
    import json
    import os
    import subprocess
    import sys

    onnx.save(MLP, tmp_path / "mlp.onnx")
    code = (
        "import json, sys, numpy as np, cannc\n"
        "x = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)\n"
        "ref = cannc.compile(sys.argv[1]).run(None, {'x': x})[0]\n"
        "s = cannc.compile(sys.argv[1], precision='bf16')\n"
        "y = s.run(None, {'x': x})[0]\n"
        "ks = s.inspect({'x': (8, 32)}, without_fusion=False)['kernels']\n"
        "print(json.dumps({'err': float(np.abs(y - ref).max()),"
        " 'notes': [k['notes'].get('precision') for k in ks]}))\n")
    env = {**os.environ, "CANNC_ISA": "avx512-nobf16",
           "CANNC_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "mlp.onnx")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["err"] < 2e-2
    gemms = [n for n in res["notes"] if n is not None]
    assert len(gemms) == 2 and all("widened" in n for n in gemms), res["notes"]


@pytest.mark.parametrize("elem", [TensorProto.BFLOAT16, TensorProto.FLOAT16])
def test_narrow_value_widened_into_a_softmax_prologue(elem):
    """A Cast from bfloat16/float16 to float32 feeding Softmax fuses into its prologue
    (the fused kernel widens the bits as expressions hold them)."""
    import ml_dtypes

    g = helper.make_graph([helper.make_node("Cast", ["x"], ["c"], to=F),
                           helper.make_node("Mul", ["c", "c"], ["c2"]),
                           helper.make_node("Softmax", ["c2"], ["y"], axis=-1)], "g",
                          [helper.make_tensor_value_info("x", elem, ["n", 16])],
                          [helper.make_tensor_value_info("y", F, ["n", 16])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    s = cannc.compile(m)
    dt = ml_dtypes.bfloat16 if elem == TensorProto.BFLOAT16 else np.float16
    x = R.standard_normal((4, 16)).astype(dt)
    xf = x.astype(np.float32) ** 2
    ref = np.exp(xf - xf.max(-1, keepdims=True))
    np.testing.assert_allclose(s.run(None, {"x": x})[0], ref / ref.sum(-1, keepdims=True),
                               rtol=1e-5, atol=1e-6)
    ks = s.inspect({"x": (4, 16)}, without_fusion=False)["kernels"]
    assert [k["op_types"] for k in ks] == [["Cast", "Mul", "Softmax"]]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nodes_that_do_not_run_are_reported_folded(precision):
    nodes = [helper.make_node("Identity", ["x"], ["xi"], name="ident"),
             helper.make_node("Shape", ["xi"], ["shp"], name="shape"),
             helper.make_node("Reshape", ["xi", "shp"], ["xr"], name="reshape"),
             *_mlp_nodes()]
    nodes[3] = helper.make_node("MatMul", ["xr", "W1"], ["h1"], name="mm1")
    s = cannc.compile(_model(nodes, _inits()), precision=precision)
    pm = s.inspect({"x": (4, 32)}, without_fusion=False)["precision"]
    assert pm["ident"] == pm["shape"] == "folded"
    assert pm["mm1"] == precision and pm["sm"] == "fp32"
