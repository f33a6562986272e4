"""The benchmark scripts stay runnable: each starts as a script and prints its usage.

(bench/ heads sys.path when a script runs, so a module there named like a standard
library package would break every script; this catches that and import errors.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

SCRIPTS = sorted((REPO_ROOT / "bench").glob("*.py"))


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 5


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_runs_and_prints_usage(script) -> None:
    proc = subprocess.run([sys.executable, str(script), "--help"], cwd=REPO_ROOT / "bench",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
