"""The worker child of `spcache serve`: restarted when it dies, stopped on shutdown."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from service.supervisor import WorkerSupervisor, worker_command


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_worker_command_runs_the_worker_module_with_this_python() -> None:
    cmd = worker_command("/c", device="cuda:1", backend="torch")
    assert cmd[:4] == [sys.executable, "-m", "spcache", "worker"]
    assert cmd[cmd.index("--device") + 1] == "cuda:1" and "/c" in cmd


def test_a_dead_worker_is_restarted_with_backoff_and_stopped_cleanly(tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    script = (f"import time; open({str(marker)!r}, 'a').write('x'); time.sleep(60)")
    sup = WorkerSupervisor([sys.executable, "-c", script], first_backoff_s=0.05,
                           max_backoff_s=0.2, stop_grace_s=5)
    sup.start()
    try:
        assert _wait(lambda: sup.pid is not None and marker.exists())
        first = sup.pid
        os.kill(first, signal.SIGKILL)
        assert _wait(lambda: sup.pid not in (None, first))
        assert _wait(lambda: marker.read_text() == "xx")
        assert sup.restarts == 1
    finally:
        code = sup.stop()
    assert code == -signal.SIGTERM and sup.pid is None


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    script = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"open({str(ready)!r}, 'w').close(); time.sleep(60)")
    sup = WorkerSupervisor([sys.executable, "-c", script], stop_grace_s=0.5)
    sup.start()
    assert _wait(ready.exists)
    assert sup.stop() == -signal.SIGKILL
