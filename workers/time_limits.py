"""Time limits: no sample holds a stage of the engine past its limit.

Each sample has two stages, each with the same limit: *loading* (read, parse and the
recipe's ``prepare``) and ``compute``. The limit is the run's ``time_limit_s``
(:class:`~cache_store.engine_options.EngineOptions`) when given, else the recipe's
``time_limit_s`` class attribute (default
:data:`~cache_store.engine_options.DEFAULT_TIME_LIMIT_S`, 600 s): :func:`limit_for`.

How a stage past its limit is ended depends on where it runs:

* **In a loader process** (loading, ``loaders`` > 0): the engine knows when the loader
  began the sample and, past the limit, terminates the loader processes and starts fresh
  ones; the sample fails naming the limit, the other samples are loaded again
  (:class:`workers.loader.LoaderPool`).
* **In the engine's own process** (``compute``; loading too with ``loaders=0``): a
  watchdog thread, :class:`SampleClock`, calls the engine's overrun handler when the
  limit passes.

  - ``spcache worker`` (and the service's worker child) hands it
    :class:`workers.worker_loop.WorkerLoop`'s: the sample's attempt fails in the queue
    naming the limit, the other items it holds are handed back, and the process exits
    with :data:`~cache_store.jobs.worker_state.OVERRUN_EXIT`; its supervisor starts a
    fresh one at once. The sample fails for good when its attempts are spent. A fresh
    process is the only clean state after a computation that would not end.
  - Elsewhere (``spcache precompute``, :func:`spcache.precompute`, a Ray actor) the
    computation is interrupted: :class:`SampleTimeLimit` is raised inside it (a real
    SIGALRM to the main thread, so a sleeping or waiting computation wakes; an
    asynchronous exception in any other thread), the sample fails alone, naming the
    limit, and the run goes on. A computation that does not give the interpreter back
    within :data:`STOP_GRACE_S` more (native code holding the GIL) cannot be
    interrupted from inside: where the process is spcache's own (the command line, a
    Ray actor: :func:`own_the_process`) it ends with one line naming the sample and
    the limit (exit 1; what was committed stays, a rerun skips it); in a caller's own
    process (a notebook, a script) an ERROR line says which sample is stuck, as spcache
    cannot end a process it does not own.

:class:`SampleClock` also says which sample the process is on, since when, and calls
its ``on_stuck`` once a stage has run half its limit (at most 30 s): the worker then
writes a heartbeat, so ``/readyz`` and the status page name the sample it is stuck on.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cache_store.engine_options import DEFAULT_TIME_LIMIT_S
from cache_store.jobs.worker_state import stuck_after

__all__ = [
    "STOP_GRACE_S",
    "Overrun",
    "SampleClock",
    "SampleTimeLimit",
    "limit_for",
    "own_the_process",
]

log = logging.getLogger(__name__)

#: how long an interrupted computation has to give the interpreter back
STOP_GRACE_S = 10.0

_OWN_PROCESS = False


def own_the_process() -> None:
    """Say that this process is spcache's own (the command line, a Ray actor): a
    computation that cannot be interrupted past its limit may end it."""
    global _OWN_PROCESS
    _OWN_PROCESS = True


def limit_for(recipe: Any, time_limit_s: float | None) -> float:
    """The limit of each stage of a sample: the run's ``time_limit_s`` when given, else
    the recipe's ``time_limit_s`` (the default for every recipe when it declares none)."""
    if time_limit_s is not None:
        return float(time_limit_s)
    return float(getattr(recipe, "time_limit_s", DEFAULT_TIME_LIMIT_S))


class SampleTimeLimit(BaseException):
    """Raised inside a stage that ran past its limit. A ``BaseException``, like
    ``KeyboardInterrupt``: a recipe's ``except Exception`` does not swallow it."""


