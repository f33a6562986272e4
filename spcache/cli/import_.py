"""``spcache import DEST.zarr --cache DIR``: copy a snapshot's records (sharded or
exported, a path or a URL) into a local LMDB cache, checked on the way, with their index
(:func:`cache_store.snapshot.importer.import_snapshot`), added to what the cache holds.
Running it again finishes an interrupted import; records already there are skipped. A
damaged record is named and left out (exit 1); every good one is copied.
"""

from __future__ import annotations

import argparse
import json

from spcache.cli.args import add_cache, add_json, location

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        type=location,
        metavar="DEST.zarr",
        help="a snapshot (DEST.zarr or s3://bucket/x.zarr)",
    )
    add_cache(parser, "the local cache directory to fill", local=True)
    parser.add_argument(
        "--fingerprint", action="append", help="import only this fingerprint (repeatable)"
    )
    add_json(parser)


def run(args: argparse.Namespace) -> int:
    from cache_store.snapshot.importer import import_snapshot

    result = import_snapshot(args.source, args.cache, fingerprints=args.fingerprint)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for fingerprint, counts in result.items():
            bad = counts["bad"]
            print(
                f"{fingerprint}: {counts['copied']} copied, {counts['present']} already "
                f"in {args.cache}" + (f", {len(bad)} bad (left out)" if bad else "")
            )
            for sample_id, reason in bad.items():
                print(f"  bad {fingerprint}/{sample_id}: {reason}")
    return 1 if any(counts["bad"] for counts in result.values()) else 0
