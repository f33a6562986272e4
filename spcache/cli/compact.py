"""``spcache compact --cache DIR [--rewrite-records]``: give the disk back: rewrite the
cache's LMDB file without its free pages, swapped in atomically while readers go on
(:func:`cache_store.housekeeping.compact`); with ``--rewrite-records``, record by record,
format-1 records rewritten as format 2 and every page filled.
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
    parser.add_argument(
        "--rewrite-records",
        action="store_true",
        help="first rewrite records of format 1 (each carrying its recipe's whole "
        "schema) as format 2 (sharing one descriptor): same tensors, a smaller file",
    )
    add_json(parser, "print the sizes as JSON")


def run(args: argparse.Namespace) -> int:
    from cache_store.housekeeping import compact

    sizes = compact(args.cache.path(), wait_s=args.wait, rewrite_records=args.rewrite_records)
    if args.json:
        print(json.dumps(sizes, sort_keys=True))
        return 0
    if args.rewrite_records:
        unreadable = sizes["unreadable"]
        print(
            f"records: {sizes['rewritten']} of {sizes['records']} rewritten to format 2"
            + (f", {unreadable} unreadable left as they were" if unreadable else "")
        )
    print(f"data.mdb: {format_size(sizes['before'])} -> {format_size(sizes['after'])}")
    return 0
