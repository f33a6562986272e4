"""``spcache verify`` and ``spcache stats``: read a cache at rest (CPU only, no torch).

A bad ``--cache`` (missing, a file, unreadable) is one line naming the path, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

from cache_store.errors import SpcacheError
from cache_store.location import cache_dir_problem, is_remote, local_path

__all__ = ["VERIFY", "STATS", "with_failures_and_jobs", "with_installed_code"]

#: failed samples listed per fingerprint by ``stats`` at most (the count is always exact)
MAX_FAILED_LISTED = 50


class VERIFY:
    @staticmethod
    def configure_parser(parser: argparse.ArgumentParser) -> None:
        _cache_reader_arguments(parser, "print the report as JSON")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        data = _isolated(
            "verify", args.cache, "verify_cache"
        )  # a child: an LMDB abort cannot kill us
        if data is None:
            return 2
        problems = [f"corrupt {key}: {reason}" for key, reason in data["corrupt"].items()]
        problems += [f"missing {key} (indexed, no record)" for key in data["missing"]]
        if data.get("damaged"):
            problems.append(str(data["damaged"]))
        if args.json:
            print(json.dumps(data, sort_keys=True))
        else:
            for problem in problems:
                print(f"  {problem}")
            print(
                f"checked {data['checked']} records: "
                + ("cache verifies clean" if not problems else f"{len(problems)} problem(s)")
            )
        return 1 if problems else 0


class STATS:
    @staticmethod
    def configure_parser(parser: argparse.ArgumentParser) -> None:
        _cache_reader_arguments(parser, "print the statistics as JSON")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from cache_store.errors import CacheDamaged

        try:
            stats = _isolated("stats", args.cache, "stats_cache")
        except CacheDamaged as exc:
            print(f"spcache stats: {exc}", file=sys.stderr)
            return 1
        if stats is None:
            return 2
        if not is_remote(args.cache) and Path(local_path(args.cache)).is_dir():
            try:
                stats = with_failures_and_jobs(stats, Path(local_path(args.cache)))
            except (SpcacheError, OSError, sqlite3.Error) as exc:  # extra: say why absent
                stats = {**stats, "failures_error": f"failure log or job queue unreadable: {exc}"}
        stats = with_installed_code(stats)
        if args.json:
            print(json.dumps(stats, sort_keys=True, default=str))
        else:
            _print_stats(stats)
        return 0


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


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _print_stats(stats: dict[str, Any]) -> None:
    """The statistics, one block per fingerprint: what it is, when it was made, its
    records, its jobs by state and its failed samples (id, path, when, reason)."""
    fps = stats.get("fingerprints", {})
    print(
        f"cache {stats.get('location', '')}: {len(fps)} fingerprint(s), "
        f"{stats.get('records', 0)} records, {_size(int(stats.get('bytes', 0)))}"
        + (f", {stats['failed']} failed sample(s)" if stats.get("failed") else "")
    )
    if stats.get("failures_error"):
        print(f"  ({stats['failures_error']})")
    for fp, entry in fps.items():
        what = (
            f"{entry['recipe']} v{entry['recipe_version']} "
            f"{json.dumps(entry.get('params', {}), sort_keys=True)}"
            if "recipe" in entry
            else "(no index)"
        )
        print(f"\nfingerprint {fp}  {what}")
        if entry.get("created"):
            print(f"  created  {entry['created']}")
        indexed = f", {entry['samples']} indexed" if "samples" in entry else ""
        print(
            f"  records  {entry.get('records', 0)} ({_size(int(entry.get('bytes', 0)))}){indexed}"
        )
        if entry.get("index_error"):
            print(f"  index    unreadable: {entry['index_error']}")
        if entry.get("other_code"):
            print(
                f"  code     {entry['other_code']} of {entry.get('records', 0)} record(s) "
                "computed by other code than the installed recipe's "
                f"({entry['installed_code_digest']}): bump the recipe's version to recompute"
            )
        if entry.get("mixed_code"):
            counts = ", ".join(
                f"{n} by {d}" for d, n in sorted(entry.get("code_digests", {}).items())
            )
            print(f"  code     mixed ({counts}): {entry['mixed_code']}")
        for job in entry.get("jobs", []):
            counted = ", ".join(f"{v} {k}" for k, v in job["counts"].items())
            print(
                f"  job      {job['id']}  {job['status'].replace('_', ' ')}  "
                f"({counted}; {job['percent']:g}%)"
            )
        failed = entry.get("failed", {"count": 0, "items": []})
        if failed["count"]:
            print(f"  failed   {failed['count']}")
            for f in failed["items"]:
                again = f" ({f['times']} times)" if f.get("times", 1) > 1 else ""
                print(f"    {f['id']}  {f['path']}  {f['when']}{again}: {f['reason']}")
            if failed["count"] > len(failed["items"]):
                print(f"    ... and {failed['count'] - len(failed['items'])} more (--json)")


def _cache_reader_arguments(parser: argparse.ArgumentParser, json_help: str) -> None:
    parser.add_argument(
        "--cache", required=True, help="cache directory, Zarr snapshot (path or URL) or service URL"
    )
    parser.add_argument("--json", action="store_true", help=json_help)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")


def _isolated(command: str, cache: str, walk: str) -> Any:
    """``cache_store.housekeeping.isolated.<walk>(cache)``: the walk runs in a child process, so a damaged
    LMDB page that makes LMDB abort cannot take this process down. A bad path or an
    unreadable cache prints one line and returns None; damage (``CacheDamaged``) is raised
    for the caller to report."""
    from cache_store.housekeeping import isolated
    from cache_store.errors import CacheDamaged

    if not is_remote(cache):
        problem = cache_dir_problem(cache, write=False)
        if problem:
            print(f"spcache {command}: {problem}", file=sys.stderr)
            return None
    try:
        return getattr(isolated, walk)(cache)
    except CacheDamaged:
        raise
    except (SpcacheError, OSError) as exc:
        reason = _one_line(exc)
        where = "" if str(cache) in reason else f"{cache}: "
        print(f"spcache {command}: cannot read cache: {where}{reason}", file=sys.stderr)
        return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
