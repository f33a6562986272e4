"""Arrows inside a package: no import cycle in ``service`` or ``workers``, and the
service's routes share code through modules of their own, never through each other.

The graph is read from the source (every ``import``, including those inside functions
and under ``TYPE_CHECKING``: a late import hides a cycle, it does not remove it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

ACYCLIC = ("service", "workers")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str, root: Path = REPO_ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (anywhere in its body).

    Importing a module loads its parent packages first; that alone is not an arrow.
    """
    paths = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                # ``from pkg import mod`` needs pkg.mod; ``from pkg import name`` needs
                # pkg itself (a module's parent packages load first, without counting)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    deps.add(sub if sub in paths else base)
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected part of ``graph`` that has one."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                found.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


@pytest.mark.parametrize("package", ACYCLIC)
def test_no_import_cycle(package: str) -> None:
    graph = import_graph(package)
    assert len(graph) > 5
    found = cycles(graph)
    assert not found, f"{package} has import cycles: " + "; ".join(" -> ".join(c) for c in found)


def _is_route_module(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf.startswith("routes_") or leaf == "fastpath"


def test_routes_do_not_import_each_other() -> None:
    graph = import_graph("service")
    routes = [name for name in graph if _is_route_module(name)]
    assert {"service.routes_caches", "service.routes_page", "service.fastpath"} <= set(routes)
    offenders = [
        f"{name} imports {dep}"
        for name in routes
        for dep in sorted(graph[name])
        if _is_route_module(dep)
    ]
    assert not offenders, offenders


def test_the_checks_see_cycles_and_route_imports(tmp_path: Path) -> None:
    """The graph reader finds what it must: late, relative and TYPE_CHECKING imports."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
    )
    (pkg / "routes_x.py").write_text("from pkg import routes_y\nfrom pkg import NAME\n")
    (pkg / "routes_y.py").write_text("import pkg.c\n")
    (pkg / "c.py").write_text("")
    graph = import_graph("pkg", root=tmp_path)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.routes_x"] == {"pkg", "pkg.routes_y"} and graph["pkg.routes_y"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
