"""``spcache worker --cache DIR``: drain the cache's job queue on one device until stopped.

Parses the flags into an :class:`~cache_store.engine_options.EngineOptions` and the
loop's settings and calls :func:`workers.worker_loop.run_worker`, which refuses (exit 2,
one line) a cache that does not exist, a backend that cannot run here, a size limit
smaller than what is stored and a cache another live worker owns, before any item is
claimed. SIGTERM and SIGINT stop the loop (SIGHUP arrives as SIGTERM from the
dispatcher). Started by ``spcache serve``, it also ends when the service dies
(``SPCACHE_PARENT_PID``, :mod:`spcache.cli`).
"""

from __future__ import annotations

import argparse
import logging
import os

from cache_store.engine_options import EngineOptions
from cache_store.processes import PARENT_PID_ENV
from spcache.cli.args import (
    add_backend,
    add_cache,
    add_device,
    add_loaders,
    add_max_size,
    add_time_limit,
)
from spcache.cli.args import add_source_roots

__all__ = ["DEFAULT_LOG_LEVEL", "configure_parser", "log_level", "run"]

#: the worker narrates its batches at INFO (``--log-level``, ``-v``/``-q`` change it)
DEFAULT_LOG_LEVEL = logging.INFO
_DEFAULTS = EngineOptions()


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_cache(parser, "cache directory (records + jobs.sqlite); it must exist", local=True)
    add_device(parser)
    add_backend(parser)
    parser.add_argument("--batch", type=int, default=8, help="items per claim (default 8)")
    parser.add_argument("--lease", type=float, default=120.0, help="lease seconds (default 120)")
    parser.add_argument("--poll", type=float, default=1.0, help="idle poll seconds (default 1)")
    add_loaders(parser)
    add_time_limit(parser)
    parser.add_argument(
        "--max-attempts", type=int, default=3, help="claims per item before it fails (default 3)"
    )
    parser.add_argument(
        "--drain", action="store_true", help="exit when nothing is left to claim instead of polling"
    )
    parser.add_argument("--worker-id", help="name in leases and heartbeats (default host:pid)")
    add_source_roots(parser, "only read sources that resolve into DIR (repeatable; default: any)")
    parser.add_argument(
        "--max-source-bytes",
        type=int,
        default=_DEFAULTS.max_source_bytes,
        metavar="N",
        help=f"largest source file read (default {_DEFAULTS.max_source_bytes >> 30} GiB)",
    )
    add_max_size(
        parser,
        "keep the cache's records under SIZE (bytes, or 500M, 2G): least recently used "
        "fingerprints are removed after each batch",
    )
    parser.add_argument(
        "--log-level", default=None, help="debug, info, warning, error (default info)"
    )


def log_level(args: argparse.Namespace) -> str | None:
    """The worker's ``--log-level``, when given (the service passes its own)."""
    level: str | None = args.log_level
    return level


def run(args: argparse.Namespace) -> int:
    from cache_store.housekeeping import parse_size
    from workers.worker_loop import run_worker

    options = EngineOptions(
        device=args.device,
        backend=args.backend,
        loaders=args.loaders,
        source_roots=args.source_roots,
        max_source_bytes=args.max_source_bytes,
        time_limit_s=args.time_limit_s,
    )
    return run_worker(
        args.cache.path(),
        options=options,
        under_service=bool(os.environ.get(PARENT_PID_ENV)),
        batch=args.batch,
        lease_s=args.lease,
        poll_s=args.poll,
        drain=args.drain,
        max_attempts=args.max_attempts,
        worker_id=args.worker_id,
        max_size=None if args.max_size is None else parse_size(args.max_size),
    )
