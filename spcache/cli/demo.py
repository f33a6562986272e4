"""``spcache demo``: make example shapes, precompute them, serve them, show where to look
(:func:`workers.demo.run_demo`). A ``--dir`` that cannot be used or a port that cannot be
bound is refused first, in one line (exit 2); the port is bound here, before anything
starts, and the service inherits it (``spcache serve --fd``). It narrates at INFO.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from cache_store.errors import UsageError
from cache_store.location import check_cache_dir

__all__ = ["DEFAULT_LOG_LEVEL", "configure_parser", "run"]

#: the demo narrates its steps (its per-sample lines when stderr is not a terminal)
DEFAULT_LOG_LEVEL = logging.INFO


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        type=Path,  # a plain directory, never a URL
        default=Path("spcache-demo"),
        help="working directory for sources and cache (default: ./spcache-demo)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="service port on 127.0.0.1 (default: SPCACHE_PORT as for `spcache serve`, "
        "else 8000; 0: any free one, printed)",
    )
    parser.add_argument("--level", type=int, default=7, help="octree level (default 7)")
    parser.add_argument(
        "--exit-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop the service after this many seconds (default: run until Ctrl-C)",
    )


def run(args: argparse.Namespace) -> int:
    from service.launch import bind_listener
    from workers.demo import run_demo

    if args.dir.is_file():
        raise UsageError(f"--dir {args.dir}: is a file, not a directory")
    check_cache_dir(args.dir, write=True)
    listener = bind_listener("127.0.0.1", _port(args.port))
    return run_demo(args.dir, listener, level=args.level, exit_after=args.exit_after)


def _port(flag: int | None) -> int:
    """``--port``, else ``SPCACHE_PORT`` (the service's own setting), else 8000."""
    if flag is not None:
        return flag
    text = os.environ.get("SPCACHE_PORT", "").strip()
    if not text:
        return 8000
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise UsageError(f"SPCACHE_PORT={text!r} is not a port number (0-65535)")
    return port
