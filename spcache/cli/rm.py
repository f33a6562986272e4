"""``spcache rm FINGERPRINT... --cache DIR``: remove fingerprints (a unique prefix of 6+
characters will do) from a cache directory, or with ``--failed`` only forget their
remembered failures (:func:`cache_store.housekeeping.rm`).
"""

from __future__ import annotations

import argparse
import json

from cache_store.housekeeping import format_size
from spcache.cli.args import add_cache, add_json

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "fingerprints",
        nargs="+",
        metavar="FINGERPRINT",
        help="fingerprint, or a unique prefix of at least 6 characters",
    )
    add_cache(parser, "cache directory", local=True)
    parser.add_argument(
        "--failed",
        action="store_true",
        help="only forget remembered failures, so they are retried",
    )
    parser.add_argument(
        "--compact",
        action="store_true",
        help="compact the file afterwards (gives the disk back)",
    )
    add_json(parser, "print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from cache_store.housekeeping import rm

    reports = rm(
        args.cache.path(), args.fingerprints, failed=args.failed, compact_after=args.compact
    )
    if args.json:
        print(json.dumps(reports, sort_keys=True))
        return 0
    for r in reports:
        if args.failed:
            print(f"{r['fingerprint']}: forgot {r['failures']} failure(s)")
        else:
            print(
                f"removed {r['fingerprint']}: {r['records']} records, "
                f"{format_size(r['bytes'])}; {r['cancelled']} queued item(s) cancelled, "
                f"{r['failures']} failure(s) forgotten"
            )
    if not args.failed and not args.compact:
        print("the file keeps its size until `spcache compact` (freed pages are reused)")
    return 0
