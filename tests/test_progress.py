"""Progress of long compiles (cannc/progress.py): drawn by tqdm only when asked, on a
terminal, after the delay."""

from __future__ import annotations

import io

import numpy as np
from onnx import TensorProto, helper

import cannc
from cannc import progress


def _model(k: int):
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], np.eye(8, dtype=np.float32) * k)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]),
                           helper.make_node("Relu", ["y"], ["z"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 8])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_stages_are_drawn_when_shown(tmp_path, monkeypatch):
    monkeypatch.setenv("CANNC_CACHE_DIR", str(tmp_path))
    out = io.StringIO()
    with progress.show_progress(out, delay=0, force=True):
        s = cannc.compile(_model(3), cores=1)
    text = out.getvalue()
    # (tqdm redraws at most every 0.1 s and clears a bar when its stage ends)
    assert "passes" in text and "LLVM" in text
    assert "kernels lowered:   0%" in text and "0/1 [" in text   # MatMul+Relu: one kernel
    x = np.ones((2, 8), np.float32)
    assert np.allclose(s.run(None, {"x": x})[0], 3 * x)


def test_quiet_without_a_reporter_or_before_the_delay(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CANNC_CACHE_DIR", str(tmp_path))
    cannc.compile(_model(4), cores=1)
    assert capsys.readouterr().err == ""
    out = io.StringIO()
    with progress.show_progress(out, delay=60, force=True):
        cannc.compile(_model(5), cores=1)
    assert out.getvalue() == ""
    # not a terminal (a pipe, a log): tqdm draws nothing unless forced
    with progress.show_progress(out, delay=0):
        cannc.compile(_model(6), cores=1)
    assert out.getvalue() == ""


def test_stage_counts_from_threads():
    import threading
    out = io.StringIO()
    with progress.show_progress(out, delay=0, force=True):
        with progress.stage("work", 40, "step") as st:
            ts = [threading.Thread(target=lambda: [st.advance() for _ in range(10)])
                  for _ in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert st._bar.n == 40
    assert "work" in out.getvalue()
    assert progress.stage("nothing shown", 5)._bar is None
