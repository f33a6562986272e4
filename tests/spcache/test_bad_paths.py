"""Every subcommand given a bad path says so in one line naming it, exit 2, no traceback.

Real processes (``python -m spcache``). Permission cases run the command as the
unprivileged ``nobody`` user (root reads and writes anything), under a world-writable
scratch directory, so they are real permission failures, not simulated ones.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.procs import run, spcache_argv
from tests.conftest import REPO_ROOT

NOBODY = 65534


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """A world-writable scratch dir with the bad paths, reachable by ``nobody``."""
    root = Path(tempfile.mkdtemp(prefix="spcache-badpaths-"))
    root.chmod(0o1777)
    (root / "a_file").write_text("not a cache\n")
    (root / "x.zarr").write_text("a file with a snapshot's name\n")
    (root / "empty").mkdir()
    (root / "readonly").mkdir(mode=0o555)
    (root / "readonly").chmod(0o555)  # mkdir's mode is masked by the umask
    (root / "secret").mkdir()
    (root / "secret").chmod(0o700)  # root's: nobody can neither list nor enter it
    (root / "mesh.xyz").write_text("0 0 0\n1 1 1\n0 1 0\n")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _as_nobody() -> list[str]:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0:
        return []  # already unprivileged: permissions apply as they are
    assert setpriv, "setpriv (util-linux) is needed to run a command as an unprivileged user"
    return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


# (command, arguments with {s} = scratch dir, the path the message must name, unprivileged)
CASES = [
    ("precompute", "{s}/mesh.xyz --recipe spc --cache {s}/a_file", "{s}/a_file", False),
    ("precompute", "{s}/mesh.xyz --recipe spc --cache {s}/a_file/sub", "{s}/a_file", False),
    ("precompute", "{s}/missing.obj --recipe spc --cache {s}/new", "{s}/missing.obj", False),
    ("precompute", "{s}/mesh.xyz --recipe spc --cache {s}/readonly", "{s}/readonly", True),
    ("precompute", "{s}/secret --recipe spc --cache {s}/cache_nobody", "{s}/secret", True),
    ("verify", "--cache {s}/missing", "{s}/missing", False),
    ("verify", "--cache {s}/a_file", "{s}/a_file", False),
    ("verify", "--cache {s}/secret", "{s}/secret", True),
    ("stats", "--cache {s}/a_file", "{s}/a_file", False),
    ("stats", "--cache {s}/missing", "{s}/missing", False),
    ("stats", "--cache {s}/secret", "{s}/secret", True),
    ("export", "0123456789abcdef --cache {s}/a_file --to {s}/out.zarr", "{s}/a_file", False),
    ("export", "0123456789abcdef --cache {s}/missing --to {s}/out.zarr", "{s}/missing", False),
    ("export", "0123456789abcdef --cache {s}/empty --to {s}/out", "{s}/out", False),
    ("export", "0123456789abcdef --cache {s}/empty --to {s}/x.zarr", "{s}/x.zarr", False),
    ("worker", "--cache {s}/a_file --drain", "{s}/a_file", False),
    ("worker", "--cache {s}/missing --drain", "{s}/missing", False),
    ("worker", "--cache {s}/readonly --drain", "{s}/readonly", True),
    ("serve", "--cache {s}/a_file --port 1", "{s}/a_file", False),
    ("serve", "--cache {s}/a_file/sub --port 1", "{s}/a_file/sub", False),
    ("demo", "--dir {s}/a_file --port 0", "{s}/a_file", False),
]


@pytest.mark.parametrize(
    ("command", "arguments", "named", "unprivileged"),
    CASES,
    ids=[
        f"{c[0]}:{c[1].split()[-1] if c[0] != 'precompute' else c[1].split()[0]}"
        f"{':nobody' if c[3] else ''}"
        for c in CASES
    ],
)
def test_a_bad_path_is_one_line_naming_it_with_exit_2(
    scratch: Path, command: str, arguments: str, named: str, unprivileged: bool
) -> None:
    argv = spcache_argv(command, *arguments.format(s=scratch).split())
    proc = run(
        (_as_nobody() if unprivileged else []) + argv,
        cwd=scratch,
        env={"PYTHONPATH": str(REPO_ROOT), "SPCACHE_CACHE": None},
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"spcache {command}: ") and named.format(s=scratch) in lines[0]
    assert proc.stdout == ""
