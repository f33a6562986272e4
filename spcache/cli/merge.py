"""``spcache merge DEST.zarr``: merge a sharded snapshot's committed manifests into each
fingerprint's index (idempotent; what the Ray driver does periodically and at the end;
run it by hand after a driver died, or to write a damaged ``index.json`` again from the
manifests). It lists what dead writers left (parts that never got a manifest, temporary
files of a write cut short) older than ``--orphan-age`` seconds (anything still being
written is younger); ``--remove-orphans`` deletes them. ``--remove-superseded`` deletes
the parts no reader reads a record of (every one committed again elsewhere: two runs
into one destination), superseded for longer than ``--orphan-age``
(:func:`cache_store.snapshot.sharded.merge`, :func:`~cache_store.snapshot.sharded.orphan_parts`,
:func:`~cache_store.snapshot.sharded.superseded_parts`).
"""

from __future__ import annotations

import argparse
import json

from spcache.cli.args import add_json, location

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    from cache_store.snapshot.sharded import DEFAULT_ORPHAN_GRACE_S

    parser.add_argument(
        "dest",
        type=location,
        metavar="DEST.zarr",
        help="a sharded snapshot: DEST.zarr or s3://bucket/x.zarr",
    )
    parser.add_argument("--fingerprint", help="merge only this fingerprint")
    parser.add_argument(
        "--remove-orphans",
        action="store_true",
        help="delete parts that have no manifest and temporary files older than "
        "--orphan-age (a writer died while writing them)",
    )
    parser.add_argument(
        "--remove-superseded",
        action="store_true",
        help="delete committed parts none of whose records is read (each committed again "
        "in another part, and so for longer than --orphan-age)",
    )
    parser.add_argument(
        "--orphan-age",
        type=float,
        default=DEFAULT_ORPHAN_GRACE_S,
        metavar="SECONDS",
        help="a file younger than this may still be written, a part superseded more "
        f"recently may still be read (default {DEFAULT_ORPHAN_GRACE_S:g})",
    )
    add_json(parser)


def run(args: argparse.Namespace) -> int:
    from cache_store.snapshot.sharded import merge, orphan_parts, superseded_parts

    merged = merge(args.dest, fingerprint=args.fingerprint)
    orphans = orphan_parts(args.dest, older_than_s=args.orphan_age, remove=args.remove_orphans)
    superseded = (
        superseded_parts(args.dest, older_than_s=args.orphan_age, remove=True)
        if args.remove_superseded
        else {}
    )
    if args.json:
        print(
            json.dumps(
                {
                    "merged": merged,
                    "orphans": orphans,
                    "orphans_removed": bool(args.remove_orphans),
                    "superseded_removed": superseded,
                    "superseded_bytes": sum(superseded.values()),
                },
                sort_keys=True,
            )
        )
        return 0
    for fingerprint, count in merged.items():
        print(f"{fingerprint}: {count} record(s) indexed")
    verb = "removed" if args.remove_orphans else "left (use --remove-orphans)"
    for path in orphans:
        print(f"orphan {verb}: {path}")
    for path, size in superseded.items():
        print(f"superseded part removed: {path} ({size} bytes)")
    if superseded:
        print(f"{len(superseded)} superseded part(s), {sum(superseded.values())} bytes reclaimed")
    return 0
