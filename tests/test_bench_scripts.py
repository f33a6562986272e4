"""The benchmark scripts stay runnable: each starts as a script and prints its usage.

(bench/ heads sys.path when a script runs, so a module there named like a standard
library package would break every script; this catches that and import errors.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

SCRIPTS = sorted((REPO_ROOT / "bench").glob("*.py"))


#: The speed goals' scripts (docs/BENCHMARKS.md records what each measured).
EXPECTED = {
    "http_serving.py",
    "peers.py",
    "precompute.py",
    "ray_precompute.py",
    "read_throughput.py",
    "spc_ops.py",
    "worker_memory.py",
    "zarr_snapshot.py",
    "zero_copy.py",
}


def test_every_benchmark_is_present_and_recorded() -> None:
    names = {p.name for p in SCRIPTS}
    assert names >= EXPECTED, f"missing: {sorted(EXPECTED - names)}"
    recorded = (REPO_ROOT / "docs" / "BENCHMARKS.md").read_text()
    unrecorded = sorted(n for n in names if f"bench/{n}" not in recorded and n not in recorded)
    assert not unrecorded, f"no figures in docs/BENCHMARKS.md for {unrecorded}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_runs_and_prints_usage(script) -> None:
    proc = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=REPO_ROOT / "bench",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:") and script.name in proc.stdout
    assert "--" in proc.stdout.split("usage:", 1)[1]  # it documents its options


def test_gpu_check_without_cuda_says_so_in_one_line_and_exits_0() -> None:
    """CUDA hidden (so this holds on a GPU machine too): one line, exit 0, no report."""
    import os

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "gpu_check.py"), "--out", "never-written.md"],
        cwd=REPO_ROOT / "bench",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "gpu_check: no CUDA device here; nothing to check (run it on a GPU machine)"
    ]
    assert not (REPO_ROOT / "bench" / "never-written.md").exists()
