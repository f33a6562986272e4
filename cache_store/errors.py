"""One error root for the whole project, and every error class.

Every error spcache raises on purpose derives from :class:`SpcacheError` and is defined
here (the service's answers and the Ray engine's included), and the specific ones also
derive from the built-in exception that carries the same meaning, so callers that
already catch ``KeyError`` or ``ValueError`` keep working. :data:`__all__` is the one list
of them: ``spcache`` and ``cache_store`` export exactly it. The service maps these
classes to HTTP status codes in one place (``service/errors.py``), the command line to
exit statuses in another (``spcache/cli/exits.py``).

:func:`one_line` is the one way an error becomes a line of text (a log line, a failure
reason, a command's last word). An error crosses a process boundary one way, coming back
as its own class with its message and attributes, its constructor not run: as plain
values (:func:`error_values`, :func:`error_from_values`: a housekeeping child's JSON
answer, a Ray actor's error) or pickled (``SpcacheError.__reduce__``: a process pool's
result), both through one rebuild.
"""

from __future__ import annotations

import datetime as _dt
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

#: every error class, the one list (``spcache`` and ``cache_store`` export exactly these);
#: the functions below are imported by name
__all__ = [
    "SpcacheError",
    "RecordNotFound",
    "FingerprintRemoved",
    "CorruptRecord",
    "UnsupportedFormat",
    "InvalidSampleId",
    "SourceError",
    "UnknownName",
    "RecipeUnusable",
    "ParameterError",
    "UsageError",
    "FingerprintLookupError",
    "ReadOnlyStoreError",
    "StoreBusy",
    "StoreFull",
    "CacheNotFound",
    "CacheDamaged",
    "QueueDamaged",
    "JobNotFound",
    "InvalidTensor",
    "TensorTypeError",
    "BackendUnavailable",
    "SampleFailed",
    "NoWorkerAlive",
    "MissTimeout",
    "StaleRecord",
    "CacheOwned",
    "LimitTooSmall",
    "CommitConflict",
    "RayUnavailable",
    "ResponseTooLarge",
    "ReadBudgetBusy",
    "WaitingFull",
]


#: How torch's DataLoader re-raises a loader worker's exception in the training process:
#: ``type(exc)(text)``, the text being "Caught <Name> in DataLoader worker process <n>.",
#: then the worker's traceback, whose last line is "<module>.<Name>: <its message>".
_FROM_WORKER = re.compile(r"Caught \w+ in DataLoader worker process \d+\.\n")


