"""Handles that belong to the process that opened them (LMDB, SQLite, httpx, zarr), and
signal handlers that belong to the process that installed them.

A handle opened before ``os.fork`` is shared with the child: using it there, or even
closing it, touches the parent's locks, sockets or WAL. Every reader and writer in
``cache_store`` therefore keeps its handles in a :class:`ProcessLocal`: opened on first
use in a process, opened anew when ``os.getpid()`` changes, and an inherited one is
*parked* (kept referenced, never used, closed or collected) instead of closed.

A signal handler is inherited by a forked child the same way: a recipe's
``multiprocessing.Pool`` (fork) inside the worker got the worker's SIGTERM handler,
which only asks the worker loop to stop, so ``Pool.terminate()`` waited for ever on
children that would not end. Every handler spcache installs is wrapped by
:func:`this_process_only`: in another process it does what the signal does by default.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Generic, TypeVar

__all__ = [
    "ProcessLocal",
    "handle_unless_ignored",
    "is_parked",
    "park",
    "this_process_only",
]

T = TypeVar("T")

# Handles inherited across fork: referenced so no finaliser ever closes them in a child.
_PARKED: list[Any] = []


def park(handle: Any) -> None:
    """Keep an inherited handle alive and untouched for the rest of this process."""
    _PARKED.append(handle)


def is_parked(handle: Any) -> bool:
    """Whether ``handle`` was parked in this process (kept, never used or closed)."""
    return any(parked is handle for parked in _PARKED)


class ProcessLocal(Generic[T]):
    """This process's handle, made by ``opener()`` on first use in each process.

    Args:
        opener: makes a new handle (called at most once per process, under a lock).
        closer: closes a handle of this process (``close()``); None: nothing to close.

    Pickles empty (a handle never travels to a spawned process); thread-safe.
    """

    def __init__(self, opener: Callable[[], T], closer: Callable[[T], None] | None = None) -> None:
        self.opener = opener
        self.closer = closer
        self._value: T | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()

    def _own_lock(self) -> threading.Lock:
        pid = os.getpid()
        if self._lock_pid != pid:  # a lock held by another thread at fork stays held
            self._lock, self._lock_pid = threading.Lock(), pid
        return self._lock

    def get(self) -> T:
        """This process's handle, opening it if needed (parking an inherited one)."""
        value, pid = self._value, os.getpid()
        if value is not None and self._pid == pid:
            return value
        with self._own_lock():
            if self._value is not None and self._pid != pid:
                park(self._value)
                self._value = None
            if self._value is None:
                self._value = self.opener()
                self._pid = pid
            return self._value

    def peek(self) -> T | None:
        """This process's handle if open, else None (never opens)."""
        return self._value if self._pid == os.getpid() else None

    def close(self) -> None:
        """Close this process's handle (an inherited one is parked); re-opens on next use."""
        with self._own_lock():
            value, self._value = self._value, None
            mine, self._pid = self._pid == os.getpid(), None
        if value is None:
            return
        if not mine:
            park(value)
        elif self.closer is not None:
            self.closer(value)

    def __getstate__(self) -> dict[str, Any]:
        return {"opener": self.opener, "closer": self.closer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["opener"], state["closer"])  # type: ignore[misc]


SignalHandler = Callable[[int, FrameType | None], Any]

#: the signals whose handler a forked child must not keep
_OWN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def this_process_only(handler: SignalHandler) -> SignalHandler:
    """``handler``, acting only in the process that calls this (the one installing it).

    A child forked while it is installed (a recipe's ``multiprocessing.Pool`` with the
    fork context, a plain ``os.fork``) gets the default instead, as the fork happens:
    SIGINT raises ``KeyboardInterrupt``, any other signal ends the process, so
    ``Pool.terminate()`` ends such children as it expects to. (The signal is blocked
    over the fork and the default installed in the child before it is unblocked: a
    SIGTERM sent to a child still starting, which a busy machine makes common, would
    otherwise be dropped by the interpreter's own after-fork clean-up.) Should the
    handler be called in another process all the same, it does the default there too."""
    owner = os.getpid()

    def handle(signum: int, frame: FrameType | None) -> Any:
        if os.getpid() == owner:
            return handler(signum, frame)
        _default(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.raise_signal(signum)
        return None

    handle.spcache_owner = owner  # type: ignore[attr-defined]
    return handle


def handle_unless_ignored(signum: int, handler: SignalHandler) -> Any:
    """Install ``handler`` (made :func:`this_process_only`) for ``signum``, unless this
    process was started with ``signum`` ignored: ``nohup`` ignores SIGHUP so a run
    outlives its terminal, and a shell starts a background job (``cmd &`` in a script)
    with SIGINT ignored so the terminal's Ctrl-C leaves it alone; spcache keeps such an
    ignore, as Python itself does for SIGINT. Returns the previous handler, for
    ``signal.signal(signum, previous)`` afterwards (SIG_IGN when nothing was installed)."""
    current = signal.getsignal(signum)
    if current is signal.SIG_IGN:
        return current
    return signal.signal(signum, this_process_only(handler))


def _default(signum: int) -> None:
    signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


_blocked_over_fork: list[signal.Signals] = []


def _block_own_signals() -> None:
    here = os.getpid()
    mine = [s for s in _OWN_SIGNALS if getattr(signal.getsignal(s), "spcache_owner", 0) == here]
    _blocked_over_fork[:] = mine
    if mine:
        signal.pthread_sigmask(signal.SIG_BLOCK, mine)


def _defaults_in_child() -> None:
    blocked, _blocked_over_fork[:] = list(_blocked_over_fork), []
    for signum in blocked:
        _default(signum)
    if blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)


def _unblock_in_parent() -> None:
    blocked, _blocked_over_fork[:] = list(_blocked_over_fork), []
    if blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)


os.register_at_fork(
    before=_block_own_signals,
    after_in_child=_defaults_in_child,
    after_in_parent=_unblock_in_parent,
)
