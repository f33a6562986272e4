"""``spcache compact --cache DIR``: give the disk back: rewrite the cache's LMDB file
without its free pages, swapped in atomically while readers go on
(:func:`cache_store.housekeeping.compact`).
"""

from __future__ import annotations

import argparse
import json

from cache_store.housekeeping import format_size
from spcache.cli.args import add_cache, add_json

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_cache(parser, "cache directory", local=True)
    parser.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for a writer's transaction (default 60)",
    )
    add_json(parser, "print the sizes as JSON")


def run(args: argparse.Namespace) -> int:
    from cache_store.housekeeping import compact

    sizes = compact(args.cache.path(), wait_s=args.wait)
    if args.json:
        print(json.dumps(sizes, sort_keys=True))
    else:
        print(f"data.mdb: {format_size(sizes['before'])} -> {format_size(sizes['after'])}")
    return 0
