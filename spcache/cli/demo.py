"""``spcache demo``: make example shapes, precompute them, serve them, show where to look
(:func:`workers.demo.run_demo`). A port in use or a ``--dir`` that cannot be used is
refused first, in one line (exit 2). It narrates at INFO.
"""

from __future__ import annotations

import argparse
import logging
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
    parser.add_argument("--port", type=int, default=8000, help="service port on 127.0.0.1")
    parser.add_argument("--level", type=int, default=7, help="octree level (default 7)")
    parser.add_argument(
        "--exit-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop the service after this many seconds (default: run until Ctrl-C)",
    )


def run(args: argparse.Namespace) -> int:
    from service.launch import port_problem
    from workers.demo import run_demo

    busy = port_problem("127.0.0.1", args.port)
    if busy:
        raise UsageError(busy)
    if args.dir.is_file():
        raise UsageError(f"--dir {args.dir}: is a file, not a directory")
    check_cache_dir(args.dir, write=True)
    return run_demo(args.dir, port=args.port, level=args.level, exit_after=args.exit_after)
