"""Housekeeping: list, remove, prune and compact the fingerprints of a cache.

Four plain functions, used by ``spcache ls|rm|prune|compact``, by the service
(``DELETE /v1/caches/{fingerprint}``) and by a worker with ``--max-size``
(:class:`SizeLimit`):

* :func:`ls`: one row per fingerprint (recipe, records, exact bytes, failures, created,
  last written, last read, complete or partial against its index). Zarr snapshots are
  listed too; they are immutable, so the other three refuse them.
* :func:`rm`: cancel the fingerprint's queued items, forget its failures, write its
  tombstone and drop its index (one LMDB transaction), then delete its records in
  chunks. Every step is idempotent and each commit leaves a consistent cache, so a
  killed ``rm`` is finished by running it again.
* :func:`prune`: least recently used first (last read or written, else created); never
  a fingerprint with queue items pending or running, nor one named in ``protect``;
  ``keep`` alone keeps the N most recently used and removes the rest; a ``max_size``
  the kept ones do not fit in is refused before anything is removed.
* :func:`compact`: give the disk back (LMDB never shrinks its file by itself):
  :func:`cache_store.stores.lmdb.compact_environment`.

Sizes are the bytes of the stored records; ``data.mdb`` is at least that, and does not
shrink until :func:`compact` (LMDB reuses the freed pages for later writes).

Why one module: ls, rm, prune and compact share one view of a cache (sizes, last use,
queued work, removal markers); split, each would re-derive it.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cache_store import usage
from cache_store.errors import (
    CacheNotFound,
    CorruptRecord,
    FingerprintLookupError,
    FingerprintRemoved,
    ReadOnlyStoreError,
    SpcacheError,
)
from cache_store.keys import is_fingerprint
from cache_store.recipes.specs import RECIPE_SPECS
from cache_store.location import LocationLike, parse_location
from cache_store.stores.base import open_store

__all__ = [
    "ls",
    "rm",
    "prune",
    "compact",
    "parse_size",
    "parse_duration",
    "format_size",
    "LimitTooSmall",
    "SizeLimit",
    "CacheEntry",
]

log = logging.getLogger(__name__)

_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: A prefix given to ``rm`` must be at least this long (and match one fingerprint).
MIN_PREFIX = 6


class LimitTooSmall(SpcacheError, ValueError):
    """A size limit smaller than a fingerprint that has to be kept."""


# --------------------------------------------------------------------------- parsing


def parse_size(text: str | int) -> int:
    """Bytes from ``"123"``, ``"500M"``, ``"2G"``, ``"1.5T"`` (K, M, G, T, P are powers of
    1024; a trailing ``B`` or ``iB`` is allowed). Raises ``ValueError`` naming the text."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(
            r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:I?B)?\s*", str(text), re.IGNORECASE
        )
        if match is None:
            raise ValueError(
                f"size {text!r}: expected a number of bytes, optionally with a "
                f"unit K, M, G, T (e.g. 500M, 2G, 1.5T)"
            )
        value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if value < 0:
        raise ValueError(f"size {text!r}: must not be negative")
    return value


def parse_duration(text: str | float) -> float:
    """Seconds from ``"45s"``, ``"90m"``, ``"12h"``, ``"30d"``, ``"2w"`` (any case, as
    sizes; or a number of seconds). Raises ``ValueError`` naming the text."""
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(text), re.IGNORECASE)
        if match is None:
            raise ValueError(
                f"duration {text!r}: expected a number with a unit s, m, h, d or w (e.g. 12h, 30d)"
            )
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2).lower() or "s"]
    if seconds < 0:
        raise ValueError(f"duration {text!r}: must not be negative")
    return seconds


def format_size(size: int) -> str:
    """``1536`` -> ``"1.5K"``: for messages and tables."""
    value = float(size)
    for unit in ("B", "K", "M", "G", "T"):
        if value < 1024 or unit == "T":
            return f"{int(value)}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{size}B"


