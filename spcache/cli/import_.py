"""``spcache import DEST.zarr --cache DIR``: copy a snapshot's records (sharded or
exported, a path or a URL) into a local LMDB cache, checked on the way, with their index
(:func:`cache_store.snapshot.importer.import_snapshot`). Running it again finishes an
interrupted import; records already there are skipped.
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
            print(
                f"{fingerprint}: {counts['copied']} copied, {counts['present']} already "
                f"in {args.cache}"
            )
    return 0
