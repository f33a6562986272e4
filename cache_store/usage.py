"""When each fingerprint of a cache was last read and last written: ``<cache>/usage/``.

One empty file per fingerprint and kind, ``<fp>.read`` and ``<fp>.written``, whose
modification time is the answer. Touching one is a single ``utime`` (no lock, no
database, safe from any number of processes, nothing to repair after a kill), and it is
done rarely: a :class:`~cache_store.readers.dataset.CachedDataset` once when it opens, the
service at most once an hour per fingerprint, a writer at most once a minute per
fingerprint per process. ``spcache ls`` shows them and ``spcache prune`` evicts the least
recently used first.

A cache the caller cannot write to (a read-only medium) simply records nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

__all__ = [
    "USAGE_DIR",
    "note_read",
    "note_written",
    "last_read",
    "last_written",
    "forget",
    "Throttle",
]

log = logging.getLogger(__name__)

USAGE_DIR = "usage"


def _touch(cache: str | os.PathLike[str], fingerprint: str, kind: str) -> None:
    folder = Path(cache) / USAGE_DIR
    path = folder / f"{fingerprint}.{kind}"
    try:
        try:
            os.utime(path)
        except FileNotFoundError:
            folder.mkdir(exist_ok=True)
            path.touch()
    except OSError as exc:  # read-only medium, no permission: usage is advice only
        log.debug("cannot record %s of %s in %s: %s", kind, fingerprint, folder, exc)


def _mtime(cache: str | os.PathLike[str], fingerprint: str, kind: str) -> float | None:
    try:
        return os.stat(Path(cache) / USAGE_DIR / f"{fingerprint}.{kind}").st_mtime
    except OSError:
        return None


def note_read(cache: str | os.PathLike[str], fingerprint: str) -> None:
    """Record that ``fingerprint`` was read now."""
    _touch(cache, fingerprint, "read")


def note_written(cache: str | os.PathLike[str], fingerprint: str) -> None:
    """Record that ``fingerprint`` was written now."""
    _touch(cache, fingerprint, "written")


def last_read(cache: str | os.PathLike[str], fingerprint: str) -> float | None:
    """Seconds since the epoch of the last recorded read, or None."""
    return _mtime(cache, fingerprint, "read")


def last_written(cache: str | os.PathLike[str], fingerprint: str) -> float | None:
    """Seconds since the epoch of the last recorded write, or None."""
    return _mtime(cache, fingerprint, "written")


def forget(cache: str | os.PathLike[str], fingerprint: str) -> None:
    """Drop the usage marks of a removed fingerprint."""
    for kind in ("read", "written"):
        with contextlib.suppress(OSError):
            os.unlink(Path(cache) / USAGE_DIR / f"{fingerprint}.{kind}")


class Throttle:
    """Calls ``note(cache, fingerprint)`` at most once per ``every_s`` per fingerprint in
    this process: cheap enough to ask on every read (a dict lookup and a clock read)."""

    def __init__(self, note: object, every_s: float) -> None:
        self.note = note
        self.every_s = every_s
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def __call__(self, cache: str | os.PathLike[str], fingerprint: str) -> None:
        key = (os.fspath(cache), fingerprint)
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            return
        with self._lock:
            self._last[key] = now
        self.note(cache, fingerprint)  # type: ignore[operator]