@dataclass(frozen=True)
class Overrun:
    """One stage of one sample, and its limit (``started``: wall-clock seconds)."""

    sample_id: str
    path: str
    stage: str  # "prepare" (loading: read, parse, prepare) or "compute"
    limit_s: float
    started: float

    @property
    def reason(self) -> str:
        """The sample's failure reason once it ran past the limit."""
        what = "compute()" if self.stage == "compute" else "loading (read, parse, prepare())"
        return f"{what} did not finish within its time limit of {self.limit_s:g} s"

    def as_json(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        return {
            "sample_id": self.sample_id,
            "path": self.path,
            "stage": self.stage,
            "since": self.started,
            "running_s": round(max(0.0, now - self.started), 1),
            "limit_s": self.limit_s,
        }


@dataclass
class _Watch:
    overrun: Overrun
    deadline: float  # monotonic
    notice_at: float  # monotonic
    thread_id: int
    noticed: bool = False
    fired: bool = False
    scheduled_async: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class SampleClock:
    """The watchdog of the stages run in this process.

    Args:
        on_overrun: called (in the watchdog thread) with the :class:`Overrun` of a stage
            past its limit; None: interrupt the stage (see the module doc).
        on_stuck: called (in the watchdog thread) once a stage has run half its limit
            (at most 30 s: :func:`~cache_store.jobs.worker_state.stuck_after`).
    """

    def __init__(
        self,
        on_overrun: Callable[[Overrun], None] | None = None,
        on_stuck: Callable[[Overrun], None] | None = None,
    ) -> None:
        self.on_overrun = on_overrun
        self.on_stuck = on_stuck
        self._cond = threading.Condition()
        self._watch: _Watch | None = None
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._interrupting = False
        # (pid, previous handler) while this clock's SIGALRM handler is installed
        self._alarm: tuple[int, Any] | None = None

    def current(self) -> Overrun | None:
        """The stage being watched now (which sample, since when, its limit), or None."""
        watch = self._watch
        return watch.overrun if watch is not None else None

    @contextlib.contextmanager
    def watch(self, sample_id: str, path: str, stage: str, limit_s: float) -> Iterator[None]:
        """Watch one stage of one sample run by the calling thread for ``limit_s``."""
        now = time.monotonic()
        watch = _Watch(
            Overrun(sample_id, str(path), stage, float(limit_s), time.time()),
            deadline=now + limit_s,
            notice_at=now + stuck_after(limit_s),
            thread_id=threading.get_ident(),
        )
        with self._cond:
            self._watch = watch
            self._start_thread()
            self._cond.notify_all()
        try:
            yield
        finally:
            self._interrupting = False  # a SIGALRM handled from here on is ignored
            with self._cond:
                self._watch = None
                if watch.scheduled_async:  # not raised yet: it must not land elsewhere
                    _async_raise(watch.thread_id, None)
                watch.done.set()
                self._cond.notify_all()

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Let this clock interrupt the main thread (its SIGALRM handler, for the
        duration); elsewhere a no-op: other threads are interrupted without one."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGALRM, self._on_alarm)
        self._alarm = (os.getpid(), previous)
        try:
            yield
        finally:
            self._alarm = None
            signal.signal(signal.SIGALRM, previous)

    def _on_alarm(self, signum: int, frame: Any) -> None:
        if self._interrupting and os.getpid() == self._pid:
            self._interrupting = False
            raise SampleTimeLimit
        previous = self._alarm[1] if self._alarm is not None else None
        if callable(previous):  # someone else's alarm
            previous(signum, frame)

    def _start_thread(self) -> None:
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._pid = os.getpid()
            self._thread = threading.Thread(
                target=self._run, name="spcache-time-limits", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                watch = self._watch
                while watch is None or watch.fired:
                    if watch is None:  # nothing watched: the thread ends with the run
                        self._thread = None  # under the lock: the next watch starts one
                        return
                    self._cond.wait()
                    watch = self._watch
                now = time.monotonic()
                due = watch.deadline if watch.noticed else watch.notice_at
                if now < due:
                    self._cond.wait(due - now)
                    continue
            if not watch.noticed:
                watch.noticed = True
                self._call(self.on_stuck, watch.overrun)
                continue
            watch.fired = True
            if self.on_overrun is not None:
                self._call(self.on_overrun, watch.overrun)
            else:
                self._interrupt(watch)

    @staticmethod
    def _call(callback: Callable[[Overrun], None] | None, overrun: Overrun) -> None:
        if callback is None:
            return
        try:
            callback(overrun)
        except Exception:  # the watchdog goes on watching
            log.exception("time limit handler failed for sample %s", overrun.sample_id)

    def _interrupt(self, watch: _Watch) -> None:
        """Raise :class:`SampleTimeLimit` in the stage's thread; end the process, or say
        so, when it does not stop within :data:`STOP_GRACE_S`."""
        overrun = watch.overrun
        log.warning(
            "sample %s (%s): %s; stopping it", overrun.sample_id, overrun.path, overrun.reason
        )
        with self._cond:
            if self._watch is not watch:
                return  # it ended meanwhile
            alarm = self._alarm
            if (
                watch.thread_id == threading.main_thread().ident
                and alarm is not None
                and alarm[0] == os.getpid()
            ):
                self._interrupting = True
                signal.pthread_kill(watch.thread_id, signal.SIGALRM)
            else:
                watch.scheduled_async = _async_raise(watch.thread_id, SampleTimeLimit)
        if watch.done.wait(STOP_GRACE_S):
            return
        line = (
            f"spcache: sample {overrun.sample_id} ({overrun.path}): {overrun.reason}, and it "
            f"did not stop within {STOP_GRACE_S:g} s more (native code that does not "
            f"return to Python)"
        )
        if _OWN_PROCESS:
            with contextlib.suppress(OSError):
                os.write(2, (line + "; ending the process (what was committed is kept)\n").encode())
            os._exit(1)
        log.error("%s; spcache cannot end a process it does not own: stop it yourself", line)


def _async_raise(thread_id: int, exc: type[BaseException] | None) -> bool:
    """Schedule ``exc`` in the thread ``thread_id`` (None: cancel a scheduled one)."""
    target = ctypes.py_object(exc) if exc is not None else ctypes.c_void_p(0)
    changed = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), target)
    return bool(changed) and exc is not None
