"""``rm``: remove fingerprints from a cache directory, every step idempotent.

Cancel the fingerprint's queued items, forget its failures, write its tombstone and drop
its index (one LMDB transaction), then delete its records in chunks. Each commit leaves
a consistent cache, so a killed ``rm`` is finished by running it again. Names are
resolved (whole fingerprints or unique prefixes) against everything the cache knows
before anything is removed.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cache_store import usage
from cache_store.errors import CacheNotFound, FingerprintLookupError
from cache_store.housekeeping.compaction import compact
from cache_store.housekeeping.listing import cache_root, open_cache_store, remembered_failures
from cache_store.housekeeping.units import iso_time
from cache_store.keys import is_fingerprint

__all__ = ["MIN_PREFIX", "active_fingerprints", "open_queue", "rm"]

log = logging.getLogger(__name__)

#: A prefix given to ``rm`` must be at least this long (and match one fingerprint).
MIN_PREFIX = 6


def open_queue(cache: Path) -> Any:
    """The job queue of ``cache``, or None when it has none."""
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
    failures = set(remembered_failures(cache)) - set(removals)
    known = stored | failures | active_fingerprints(cache)
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
                + (f" at {iso_time(gone[removed[0]])}" if gone[removed[0]] else "")
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

    root = cache_root(cache)
    try:
        store = open_cache_store(root, readonly=False)
    except CacheNotFound:
        if not (root.is_dir() and _has_bookkeeping(root)):
            raise
        store = None  # no records yet: queued work and failures only
    reports = []
    try:
        chosen, stored = _resolve(store, root, fingerprints)
        queue = open_queue(root)
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


def active_fingerprints(cache: Path) -> set[str]:
    """Fingerprints with queue items pending or running (never removed by a prune)."""
    queue = open_queue(cache)
    if queue is None:
        return set()
    try:
        return set(queue.active_fingerprints())
    finally:
        queue.close()
