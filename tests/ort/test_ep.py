"""cannc as an ONNX Runtime plugin execution provider, end to end with the real onnxruntime:
zoo models through the EP equal ORT's CPU provider, the allow and deny lists, fallback of
what cannc does not support, EPContext round trips, many threads on one session, options."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import cannc.ort
from cannc.errors import CanncError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from models import zoo  # noqa: E402

EP = cannc.ort.EP_NAME
RTOL, ATOL = 1e-4, 1e-5


def _so(**config: str) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    for k, v in config.items():
        so.add_session_config_entry(k, v)
    return so


def _cpu(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _ep(model: onnx.ModelProto | str, so: ort.SessionOptions | None = None,
        **options) -> ort.InferenceSession:
    return cannc.ort.session(model, sess_options=so or _so(), **options)


def _same(got: list[np.ndarray], exp: list[np.ndarray], rtol=RTOL, atol=ATOL) -> None:
    assert len(got) == len(exp)
    for g, e in zip(got, exp):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)


def _fraction(sess: ort.InferenceSession) -> tuple[float, dict[str, list[str]]]:
    where = cannc.ort.assignment(sess)
    total = sum(len(v) for v in where.values())
    return len(where.get(EP, [])) / max(total, 1), where


@pytest.mark.parametrize("name", ["mlp", "resnet", "mobilenet", "bert", "gpt"])
def test_zoo_model_through_the_ep_equals_cpu(name):
    model = zoo.build(name)
    sess, cpu = _ep(model), _cpu(model)
    assert sess.get_providers()[0] == EP
    frac, where = _fraction(sess)
    assert frac >= 0.95, where
    shapes = [(1, 16), (2, 7)] if name in ("bert", "gpt") else [(1, 16), (3, 16)]
    for batch, seq in shapes:     # a second shape: symbolic dims take sizes at run time
        feeds = zoo.example_inputs(name, batch=batch, seq=seq, seed=batch + seq)
        _same(sess.run(None, feeds), cpu.run(None, feeds))


def _ops_on(sess: ort.InferenceSession) -> dict[str, list[str]]:
    """Op types per execution provider (ORT's graph, after its own level-1 rewrites)."""
    out: dict[str, list[str]] = {}
    for sub in sess.get_provider_graph_assignment_info():
        out.setdefault(sub.ep_name, []).extend(n.op_type for n in sub.get_nodes())
    return out


@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_allow_list_puts_only_matmul_on_cannc(name):
    model = zoo.build(name)
    sess = _ep(model, op_type_allow_list="MatMul")
    ops = _ops_on(sess)
    assert ops.get(EP) and set(ops[EP]) == {"MatMul"}
    assert "MatMul" not in ops["CPUExecutionProvider"]
    feeds = zoo.example_inputs(name, batch=2, seq=5)
    _same(sess.run(None, feeds), _cpu(model).run(None, feeds))


def test_deny_list_keeps_those_ops_on_ort():
    model = zoo.build("bert")
    sess = _ep(model, op_type_deny_list=["MatMul", "Softmax"])
    ops = _ops_on(sess)
    assert ops.get(EP) and not {"MatMul", "Softmax"} & set(ops[EP])
    assert {"MatMul", "Softmax"} <= set(ops["CPUExecutionProvider"])
    feeds = zoo.example_inputs("bert", batch=2, seq=5)
    _same(sess.run(None, feeds), _cpu(model).run(None, feeds))


def _det_model() -> onnx.ModelProto:
    """Relu -> Det (cannc has no Det) -> Mul(relu, det): Relu and Mul must not be fused
    into one group (a path between them leaves the group)."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Det", ["r"], ["d"], name="det"),
             helper.make_node("Mul", ["r", "d"], ["m"], name="mul"),
             helper.make_node("Tanh", ["m"], ["y"], name="tanh")]
    g = helper.make_graph(nodes, "det", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                        [4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_unsupported_node_falls_back_to_ort_and_groups_stay_convex():
    model = _det_model()
    sess = _ep(model)
    _, where = _fraction(sess)
    assert "det" in where["CPUExecutionProvider"]
    assert set(where[EP]) == {"relu", "mul", "tanh"}
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    _same(sess.run(None, {"x": x}), _cpu(model).run(None, {"x": x}))


def test_a_group_that_fails_to_compile_runs_on_ort(monkeypatch, caplog):
    import cannc.ort.ep as ep_mod

    real = ep_mod.Session

    def failing(model, **kw):
        if any(n.op_type == "Tanh" for n in model.graph.node):
            raise CanncError("injected compile failure")
        return real(model, **kw)

    monkeypatch.setattr(ep_mod, "Session", failing)
    model = _det_model()
    with caplog.at_level("WARNING", logger="cannc.ort"):
        sess = _ep(model)
    _, where = _fraction(sess)
    assert "tanh" in where["CPUExecutionProvider"] and "relu" in where[EP]
    assert "injected compile failure" in caplog.text
    x = np.ones((4, 4), np.float32)
    _same(sess.run(None, {"x": x}), _cpu(model).run(None, {"x": x}))
    with pytest.raises(Exception, match="injected compile failure"):
        _ep(model, strict=1)


def test_many_threads_on_one_session():
    model = zoo.build("mlp")
    sess, cpu = _ep(model), _cpu(model)
    feeds = [zoo.example_inputs("mlp", batch=1 + i % 3, seed=i) for i in range(8)]
    want = [cpu.run(None, f) for f in feeds]
    bad: list[str] = []

    def worker(i: int) -> None:
        for _ in range(40):
            got = sess.run(None, feeds[i])
            if not np.allclose(got[0], want[i][0], rtol=RTOL, atol=ATOL):
                bad.append(f"thread {i}")
                return

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad


@pytest.mark.parametrize("embed", ["1", "0"])
def test_epcontext_round_trip_loads_without_compiling(tmp_path, monkeypatch, embed):
    import cannc.ort.ep as ep_mod

    model = zoo.build("mlp")
    src = tmp_path / "mlp.onnx"
    onnx.save(model, src)
    ctx = tmp_path / "mlp_ctx.onnx"
    so = _so(**{"ep.context_enable": "1", "ep.context_file_path": str(ctx),
                "ep.context_embed_mode": embed})
    first = _ep(str(src), so)
    feeds = zoo.example_inputs("mlp", batch=2)
    want = first.run(None, feeds)
    assert ctx.exists()
    saved = onnx.load(ctx)
    kinds = {n.op_type for n in saved.graph.node}
    assert "EPContext" in kinds
    if embed == "0":
        assert list(tmp_path.glob("*.cnc"))

    def no_compile(*a, **k):
        raise AssertionError("an EPContext model must load, not compile")

    monkeypatch.setattr(ep_mod, "Session", no_compile)
    second = _ep(str(ctx))
    assert second.get_providers()[0] == EP
    _same(second.run(None, feeds), want, rtol=0, atol=0)


def test_precision_mode_bf16_is_close_to_fp32():
    model = zoo.build("mlp")
    sess = _ep(model, precision_mode="bf16")
    feeds = zoo.example_inputs("mlp", batch=4)
    got, = sess.run(None, feeds)
    exp, = _cpu(model).run(None, feeds)
    cos = float(np.dot(got.ravel(), exp.ravel())
                / (np.linalg.norm(got) * np.linalg.norm(exp)))
    assert cos > 0.999
    assert not np.array_equal(got, exp)       # bf16 really ran
    hp = _ep(model, precision_mode="bf16", op_select_impl_mode="high_precision")
    np.testing.assert_allclose(hp.run(None, feeds)[0], exp, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("options, words", [
    ({"precision_mode": "fp8"}, ["precision_mode", "fp8"]),
    ({"no_such_option": "1"}, ["no_such_option"]),
    ({"op_type_allow_list": "Matmul"}, ["op_type_allow_list", "Matmul"]),
    ({"cores": "zero"}, ["cores", "zero"]),
    ({"op_select_impl_mode": "fastest"}, ["op_select_impl_mode", "fastest"]),
])
def test_bad_options_name_what_is_wrong(options, words):
    # through the helper: checked before ORT sees them
    with pytest.raises(CanncError) as e:
        cannc.ort.session_options(options)
    assert all(w in str(e.value) for w in words)
    # through ORT's own API: session creation fails with the same message
    cannc.ort.register()
    so = ort.SessionOptions()
    so.add_provider_for_devices(cannc.ort.ep_devices(), options)
    with pytest.raises(Exception) as e2:
        ort.InferenceSession(zoo.build("mlp").SerializeToString(), so)
    assert all(w in str(e2.value) for w in words)


DOCUMENTED = """
import sys
import numpy as np
import onnxruntime as ort, cannc.ort
sys.path.insert(0, {root!r})
from models import zoo
ort.register_execution_provider_library("cannc", cannc.ort.library_path())
devs = [d for d in ort.get_ep_devices() if d.ep_name == "CanncExecutionProvider"]
so = ort.SessionOptions()
so.add_provider_for_devices(devs, {{"op_type_allow_list": "MatMul,Conv"}})
sess = ort.InferenceSession({model!r}, so)
assert sess.get_providers()[0] == "CanncExecutionProvider", sess.get_providers()
cannc.ort.register()          # the helper after a manual registration: no second device
assert len(cannc.ort.ep_devices()) == 1
feeds = zoo.example_inputs("resnet", batch=2)
cpu = ort.InferenceSession({model!r}, providers=["CPUExecutionProvider"])
for g, e in zip(sess.run(None, feeds), cpu.run(None, feeds)):
    np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
print("ok")
"""


def test_the_documented_registration_works(tmp_path):
    """The issue's snippet, as a user types it, in a fresh process."""
    import subprocess

    path = tmp_path / "resnet.onnx"
    onnx.save(zoo.build("resnet"), path)
    r = subprocess.run([sys.executable, "-c", DOCUMENTED.format(root=str(ROOT),
                                                                model=str(path))],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_profiling_reports_kernels():
    model = zoo.build("mlp")
    sess = _ep(model, enable_profiling=1)
    feeds = zoo.example_inputs("mlp", batch=2)
    for _ in range(3):
        sess.run(None, feeds)
    before = len(cannc.ort.profiles())
    del sess
    import gc
    gc.collect()
    profs = cannc.ort.profiles()[before:]
    assert profs
    runs = [p for prof in profs for p in prof["programs"] if p["runs"]]
    assert runs and all(k["mean_us"] >= 0 for p in runs for k in p["kernels"])
    assert sum(p["runs"] for p in runs) >= 3


def test_too_old_onnxruntime_gives_a_clear_error(monkeypatch):
    monkeypatch.setattr(ort, "__version__", "1.20.1")
    with pytest.raises(CanncError, match="1.23"):
        cannc.ort.library_path()
