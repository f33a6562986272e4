"""No module uses another module's private (``_underscore``) names, in code or in tests.

A private name is one module's business: reaching into it from elsewhere (``from m
import _helper`` or ``m._helper`` on an imported module) ties two modules together in a
way no reader of ``m`` can see. What is shared gets a public name; test helpers live in
``tests/helpers/``. A package's private *modules* (``workers/ops/_checks.py``) may be
imported by their own package's modules.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

ROOTS = ("spcache", "cache_store", "service", "workers", "tests", "bench", "examples")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    base = REPO_ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def offenders_in(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    here = _module_name(path)
    own_package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    modules: dict[str, str] = {}  # local name -> module it is bound to
    found = []
    where = path.relative_to(REPO_ROOT)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    modules[alias.asname] = alias.name
                if (
                    any(_private(part) for part in alias.name.split("."))
                    and alias.name.rpartition(".")[0] != own_package
                ):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(path, node)
            if source == "__future__":
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if _is_module(target):
                    modules[alias.asname or alias.name] = target
                    if _private(alias.name) and source != own_package:
                        found.append(f"{where}:{node.lineno}: from {source} import {alias.name}")
                elif _private(alias.name) and source != here:
                    found.append(f"{where}:{node.lineno}: from {source} import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and modules[node.value.id] != here
        ):
            found.append(
                f"{where}:{node.lineno}: {node.value.id}.{node.attr} ({modules[node.value.id]})"
            )
    return found


def test_no_module_reaches_into_another_modules_private_names() -> None:
    offenders = []
    for root in ROOTS:
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            if ".venv" in path.parts or "build" in path.parts:
                continue
            offenders += offenders_in(path)
    assert not offenders, "private names used across modules:\n" + "\n".join(offenders)


def test_the_check_catches_each_kind_of_reach(tmp_path: Path, monkeypatch) -> None:
    """The checker itself: each way of reaching a private name is reported."""
    me = sys.modules[__name__]
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_inner.py").write_text("X = 1\n")
    (pkg / "mod.py").write_text("_hidden = 1\n")
    (pkg / "user.py").write_text(
        "from pkg.mod import _hidden\n"
        "import pkg.mod as m\n"
        "from pkg import mod\n"
        "from . import _inner\n"  # a private module of its own package: allowed
        "y = m._hidden + mod._hidden\n"
    )
    monkeypatch.setattr(me, "REPO_ROOT", tmp_path)
    found = offenders_in(pkg / "user.py")
    assert len(found) == 3, found
    assert any("import _hidden" in f for f in found)
    assert any("m._hidden" in f for f in found) and any("mod._hidden" in f for f in found)
