"""Helpers for the fault suite: child processes with line-by-line output, sizes from the
environment, and the figures each case reports.

Every case prints its figures as one ``FIGURES <case> {json}`` line (shown with
``pytest -s`` or ``-rA``) and, when ``SPCACHE_FAULT_FIGURES`` names a file, appends the
same JSON there; ``docs/RELIABILITY.md`` quotes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any


from tests.conftest import REPO_ROOT


def env_int(name: str, default: int) -> int:
    """A size read from the environment at test time (CI defaults otherwise)."""
    return int(os.environ.get(name, default))


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def report(case: str, figures: dict[str, Any]) -> None:
    line = json.dumps({"case": case, **figures}, sort_keys=True, default=str)
    print(f"FIGURES {line}")
    target = os.environ.get("SPCACHE_FAULT_FIGURES")
    if target:
        with open(target, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


class Child:
    """A ``python -m tests.helpers.procs`` child whose stdout lines arrive on a queue."""

    def __init__(self, *args: str, stdin: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.procs", *args],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, prefix: str | tuple[str, ...], timeout: float = 60.0) -> str:
        """The next line starting with ``prefix`` (other lines are returned by ``seen``)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"child {self.pid}: no {prefix!r} line in {timeout} s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(
                    f"child {self.pid} exited ({self.proc.wait()}) before printing {prefix!r}"
                )
            if line.startswith(prefix):
                return line

    def drain(self) -> list[str]:
        """Every line printed so far (after the process is gone: all of them)."""
        out = []
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return out
            if line is not None:
                out.append(line)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._close()

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._close()
        return code

    def _close(self) -> None:
        self._reader.join(10)
        for pipe in (self.proc.stdout, self.proc.stdin):
            if pipe is not None and not pipe.closed:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()


@contextlib.contextmanager
def served(settings: Any, attempts: int = 3) -> Iterator[Any]:
    """The app under a real uvicorn on loopback (``InProcessServer``), started again on
    another port if a start fails (a loaded machine can miss the start deadline)."""
    from tests.helpers.service import InProcessServer

    for attempt in range(attempts):
        server = InProcessServer(settings)
        try:
            server.__enter__()
        except RuntimeError:
            server.server.should_exit = True
            server.socket.close()
            if attempt == attempts - 1:
                raise
            continue
        try:
            yield server
        finally:
            server.__exit__(None, None, None)
        return


def plant_lmdb_value(cache_dir: str | os.PathLike[str], key: str, value: bytes) -> None:
    """Write ``value`` under ``key`` in the LMDB cache at ``cache_dir`` with the lmdb
    module itself, past every check of ``LMDBStore.put_many`` (no store of this process
    may have the cache open)."""
    import lmdb

    env = lmdb.open(os.path.join(os.fspath(cache_dir), "records"), max_dbs=4, subdir=True)
    try:
        with env.begin(write=True) as txn:
            txn.put(key.encode(), value, db=env.open_db(b"records", txn=txn))
    finally:
        env.close()
