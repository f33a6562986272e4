"""``spcache prune --cache DIR``: remove least recently used fingerprints until the
records fit ``--max-size``, or those unused for ``--unused-for``, keeping the ``--keep``
most recent (:func:`cache_store.housekeeping.prune`); ``--dry-run`` only says what would
go.
"""

from __future__ import annotations

import argparse
import json

from cache_store.errors import UsageError
from cache_store.housekeeping import format_size
from spcache.cli.args import add_cache, add_json, add_max_size
from spcache.cli.ls import format_when

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_cache(parser, "cache directory", local=True)
    add_max_size(
        parser,
        "remove least recently used fingerprints until the records fit in SIZE "
        "(bytes, or 500M, 2G, 1.5T)",
    )
    parser.add_argument(
        "--unused-for",
        metavar="DURATION",
        help="remove fingerprints not read or written for DURATION (e.g. 12h, 30d, 2w)",
    )
    parser.add_argument(
        "--keep",
        type=int,
        metavar="N",
        help="never remove the N most recently used; alone: keep them, remove the rest",
    )
    parser.add_argument("--dry-run", action="store_true", help="only say what would go")
    parser.add_argument("--compact", action="store_true", help="compact afterwards")
    add_json(parser)


def run(args: argparse.Namespace) -> int:
    from cache_store.housekeeping import prune

    if args.max_size is None and args.unused_for is None and args.keep is None:
        raise UsageError("give at least one of --max-size, --unused-for, --keep")
    result = prune(
        args.cache.path(),
        max_size=args.max_size,
        unused_for=args.unused_for,
        keep=args.keep,
        dry_run=args.dry_run,
        compact_after=args.compact,
    )
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for row in result["removed"]:
        recipe = row["recipe"] or "unindexed"
        print(
            f"{verb} {row['fingerprint']} ({recipe}, {row['records']} records, "
            f"{format_size(row['bytes'])}, last used "
            f"{format_when(row['last_read'] or row['last_written'] or row['created'])})"
        )
    print(
        f"{len(result['removed'])} fingerprint(s) {verb}; records "
        f"{format_size(result['bytes_before'])} -> {format_size(result['bytes_after'])}"
    )
    return 0
