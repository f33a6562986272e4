"""What ``spcache stats`` and ``spcache verify`` report about a cache, as data.

Both walk the store in a child process (:mod:`cache_store.housekeeping.isolated`), so a damaged
LMDB page that makes LMDB abort cannot take the caller down. :func:`cache_stats` adds,
for a local cache directory, each fingerprint's remembered failures and its jobs' states,
and for every fingerprint whose recipe is installed, how many records other recipe code
computed. A location that is no readable cache is refused by name
(:class:`~cache_store.errors.UsageError`, :class:`~cache_store.errors.CacheNotFound`).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from cache_store.errors import SpcacheError
from cache_store.location import Location, LocationLike, check_cache_dir, parse_location

__all__ = [
    "MAX_FAILED_LISTED",
    "cache_stats",
    "verify_location",
    "with_failures_and_jobs",
    "with_installed_code",
]

#: failed samples listed per fingerprint by ``stats`` at most (the count is always exact)
MAX_FAILED_LISTED = 50


def _readable(location: LocationLike) -> Location:
    parsed = parse_location(location)
    if parsed.is_local:
        check_cache_dir(parsed, write=False)
    return parsed


def verify_location(location: LocationLike) -> dict[str, Any]:
    """:func:`cache_store.housekeeping.isolated.verify_cache` of a cache directory, a snapshot
    or the service: ``checked``, ``ok``, ``corrupt``, ``missing``, ``unindexed``,
    ``damaged``; plus ``writer`` (who holds a local cache's worker lock, looked at when
    something is unindexed; else None).

    Records of a fingerprint without an index (``unindexed``) are what a lost index
    leaves (a flipped LMDB meta page rolls the last commit back), and also what a run
    leaves until its index is written at its end. A live worker (its lock held), or a
    live run holding claims on the fingerprint's samples (``claims.sqlite``:
    :func:`cache_store.jobs.claims.live_runs`), may be that run: then the fingerprint is
    moved to ``unindexed_live`` (who: ``writers``) and is not a finding. A run killed
    before its index leaves the same as a lost index; the next run over the same
    sources writes the index again.
    """
    from cache_store.housekeeping.isolated import verify_cache
    from cache_store.jobs.claims import live_runs
    from cache_store.jobs.owner_lock import describe_holder, lock_holder

    parsed = _readable(location)
    report = verify_cache(parsed.target)
    report.setdefault("unindexed", {})
    report["writer"] = None
    if parsed.is_local and parsed.path().is_dir() and report["unindexed"]:
        holder = lock_holder(parsed.path())
        runs = live_runs(parsed.path())
        if holder is not None:
            report["writer"] = describe_holder(holder)
        writers = {
            fp: report["writer"] or runs[fp]
            for fp in report["unindexed"]
            if holder is not None or fp in runs
        }
        if writers:
            report["writers"] = writers
            report["unindexed_live"] = {fp: report["unindexed"].pop(fp) for fp in writers}
            report["ok"] = not (
                report["corrupt"] or report["missing"] or report["damaged"] or report["unindexed"]
            )
    return report


def cache_stats(location: LocationLike, *, limit: int = MAX_FAILED_LISTED) -> dict[str, Any]:
    """The statistics of a cache directory, a snapshot or the service: per fingerprint
    its recipe, records and bytes, and (see the module docstring) failures, jobs and
    records of other recipe code. Raises
    :class:`~cache_store.errors.CacheDamaged` when the walk cannot finish."""
    from cache_store.housekeeping.isolated import stats_cache

    parsed = _readable(location)
    stats = stats_cache(parsed.target)
    if parsed.is_local and parsed.path().is_dir():
        try:
            stats = with_failures_and_jobs(stats, parsed.path(), limit=limit)
        except (SpcacheError, OSError, sqlite3.Error) as exc:  # extra: say why absent
            stats = {**stats, "failures_error": f"failure log or job queue unreadable: {exc}"}
    return with_installed_code(stats)


def with_failures_and_jobs(
    stats: dict[str, Any], cache: Path, *, limit: int = MAX_FAILED_LISTED
) -> dict[str, Any]:
    """``stats`` with, under each fingerprint, its remembered failures (``failed``:
    :func:`cache_store.jobs.failures.failures_of`) and its jobs' states (``jobs``);
    fingerprints known only to the queue or the failure log are added. Creates nothing."""
    from cache_store.jobs.failures import failure_counts, failures_of
    from cache_store.jobs.queue import JOBS_FILENAME, JobQueue

    per_fp = {fp: dict(entry) for fp, entry in stats.get("fingerprints", {}).items()}
    jobs: dict[str, list[dict[str, Any]]] = {}
    if (cache / JOBS_FILENAME).is_file():
        queue = JobQueue(cache)
        try:
            for job in queue.jobs(limit=10_000):
                jobs.setdefault(job.fingerprint, []).append(
                    {
                        "id": job.id,
                        "status": job.status,
                        "recipe": job.recipe,
                        "total": job.total,
                        "percent": job.percent,
                        "counts": {k: v for k, v in job.counts.items() if v},
                    }
                )
        finally:
            queue.close()
    counts = failure_counts(cache)
    for fp in [*jobs, *counts]:
        per_fp.setdefault(fp, {"records": 0, "bytes": 0})
    total_failed = 0
    for fp, entry in per_fp.items():
        entry["failed"] = (
            failures_of(cache, fp, limit=limit) if counts.get(fp) else {"count": 0, "items": []}
        )
        entry["jobs"] = jobs.get(fp, [])
        total_failed += entry["failed"]["count"]
    return {**stats, "failed": total_failed, "fingerprints": dict(sorted(per_fp.items()))}


def with_installed_code(stats: dict[str, Any]) -> dict[str, Any]:
    """``stats`` with, under each fingerprint whose recipe and version are installed,
    ``installed_code_digest`` and ``other_code``: how many of its records were computed
    by other recipe code than the installed one (its code changed without a version
    bump: those records are kept and served, not recomputed)."""
    from cache_store.recipes.registry import code_changed, installed_code_digest

    per_fp: dict[str, Any] = {}
    for fp, entry in stats.get("fingerprints", {}).items():
        digests = entry.get("code_digests")
        mine = installed_code_digest(str(entry.get("recipe", "")), entry.get("recipe_version"))
        if mine is None or "recipe_version" not in entry or not digests:
            per_fp[fp] = entry
            continue
        other = sum(n for d, n in digests.items() if code_changed(mine, d))
        per_fp[fp] = {**entry, "installed_code_digest": mine, "other_code": other}
    return {**stats, "fingerprints": per_fp}
