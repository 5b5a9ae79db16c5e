"""Rewrite rules: pattern + check (a reason) + rewrite, and the fusion log they write.

A `Rule`'s pattern finds a candidate anchored at one node (None: not this rule's
pattern), its check returns a `Refusal` (why the candidate cannot be rewritten, and
which pair(s) of nodes that concerns) or None, its rewrite changes the graph. Every
refusal goes to `graph.meta["fusion_log"]` as a `Decision`; `cannc inspect` prints the
log, so "why didn't this fuse?" is answered by the rules' own reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..ir.graph import Graph, Node
from .manager import PassContext


@dataclass(frozen=True)
class Decision:
    producer: str
    consumer: str
    rule: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"producer": self.producer, "consumer": self.consumer, "rule": self.rule,
                "reason": self.reason}


def log(graph: Graph, producer: str, consumer: str, rule: str, reason: str) -> None:
    graph.meta.setdefault("fusion_log", []).append(Decision(producer, consumer, rule, reason))


@dataclass(frozen=True)
class Refusal:
    """Why a candidate is not rewritten, for the (producer, consumer) pairs it concerns."""

    reason: str
    pairs: tuple[tuple[str, str], ...]


S = TypeVar("S")   # state shared by the rules of one pass (e.g. the elementwise groups)
M = TypeVar("M")   # what a rule's pattern found


@dataclass(frozen=True)
class Rule(Generic[S, M]):
    """A rewrite rule, switchable by name (`PassContext.fusion`).

    ``switch`` names the switch that governs a match when it is not the rule's own name
    (an op's `Fusion` record names its rule); ``pairs`` gives the node pairs a
    switched-off rule reports, for rules whose refusals are worth seeing even when off
    (None: a switched-off rule is skipped silently, without matching)."""

    name: str
    pattern: Callable[[Graph, S, Node], M | None]
    check: Callable[[Graph, S, M], Refusal | None]
    rewrite: Callable[[Graph, S, M], None]
    switch: Callable[[M], str] | None = None
    pairs: Callable[[M], tuple[tuple[str, str], ...]] | None = None

    def apply(self, graph: Graph, state: S, n: Node, ctx: PassContext) -> bool:
        """Try the rule at node n: True if it rewrote the graph."""
        if self.switch is None and self.pairs is None and not ctx.fusion_enabled(self.name):
            return False
        m = self.pattern(graph, state, n)
        if m is None:
            return False
        rule = self.switch(m) if self.switch is not None else self.name
        if not ctx.fusion_enabled(rule):
            if self.pairs is not None:
                for p, c in self.pairs(m):
                    log(graph, p, c, rule, "rule switched off")
            return False
        why = self.check(graph, state, m)
        if why is not None:
            for p, c in why.pairs:
                log(graph, p, c, rule, why.reason)
            return False
        self.rewrite(graph, state, m)
        return True

    def run(self, graph: Graph, state: S, ctx: PassContext) -> bool:
        """Try the rule at every node, in order (nodes a rewrite removed are skipped)."""
        changed = False
        for n in list(graph.nodes()):
            if n.name in graph.g:
                changed |= self.apply(graph, state, n, ctx)
        return changed
