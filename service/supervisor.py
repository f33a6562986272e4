"""Keep one worker child process alive next to the service.

The worker is a separate program (``python -m spcache worker --cache ...``) started with
``subprocess`` (fork + exec: spawn semantics), so the service process never imports the
GPU code nor initialises CUDA. If it dies it is started again after a back-off that
doubles on each quick death (capped) and resets once it has stayed up a while; one that
ended itself because a sample ran past its time limit (exit
:data:`~cache_store.jobs.worker_state.OVERRUN_EXIT`) is started again at once. On stop
it gets SIGTERM (it finishes or releases what it holds), then SIGKILL after a grace
period.

When the child dies, the items it held are made claimable at once
(:meth:`JobQueue.expire_leases_of`, the attempt counted): the next worker takes them
over instead of waiting out the dead one's leases (120 s by default).

While the child is starting, and after a death while it is restarted, the supervisor
says so in the cache's job queue (:meth:`JobQueue.announce_restart`): read-through
waiters then wait for the new worker instead of failing with ``NoWorkerAlive``. A child
that keeps dying at once (``QUICK_DEATHS`` times in a row) is not announced any more, so
waiters fail fast with the command to run.

The child is told this process's pid (``SPCACHE_PARENT_PID``) and ends when this process
dies, even by SIGKILL. Before each start the supervisor looks at the cache's worker lock
(``cache_store.jobs.owner_lock``): while another live worker owns the cache it starts none,
says who holds it, and looks again after the back-off.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from cache_store.errors import SpcacheError
from cache_store.jobs.owner_lock import describe_holder, lock_holder
from cache_store.jobs.queue import JobQueue
from cache_store.jobs.worker_state import OVERRUN_EXIT
from cache_store.processes import child_env, stop_child

__all__ = ["WorkerSupervisor", "worker_command"]

log = logging.getLogger(__name__)


#: How long a starting worker may take to write its first heartbeat (imports torch).
START_GRACE_S = 60.0
#: The exit status of an spcache command whose usage, backend or path was refused
#: (``spcache.cli.exits.USAGE``): the supervisor does not restart a worker that exits
#: with it.
REFUSED_EXIT = 2
#: Deaths in a row, each before ``healthy_after_s``, after which a restart is not
#: announced to waiters.
QUICK_DEATHS = 3
#: What the job queue may raise at the supervisor: logged, never the end of its thread
#: (one that died so left the service without a worker).
QUEUE_ERRORS = (SpcacheError, OSError, sqlite3.Error)


def worker_command(
    cache: str,
    *,
    device: str | None = None,
    backend: str = "auto",
    log_level: str | None = None,
    source_roots: Sequence[os.PathLike[str] | str] = (),
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line that starts one worker for ``cache``; with ``source_roots`` the
    worker re-checks, when it opens a source, that it still lies inside one of them (the
    service checked at submit time, but a path can be swapped for a link afterwards)."""
    cmd = [sys.executable, "-m", "spcache", "worker", "--cache", str(cache), "--backend", backend]
    for root in source_roots:
        cmd += ["--source-root", str(root)]
    if device:
        cmd += ["--device", device]
    if log_level:
        cmd += ["--log-level", log_level]
    return cmd + list(extra)


