"""Which live worker owns a cache directory: an ``flock`` on ``<cache>/worker.lock``.

The worker started by ``spcache worker`` (alone or as ``spcache serve``'s child) holds
the lock for as long as it lives; the kernel drops it when the process dies, however it
dies. A second ``spcache worker`` on the same cache, or a service about to start its
worker, sees the lock and names its holder (pid, host, start time) from the JSON the
holder wrote into the file. CPU only; POSIX ``fcntl``.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from cache_store.errors import CacheOwned

__all__ = ["LOCK_FILENAME", "CacheOwned", "WorkerLock", "lock_holder", "describe_holder"]

LOCK_FILENAME = "worker.lock"


def describe_holder(holder: dict[str, Any]) -> str:
    """``worker pid 123 on host (worker id ..., since 2026-...)``."""
    text = f"worker pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    details = []
    if holder.get("worker_id"):
        details.append(f"id {holder['worker_id']}")
    if isinstance(holder.get("started"), int | float):
        details.append(
            "since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
        )
    return text + (f" ({', '.join(details)})" if details else "")


class WorkerLock:
    """The worker lock of ``cache`` (a directory); a context manager.

    Args:
        cache: the cache directory (created if missing when acquired).
    """

    def __init__(self, cache: str | os.PathLike[str]) -> None:
        self.cache = Path(cache)
        self.path = self.cache / LOCK_FILENAME
        self._fd: int | None = None

    def acquire(self, **info: Any) -> None:
        """Take the lock and record who holds it.

        Raises:
            CacheOwned: another process holds it.
            OSError: the cache directory cannot be created or written.
        """
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: already acquired")
        self.cache.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            for attempt in range(5):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = lock_holder(self.cache)
                    # a momentary shared lock is lock_holder() looking: try again
                    if holder is not None or attempt == 4:
                        raise CacheOwned(
                            self.cache, holder or {}, describe_holder(holder or {})
                        ) from None
                    time.sleep(0.05)
        except BaseException:
            os.close(fd)
            raise
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), **info}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder, sort_keys=True).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.ftruncate(fd, 0)
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> WorkerLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_holder(cache: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Who holds ``cache``'s worker lock (what it wrote, at least ``{}``), or None if nobody.

    Never creates anything: a cache without a lock file has no holder.
    """
    path = Path(cache) / LOCK_FILENAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raw = os.pread(fd, 4096, 0)
            try:
                holder = json.loads(raw) if raw else {}
            except ValueError:
                holder = {}
            return holder if isinstance(holder, dict) else {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
