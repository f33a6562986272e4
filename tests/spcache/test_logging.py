"""Logging follows the subcommand's own level, through the real entry point.

The dispatcher must not call ``basicConfig(WARNING)`` before dispatching: ``serve`` and
``worker`` would then log nothing below WARNING whatever ``--log-level`` said.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_log(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> str:
    """Start ``python -m spcache serve --no-worker``, wait for uvicorn to listen, stop it,
    return its stderr."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spcache",
            "serve",
            "--cache",
            str(tmp_path / "cache"),
            "--port",
            str(port),
            "--no-worker",
            *flags,
        ],
        cwd=REPO_ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        _wait_listening(port, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    return err


def _wait_listening(port: int, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "serve exited early"
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    pytest.fail(f"serve did not listen on {port} within {timeout}s")


def test_serve_logs_debug_lines_with_log_level_debug(tmp_path: Path) -> None:
    err = _serve_log(tmp_path, "--log-level", "debug")
    assert " DEBUG " in err, err[-3000:]
    assert " INFO service.launch: spcache serve: cache " in err


def test_serve_logs_at_info_by_default_and_says_what_it_uses(tmp_path: Path) -> None:
    err = _serve_log(tmp_path)
    assert " DEBUG " not in err
    assert f"spcache serve: cache {(tmp_path / 'cache').resolve()}" in err
    assert "spcache serve: warm-up sources must lie under " in err
    assert "spcache serve: no worker child" in err
    assert "spcache serve: listening on http://127.0.0.1:" in err


def test_serve_takes_its_level_from_the_environment_and_warning_hides_info(tmp_path: Path) -> None:
    err = _serve_log(tmp_path, env={"SPCACHE_LOG_LEVEL": "warning"})
    assert " INFO " not in err and " DEBUG " not in err


@pytest.mark.parametrize("level", ["debug", "info", "warning"])
def test_worker_logs_at_its_log_level(tmp_path: Path, level: str) -> None:
    (tmp_path / "cache").mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spcache",
            "worker",
            "--cache",
            str(tmp_path / "cache"),
            "--device",
            "cpu",
            "--drain",
            "--loaders",
            "0",
            "--log-level",
            level,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = " INFO workers.worker_loop: worker " in proc.stderr
    assert info == (level in ("debug", "info")), proc.stderr[-3000:]
    assert (" DEBUG " in proc.stderr) == (level == "debug")


def test_verbose_flags_set_the_level_of_commands_without_log_level(tmp_path: Path) -> None:
    quiet = subprocess.run(
        [sys.executable, "-m", "spcache", "stats", "--cache", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    loud = subprocess.run(
        [sys.executable, "-m", "spcache", "-vv", "stats", "--cache", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert " DEBUG " not in quiet.stderr
    assert " DEBUG spcache.cli: spcache stats: pid " in loud.stderr, loud.stderr
