"""``spcache merge`` and ``spcache import``: a sharded snapshot's index, and a local hot copy.

``merge DEST``: merges the committed manifests of every fingerprint into its index
(idempotent; what the Ray driver does periodically and at the end; run it by hand after
a driver died, or to write a damaged ``index.json`` again from the manifests). It lists
what dead writers left (parts that never got a manifest, temporary files of a write cut
short) older than ``--orphan-age`` seconds (anything still being written is younger);
``--remove-orphans`` deletes them.

``import DEST --cache DIR``: copies the committed records of a snapshot (sharded or
exported) into a local LMDB cache, checked on the way, and writes their index there, so
training reads them at LMDB speed. Records already in the cache with the same checksum
are skipped, so an interrupted import is finished by running it again.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cache_store.errors import SpcacheError
from cache_store.location import cache_dir_problem, parse_location

__all__ = ["IMPORT", "MERGE", "import_snapshot"]

#: records per LMDB transaction while importing
IMPORT_BATCH = 64


class MERGE:
    @staticmethod
    def configure_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("dest", help="a sharded snapshot: DEST.zarr or s3://bucket/x.zarr")
        parser.add_argument("--fingerprint", help="merge only this fingerprint")
        parser.add_argument(
            "--remove-orphans",
            action="store_true",
            help="delete parts that have no manifest and temporary files older than "
            "--orphan-age (a writer died while writing them)",
        )
        parser.add_argument(
            "--orphan-age",
            type=float,
            default=3600.0,
            metavar="SECONDS",
            help="a file younger than this may still be written (default 3600)",
        )
        parser.add_argument("--json", action="store_true", help="print the result as JSON")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from cache_store.snapshot.sharded import merge, orphan_parts

        try:
            merged = merge(args.dest, fingerprint=args.fingerprint)
            orphans = orphan_parts(
                args.dest, older_than_s=args.orphan_age, remove=args.remove_orphans
            )
        except (SpcacheError, OSError) as exc:
            print(f"spcache merge: {args.dest}: {' '.join(str(exc).split())}", file=sys.stderr)
            return 2
        if args.json:
            print(
                json.dumps(
                    {
                        "merged": merged,
                        "orphans": orphans,
                        "orphans_removed": bool(args.remove_orphans),
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
        return 0


class IMPORT:
    @staticmethod
    def configure_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("dest", help="a snapshot (DEST.zarr or s3://bucket/x.zarr)")
        parser.add_argument("--cache", required=True, help="the local cache directory to fill")
        parser.add_argument(
            "--fingerprint", action="append", help="import only this fingerprint (repeatable)"
        )
        parser.add_argument("--json", action="store_true", help="print the result as JSON")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        problem = cache_dir_problem(args.cache, write=True)
        if problem:
            print(f"spcache import: {problem}", file=sys.stderr)
            return 2
        try:
            result = import_snapshot(args.dest, args.cache, fingerprints=args.fingerprint)
        except (SpcacheError, OSError) as exc:
            print(f"spcache import: {' '.join(str(exc).split())}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(result, sort_keys=True))
        else:
            for fingerprint, counts in result.items():
                print(
                    f"{fingerprint}: {counts['copied']} copied, {counts['present']} already "
                    f"in {args.cache}"
                )
        return 0


def import_snapshot(
    source: str,
    cache: str,
    *,
    fingerprints: list[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, dict[str, int]]:
    """Copy the indexed records of ``source`` (a snapshot) into the LMDB cache ``cache``;
    returns ``{fingerprint: {"copied", "present"}}``."""
    from cache_store.format.decode import check_record
    from cache_store.format.header import read_header
    from cache_store.stores.opener import open_store

    if parse_location(source).kind != "zarr":
        raise SpcacheError(f"{source}: import reads a snapshot (*.zarr), not a cache or URL")
    options: dict[str, Any] = {"storage_options": storage_options} if storage_options else {}
    result: dict[str, dict[str, int]] = {}
    with open_store(source, True, **options) as src, open_store(cache, readonly=False) as dst:
        for fingerprint in fingerprints or src.fingerprints():
            index = src.get_index(fingerprint)
            keys = [f"{fingerprint}/{sid}" for sid in index.sample_ids.tolist()]
            copied = present = 0
            for start in range(0, len(keys), IMPORT_BATCH):
                batch = []
                for key in keys[start : start + IMPORT_BATCH]:
                    value = src.get(key)
                    if dst.has(key) and (
                        read_header(dst.get(key), key=key).metadata["checksum"]
                        == read_header(value, key=key).metadata["checksum"]
                    ):
                        present += 1
                        continue
                    batch.append((key, value))
                if batch:
                    for key, value in batch:  # the cache never takes a damaged record
                        check_record(value, key=key, lookup=src.descriptor)
                    dst.put_many(batch, src.descriptors_for(batch))
                    copied += len(batch)
            dst.put_index(index)
            result[fingerprint] = {"copied": copied, "present": present}
    return result
