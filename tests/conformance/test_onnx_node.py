"""The official ONNX node test suite (onnx/backend/test/case/node) against cannc.

The cases are generated in memory from the installed onnx package (no data is
downloaded or written into the repo). A case whose ops are not all in cannc's
registry is an expected failure that names the missing ops; the cases listed
in KNOWN_FAILURES fail for the reason given. Nothing is skipped silently: an
unexpected pass of a listed case fails the run (strict xfail), so the list
stays honest.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnx.backend.test.case import node as node_cases

import cannc.backend as backend
from cannc.ir.registry import lookup

# case name -> reason (see the closing notes of the conformance issue for counts)
KNOWN_FAILURES: dict[str, str] = {}

_CASES = None


def _cases():
    global _CASES
    if _CASES is None:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _CASES = sorted(node_cases.collect_testcases(None), key=lambda c: c.name)
    return _CASES


def _missing_ops(case) -> list[str]:
    missing = []
    for n in case.model.graph.node:
        if lookup(n.op_type, n.domain) is None:
            missing.append(n.op_type if not n.domain else f"{n.domain}.{n.op_type}")
    return sorted(set(missing))


def _params():
    out = []
    for c in _cases():
        marks = []
        missing = _missing_ops(c)
        if missing:
            marks.append(pytest.mark.xfail(reason=f"ops not in cannc: {', '.join(missing)}",
                                           strict=True, run=False))
        elif c.name in KNOWN_FAILURES:
            marks.append(pytest.mark.xfail(reason=KNOWN_FAILURES[c.name], strict=True))
        out.append(pytest.param(c, id=c.name, marks=marks))
    return out


def _normalize(t):
    """Like onnx.backend.test.runner: data may be TensorProto (bfloat16, float8, int4...)."""
    if isinstance(t, onnx.TensorProto):
        return numpy_helper.to_array(t)
    return np.asarray(t)


def _assert_close(got, exp, rtol, atol, name):
    exp = _normalize(exp)
    assert got.dtype == exp.dtype, f"{name}: dtype {got.dtype} != {exp.dtype}"
    assert got.shape == exp.shape, f"{name}: shape {got.shape} != {exp.shape}"
    if exp.dtype.kind == "V" or exp.dtype.name == "bfloat16":
        # ml_dtypes floats (bfloat16, float8...): compare in float32 like the ONNX runner,
        # which allows two bfloat16 ULPs
        if exp.dtype.name == "bfloat16":
            rtol = max(rtol, 2 ** -6)
        np.testing.assert_allclose(got.astype(np.float32), exp.astype(np.float32),
                                   rtol=rtol, atol=atol, err_msg=name)
    elif exp.dtype.kind in "fc":
        np.testing.assert_allclose(got.astype(np.float64), exp.astype(np.float64),
                                   rtol=rtol, atol=atol, err_msg=name)
    elif exp.dtype == object:
        assert list(got.reshape(-1)) == list(exp.reshape(-1)), name
    else:
        np.testing.assert_array_equal(got, exp, err_msg=name)


def run_case(case) -> None:
    """Compile the case's model with cannc, run every data set, compare every output."""
    rep = backend.prepare(case.model, cores=1)
    for inputs, outputs in case.data_sets:
        got = rep.run([_normalize(x) for x in inputs])
        assert len(got) == len(outputs)
        for g, e, o in zip(got, outputs, case.model.graph.output):
            _assert_close(g, e, case.rtol, case.atol, f"{case.name}:{o.name}")


def reason_category(reason: str) -> str:
    """The category of a KNOWN_FAILURES reason: the text before its first ':'."""
    return reason.split(":", 1)[0].strip()


@pytest.mark.parametrize("case", _params())
def test_node(case):
    run_case(case)
