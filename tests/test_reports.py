"""The support and inspect reports are library functions: `cannc.check` and
`Session.inspect` give what `cannc check --json` and `cannc inspect --json` print."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cannc
from cannc.cli import main
from cannc.compiler.report import NodeSupport, SupportReport
from cannc.frontend import import_model
from models import zoo


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> str:
    return str(zoo.save("mlp", tmp_path_factory.mktemp("zoo")))


@pytest.fixture(scope="module")
def partly_unsupported(tmp_path_factory) -> str:
    """A Det (no lowering) and a custom-domain op beside an ordinary Add."""
    T = TensorProto
    nodes = [helper.make_node("Det", ["x"], ["d"], name="det0"),
             helper.make_node("Add", ["x", "x"], ["a"], name="add0"),
             helper.make_node("FancyOp", ["a"], ["o"], name="fancy0", domain="com.acme")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [3, 3])],
                          [helper.make_tensor_value_info("d", T.FLOAT, []),
                           helper.make_tensor_value_info("o", T.FLOAT, [3, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("com.acme", 1)])
    m.ir_version = 9
    path = tmp_path_factory.mktemp("unsup") / "unsup.onnx"
    onnx.save(m, str(path))
    return str(path)


def _cli_json(capsys, *argv: str) -> tuple[int, Any]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, json.loads(out)


def _stable(rep: dict[str, Any]) -> dict[str, Any]:
    """The report without what differs between two compiles of the same model (times,
    object-cache hits)."""
    rep = json.loads(json.dumps(rep, default=str))
    for key in ("compile_seconds", "cache_hits", "cache_misses"):
        rep.pop(key)
    for p in rep["passes"]:
        p.pop("seconds")
    return rep


def test_session_inspect_is_cli_inspect_json(mlp, capsys):
    rc, cli = _cli_json(capsys, "inspect", mlp, "--json", "--shape", "x=2x256")
    assert rc == 0
    sess = cannc.compile(mlp, eager=False)
    lib = sess.inspect({"x": (2, 256)})
    assert _stable(lib) == _stable(cli)
    assert lib["model"] == mlp and "without_fusion" in lib["fusion"]
    # shapes not given: the first compiled specialisation
    again = sess.inspect(without_fusion=False)
    assert again["input_shapes"] == {"x": [2, 256]} and "without_fusion" not in again["fusion"]


def test_check_is_cli_check_json(partly_unsupported, capsys):
    rc, cli = _cli_json(capsys, "check", partly_unsupported, "--json")
    assert rc == 1
    rep = cannc.check(partly_unsupported)
    assert isinstance(rep, SupportReport) and rep.to_dict() == cli
    assert not rep.supported
    bad = {r.name: r for r in rep.unsupported()}
    assert set(bad) == {"det0", "fancy0"}
    assert isinstance(bad["det0"], NodeSupport) and bad["det0"].reason
    assert bad["fancy0"].domain == "com.acme" and bad["det0"].input_dtypes == ("float32",)
    assert rep.counts["unsupported"] == 2 and rep.counts["ok"] == 1


def test_check_accepts_graph_and_proto(mlp):
    proto = onnx.load(mlp)
    by_path, by_proto = cannc.check(mlp, {"x": (4, 256)}), cannc.check(proto, {"x": (4, 256)})
    graph, _ = import_model(proto)
    by_graph = cannc.check(graph, {"x": (4, 256)})
    assert by_path.supported and by_proto.supported and by_graph.supported
    assert by_path.model == mlp and by_proto.model is None
    assert by_proto.nodes == by_graph.nodes == by_path.nodes
    assert {r.name for r in by_path.nodes} >= {n.name for n in proto.graph.node}
    with pytest.raises(cannc.CanncError, match="unknown pipeline 'O7'"):
        cannc.check(mlp, pipeline="O7")


def test_check_reports_shape_inference_failure():
    w = numpy_helper.from_array(np.ones((32, 4), np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm_3")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    rep = cannc.check(m)
    assert not rep.supported
    assert rep.shape_inference_error.startswith("ShapeError: MatMul at node 'mm_3'")
