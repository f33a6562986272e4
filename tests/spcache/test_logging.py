"""Logging follows the subcommand's own level, through the real entry point.

The dispatcher must not call ``basicConfig(WARNING)`` before dispatching: ``serve`` and
``worker`` would then log nothing below WARNING whatever ``--log-level`` said.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.procs import run_spcache, serve


def _serve_log(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> str:
    """Start ``spcache serve --no-worker``, wait for it to answer, stop it, return its
    stderr."""
    with serve("--cache", tmp_path / "cache", "--no-worker", *flags, env=env) as server:
        server.stop()
    return server.proc.stderr()


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
    proc = run_spcache(
        "worker",
        "--cache",
        tmp_path / "cache",
        "--device",
        "cpu",
        "--drain",
        "--loaders",
        "0",
        "--log-level",
        level,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = " INFO workers.worker_loop: worker " in proc.stderr
    assert info == (level in ("debug", "info")), proc.stderr[-3000:]
    assert (" DEBUG " in proc.stderr) == (level == "debug")


def test_verbose_flags_set_the_level_of_commands_without_log_level(tmp_path: Path) -> None:
    quiet = run_spcache("stats", "--cache", tmp_path)
    loud = run_spcache("-vv", "stats", "--cache", tmp_path)
    assert " DEBUG " not in quiet.stderr
    assert " DEBUG spcache.cli: spcache stats: pid " in loud.stderr, loud.stderr