class WorkerSupervisor:
    """Run ``command`` as a child process and restart it when it exits unasked.

    Args:
        command: argv of the child.
        max_backoff_s: longest wait before a restart.
        healthy_after_s: a child that ran this long resets the back-off.
        stop_grace_s: how long :meth:`stop` waits after SIGTERM before SIGKILL.
        cache: the cache directory whose worker lock is checked before each start
            (None: not checked).
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        max_backoff_s: float = 60.0,
        healthy_after_s: float = 60.0,
        stop_grace_s: float = 30.0,
        first_backoff_s: float = 1.0,
        cache: str | os.PathLike[str] | None = None,
    ) -> None:
        self.command = list(command)
        self.cache = Path(cache) if cache is not None else None
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.stop_grace_s = stop_grace_s
        self.first_backoff_s = first_backoff_s
        self.restarts = 0
        self.gave_up = False  # the worker exited REFUSED_EXIT: not restarted
        self.supervisor_id = f"supervisor:{socket.gethostname()}:{os.getpid()}"
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
        self._thread = threading.Thread(
            target=self._watch, name="spcache-worker-supervisor", daemon=True
        )
        self._thread.start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        log.info("starting worker: %s", " ".join(self.command))
        return subprocess.Popen(self.command, stdin=subprocess.DEVNULL, env=child_env())

    def _owned_elsewhere(self) -> str | None:
        """Who else holds the cache's worker lock, in words, or None."""
        if self.cache is None:
            return None
        try:
            holder = lock_holder(self.cache)
        except OSError as exc:
            log.warning("cannot read the worker lock of %s: %s", self.cache, exc)
            return None
        return describe_holder(holder) if holder is not None else None

    def _announce(self, within_s: float | None) -> None:
        """Tell read-through waiters a worker is on its way within ``within_s`` (None:
        none is)."""
        if self.cache is None:
            return
        queue = JobQueue(self.cache)
        try:
            if within_s is None:
                queue.end_restarts(self.supervisor_id)
            else:
                queue.announce_restart(self.supervisor_id, within_s)
        except QUEUE_ERRORS as exc:  # waiters then fail fast, as without it
            log.warning("cannot tell waiters the worker is restarting: %s", exc)
        finally:
            queue.close()

    def _take_back_leases(self, pid: int, code: int) -> None:
        """The child is gone: the items it held are claimable now, by the worker started
        next, instead of when their leases run out (up to the whole lease)."""
        if self.cache is None:
            return
        how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit status {code}"
        queue = JobQueue(self.cache)
        try:
            n = queue.expire_leases_of(pid, f"the worker (pid {pid}) died holding it ({how})")
        except QUEUE_ERRORS as exc:  # the leases then run out as before
            log.warning("cannot hand back the items of the dead worker (pid %d): %s", pid, exc)
            return
        finally:
            queue.close()
        if n:
            log.warning("worker (pid %d) died holding %d item(s); they are claimable again", pid, n)

    def _watch(self) -> None:
        backoff = self.first_backoff_s
        quick_deaths = 0
        while not self._stop.is_set():
            holder = self._owned_elsewhere()
            if holder is not None:
                log.warning(
                    "cache %s is owned by %s; not starting a second worker "
                    "(looking again in %.0fs)",
                    self.cache,
                    holder,
                    backoff,
                )
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                if quick_deaths < QUICK_DEATHS:
                    self._announce(START_GRACE_S)
                self._proc = self._spawn()
            started = time.monotonic()
            code = self._proc.wait()
            if self._stop.is_set():
                return
            ran = time.monotonic() - started
            self._take_back_leases(self._proc.pid, code)
            if code == REFUSED_EXIT:
                # its options, backend or cache were refused: a restart would be refused
                # the same way, forever
                self.gave_up = True
                self._announce(None)
                log.error(
                    "worker (pid %d) refused to start (exit %d: its options, backend or "
                    "cache were refused; its own message is above); not restarting it. "
                    "The API serves what is cached; fix the worker's options and restart",
                    self._proc.pid,
                    code,
                )
                return
            if code == OVERRUN_EXIT:
                # it ended itself because a sample ran past its time limit (it failed that
                # attempt): not a crash, so a fresh worker now, the back-off untouched
                self._announce(START_GRACE_S)
                log.warning(
                    "worker (pid %d) ended itself after %.1fs: a sample ran past its time "
                    "limit (its log above names it); starting a fresh worker",
                    self._proc.pid,
                    ran,
                )
                self.restarts += 1
                continue
            if ran >= self.healthy_after_s:
                backoff = self.first_backoff_s
                quick_deaths = 0
            else:
                quick_deaths += 1
            self._announce(backoff + START_GRACE_S if quick_deaths < QUICK_DEATHS else None)
            log.warning(
                "worker (pid %d) exited with %s after %.1fs; restarting in %.1fs",
                self._proc.pid,
                code,
                ran,
                backoff,
            )
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
            code = stop_child(proc, self.stop_grace_s, what="worker")
            self._take_back_leases(proc.pid, code)  # what it still held after a kill
        elif proc is not None:
            code = proc.returncode
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._announce(None)
        return code


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
