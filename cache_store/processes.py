"""What spcache's processes know about one another: the one home of each rule.

* A child ends when its parent dies. ``spcache serve`` starts a worker, ``spcache demo``
  starts a service; each child is given its parent's pid in :data:`PARENT_PID_ENV`
  (:func:`child_env`) and, through the command line's dispatcher, calls
  :func:`exit_with_parent` first thing. On Linux the kernel then sends the child SIGTERM
  the moment its parent dies, even by SIGKILL (``prctl(PR_SET_PDEATHSIG)``); a daemon
  thread watching ``os.getppid()`` is the fallback where prctl is unavailable, and the
  last resort (a hard exit after a grace period) where the child's SIGTERM handling hangs.
* Whether a pid is a live process (:func:`pid_alive`): a zombie is not.
* How a parent stops a child (:func:`stop_child`): SIGTERM, a grace period, SIGKILL.

Standard library only, no spcache imports: every package may use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import Any

__all__ = [
    "PARENT_PID_ENV",
    "child_env",
    "exit_with_parent",
    "set_parent_death_signal",
    "pid_alive",
    "stop_child",
]

log = logging.getLogger(__name__)

#: The environment variable that names the pid a child spcache process must not outlive.
PARENT_PID_ENV = "SPCACHE_PARENT_PID"

_PR_SET_PDEATHSIG = 1


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that must end with this process: ``base`` (default:
    this process's environment) plus :data:`PARENT_PID_ENV` naming this process."""
    return {**(os.environ if base is None else base), PARENT_PID_ENV: str(os.getpid())}


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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (dead, waiting for its parent to
    reap it: ``kill(pid, 0)`` still succeeds for one). Someone else's process counts as
    alive; without ``/proc`` (not Linux) existing is all there is to go on."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no /proc (not Linux), or it ended just now
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")
    state = stat[stat.rfind(b")") + 2 :][:1]  # the field after "(command name)"
    return state not in (b"Z", b"X")


def stop_child(
    proc: subprocess.Popen[Any], grace_s: float, *, group: bool = False, what: str = "child"
) -> int:
    """Stop ``proc`` and return its exit status: SIGTERM (it finishes or releases what it
    holds), then SIGKILL if it has not ended within ``grace_s``. ``group``: signal its
    whole process group (a child started with ``start_new_session=True``, and whatever
    it started). ``what`` names it in the warning a kill logs."""
    if proc.poll() is not None:
        return proc.returncode

    def send(signum: int) -> None:
        try:
            if group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
        except ProcessLookupError:  # it ended between the poll and the signal
            pass

    send(signal.SIGTERM)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        log.warning("%s (pid %d) did not stop in %.0fs; killing it", what, proc.pid, grace_s)
        send(signal.SIGKILL)
        return proc.wait()
