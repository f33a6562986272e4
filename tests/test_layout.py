"""The project's shape: packages import without side effects and arrows point one way."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT


def _imported_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                         capture_output=True, text=True).stdout
    return set(out.split())


def test_cache_store_imports_neither_service_workers_nor_fastapi() -> None:
    mods = _imported_after("cache_store")
    forbidden = {m for m in mods if m.split(".")[0] in {"service", "workers", "fastapi", "kaolin"}}
    assert not forbidden


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    lines = readme.splitlines()
    marker = next(i for i, line in enumerate(lines) if "ci:test-command" in line)
    command = next(line for line in lines[marker + 1:] if line and not line.startswith("```"))
    assert "torch==2.13.0" in command
    assert command.index("torch==2.13.0") < command.index("-e '.[dev]'")
    assert "pytest" in command