class SpcacheError(Exception):
    """Root of every error raised by spcache on purpose.

    Raised in a DataLoader worker, an error reaches the training process as the same
    class with torch's text as its message (the worker's traceback included): every
    subclass accepts that text in place of its own arguments, and reads its attributes
    back from the original message at the end of it (``message_fields``; None where
    the message does not give one). ``except SampleFailed as exc: exc.sample_id`` works
    the same with ``num_workers=0`` or 8."""

    #: the message ``__init__`` makes, as a regex whose named groups are attributes
    message_fields: ClassVar[re.Pattern[str] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = _accepting_worker_text(init)  # type: ignore[method-assign]

    def __str__(self) -> str:  # KeyError would quote the message; keep it readable.
        return str(self.args[0]) if self.args else self.__class__.__name__

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (a process pool's result, multiprocessing): rebuilt on the other side as
        its own class with its message and attributes, its constructor not run (a
        subclass's ``__init__`` takes other arguments than its message, so the default,
        calling it with ``args``, failed and broke the pool instead of raising)."""
        return (_rebuilt, (type(self), self.args, dict(vars(self))))

    def _from_worker(self, text: str) -> None:
        """Become the error torch rebuilt from ``text`` (see the class docstring)."""
        Exception.__init__(self, text)
        pattern = type(self).message_fields
        if pattern is None:
            return
        original = _original_message(text, type(self).__name__)
        found = pattern.fullmatch(original) if original is not None else None
        for name in pattern.groupindex:
            setattr(self, name, found.group(name) if found else None)


def _accepting_worker_text(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: SpcacheError, *args: Any, **kwargs: Any) -> None:
        text = args[0] if len(args) == 1 and not kwargs else None
        if isinstance(text, str) and _FROM_WORKER.match(text):
            self._from_worker(text)
            return
        init(self, *args, **kwargs)

    return __init__


def _original_message(text: str, name: str) -> str | None:
    """The message of the worker's exception: the last "<module>.<name>: ..." line."""
    line = re.compile(rf"(?:[\w.]+\.)?{re.escape(name)}: (.*)")
    for candidate in reversed(text.rstrip("\n").splitlines()):
        found = line.fullmatch(candidate)
        if found:
            return found.group(1)
    return None


class RecordNotFound(SpcacheError, KeyError):
    """No record under ``key`` in the cache at ``cache``."""

    message_fields = re.compile(r"no record ['\"](?P<key>.*?)['\"](?: in cache (?P<cache>.*))?")

    def __init__(self, key: str, cache: str = "") -> None:
        where = f" in cache {cache}" if cache else ""
        super().__init__(f"no record {key!r}{where}")
        self.key = key
        self.cache = cache


class FingerprintRemoved(RecordNotFound):
    """Every record of ``fingerprint`` was removed from the cache (``spcache rm`` or
    ``prune``) at ``removed_at`` (seconds since the epoch). A ``RecordNotFound``, so code
    that handles a missing record handles this one too; the message says why.

    Rebuilt from a DataLoader worker's text (see :class:`SpcacheError`), ``fingerprint``
    and ``key`` are read back from it. Pickled, it keeps every field."""

    def __init__(
        self, fingerprint: str, cache: str = "", removed_at: float | None = None, key: str = ""
    ) -> None:
        when = (
            ""
            if removed_at is None
            else " at "
            + _dt.datetime.fromtimestamp(removed_at, _dt.UTC).isoformat(timespec="seconds")
        )
        where = f" from cache {cache}" if cache else ""
        what = f"record {key!r}: " if key else ""
        Exception.__init__(
            self,
            f"{what}fingerprint {fingerprint} was removed{where}{when} "
            f"(spcache rm/prune); compute it again to read it",
        )
        self.key = key or fingerprint
        self.cache = cache
        self.fingerprint = fingerprint
        self.removed_at = removed_at

    def _from_worker(self, text: str) -> None:
        _rebuild_removed(self, text)


_REMOVED_TEXT = re.compile(r"(?:record '([^'\n]*)': )?fingerprint ([0-9a-f]{32}) was removed")


def _rebuild_removed(error: FingerprintRemoved, message: str) -> None:
    """Fill ``error`` from its own message (the last one in it: a worker's traceback
    quotes the original at its end)."""
    Exception.__init__(error, message)
    found = list(_REMOVED_TEXT.finditer(message))
    error.fingerprint = found[-1].group(2) if found else ""
    error.key = (found[-1].group(1) or error.fingerprint) if found else message
    error.cache = ""
    error.removed_at = None


class CorruptRecord(SpcacheError, ValueError):
    """The bytes stored under ``key`` are not a valid record (``reason`` says why)."""

    message_fields = re.compile(r"corrupt record ['\"](?P<key>.*?)['\"]: (?P<reason>.*)")

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"corrupt record {key!r}: {reason}")
        self.key = key
        self.reason = reason


class UnsupportedFormat(CorruptRecord):
    """A stored thing carries a format version this code does not know."""


class InvalidSampleId(SpcacheError, ValueError):
    """A sample id that may not become part of a key."""

    def __init__(self, sample_id: object, reason: str) -> None:
        shown = repr(sample_id)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid sample id {shown}: {reason}")
        self.sample_id = sample_id
        self.reason = reason


class SourceError(SpcacheError, ValueError):
    """A source file (mesh or point cloud) that cannot become a record."""

    # split at the first ": " (a reason often holds one; a path seldom does)
    message_fields = re.compile(r"(?P<path>.*?): (?P<reason>.*)")

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class UnknownName(SpcacheError, KeyError):
    """A name looked up in a registry (recipes, stores, backends) that is not there."""

    def __init__(self, kind: str, name: object, known: Iterable[str]) -> None:
        known = sorted(known)
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(known) or '(none)'}")
        self.kind = kind
        self.name = name
        self.known = known


class RecipeUnusable(UnknownName):
    """A recipe that is installed (a plugin) but cannot be used: its class breaks the
    contract or its constructor raises. ``reason`` is the registry's line for it (which
    entry, and why); the recipe is not among the ``known`` ones."""

    def __init__(self, name: object, reason: str, known: Iterable[str]) -> None:
        SpcacheError.__init__(self, f"recipe {name!r} cannot be used: {reason}")
        self.kind = "recipe"
        self.name = name
        self.known = sorted(known)
        self.reason = reason


