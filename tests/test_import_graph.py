"""The arrows between modules, read from the source: no import cycle anywhere, no import
upward between packages, and the service's routes share code through modules of their
own, never through each other.

The graph covers ``cache_store``, ``workers``, ``service`` and ``spcache`` and every
``import`` in them, including those inside functions and under ``TYPE_CHECKING``: a late
import hides a cycle or an upward arrow from ``sys.modules`` (``tests/test_layout.py``
looks there), it does not remove it. A package's ``__init__`` is a module like the others:
``from cache_store import __version__`` in a submodule is an arrow to the package, and
the package's re-exports are arrows to its submodules.

The layers (DESIGN.md, "Packages and the arrows between them")::

    spcache            may import every package
    service, workers   cache_store only (not each other, not spcache)
    cache_store        itself only
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

PACKAGES = ("cache_store", "workers", "service", "spcache")
#: package -> the packages its modules may import (their own included)
MAY_IMPORT = {
    "cache_store": {"cache_store"},
    "workers": {"workers", "cache_store"},
    "service": {"service", "cache_store"},
    "spcache": set(PACKAGES),
}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(
    packages: tuple[str, ...] = PACKAGES, root: Path = REPO_ROOT
) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (anywhere in its body).

    Importing a module loads its parent packages first; that alone is not an arrow.
    """
    paths = {
        module_name(p, root): p
        for package in packages
        for p in sorted((root / package).rglob("*.py"))
    }
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


def upward(graph: dict[str, set[str]], may_import: dict[str, set[str]] = MAY_IMPORT) -> list[str]:
    """Every arrow from a module to a package its own may not import."""
    return [
        f"{name} imports {dep}"
        for name, deps in sorted(graph.items())
        for dep in sorted(deps)
        if dep.split(".")[0] not in may_import[name.split(".")[0]]
    ]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_package_is_read(graph: dict[str, set[str]]) -> None:
    for package in PACKAGES:
        assert package in graph and sum(m.startswith(f"{package}.") for m in graph) > 5
    # function-level imports are arrows: the dispatcher imports each command's module late
    assert "spcache.cli.exits" in graph["spcache.cli"]


def test_no_import_cycle_anywhere(graph: dict[str, set[str]]) -> None:
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_import_upward(graph: dict[str, set[str]]) -> None:
    offenders = upward(graph)
    assert not offenders, offenders


def _is_route_module(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf.startswith("routes_") or leaf == "fastpath"


def test_routes_do_not_import_each_other(graph: dict[str, set[str]]) -> None:
    routes = [name for name in graph if name.startswith("service.") and _is_route_module(name)]
    assert {"service.routes_caches", "service.routes_page", "service.fastpath"} <= set(routes)
    offenders = [
        f"{name} imports {dep}"
        for name in routes
        for dep in sorted(graph[name])
        if _is_route_module(dep)
    ]
    assert not offenders, offenders


def test_the_checks_see_cycles_upward_and_route_imports(tmp_path: Path) -> None:
    """The graph reader finds what it must: late, relative and TYPE_CHECKING imports, an
    arrow to a package's ``__init__`` and its re-exports, and an arrow upward."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.c import NAME\n__version__ = '1'\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
    )
    (pkg / "routes_x.py").write_text("from pkg import routes_y\nfrom pkg import NAME\n")
    (pkg / "routes_y.py").write_text("import pkg.c\n")
    (pkg / "c.py").write_text("def late():\n    from pkg import __version__\n")
    low = tmp_path / "low"
    low.mkdir()
    (low / "__init__.py").write_text("")
    (low / "d.py").write_text("def up():\n    import pkg.c\n")
    graph = import_graph(("pkg", "low"), root=tmp_path)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.routes_x"] == {"pkg", "pkg.routes_y"} and graph["pkg.routes_y"] == {"pkg.c"}
    assert graph["pkg"] == {"pkg.c"} and graph["pkg.c"] == {"pkg"}
    assert cycles(graph) == [["pkg.c", "pkg", "pkg.c"], ["pkg.a", "pkg.b", "pkg.a"]]
    assert graph["low.d"] == {"pkg.c"}
    assert upward(graph, {"pkg": {"pkg", "low"}, "low": {"low"}}) == ["low.d imports pkg.c"]
