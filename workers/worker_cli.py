"""``spcache worker --cache DIR``: the worker loop behind the command line.

Adds to :mod:`workers.worker_loop` what only a whole process can do: it checks the cache
path and the ops backend (``--backend kaolin`` where it cannot run: one line, exit 2,
before any item is claimed), takes the cache's worker lock (:mod:`cache_store.jobs.owner_lock`;
a second worker on the same cache is refused with the holder's pid and host, exit 2),
and runs the loop, whose SIGTERM/SIGINT handling stops it (SIGHUP arrives as SIGTERM from
the dispatcher). Started by ``spcache serve``, it also ends when the service dies
(:mod:`spcache.cli` sees ``SPCACHE_PARENT_PID``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cache_store.errors import BackendUnavailable, UnknownName
from cache_store.jobs.owner_lock import CacheOwned, WorkerLock
from cache_store.location import cache_dir_problem, local_path
from workers import worker_loop

__all__ = ["configure_parser", "run", "log_level"]


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return worker_loop.configure_parser(parser)


def log_level(args: argparse.Namespace) -> str | None:
    """The worker's ``--log-level`` (default info), for the dispatcher's one logging setup."""
    return getattr(args, "log_level", None)


def run(args: argparse.Namespace) -> int:
    # A worker never creates its cache: a mistyped --cache would otherwise make a new,
    # empty queue there and wait forever for jobs nobody sends.
    problem: str | None
    try:  # file:///x is the path /x; a URL is no cache directory (never through Path)
        args.cache = local_path(args.cache)
    except (ValueError, UnknownName):
        print(f"spcache worker: {args.cache}: not a local cache directory", file=sys.stderr)
        return 2
    if not Path(args.cache).exists():
        problem = (
            f"{args.cache}: no such cache directory (a worker drains an existing "
            f"cache: check the path, or create it first)"
        )
    else:
        problem = cache_dir_problem(args.cache, write=True)
    if problem:
        print(f"spcache worker: {problem}", file=sys.stderr)
        return 2
    try:  # a backend that cannot run here: refused before any item is claimed
        worker_loop.WorkerLoop(
            args.cache, device=args.device, backend=args.backend
        ).choose_backend()
    except (BackendUnavailable, UnknownName) as exc:
        print(f"spcache worker: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as exc:  # torch.device refuses the name
        print(
            f"spcache worker: --device {args.device!r}: {' '.join(str(exc).split())}",
            file=sys.stderr,
        )
        return 2
    lock = WorkerLock(args.cache)
    try:
        lock.acquire(worker_id=args.worker_id, device=args.device)
    except CacheOwned as exc:
        print(f"spcache worker: {exc}; stop it first, or point --cache elsewhere", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"spcache worker: {args.cache}: cannot take the worker lock: {exc}", file=sys.stderr)
        return 2
    try:
        return int(worker_loop.run(args))
    finally:
        lock.release()