class ParameterError(SpcacheError, ValueError):
    """Recipe (or request) parameters that do not fit their schema.

    ``problems`` lists one human-readable line per offending parameter.
    """

    def __init__(self, problems: Iterable[str], what: str = "parameters") -> None:
        problems = list(problems)
        super().__init__(f"invalid {what}: " + "; ".join(problems))
        self.problems = problems


class UsageError(SpcacheError, ValueError):
    """An option, a source list or a location that cannot be used as given (a device
    name, a negative count, no source found, a cache directory that cannot be made): the
    command line exits 2 for it, and :func:`spcache.precompute` raises it."""


class FingerprintLookupError(SpcacheError, LookupError):
    """A recipe name plus parameters that select no, or more than one, fingerprint."""

    def __init__(self, message: str, candidates: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.candidates = list(candidates)


class ReadOnlyStoreError(SpcacheError, PermissionError):
    """A write attempted on a store opened read-only."""


class StoreBusy(SpcacheError):
    """The store cannot serve this read now (e.g. LMDB's reader table is full); retry later."""


class StoreFull(SpcacheError, OSError):
    """A write failed for lack of space (or an I/O error) on the cache's disk; retrying
    the same write will fail the same way until space is freed."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"no space left on {path}: {reason}")
        self.path = str(path)
        self.reason = reason


class CacheDamaged(SpcacheError):
    """The cache's storage itself (not one record) is damaged: a page of the LMDB file
    cannot be read, or a walk over it aborted. ``cache`` names it, ``reason`` says why.
    Recovery: ``spcache verify --salvage DEST`` copies what is still readable."""

    def __init__(self, cache: object, reason: str) -> None:
        super().__init__(f"cache damaged: {cache}: {reason}")
        self.cache = str(cache)
        self.reason = reason


class QueueDamaged(SpcacheError):
    """The job queue's file was deleted, replaced or truncated under a running process."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"job queue damaged: {path}: {reason}")
        self.path = str(path)
        self.reason = reason


class CacheNotFound(SpcacheError, FileNotFoundError):
    """No cache at ``path`` (a reader opened a location that holds none)."""

    def __init__(self, path: object, reason: str = "no cache there") -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class JobNotFound(SpcacheError, KeyError):
    """No job with this id in the queue."""

    def __init__(self, job_id: object) -> None:
        super().__init__(f"no job {job_id!r}")
        self.job_id = job_id


class InvalidTensor(SpcacheError, ValueError):
    """A tensor argument with the wrong shape, range or content (the message names it)."""


class TensorTypeError(SpcacheError, TypeError):
    """A tensor argument of the wrong dtype, or not a tensor at all (the message names it)."""


class BackendUnavailable(SpcacheError, RuntimeError):
    """A known compute backend (e.g. ``kaolin``) that cannot run here; ``reason`` says why."""

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"backend {backend!r} is unavailable: {reason}")
        self.backend = backend
        self.reason = reason


class SampleFailed(SpcacheError):
    """A sample could not be computed (e.g. a bad mesh); the message names its id, its
    source path and the reason the worker recorded. Other samples are unaffected."""

    message_fields = re.compile(
        r"sample ['\"](?P<sample_id>.*?)['\"] \((?P<path>.*?)\) failed: (?P<reason>.*)"
    )

    def __init__(self, sample_id: object, path: object = None, reason: object = None) -> None:
        super().__init__(f"sample {sample_id!r} ({path}) failed: {reason}")
        self.sample_id = sample_id
        self.path = path
        self.reason = reason


class NoWorkerAlive(SpcacheError, RuntimeError):
    """A read-through miss with no worker alive to compute it (the message says how to
    start one)."""


class MissTimeout(SpcacheError, TimeoutError):
    """A read-through miss whose record did not land within ``miss_timeout``."""


