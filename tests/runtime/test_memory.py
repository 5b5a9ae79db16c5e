"""The memory planner (a compile step, cannc.compiler.planning): live buffers never
overlap; reuse gets near the lower bound."""

from hypothesis import given, settings
from hypothesis import strategies as st

from cannc.artifact import ALIGN
from cannc.compiler.planning import Interval, place


def _check(intervals, p):
    for a in intervals:
        for b in intervals:
            if a.value >= b.value:
                continue
            if a.end < b.start or b.end < a.start:
                continue
            oa, ob = p.offsets[a.value], p.offsets[b.value]
            assert oa + a.size <= ob or ob + b.size <= oa, (a, b, oa, ob)
    for iv in intervals:
        assert p.offsets[iv.value] % ALIGN == 0
        assert p.offsets[iv.value] + iv.size <= p.arena_bytes
    assert p.lower_bound_bytes <= p.arena_bytes <= p.naive_bytes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(-1, 30), st.integers(0, 10)),
                min_size=1, max_size=40))
def test_no_two_live_buffers_overlap(items):
    intervals = [Interval(f"v{i}", size, s, s + d) for i, (size, s, d) in enumerate(items)]
    _check(intervals, place(intervals))


def test_chain_reuses_memory():
    # a chain a -> b -> c -> d: only two buffers are live at once
    ivs = [Interval(f"v{i}", 1024, i, i + 1) for i in range(10)]
    p = place(ivs)
    assert p.arena_bytes == 2 * 1024 == p.lower_bound_bytes
    assert p.naive_bytes == 10 * 1024
