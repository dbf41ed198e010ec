"""LongStraw's modules import each other without a circle.

A circle of imports makes the order modules load in matter, and hides one
behind an import inside a function. The graph counts every import of
longstraw (the core, `passes/` as `longstraw.passes`, `models/` as
`longstraw.models`): at the top of a module and inside functions alike;
only imports under `if TYPE_CHECKING:` are left out (annotations, never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

from helpers.paths import REPO

ROOTS = {"longstraw": REPO / "longstraw", "longstraw.passes": REPO / "passes", "longstraw.models": REPO / "models"}


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package."""
    found = {}
    for package, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _under_type_checking(tree: ast.Module) -> set[int]:
    """The ids of the nodes inside `if TYPE_CHECKING:` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return skipped


def import_graph() -> nx.DiGraph:
    """An edge a -> b where module a imports (from) module b."""
    mods = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(mods)
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
        skipped = _under_type_checking(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                if target in mods and target != name:
                    graph.add_edge(name, target)
    return graph


def test_no_import_circle():
    circles = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert not circles, f"modules that import each other in a circle: {circles}"


def test_a_circle_is_found():
    """The check on a graph with a circle hidden inside a function."""
    graph = import_graph()
    graph.add_edge("longstraw.nodes", "longstraw.backend")  # backend imports nodes, through others
    assert any(len(c) > 1 for c in nx.strongly_connected_components(graph))
