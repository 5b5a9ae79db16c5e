"""The pass manager: named passes, run in a straight list, timed, verified and dumped.

A pass is a function `Graph -> bool` (did it change anything) registered with
`@graph_pass("name")`. The manager times each one, verifies the IR after it
when CANNC_VERIFY=1 (always in tests), dumps the IR after the passes named in
`dump_after`, and wraps any exception in a CompileError naming the pass.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import config
from ..errors import CanncError, CompileError
from ..ir.graph import Graph, verify

PassFn = Callable[[Graph], bool]
_PASSES: dict[str, PassFn] = {}


def graph_pass(name: str) -> Callable[[PassFn], PassFn]:
    def deco(fn: PassFn) -> PassFn:
        _PASSES[name] = fn
        fn.pass_name = name  # type: ignore[attr-defined]
        return fn
    return deco


def get_pass(name: str) -> PassFn:
    return _PASSES[name]


@dataclass
class PassRecord:
    name: str
    seconds: float
    changed: bool
    nodes_after: int


@dataclass
class PassManager:
    passes: list[str]
    verify: bool = field(default_factory=lambda: config.VERIFY)
    dump_after: set[str] = field(default_factory=set)
    dump_dir: str | None = field(default_factory=lambda: config.DUMP_DIR)
    records: list[PassRecord] = field(default_factory=list)
    dumps: dict[str, str] = field(default_factory=dict)

    def run(self, graph: Graph) -> Graph:
        for name in self.passes:
            fn = _PASSES[name]
            t0 = time.perf_counter()
            try:
                changed = bool(fn(graph))
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
        return graph