def _iso(stamp: float | None) -> str | None:
    if stamp is None:
        return None
    return _dt.datetime.fromtimestamp(stamp, _dt.UTC).isoformat(timespec="seconds")


def _from_iso(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return _dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


# --------------------------------------------------------------------------- ls


@dataclass
class CacheEntry:
    """One fingerprint of a cache, as :func:`ls` reports it."""

    fingerprint: str
    recipe: str | None = None
    recipe_version: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    records: int = 0
    bytes: int = 0
    indexed: int = 0
    present: int = 0
    failed: int = 0
    created: float | None = None
    last_written: float | None = None
    last_read: float | None = None
    removed_at: float | None = None
    index_error: str | None = None
    #: code digest -> records computed by it (``"none"``: records that carry none)
    code_digests: dict[str, int] = field(default_factory=dict)

    @property
    def last_used(self) -> float:
        """What LRU order sorts by: the latest read or write recorded, else the index's
        creation (0: none known)."""
        marks = [t for t in (self.last_read, self.last_written) if t is not None]
        return max(marks) if marks else (self.created or 0.0)

    @property
    def state(self) -> str:
        if self.removed_at is not None:
            return "removing"  # tombstoned with records left: a killed rm; run it again
        if self.index_error:
            return "index unreadable"
        if self.recipe is None:
            return "failed" if not self.records and self.failed else "unindexed"
        return "complete" if self.present == self.indexed else "partial"

    @property
    def recipe_changed(self) -> bool | None:
        """Whether the installed recipe's version differs from the one that computed the
        records (None: not indexed)."""
        if self.recipe is None:
            return None
        spec = RECIPE_SPECS.get(self.recipe)
        return spec is None or spec.version != self.recipe_version

    @property
    def code_changed(self) -> bool | None:
        """Whether some of its records were computed by other recipe code than the
        installed recipe's (edited without a version bump), by the rule stats and the
        item route use. None: not indexed, the recipe is not installed here at this
        version, or no record carries a code digest."""
        from cache_store.recipes.registry import code_changed, installed_code_digest

        if self.recipe is None:
            return None
        installed = installed_code_digest(self.recipe, self.recipe_version)
        if installed is None:
            return None
        seen = {code_changed(installed, digest) for digest in self.code_digests}
        return True if True in seen else (False if False in seen else None)

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "recipe": self.recipe,
            "recipe_version": self.recipe_version,
            "params": self.params,
            "records": self.records,
            "bytes": self.bytes,
            "indexed": self.indexed,
            "state": self.state,
            "failed": self.failed,
            "created": _iso(self.created),
            "last_written": _iso(self.last_written),
            "last_read": _iso(self.last_read),
            "recipe_changed": self.recipe_changed,
            "code_changed": self.code_changed,
        }


def _is_snapshot(cache: str | os.PathLike[str]) -> bool:
    return parse_location(cache).kind == "zarr"


def _cache_root(cache: LocationLike) -> Path:
    """The directory of a local cache location (``file://`` stripped); a snapshot or a
    URL is refused by name, never folded by ``Path`` into a local ``s3:/...``."""
    where = parse_location(cache)
    if where.kind != "lmdb" or not where.is_local:
        raise ReadOnlyStoreError(
            f"{cache}: a Zarr snapshot or remote cache is immutable here; "
            f"rm, prune and compact act on a cache directory"
        )
    return Path(where.target)


def _lmdb_store(cache: LocationLike, *, readonly: bool) -> Any:
    from cache_store.stores.lmdb import LMDBStore, has_cache

    root = _cache_root(cache)
    if not root.is_dir():
        raise CacheNotFound(root, "not a directory" if root.exists() else "no such directory")
    if not has_cache(root):
        raise CacheNotFound(root, "no cache here (records/data.mdb missing)")
    return LMDBStore(root, readonly=readonly)


