"""The short fuzzing budget of the normal test suite: random valid graphs (tests/fuzz/gen.py)
compiled with cannc and compared with onnxruntime. The long campaign is
`python -m tests.fuzz --minutes 30 [--seed N]`.

The seeds are fixed (a run is reproducible); `CANNC_FUZZ_SEED` moves the window and
`CANNC_FUZZ_COUNT` resizes it. A failure names its seed and saves a reproducer under
`CANNC_FUZZ_OUT` (default: pytest's tmp_path).
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from tests.fuzz.gen import OPS, random_model
from tests.fuzz.run import campaign, check, compare, prune, summary

SEED = int(os.environ.get("CANNC_FUZZ_SEED", "20260")) * 1000
COUNT = int(os.environ.get("CANNC_FUZZ_COUNT", "40"))


def test_random_graphs_match_onnxruntime(tmp_path):
    out = os.environ.get("CANNC_FUZZ_OUT", str(tmp_path))
    msgs: list[str] = []
    results = campaign(range(SEED, SEED + COUNT), out, log=msgs.append)
    bad = [r for r in results if r.failed]
    assert not bad, f"{summary(results)}; reproducers in {out}:\n" + "\n".join(msgs)
    # the generator makes valid graphs: onnxruntime runs (almost) all of them
    invalid = [r for r in results if r.kind == "invalid"]
    assert len(invalid) <= COUNT // 10, [(r.seed, r.detail[:200]) for r in invalid]


@pytest.mark.parametrize("only", [
    # the op mix of the wrong result (a) and of its plan KeyError (b)
    {"Abs", "Add", "HardSwish", "MatMul", "Max", "Pow", "ReduceMax", "Softmax"},
    {"Softmax", "Pad", "Slice", "Concat", "Reshape", "Transpose"},
])
def test_targeted_op_mixes(only, tmp_path):
    results = campaign(range(SEED + 500, SEED + 510), str(tmp_path), log=lambda s: None,
                       gen=lambda s: random_model(s, 8, only))
    bad = [(r.seed, r.kind, r.detail.splitlines()[0][:300]) for r in results if r.failed]
    assert not bad, bad


def test_generator_is_deterministic_and_covers_the_ops():
    a, b = random_model(7), random_model(7)
    assert a.model.SerializeToString() == b.model.SerializeToString()
    assert all(np.array_equal(a.feeds[k], b.feeds[k]) for k in a.feeds)
    seen = set()
    for s in range(200):
        seen.update(n.op_type for n in random_model(s).model.graph.node)
    wanted = {t for _, _, ts in OPS for t in ts} - {"Constant"}
    missing = wanted - seen
    assert not missing, f"200 graphs never made {sorted(missing)}"


def test_outputs_include_inputs_views_constants_and_consumed_values():
    kinds = {"input": 0, "view": 0, "consumed": 0, "constant": 0}
    for s in range(150):
        m = random_model(s).model.graph
        ins = {i.name for i in m.input}
        inits = {i.name for i in m.initializer}
        made = {o: n for n in m.node for o in n.output}
        read = {v for n in m.node for v in n.input}
        for o in m.output:
            n = made.get(o.name)
            if o.name in ins:
                kinds["input"] += 1
            elif n is not None and n.op_type in ("Reshape", "Transpose", "Slice", "Flatten",
                                                 "Squeeze", "Unsqueeze"):
                kinds["view"] += 1
            if o.name in read:
                kinds["consumed"] += 1
            if n is not None and all(v in inits or not v for v in n.input):
                kinds["constant"] += 1
    assert all(v > 0 for v in kinds.values()), kinds


def test_the_checker_catches_a_wrong_result():
    """The differential check is not vacuous: a model whose cannc result is compared with
    onnxruntime's of a different model fails."""
    case = random_model(3)
    res = check(case)
    assert res.kind == "ok", res.detail
    got = [np.asarray(v) for v in _ort(case.model, case.feeds)]
    bumped = [g + np.float32(1e-2) if g.dtype.kind == "f" and g.size else g for g in got]
    names = [o.name for o in case.model.graph.output]
    assert compare(bumped, got, names) or not any(g.size for g in got)


def test_prune_keeps_what_the_outputs_need():
    case = random_model(11)
    first = case.model.graph.output[0].name
    m = prune(case.model, [first])
    onnx.checker.check_model(m)
    assert [o.name for o in m.graph.output] == [first]
    assert len(m.graph.node) <= len(case.model.graph.node)


def _ort(model, feeds):
    from tests.fuzz.run import ort_outputs
    return ort_outputs(model, feeds)


def _one_path_case(nodes, x):
    from onnx import TensorProto, helper

    from tests.fuzz.gen import Case
    g = helper.make_graph(nodes, "c", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                      list(x.shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[onnx.numpy_helper.from_array(np.float32(-3.0), "e")])
    return Case(5, helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]),
                {"x": x}, [n.op_type for n in nodes])


def test_ill_conditioned_graphs_are_told_apart_from_wrong_results():
    """Sin(Pow(x, -3)) at x ~ 0.043 (x^-3 ~ 12500, where one ulp is 0.001): a result off by
    what one ulp of the Pow gives is ill-conditioned, not a mismatch; a result off by the
    same amount on a well-conditioned graph (Relu) still fails."""
    from onnx import helper

    from tests.fuzz.run import ill_conditioned
    x = np.full((4, 8), 0.04307521, np.float32) * (1 + np.arange(32, dtype=np.float32)
                                                   .reshape(4, 8) * np.float32(1e-6))
    case = _one_path_case([helper.make_node("Pow", ["x", "e"], ["p"]),
                           helper.make_node("Sin", ["p"], ["y"])], x)
    (exp,) = _ort(case.model, case.feeds)
    p = np.power(x.astype(np.float64), -3).astype(np.float32)
    off = np.sin(np.nextafter(p, np.float32(np.inf)).astype(np.float64)).astype(np.float32)
    assert compare([off], [exp], ["y"]), "the ulp of the Pow must show after the Sin"
    assert ill_conditioned(case, [off], [exp])
    relu = _one_path_case([helper.make_node("Relu", ["x"], ["y"])], x)
    (exp,) = _ort(relu.model, relu.feeds)
    assert not ill_conditioned(relu, [exp + np.float32(1e-3)], [exp])
