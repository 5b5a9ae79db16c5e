"""The pass manager: named passes, run in a straight list, timed, verified and dumped.

A pass is a function `(graph, ctx) -> bool` (did it change anything) registered with
`@graph_pass("name")`, or `@graph_pass("name", options=SomeOptions)` when it takes
options of its own (a frozen dataclass; `ctx.options` is the pass's instance). The
manager resolves the pipeline when it is built (a misspelt pass name or an unknown
option is a CompileError naming what exists), hands every pass the same frozen
`PassContext`, times each one, verifies the IR before the first pass and after each
when CANNC_VERIFY=1 (always in tests), dumps the IR after the passes named in
`dump_after`, and wraps any exception in a CompileError naming the pass.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .. import config, progress
from ..errors import CanncError, CompileError
from ..ir.graph import Graph, verify


@dataclass(frozen=True)
class PassContext:
    """What every pass is handed: the compile options, read-only.

    ``fusion`` is True (every rule), False (none) or per-rule switches
    ``{"gemm_epilogue": False, ...}`` (rules not named are on); ``target`` the CPU
    compiled for (None: this host); ``tuning`` whether measured tuning results may be
    used; ``pass_options`` per-pass options by
    pass name (checked against each pass's declared options when the manager is built);
    ``options`` the running pass's own options (set by the manager)."""

    fusion: bool | Mapping[str, bool] = True
    target: str | None = None
    tuning: bool = True
    pass_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    options: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.fusion, bool):
            object.__setattr__(self, "fusion", MappingProxyType(
                {str(k): bool(v) for k, v in self.fusion.items()}))
        object.__setattr__(self, "pass_options", MappingProxyType(
            {k: MappingProxyType(dict(v)) for k, v in self.pass_options.items()}))

    def fusion_enabled(self, rule: str) -> bool:
        if isinstance(self.fusion, bool):
            return self.fusion
        return bool(self.fusion.get(rule, True))


PassFn = Callable[[Graph, PassContext], bool]


@dataclass(frozen=True)
class Pass:
    name: str
    fn: PassFn
    options: type | None = None       # a dataclass of the pass's own options, if any
    doc: str = ""

    def make_options(self, given: Mapping[str, Any]) -> Any:
        """The pass's options instance from `given` (defaults for what is not given)."""
        if self.options is None:
            if given:
                raise CompileError(f"pass '{self.name}' takes no options "
                                   f"(given: {', '.join(sorted(given))})")
            return None
        known = [f.name for f in dataclasses.fields(self.options)]
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise CompileError(f"unknown option(s) {', '.join(unknown)} for pass "
                               f"'{self.name}'; its options: {', '.join(known)}")
        return self.options(**given)


_PASSES: dict[str, Pass] = {}


def graph_pass(name: str, *, options: type | None = None) -> Callable[[PassFn], PassFn]:
    """Register `fn(graph, ctx) -> bool` as the pass `name` (a name is registered once)."""
    if options is not None and not dataclasses.is_dataclass(options):
        raise TypeError(f"the options of pass '{name}' must be a dataclass")

    def deco(fn: PassFn) -> PassFn:
        if name in _PASSES:
            raise CompileError(f"pass '{name}' is registered twice "
                               f"({_PASSES[name].fn.__module__} and {fn.__module__})")
        _PASSES[name] = Pass(name, fn, options, (fn.__doc__ or "").strip())
        return fn
    return deco


def get_pass(name: str) -> Pass:
    p = _PASSES.get(name)
    if p is None:
        raise CompileError(f"unknown pass {name!r}; known passes: {', '.join(sorted(_PASSES))}")
    return p


def registered_passes() -> list[str]:
    return sorted(_PASSES)


@dataclass
class PassRecord:
    name: str
    seconds: float
    changed: bool
    nodes_after: int


@dataclass
class PassManager:
    passes: list[str]
    ctx: PassContext = field(default_factory=PassContext)
    verify: bool = field(default_factory=lambda: config.VERIFY)
    dump_after: set[str] = field(default_factory=set)
    dump_dir: str | None = field(default_factory=lambda: config.DUMP_DIR)
    records: list[PassRecord] = field(default_factory=list)
    dumps: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # resolve the pipeline now: a misspelt name or option fails before any pass runs
        self._resolved = [get_pass(name) for name in self.passes]
        for name in self.ctx.pass_options:
            if name not in _PASSES:
                get_pass(name)
        unknown = sorted(set(self.dump_after) - set(self.passes) - {"all"})
        if unknown:
            raise CompileError(f"dump_after names {', '.join(map(repr, unknown))}, which "
                               f"the pipeline does not run; its passes: "
                               f"{', '.join(self.passes)} (or 'all')")
        self._contexts = [dataclasses.replace(
            self.ctx, options=p.make_options(self.ctx.pass_options.get(p.name, {})))
            for p in self._resolved]

    def run(self, graph: Graph) -> Graph:
        if self.verify and self._resolved:
            try:
                verify(graph)
            except AssertionError as e:
                raise CompileError(f"IR invalid before pass '{self._resolved[0].name}': "
                                   f"{e}") from e
        with progress.stage("passes", len(self._resolved), "pass") as shown:
            self._run(graph, shown)
        return graph

    def _run(self, graph: Graph, shown: progress.Stage) -> None:
        for p, ctx in zip(self._resolved, self._contexts):
            name = p.name
            shown.advance(0, name)
            t0 = time.perf_counter()
            try:
                changed = bool(p.fn(graph, ctx))
            except CanncError:
                raise
            except Exception as e:
                raise CompileError(f"pass '{name}' failed: {type(e).__name__}: {e}") from e
            dt = time.perf_counter() - t0
            self.records.append(PassRecord(name, dt, changed, graph.num_nodes()))
            if config.DEBUG:
                print(f"[cannc] pass {name:<22} {dt * 1e3:8.2f} ms  changed={changed} "
                      f"nodes={graph.num_nodes()}", file=sys.stderr)
            if self.verify:
                try:
                    verify(graph)
                except AssertionError as e:
                    raise CompileError(f"IR invalid after pass '{name}': {e}") from e
            if name in self.dump_after or "all" in self.dump_after:
                text = graph.dump()
                self.dumps[name] = text
                if self.dump_dir:
                    d = Path(self.dump_dir)
                    d.mkdir(parents=True, exist_ok=True)
                    (d / f"after_{name}.txt").write_text(text)
            shown.advance()
