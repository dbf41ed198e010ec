"""Passes, model bindings, benchmarks and examples use LongStraw through its
public names only: what they need is what a pass or a tool written outside
the package needs, so it must be public (documented and kept stable)."""

from __future__ import annotations

import ast

import pytest

from helpers.paths import REPO

CLIENTS = ("passes", "models", "benchmarks", "examples")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str, package: str | None) -> list[str]:
    """`_private` names of longstraw that `source` imports or reads as an
    attribute of something it imported from longstraw. `package` is the
    longstraw package the file belongs to (`longstraw.passes`), for its
    relative imports."""
    tree = ast.parse(source)
    bound: set[str] = set()  # local names bound to longstraw modules or objects
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "longstraw":
                    found += [f"line {node.lineno}: import {alias.name}" for part in alias.name.split(".") if _private(part)]
                    bound.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                if package is None:
                    continue
                module = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([module] if module else []))
            if module.split(".")[0] != "longstraw":
                continue
            for part in module.split("."):
                if _private(part):
                    found.append(f"line {node.lineno}: from {module}")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"line {node.lineno}: from {module} import {alias.name}")
                bound.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("folder", CLIENTS)
def test_clients_use_public_names_only(folder):
    package = {"passes": "longstraw.passes", "models": "longstraw.models"}.get(folder)
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}/"
    uses = {str(f.relative_to(REPO)): u for f in files if (u := private_uses(f.read_text(), package))}
    assert not uses, f"private longstraw names used: {uses}"


@pytest.mark.parametrize(
    "source, flagged",
    [
        ("from longstraw.runtime.runner import _noting", True),
        ("from longstraw.runtime import phases\nphases._AROUND_STEPS", True),
        ("import longstraw.passes.attention as a\na.kernel_for._cache", True),
        ("from .attention import _split", True),
        ("from longstraw._internal import x", True),
        ("from longstraw.runtime.carry import CarryKernel\nCarryKernel.__name__", False),
        ("import torch\ntorch._dynamo.reset()", False),
        ("from longstraw.runtime.kernels import attention\nattention.kernel_for", False),
    ],
)
def test_the_check_sees_private_names(source, flagged):
    assert bool(private_uses(source, "longstraw.passes")) is flagged
