"""docs/DESIGN.md's module map names every module of the four packages, and nothing else."""

from __future__ import annotations

import re

from tests.conftest import REPO_ROOT

PACKAGES = ("spcache", "cache_store", "service", "workers")


def _map_section() -> str:
    text = (REPO_ROOT / "docs" / "DESIGN.md").read_text()
    start = text.index("## Module map")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_the_module_map_matches_the_tree() -> None:
    listed = re.findall(r"^\| `([\w/]+\.py)` \| .+ \|$", _map_section(), flags=re.M)
    on_disk = {
        str(p.relative_to(REPO_ROOT))
        for package in PACKAGES
        for p in (REPO_ROOT / package).rglob("*.py")
    }
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert not on_disk - set(listed), (
        f"modules missing from the map: {sorted(on_disk - set(listed))}"
    )
    assert not set(listed) - on_disk, f"listed but not in the tree: {sorted(set(listed) - on_disk)}"


def test_a_long_module_says_why_in_its_head() -> None:
    """A module over ~500 lines carries, in its docstring, a line saying why it is one
    module (``Why one module: ...``)."""
    import ast

    long_and_silent = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            text = path.read_text()
            if text.count("\n") <= 520:
                continue
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Why one module:" not in doc:
                long_and_silent.append(
                    f"{path.relative_to(REPO_ROOT)} ({text.count(chr(10))} lines)"
                )
    assert not long_and_silent, long_and_silent


#: Issue 33's bound on a module's length: past it, a module is split along a seam.
MODULE_LINES_MAX = 650


def test_no_module_is_over_the_bound() -> None:
    over = [
        f"{path.relative_to(REPO_ROOT)} ({n} lines)"
        for package in PACKAGES
        for path in sorted((REPO_ROOT / package).rglob("*.py"))
        if (n := path.read_text().count("\n")) > MODULE_LINES_MAX
    ]
    assert not over, f"over {MODULE_LINES_MAX} lines (split along a seam): {over}"