def _entries(cache: str | os.PathLike[str], *, failure_only: bool = False) -> list[CacheEntry]:
    """Every fingerprint with an index or records (or a tombstone with records left),
    with exact sizes; with ``failure_only``, also those known only from remembered
    failures (every sample failed: no record, no index)."""
    if _is_snapshot(cache):
        return _snapshot_entries(cache)
    store = _lmdb_store(cache, readonly=True)
    try:
        stats = store.stats()["fingerprints"]
        removals = store.removals()
        entries = []
        for fp, info in stats.items():
            entry = CacheEntry(
                fp,
                records=int(info.get("records", 0)),
                bytes=int(info.get("bytes", 0)),
                removed_at=removals.get(fp),
                code_digests=dict(info.get("code_digests", {})),
            )
            if "index_error" in info:
                entry.index_error = str(info["index_error"])
            if "recipe" in info:
                entry.recipe, entry.recipe_version = info["recipe"], int(info["recipe_version"])
                entry.params = dict(info["params"])
                entry.indexed = int(info["samples"])
                entry.created = _from_iso(info.get("created"))
                if entry.indexed:
                    prefix = fp + "/"
                    stored = {key[len(prefix) :] for key in store.keys(prefix)}
                    try:
                        ids = store.get_index(fp).sample_ids.tolist()
                    except FingerprintRemoved as exc:  # removed since the walk above
                        entry.removed_at = exc.removed_at or time.time()
                        ids = []
                    entry.present = sum(1 for sid in ids if sid in stored)
            if entry.removed_at is not None and not entry.records:
                continue  # removed completely: nothing left to list
            entries.append(entry)
    finally:
        store.close()
    root = _cache_root(cache)
    failed = _failure_counts(root)
    if failure_only:  # not one removed: its failures are writes the removal refused
        listed = {e.fingerprint for e in entries} | set(removals)
        entries += [CacheEntry(fp) for fp in sorted(failed) if fp not in listed]
    for entry in entries:
        entry.failed = failed.get(entry.fingerprint, 0)
        entry.last_read = usage.last_read(root, entry.fingerprint)
        entry.last_written = usage.last_written(root, entry.fingerprint)
    return entries


def _snapshot_entries(cache: str | os.PathLike[str]) -> list[CacheEntry]:
    store = open_store(cache, readonly=True)
    try:
        stats = store.stats()["fingerprints"]
    finally:
        store.close()
    entries = []
    for fp, info in stats.items():
        entry = CacheEntry(
            fp,
            records=int(info.get("records", 0)),
            bytes=int(info.get("bytes", 0)),
            code_digests=dict(info.get("code_digests", {})),
        )
        if "recipe" in info:
            entry.recipe, entry.recipe_version = info["recipe"], int(info["recipe_version"])
            entry.params, entry.indexed = dict(info["params"]), int(info["samples"])
            entry.present = min(entry.indexed, entry.records)
            entry.created = _from_iso(info.get("created"))
        entries.append(entry)
    return entries


def _failure_counts(cache: Path) -> dict[str, int]:
    from cache_store.jobs.failures import failure_counts

    try:
        return failure_counts(cache)  # the failure log and the queue's failed items
    except Exception as exc:  # noqa: BLE001 - the counts are extra; say why they are absent
        log.warning("%s: failures unreadable: %s", cache, exc)
        return {}


