"""The hypothesis-driven fuzzer: graphs drawn by tests/fuzz/hypo.py (the seeded
generator's op table, choices drawn by hypothesis) compiled with cannc and compared with
onnxruntime; a failure shrinks to a small graph. A short budget runs here
(`CANNC_FUZZ_HYPOTHESIS_EXAMPLES`, default 25, derandomized); set it higher, and
`CANNC_FUZZ_HYPOTHESIS_RANDOM=1` for fresh examples each run, for a longer search."""

from __future__ import annotations

import os

import onnx
from hypothesis import HealthCheck, find, given, settings

from tests.fuzz.hypo import graphs
from tests.fuzz.run import check

EXAMPLES = int(os.environ.get("CANNC_FUZZ_HYPOTHESIS_EXAMPLES", "25"))
FRESH = os.environ.get("CANNC_FUZZ_HYPOTHESIS_RANDOM") == "1"
_SETTINGS = dict(deadline=None, database=None, derandomize=not FRESH,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much])


@settings(max_examples=EXAMPLES, **_SETTINGS)
@given(graphs())
def test_drawn_graphs_match_onnxruntime(case):
    res = check(case)
    assert not res.failed, (f"{res.kind}: {res.detail}\n"
                            f"{onnx.printer.to_text(case.model.graph)}")


def _ops(case) -> set[str]:
    return {n.op_type for n in case.model.graph.node}


def test_shrinking_reaches_a_small_graph():
    """The front end shrinks: the smallest drawn graph with a Where (a stand-in for a
    failing property) is the Where and the comparison that makes its condition, with one
    output. (A few seconds: the shrinker generates a few hundred graphs.)"""
    small = find(graphs(), lambda c: "Where" in _ops(c),
                 settings=settings(max_examples=100, **_SETTINGS))
    g = small.model.graph
    assert len(g.node) <= 2 and len(g.output) == 1, onnx.printer.to_text(g)
