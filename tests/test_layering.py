"""The shape of the house (ARCHITECTURE.md "Layers"): every import points down, no cycles.

Every import statement in cannc/ is read, at module level and inside functions
(`if TYPE_CHECKING:` blocks too): an import inside a function that dodges a cycle is
still an upward arrow. A failure names the importing file, the line and the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1] / "cannc"

# layer of a module: the longest matching prefix wins
LAYER_OF = {
    "cannc.errors": "base", "cannc.config": "base", "cannc._version": "base",
    "cannc.progress": "base",
    "cannc.ir": "ir",
    "cannc.te": "ir",            # tensor expressions of custom ops: no LLVM
    "cannc.native": "native",
    "cannc.artifact": "artifact",
    "cannc.schedule": "schedule",
    "cannc.runtime": "runtime",
    "cannc.codegen": "codegen",
    "cannc.frontend": "frontend",
    "cannc.passes": "passes",
    "cannc.compiler": "compiler",
    "cannc": "faces",            # the package root, session, cli, backend, export, ort, ops, te
}
BELOW = {   # what each layer may import, besides itself
    "base": set(),
    "ir": {"base"},
    "native": {"base"},
    "artifact": {"base", "ir"},
    "schedule": {"base", "ir", "native", "artifact"},
    "runtime": {"base", "ir", "native", "artifact", "schedule"},
    "codegen": {"base", "ir", "native", "artifact", "schedule", "runtime"},
    "frontend": {"base", "ir"},
    "passes": {"base", "ir", "schedule", "artifact"},
    "compiler": {"base", "ir", "native", "artifact", "schedule", "runtime", "codegen",
                 "frontend", "passes"},
    "faces": {"base", "ir", "native", "artifact", "schedule", "runtime", "codegen",
              "frontend", "passes", "compiler"},
}


def layer(mod: str) -> str:
    best = max((p for p in LAYER_OF if mod == p or mod.startswith(p + ".")), key=len)
    return LAYER_OF[best]


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _targets(mod: str, is_pkg: bool, node: ast.AST, mods: dict[str, Path]) -> list[str]:
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = mod.split(".") if is_pkg else mod.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            src = ".".join(base + ([node.module] if node.module else []))
        else:
            src = node.module or ""
        # `from pkg import submodule` imports the submodule, `from mod import name` the module
        names = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
    out = []
    for n in names:
        while n and n not in mods:
            n = n.rpartition(".")[0]
        if n and n != mod:
            out.append(n)
    return out


def import_graph() -> tuple[nx.DiGraph, list[tuple[str, str, int]]]:
    mods = _modules()
    g = nx.DiGraph()
    edges = []
    for mod, path in mods.items():
        g.add_node(mod)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, path.name == "__init__.py", node, mods):
                    g.add_edge(mod, t)
                    edges.append((mod, t, node.lineno))
    return g, edges


GRAPH, EDGES = import_graph()


@pytest.mark.parametrize("lay", sorted(BELOW))
def test_no_upward_import(lay: str) -> None:
    bad = [f"{ROOT.parent / (a.replace('.', '/'))}:{line}: {a} ({layer(a)}) imports {b} "
           f"({layer(b)})"
           for a, b, line in EDGES
           if layer(a) == lay and layer(b) != lay and layer(b) not in BELOW[lay]]
    assert not bad, f"{len(bad)} upward or sideways imports from {lay}:\n" + "\n".join(bad)


def test_no_import_cycle() -> None:
    cycles = [sorted(c) for c in nx.strongly_connected_components(GRAPH) if len(c) > 1]
    assert not cycles, "import cycles between files:\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_scanner_sees_function_level_imports() -> None:
    """The scan must read imports inside functions, or the two tests above prove little."""
    tree = ast.parse("def f():\n    from .b import x\n")
    node = tree.body[0].body[0]  # type: ignore[attr-defined]
    assert _targets("cannc.a", False, node, {"cannc.a": Path(), "cannc.b": Path()}) == ["cannc.b"]
    assert layer("cannc.codegen.lower.elementwise") == "codegen"
    assert layer("cannc.session") == "faces"
