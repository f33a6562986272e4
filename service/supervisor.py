"""Keep one worker child process alive next to the service.

The worker is a separate program (``python -m workers worker --cache ...``) started with
``subprocess`` (fork + exec: spawn semantics), so the service process never imports the
GPU code nor initialises CUDA. If it dies it is started again after a back-off that
doubles on each quick death (capped) and resets once it has stayed up a while. On stop
it gets SIGTERM (it finishes or releases what it holds), then SIGKILL after a grace
period.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["WorkerSupervisor", "worker_command"]

log = logging.getLogger(__name__)


def worker_command(cache: str, *, device: str | None = None, backend: str = "auto",
                   extra: Sequence[str] = ()) -> list[str]:
    """The command line that starts one worker for ``cache``."""
    cmd = [sys.executable, "-m", "workers", "worker", "--cache", str(cache), "--backend", backend]
    if device:
        cmd += ["--device", device]
    return cmd + list(extra)


class WorkerSupervisor:
    """Run ``command`` as a child process and restart it when it exits unasked.

    Args:
        command: argv of the child.
        max_backoff_s: longest wait before a restart.
        healthy_after_s: a child that ran this long resets the back-off.
        stop_grace_s: how long :meth:`stop` waits after SIGTERM before SIGKILL.
    """

    def __init__(self, command: Sequence[str], *, max_backoff_s: float = 60.0,
                 healthy_after_s: float = 60.0, stop_grace_s: float = 30.0,
                 first_backoff_s: float = 1.0) -> None:
        self.command = list(command)
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.stop_grace_s = stop_grace_s
        self.first_backoff_s = first_backoff_s
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("supervisor already started")
        self._thread = threading.Thread(target=self._watch, name="spcache-worker-supervisor",
                                        daemon=True)
        self._thread.start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        log.info("starting worker: %s", " ".join(self.command))
        return subprocess.Popen(self.command, stdin=subprocess.DEVNULL)

    def _watch(self) -> None:
        backoff = self.first_backoff_s
        while not self._stop.is_set():
            with self._lock:
                if self._stop.is_set():
                    return
                self._proc = self._spawn()
            started = time.monotonic()
            code = self._proc.wait()
            if self._stop.is_set():
                return
            ran = time.monotonic() - started
            if ran >= self.healthy_after_s:
                backoff = self.first_backoff_s
            log.warning("worker (pid %d) exited with %s after %.1fs; restarting in %.1fs",
                        self._proc.pid, code, ran, backoff)
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, self.max_backoff_s)
            self.restarts += 1

    def stop(self) -> int | None:
        """Stop the child (SIGTERM, then SIGKILL after the grace period); returns its exit code."""
        with self._lock:
            if self._stop.is_set() and (self._proc is None or self._proc.poll() is not None):
                return self._proc.returncode if self._proc is not None else None
            self._stop.set()
            proc = self._proc
        code = None
        if proc is not None and proc.poll() is None:
            log.info("stopping worker (pid %d)", proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                log.warning("worker (pid %d) did not stop in %.0fs; killing it", proc.pid,
                            self.stop_grace_s)
                proc.kill()
                code = proc.wait()
        elif proc is not None:
            code = proc.returncode
        if self._thread is not None:
            self._thread.join(timeout=5)
        return code
