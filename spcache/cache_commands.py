"""``spcache verify`` and ``spcache stats``: read a cache at rest (CPU only, no torch).

A bad ``--cache`` (missing, a file, unreadable) is one line naming the path, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cache_store.errors import SpcacheError
from cache_store.location import cache_dir_problem, is_remote

__all__ = ["VERIFY", "STATS", "failed_samples"]

#: failed queue items listed by ``stats`` at most (the count is always exact)
MAX_FAILED_LISTED = 50


class VERIFY:
    @staticmethod
    def configure_parser(parser: argparse.ArgumentParser) -> None:
        _cache_reader_arguments(parser, "print the report as JSON")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        data = _isolated("verify", args.cache, "verify_cache")  # a child: an LMDB abort cannot kill us
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
            print(f"checked {data['checked']} records: "
                  + ("cache verifies clean" if not problems else f"{len(problems)} problem(s)"))
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
        if not is_remote(args.cache) and Path(args.cache).is_dir():
            try:
                stats = {**stats, "failed_samples": failed_samples(Path(args.cache))}
            except (SpcacheError, OSError) as exc:  # the queue is extra: say why it is absent
                stats = {**stats, "failed_samples": {"error": f"job queue unreadable: {exc}"}}
        if args.json:
            print(json.dumps(stats, sort_keys=True, default=str))
        else:
            _print_tree(stats)
        return 0


def failed_samples(cache: Path, *, limit: int = MAX_FAILED_LISTED) -> dict[str, Any]:
    """Failed items of the cache's job queue, newest job first: ``{"count": N, "items":
    [{"job", "id", "path", "attempts", "reason"}, ...]}`` (at most ``limit`` items).

    A cache without a job queue has none; nothing is created.
    """
    from cache_store.jobs.queue import JOBS_FILENAME, JobQueue

    if not (cache / JOBS_FILENAME).is_file():
        return {"count": 0, "items": []}
    queue = JobQueue(cache)
    try:
        count, items = 0, []
        offset = 0
        while True:
            jobs = queue.jobs(limit=100, offset=offset)
            if not jobs:
                break
            offset += len(jobs)
            for job in jobs:
                failed = job.counts.get("failed", 0)
                if not failed:
                    continue
                count += failed
                if len(items) < limit:
                    detail = queue.job(job.id, errors_limit=limit - len(items))
                    items += [{"job": job.id, "id": e.sample_id, "path": e.path,
                               "attempts": e.attempts, "reason": e.error} for e in detail.errors]
    finally:
        queue.close()
    return {"count": count, "items": items}


def _cache_reader_arguments(parser: argparse.ArgumentParser, json_help: str) -> None:
    parser.add_argument("--cache", required=True,
                        help="cache directory, Zarr snapshot (path or URL) or service URL")
    parser.add_argument("--json", action="store_true", help=json_help)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")


def _isolated(command: str, cache: str, walk: str) -> Any:
    """``cache_store.stores.isolated.<walk>(cache)``: the walk runs in a child process, so a damaged
    LMDB page that makes LMDB abort cannot take this process down. A bad path or an
    unreadable cache prints one line and returns None; damage (``CacheDamaged``) is raised
    for the caller to report."""
    from cache_store.stores import isolated
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


def _print_tree(data: Any, indent: str = "") -> None:
    if isinstance(data, dict):
        for key, value in data.items():
            if isinstance(value, dict | list):
                print(f"{indent}{key}:")
                _print_tree(value, indent + "  ")
            else:
                print(f"{indent}{key}: {value}")
    elif isinstance(data, list):
        for value in data:
            _print_tree(value, indent + "- ") if isinstance(value, dict | list) \
                else print(f"{indent}- {value}")
    else:
        print(f"{indent}{data}")