def ls(cache: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """One JSON-able row per fingerprint of ``cache`` (a cache directory or a ``.zarr``
    snapshot), least recently used first: ``fingerprint``, ``recipe``,
    ``recipe_version``, ``params``, ``records``, ``bytes`` (exact), ``indexed``,
    ``state`` (complete / partial / unindexed / removing, or failed: nothing stored,
    only remembered failures), ``failed``, ``created``,
    ``last_written``, ``last_read`` (ISO 8601 UTC or None), ``recipe_changed`` (the
    installed recipe's version differs) and ``code_changed`` (some records were computed by
    other code than the installed recipe's, under the same version)."""
    entries = sorted(_entries(cache, failure_only=True), key=lambda e: (e.last_used, e.fingerprint))
    return [e.as_json() for e in entries]


# --------------------------------------------------------------------------- rm


def _queue(cache: Path) -> Any:
    from cache_store.jobs.queue import JOBS_FILENAME, JobQueue

    return JobQueue(cache) if (cache / JOBS_FILENAME).is_file() else None


def _has_bookkeeping(cache: Path) -> bool:
    """Whether ``cache`` holds a job queue or a failure log (it may have no records yet:
    a warm-up still queued, or a run whose every sample failed)."""
    from cache_store.jobs.failures import FAILURES_FILENAME
    from cache_store.jobs.queue import JOBS_FILENAME

    return (cache / JOBS_FILENAME).is_file() or (cache / FAILURES_FILENAME).is_file()


def _resolve(store: Any, cache: Path, names: Iterable[str]) -> tuple[list[str], set[str]]:
    """``(chosen, stored)``: the fingerprints named by ``names`` (whole, or a unique prefix
    of MIN_PREFIX+ chars), and which of them the store holds (an index or records).

    Known are those with an index or records (a tombstone with records left is a killed
    ``rm``), remembered failures, or queue items pending or running. A fingerprint
    removed completely is not known: naming it says it was already removed. All names
    are checked before anything is removed."""
    stored = (
        set() if store is None else set(store.fingerprints()) | set(store.record_fingerprints())
    )
    removals = {} if store is None else store.removals()
    # failures of a fingerprint removed completely are its in-flight writes refused by
    # the removal: they do not bring it back (queued work asked for since does)
    failures = set(_failure_counts(cache)) - set(removals)
    known = stored | failures | _active(cache)
    gone = {fp: when for fp, when in removals.items() if fp not in known}
    out, problems = [], []
    for name in names:
        text = str(name).strip().lower()
        if is_fingerprint(text):
            matches = [text] if text in known else []
            removed = [text] if text in gone else []
        elif len(text) >= MIN_PREFIX and re.fullmatch(r"[0-9a-f]+", text):
            matches = sorted(fp for fp in known if fp.startswith(text))
            removed = sorted(fp for fp in gone if fp.startswith(text))
        else:
            problems.append(
                f"{name!r}: not a fingerprint (32 hex characters, or a prefix of "
                f"at least {MIN_PREFIX})"
            )
            continue
        if len(matches) == 1:
            if matches[0] not in out:
                out.append(matches[0])
        elif not matches and len(removed) == 1:
            problems.append(
                f"{name!r}: fingerprint {removed[0]} was already removed from {cache}"
                + (f" at {_iso(gone[removed[0]])}" if gone[removed[0]] else "")
            )
        elif not matches:
            problems.append(f"{name!r}: no such fingerprint in {cache}")
        else:
            problems.append(
                f"{name!r}: matches {len(matches)} fingerprints "
                f"({', '.join(matches)}); give more characters"
            )
    if problems:
        listed = ", ".join(sorted(known)) or "none"
        raise FingerprintLookupError(
            "; ".join(problems) + f" (fingerprints here: {listed})", sorted(known)
        )
    return out, stored & set(out)


def rm(
    cache: str | os.PathLike[str],
    fingerprints: Iterable[str],
    *,
    failed: bool = False,
    compact_after: bool = False,
) -> list[dict[str, Any]]:
    """Remove fingerprints from a cache directory; one JSON-able report per fingerprint:
    ``fingerprint``, ``records`` and ``bytes`` deleted, ``cancelled`` queue items,
    ``failures`` forgotten.

    A fingerprint known only to the queue or the failure log (nothing stored yet) has
    its queued items cancelled and its failures forgotten; the store is not touched.
    With ``failed=True`` only the remembered failures (failure log and failed queue
    items) are cleared, so those samples are computed again when next asked for.
    Readers of a removed fingerprint get :class:`~cache_store.errors.FingerprintRemoved`;
    readers of others never notice. ``compact_after`` compacts the file afterwards.
    Raises :class:`FingerprintLookupError` (nothing removed) for an unknown name or one
    already removed.
    """
    from cache_store.jobs.failures import FailureLog

    root = _cache_root(cache)
    try:
        store = _lmdb_store(root, readonly=False)
    except CacheNotFound:
        if not (root.is_dir() and _has_bookkeeping(root)):
            raise
        store = None  # no records yet: queued work and failures only
    reports = []
    try:
        chosen, stored = _resolve(store, root, fingerprints)
        queue = _queue(root)
        failures = FailureLog(root)
        try:
            for fp in chosen:
                report: dict[str, Any] = {
                    "fingerprint": fp,
                    "records": 0,
                    "bytes": 0,
                    "cancelled": 0,
                    "failures": 0,
                }
                if queue is not None and not failed:
                    report["cancelled"] = queue.cancel_fingerprint(fp)
                report["failures"] = failures.forget_fingerprint(fp)
                if queue is not None:
                    report["failures"] = max(report["failures"], queue.forget_failed(fp))
                if not failed and fp in stored:
                    store.mark_removed(fp)
                    report["records"], report["bytes"] = store.delete_records(fp)
                    usage.forget(root, fp)
                    log.info(
                        "%s: removed fingerprint %s (%d records, %d bytes)",
                        root,
                        fp,
                        report["records"],
                        report["bytes"],
                    )
                reports.append(report)
        finally:
            failures.close()
            if queue is not None:
                queue.close()
    finally:
        if store is not None:
            store.close()
    if compact_after and not failed and store is not None:
        compact(root)
    return reports


# --------------------------------------------------------------------------- prune


def plan_prune(
    entries: list[CacheEntry],
    *,
    max_size: int | None = None,
    unused_for: float | None = None,
    keep: int | None = None,
    protect: Iterable[str] = (),
    now: float | None = None,
    strict: bool = True,
) -> tuple[list[CacheEntry], list[CacheEntry]]:
    """``(remove, kept)``: which fingerprints a prune removes, least recently used first.

    ``protect`` (queued, running, being written) and the ``keep`` most recently used are
    never removed; ``unused_for`` removes the others unused that long; ``max_size``
    removes more, oldest first, until the rest fits. ``keep`` alone removes every other
    fingerprint. Raises :class:`LimitTooSmall`, before anything is chosen, when the
    fingerprints that must be kept hold more than ``max_size`` together (``strict``, a
    prune asked for once) or one of them alone does (not ``strict``: a writer's limit,
    which evicts what it can and warns).
    """
    if max_size is None and unused_for is None and keep is None:
        raise ValueError("prune needs at least one of max_size, unused_for, keep")
    now = time.time() if now is None else now
    protected = set(protect)
    lru = sorted(entries, key=lambda e: (e.last_used, e.fingerprint))
    kept_recent = {e.fingerprint for e in lru[-keep:]} if keep else set()
    must_keep = [e for e in lru if e.fingerprint in protected or e.fingerprint in kept_recent]
    keep_names = {e.fingerprint for e in must_keep}
    if max_size is not None and must_keep:
        _check_limit(max_size, must_keep, protected, keep, strict=strict)
    candidates = [e for e in lru if e.fingerprint not in keep_names]
    chosen: set[str] = set()
    if max_size is None and unused_for is None:  # --keep N alone: the rest goes
        chosen = {e.fingerprint for e in candidates}
    if unused_for is not None:
        chosen = {e.fingerprint for e in candidates if e.last_used < now - unused_for}
    if max_size is not None:
        total = sum(e.bytes for e in entries if e.fingerprint not in chosen)
        for entry in candidates:
            if total <= max_size:
                break
            if entry.fingerprint not in chosen:
                chosen.add(entry.fingerprint)
                total -= entry.bytes
    remove = [e for e in lru if e.fingerprint in chosen]
    kept = [e for e in lru if e.fingerprint not in chosen]
    return remove, kept


def _check_limit(
    max_size: int,
    must_keep: list[CacheEntry],
    protected: set[str],
    keep: int | None,
    *,
    strict: bool,
) -> None:
    """Raise :class:`LimitTooSmall` naming the kept fingerprints that do not fit."""

    def why(entry: CacheEntry) -> str:
        if entry.fingerprint in protected:
            return "it has queue items pending or running, or is being written"
        return f"it is among the {keep} most recently used kept (--keep)"

    limit = f"size limit {max_size} bytes ({format_size(max_size)})"
    largest = max(must_keep, key=lambda e: e.bytes)
    if largest.bytes > max_size:
        raise LimitTooSmall(
            f"{limit} is smaller than fingerprint {largest.fingerprint} ({largest.bytes} "
            f"bytes, {format_size(largest.bytes)}), which must be kept: {why(largest)}; "
            f"give a larger limit"
        )
    together = sum(e.bytes for e in must_keep)
    if not strict or together <= max_size:
        return
    named = "; ".join(
        f"{e.fingerprint} ({e.bytes} bytes, {format_size(e.bytes)}: {why(e)})" for e in must_keep
    )
    raise LimitTooSmall(
        f"{limit} is smaller than the {len(must_keep)} fingerprints that must be kept, "
        f"{together} bytes ({format_size(together)}) together: {named}; give a larger "
        f"limit" + (" or a smaller --keep" if keep else "")
    )


def _active(cache: Path) -> set[str]:
    queue = _queue(cache)
    if queue is None:
        return set()
    try:
        return set(queue.active_fingerprints())
    finally:
        queue.close()


def prune(
    cache: str | os.PathLike[str],
    *,
    max_size: int | str | None = None,
    unused_for: float | str | None = None,
    keep: int | None = None,
    dry_run: bool = False,
    protect: Iterable[str] = (),
    compact_after: bool = False,
) -> dict[str, Any]:
    """Remove least recently used fingerprints (see :func:`plan_prune`); never one with
    queue items pending or running. Returns ``{"removed": [rows], "kept": [rows],
    "bytes_before", "bytes_after", "dry_run"}`` (rows as :func:`ls`'s)."""
    root = _cache_root(cache)
    limit = None if max_size is None else parse_size(max_size)
    unused = None if unused_for is None else parse_duration(unused_for)
    if keep is not None and keep < 0:
        raise ValueError(f"keep {keep}: must not be negative")
    _lmdb_store(root, readonly=True).close()  # a clear error for a snapshot or a bad path
    entries = _entries(root)
    remove, kept = plan_prune(
        entries, max_size=limit, unused_for=unused, keep=keep, protect=set(protect) | _active(root)
    )
    if remove and not dry_run:
        rm(root, [e.fingerprint for e in remove], compact_after=compact_after)
    before = sum(e.bytes for e in entries)
    return {
        "removed": [e.as_json() for e in remove],
        "kept": [e.as_json() for e in kept],
        "bytes_before": before,
        "bytes_after": before - sum(e.bytes for e in remove),
        "dry_run": dry_run,
    }


# --------------------------------------------------------------------------- compact


def compact(
    cache: str | os.PathLike[str], *, wait_s: float = 60.0, rewrite_records: bool = False
) -> dict[str, int]:
    """Shrink the cache's ``data.mdb`` to what it holds (a compacting copy swapped in
    atomically; readers keep reading, writers wait). Returns ``{"before", "after"}``
    file sizes in bytes.

    With ``rewrite_records``, the copy is written record by record: every format-1
    record rewritten as format 2 (:func:`cache_store.format.encode.upgrade_record`: the
    same tensors and metadata, what the fingerprint's records share moved to its
    descriptor), every page filled whole (LMDB's own copy keeps pages as full as they
    were). Slower than the plain copy, and writers wait for all of it. A record that
    does not check out is copied as it is (``verify`` names it). Adds ``records``,
    ``rewritten`` and ``unreadable`` counts."""
    from cache_store.stores.lmdb import compact_environment

    root = _cache_root(cache)
    _lmdb_store(root, readonly=True).close()
    if not rewrite_records:
        return compact_environment(root, wait_s=wait_s)
    from cache_store.format.encode import upgrade_record

    unreadable = 0

    def rewrite(key: str, value: bytes) -> Any:
        nonlocal unreadable
        try:
            return upgrade_record(value, key=key)
        except CorruptRecord as exc:
            unreadable += 1
            log.warning("compact: %s is copied as it is: %s", key, exc.reason)
            return None

    return {**compact_environment(root, wait_s=wait_s, rewrite=rewrite), "unreadable": unreadable}


# --------------------------------------------------------------------------- a limit


class SizeLimit:
    """``--max-size`` for a long-running writer (``spcache worker``/``serve``).

    :meth:`check_start` refuses a limit smaller than the largest fingerprint already
    stored (while it is written again it could not be evicted). :meth:`after_batch`,
    called after each batch the writer committed, evicts least recently used
    fingerprints until the records fit, never ``writing`` nor one with queue items
    pending or running. Sizes of the other fingerprints are re-walked at most every
    ``refresh_s``; the one being written after every batch.
    """

    def __init__(
        self, cache: str | os.PathLike[str], max_size: int, *, refresh_s: float = 60.0
    ) -> None:
        self.cache = Path(cache)
        self.max_size = int(max_size)
        self.refresh_s = refresh_s
        self._entries: dict[str, CacheEntry] = {}
        self._walked = 0.0
        self._warned: set[str] = set()

    def _refresh(self, writing: str | None) -> None:
        from cache_store.stores.lmdb import has_cache

        if not has_cache(self.cache):
            self._entries = {}
            return
        now = time.monotonic()
        if now - self._walked >= self.refresh_s or not self._entries:
            self._entries = {e.fingerprint: e for e in _entries(self.cache)}
            self._walked = now
        elif writing is not None:
            store = _lmdb_store(self.cache, readonly=True)
            try:
                records, size = store.fingerprint_size(writing)
            finally:
                store.close()
            entry = self._entries.setdefault(writing, CacheEntry(writing))
            entry.records, entry.bytes = records, size
            entry.last_written = time.time()

    def total(self) -> int:
        return sum(e.bytes for e in self._entries.values())

    def check_start(self) -> None:
        """Raise :class:`LimitTooSmall` for a limit below the largest stored fingerprint."""
        self._refresh(None)
        if not self._entries:
            return
        largest = max(self._entries.values(), key=lambda e: e.bytes)
        if largest.bytes > self.max_size:
            raise LimitTooSmall(
                f"--max-size {self.max_size} bytes ({format_size(self.max_size)}) is smaller "
                f"than fingerprint {largest.fingerprint} already in {self.cache} "
                f"({largest.bytes} bytes, {format_size(largest.bytes)}): it could not be "
                f"evicted while it is written; give a larger limit or remove it first "
                f"(spcache rm)"
            )

    def after_batch(self, writing: str | None) -> list[str]:
        """Evict what the limit asks for; returns the fingerprints removed."""
        self._refresh(writing)
        if self.total() <= self.max_size:
            return []
        protect = _active(self.cache) | ({writing} if writing else set())
        entries = list(self._entries.values())
        try:
            remove, _ = plan_prune(entries, max_size=self.max_size, protect=protect, strict=False)
        except LimitTooSmall as exc:
            remove = []
            if writing not in self._warned:
                self._warned.add(writing or "")
                log.warning("%s: over --max-size and nothing can be evicted: %s", self.cache, exc)
        if remove:
            names = [e.fingerprint for e in remove]
            log.info(
                "%s: %d bytes stored, over --max-size %d: evicting %s (least recently used)",
                self.cache,
                self.total(),
                self.max_size,
                ", ".join(names),
            )
            rm(self.cache, names)
            for name in names:
                self._entries.pop(name, None)
        if self.total() > self.max_size and writing not in self._warned:
            self._warned.add(writing or "")
            log.warning(
                "%s: still %d bytes stored, over --max-size %d: the rest is queued, "
                "running or being written",
                self.cache,
                self.total(),
                self.max_size,
            )
        return [e.fingerprint for e in remove]
