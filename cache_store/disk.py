"""What every writer of a local disk shares: making a name durable, and waiting for a lock.

* :func:`fsync_path`: flush a file's bytes, or a directory's entries (a rename, a new
  name), to the disk. A rename is durable only once its directory is fsynced.
* :func:`flock_within`: take an ``flock`` on an open file, waiting up to a bound for
  whoever holds it (compaction and the LMDB writers share ``records.lock``).

Standard library only; POSIX.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable

__all__ = ["fsync_path", "flock_within"]


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync the file or directory at ``path`` (opened read-only, which both allow)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flock_within(
    fd: int,
    operation: int,
    wait_s: float,
    *,
    poll_s: float = 0.05,
    on_wait: Callable[[], None] | None = None,
) -> bool:
    """Take ``flock(fd, operation)`` (``fcntl.LOCK_SH`` or ``LOCK_EX``), trying again
    every ``poll_s`` while another holder keeps it, for up to ``wait_s`` seconds. True
    once held; False when it was still held elsewhere at the bound (the caller says what
    that means). ``on_wait`` is called once, the first time it has to wait."""
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            if not waited and on_wait is not None:
                on_wait()
            waited = True
            time.sleep(poll_s)
