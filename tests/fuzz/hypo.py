"""A hypothesis front end to the random-graph generator (tests/fuzz/gen.py).

`graphs()` is a strategy of `Case`s built by the same `random_model` and op table as the
seeded fuzzer, with every structural choice (how many nodes, which op, shapes, axes,
attributes, which values an op reads, which values become outputs) drawn from hypothesis
instead of a numpy Generator. A failing graph therefore shrinks: hypothesis minimises the
choices, towards fewer nodes, the first op of the table (unary), small dims and the
first branch of every decision. Bulk tensor contents (inputs, weights) come from a numpy
Generator seeded by one drawn integer: they do not need shrinking.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from .gen import Case, random_model

_FRACTION = 1000


class DrawnRng:
    """The subset of numpy.random.Generator that gen.py uses, its scalar choices drawn
    from hypothesis (`draw`), its arrays from a numpy Generator."""

    def __init__(self, draw, seed: int) -> None:
        self._draw = draw
        self._np = np.random.default_rng(seed)

    def another_node(self, made: int, most: int) -> bool:
        """Whether the graph gets another node (after `made`; at least one, at most
        `most`): shrinks towards fewer nodes."""
        return made < 1 or (made < most and self._draw(st.integers(0, 3)) > 0)

    def integers(self, low, high=None, size=None):
        if size is not None:
            return self._np.integers(low, high, size=size)
        if high is None:
            low, high = 0, low
        return self._draw(st.integers(int(low), int(high) - 1))

    def random(self, size=None):
        if size is not None:
            return self._np.random(size)
        # a small integer, scaled: hypothesis favours 0.0 and the bounds of floats, and
        # the small values of wide integer ranges, either of which would take the first
        # branch of every `random() < p` almost always. It shrinks towards 1.0: every
        # optional extra (`if random() < p`) left out
        return 1.0 - (self._draw(st.integers(0, _FRACTION - 1)) + 1) / _FRACTION

    def standard_normal(self, size=None):
        return self._np.standard_normal(size)

    def permutation(self, n):
        return np.asarray(self._draw(st.permutations(range(int(n)))), np.int64)

    def shuffle(self, x) -> None:
        order = self._draw(st.permutations(range(len(x))))
        x[:] = [x[i] for i in order]

    def choice(self, a, size=None, replace=True, p=None):
        items = list(range(a)) if isinstance(a, (int, np.integer)) else list(a)
        n = len(items)
        if size is not None:
            if replace:
                idx = [self._index(n, p) for _ in range(int(np.prod(size)))]
            else:
                idx = self._draw(st.permutations(range(n)))[:int(np.prod(size))]
            return np.asarray([items[i] for i in idx]).reshape(size)
        return items[self._index(n, p)]

    def _index(self, n: int, p) -> int:
        if p is None:
            return self._draw(st.integers(0, n - 1))
        # weighted: a drawn point of the cumulative distribution (shrinks to the first
        # item with a non-zero weight)
        u = self.random()
        c = np.cumsum(np.asarray(p, np.float64))
        return int(min(np.searchsorted(c, u * c[-1], side="right"), n - 1))


@st.composite
def graphs(draw, n_nodes: int | None = None, only=None) -> Case:
    """Random valid graphs (with their feeds) of the generator's op table."""
    seed = draw(st.integers(0, 2 ** 32 - 1))
    return random_model(seed, n_nodes, only, rng=DrawnRng(draw, seed))