class StaleRecord(SpcacheError):
    """A stored record was computed from other bytes than its source holds now (the
    source was edited, or another file stands under the same sample id), read with
    ``on_stale="error"``. The message names the key, the source and both hashes."""

    message_fields = re.compile(
        r"record ['\"](?P<key>.*?)['\"] is stale: it was computed from a source with "
        r"hash \S+, and (?P<path>.*) now hashes to \S+"
    )

    def __init__(
        self, key: object, path: object = None, stored: object = None, current: object = None
    ) -> None:
        super().__init__(
            f"record {key!r} is stale: it was computed from a source with "
            f"hash {stored}, and {path} now hashes to {current}"
        )
        self.key = key
        self.path = path


class CacheOwned(SpcacheError):
    """Another live worker holds the cache's worker lock (:mod:`cache_store.jobs.owner_lock`);
    ``holder`` is what it wrote into the lock file, ``described`` that as a phrase."""

    def __init__(self, cache: object, holder: dict[str, Any], described: str) -> None:
        super().__init__(f"{cache}: already owned by {described}")
        self.cache = str(cache)
        self.holder = holder


class LimitTooSmall(UsageError):
    """A size limit (``spcache prune --max-size``, a worker's ``--max-size``) smaller
    than a fingerprint that has to be kept."""


class CommitConflict(SpcacheError):
    """A sharded snapshot's manifest of that name is already committed (a second attempt
    of one part)."""


class RayUnavailable(BackendUnavailable):
    """Ray is not installed, or the cluster cannot be reached or cannot host the actors."""

    def __init__(self, reason: str) -> None:
        super().__init__("ray", reason)


# The service's own answers (``service/errors.py`` gives each its HTTP status).


class ResponseTooLarge(SpcacheError):
    """The answer would be larger than one response may be (HTTP 413)."""


class ReadBudgetBusy(SpcacheError):
    """Other responses hold the process's read budget now; retry shortly (HTTP 503)."""


class WaitingFull(SpcacheError):
    """Every read-through wait slot is taken (``max_waiting_requests``); retry after
    ``Retry-After`` (see :mod:`service.read_through`)."""


#: The longest a sample's failure reason quotes an error (``one_line(exc,
#: limit=REASON_MAX)``): reasons are stored and shown in tables, where a traceback-sized
#: message would drown them.
REASON_MAX = 300


def one_line(exc: BaseException, *, with_class: bool = False, limit: int | None = None) -> str:
    """``exc``'s message on one line: whitespace runs folded, a ``KeyError``'s quotes
    taken off, the class name where the message is empty. ``with_class`` puts the class
    name first (``"ValueError: ..."``), for where the class says what happened (a
    loader's or a recipe's own error); ``limit`` cuts the message to at most that many
    characters (:data:`REASON_MAX` for a sample's failure reason)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, KeyError) and len(exc.args) == 1 and text.startswith(("'", '"')):
        text = " ".join(str(exc.args[0]).split())  # KeyError quotes its message
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    name = type(exc).__name__
    if not text:
        return name
    return f"{name}: {text}" if with_class else text


_PLAIN = (str, int, float, bool, list, tuple, type(None))


def error_values(exc: BaseException) -> dict[str, Any]:
    """``exc`` as plain values (JSON, or Ray's transport, carries them): its class name,
    its message and its attributes that are plain values. :func:`error_from_values`
    makes the error again on the other side."""
    attrs = {k: v for k, v in vars(exc).items() if isinstance(v, _PLAIN)}
    return {"error": type(exc).__name__, "message": str(exc), "attrs": attrs}


def error_from_values(values: Mapping[str, Any]) -> SpcacheError:
    """The error :func:`error_values` described, as its own class when it is one of
    this module's (its message and attributes restored, its constructor not run); any
    other class comes back as a :class:`SpcacheError` naming it."""
    name, message = str(values.get("error", "")), str(values.get("message", ""))
    cls = globals().get(name) if name in __all__ else None
    if not (isinstance(cls, type) and issubclass(cls, SpcacheError)):
        return SpcacheError(f"{name}: {message}" if name else message)
    return _rebuilt(cls, (message,), values.get("attrs") or {})


def _rebuilt(
    cls: type[SpcacheError], args: tuple[Any, ...], attrs: Mapping[str, Any]
) -> SpcacheError:
    """An error of class ``cls`` with ``args`` and attributes ``attrs``, its constructor not
    run: how an error comes back across a process boundary, pickled or as plain values."""
    error = cls.__new__(cls)
    error.args = args
    vars(error).update(attrs)
    return error
