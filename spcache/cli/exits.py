"""Exit statuses of the ``spcache`` commands, from one table (as ``service/errors.py``
maps errors to HTTP statuses).

* 0: all went well;
* 1: the command ran but did not succeed: some samples failed, the cache did not verify,
  the disk filled up, the cache is busy or damaged, a snapshot was not exported;
* 2: the command cannot run as given: bad usage, an unknown name or parameter, a path
  that is missing or of the wrong kind or not permitted, a backend that cannot run here;
* 130: interrupted (Ctrl-C, SIGTERM, SIGHUP);
* 141 (128 + SIGPIPE): stdout was closed by its reader (``spcache ls | head -1``), as a
  shell reports any tool that SIGPIPE ended.

A command returns 0 or 1 itself for its results (``precompute``: some samples failed;
``verify``: problems found); an error it raises is printed as one line and mapped by
:data:`EXIT_BY_ERROR`, the same for every command.
"""

from __future__ import annotations

import os
import signal
import sys

from cache_store.errors import (
    BackendUnavailable,
    CacheDamaged,
    CacheNotFound,
    CorruptRecord,
    FingerprintLookupError,
    InvalidSampleId,
    JobNotFound,
    MissTimeout,
    NoWorkerAlive,
    ParameterError,
    QueueDamaged,
    ReadOnlyStoreError,
    RecordNotFound,
    SampleFailed,
    SourceError,
    SpcacheError,
    StoreBusy,
    StoreFull,
    UnknownName,
    UsageError,
)

__all__ = [
    "EXIT_BY_ERROR",
    "FAILED",
    "INTERRUPTED",
    "OK",
    "STDOUT_CLOSED",
    "USAGE",
    "exit_status",
    "stdout_closed",
]

OK = 0
FAILED = 1
USAGE = 2
INTERRUPTED = 130
STDOUT_CLOSED = 128 + signal.SIGPIPE

#: Most specific class first; the first ``isinstance`` match wins. An exception of no
#: class here is a bug: it keeps its traceback.
EXIT_BY_ERROR: tuple[tuple[type[BaseException], int], ...] = (
    # the command ran, and did not succeed
    (StoreFull, FAILED),  # what was committed before it is kept
    (StoreBusy, FAILED),  # a compaction or a writer holds it: try again
    (CacheDamaged, FAILED),
    (QueueDamaged, FAILED),
    (CorruptRecord, FAILED),
    (SampleFailed, FAILED),
    (NoWorkerAlive, FAILED),
    (MissTimeout, FAILED),
    # the command cannot run as given
    (UsageError, USAGE),
    (ParameterError, USAGE),
    (UnknownName, USAGE),
    (SourceError, USAGE),
    (InvalidSampleId, USAGE),
    (FingerprintLookupError, USAGE),
    (RecordNotFound, USAGE),  # a fingerprint or sample the cache does not hold
    (JobNotFound, USAGE),
    (CacheNotFound, USAGE),
    (ReadOnlyStoreError, USAGE),  # rm, prune, compact of a snapshot
    (BackendUnavailable, USAGE),  # also Ray missing or unreachable
    (SpcacheError, FAILED),  # any other: an operation that did not succeed
    # a path the command was given
    (FileNotFoundError, USAGE),
    (NotADirectoryError, USAGE),
    (IsADirectoryError, USAGE),
    (PermissionError, USAGE),
    (OSError, FAILED),  # the disk or the network failed underneath
    (ValueError, USAGE),  # a malformed value (a size, a duration, a JSON option)
)


def exit_status(exc: BaseException) -> int | None:
    """The exit status for ``exc`` (:data:`EXIT_BY_ERROR`), or None where it is not an
    error a command reports."""
    for cls, status in EXIT_BY_ERROR:
        if isinstance(exc, cls):
            return status
    return None


def stdout_closed() -> int:
    """stdout's reader went away (``| head``): point stdout at /dev/null, so the
    interpreter's last flush finds nothing to fail on, and return :data:`STDOUT_CLOSED`:
    no traceback, no message (the reader asked for no more)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind stdout (embedded, captured)
        pass
    return STDOUT_CLOSED
