"""ProcessLocal: one handle per process; inherited handles are parked, never closed."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle

from cache_store import process_local
from cache_store.process_local import ProcessLocal


class _Handle:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.closed_in: list[int] = []

    def close(self) -> None:
        self.closed_in.append(os.getpid())


def _in_child(local: ProcessLocal[_Handle], out: mp.Queue) -> None:
    inherited = local._value
    mine = local.get()
    local.close()
    out.put(
        (
            mine is not inherited,
            mine.pid == os.getpid(),
            mine.closed_in == [os.getpid()],
            inherited.closed_in == [],
            process_local.is_parked(inherited),
        )
    )


def test_opens_once_per_process_and_parks_the_inherited_handle() -> None:
    local = ProcessLocal(_Handle, _Handle.close)
    assert local.peek() is None  # nothing until first use
    first = local.get()
    assert local.get() is first and local.peek() is first and first.pid == os.getpid()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(local, out))
    child.start()
    assert out.get(timeout=30) == (True, True, True, True, True)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert local.get() is first and first.closed_in == []  # the child never closed ours
    local.close()
    assert first.closed_in == [os.getpid()] and local.peek() is None
    assert local.get() is not first  # re-opens on next use


def test_pickles_without_its_handle() -> None:
    local = ProcessLocal(_Handle, _Handle.close)
    local.get()
    copy = pickle.loads(pickle.dumps(local))
    assert copy.peek() is None and copy.opener is _Handle
    assert isinstance(copy.get(), _Handle)


def test_a_signal_handler_acts_only_in_the_process_that_installed_it() -> None:
    """A child forked while the handler is installed ends on SIGTERM as by default (a
    recipe's ``multiprocessing.Pool`` is terminated that way), also when the signal
    arrives while the child is still starting (the interpreter's after-fork clean-up
    would drop it); the parent's handler still runs in the parent."""
    import signal
    import time

    from cache_store.process_local import this_process_only

    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, this_process_only(lambda n, f: seen.append(n)))
    try:
        for _ in range(20):
            pid = os.fork()
            if pid == 0:
                time.sleep(60)  # the parent's handler would only note the signal: still here
                os._exit(3)
            os.kill(pid, signal.SIGTERM)  # at once: the child may not have started yet
            deadline = time.monotonic() + 60
            while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    raise AssertionError("a forked child kept the parent's SIGTERM handler")
                time.sleep(0.01)
            status = done[1]
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
