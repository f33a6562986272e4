"""A child process that ends when its parent dies.

``spcache serve`` starts a worker, ``spcache demo`` starts a service; each child is given
its parent's pid (``SPCACHE_PARENT_PID``) and calls :func:`exit_with_parent` first thing.
On Linux the kernel then sends the child SIGTERM the moment its parent dies, even by
SIGKILL (``prctl(PR_SET_PDEATHSIG)``); a daemon thread watching ``os.getppid()`` is the
fallback where prctl is unavailable, and the last resort (a hard exit after a grace
period) where the child's SIGTERM handling hangs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import threading
import time

__all__ = ["exit_with_parent", "set_parent_death_signal"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux).

    Returns False where that is not available (another OS, no libc).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return False
    if prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    return True


def exit_with_parent(parent_pid: int | str, *, grace_s: float = 30.0, poll_s: float = 0.5) -> None:
    """End this process (SIGTERM, then a hard exit after ``grace_s``) once ``parent_pid``
    is no longer its parent.

    Raises:
        ValueError: ``parent_pid`` is not a pid.
    """
    parent = int(parent_pid)
    by_kernel = set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the request above was made
        log.warning("parent process %d is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(
        target=_watch_parent,
        args=(parent, by_kernel, grace_s, poll_s),
        daemon=True,
        name="spcache-parent-watch",
    ).start()


def _watch_parent(parent: int, by_kernel: bool, grace_s: float, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    if not by_kernel:
        log.warning("parent process %d is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    log.error(
        "parent process %d is gone and this process did not stop in %.0fs; exiting", parent, grace_s
    )
    os._exit(1)
