"""The process rules every package shares (``cache_store.processes``): is a pid alive,
stop a child (SIGTERM, grace, SIGKILL), the parent's pid in the child's environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cache_store.processes import PARENT_PID_ENV, child_env, pid_alive, stop_child

BOUND_S = 60.0


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {BOUND_S} s"
        time.sleep(0.05)


def test_a_live_process_a_zombie_and_a_reaped_one() -> None:
    assert pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    # not reaped yet: a zombie, which kill(pid, 0) alone takes for alive
    _wait_for(lambda: not pid_alive(proc.pid), "the child ended (a zombie)")
    assert proc.poll() == 0  # reaped now
    assert not pid_alive(proc.pid)


def test_a_child_that_stops_on_sigterm_is_not_killed() -> None:
    code = "import time; print('up', flush=True); time.sleep(600)"
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        assert stop_child(proc, BOUND_S) == -signal.SIGTERM


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        assert stop_child(proc, 0.5) == -signal.SIGKILL


def test_a_group_is_stopped_whole(tmp_path: Path) -> None:
    """``group=True``: the child's own children go too (the demo's service and its worker)."""
    grandchild_pid = tmp_path / "pid"
    code = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(grandchild_pid)!r}, 'w').write(str(g.pid))\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    _wait_for(lambda: grandchild_pid.exists() and grandchild_pid.read_text(), "the grandchild")
    pid = int(grandchild_pid.read_text())
    assert pid_alive(pid)
    stop_child(proc, BOUND_S, group=True)
    # the grandchild's parent is gone: init reaps it once SIGTERM ended it
    _wait_for(lambda: not pid_alive(pid), "the grandchild stopped")


def test_an_ended_child_is_not_signalled() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    assert stop_child(proc, BOUND_S) == 3


def test_the_child_environment_names_this_process() -> None:
    env = child_env({"A": "1"})
    assert env == {"A": "1", PARENT_PID_ENV: str(os.getpid())}
    assert child_env()[PARENT_PID_ENV] == str(os.getpid())
    assert PARENT_PID_ENV == "SPCACHE_PARENT_PID"  # the name users and scripts see
