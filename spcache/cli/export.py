"""``spcache export FINGERPRINT --cache DIR --to DEST.zarr``: publish a Zarr snapshot.

Writes the records of one fingerprint of an LMDB cache as a Zarr v3 group under ``DEST``
(a path or an fsspec URL, ending in ``.zarr``), atomically for readers
(:func:`cache_store.snapshot.zarr.export.export_snapshot`). Exit 0 exported, 1 not exported
(bad records, an existing export, another writer), 2 bad usage: an unknown fingerprint,
a bad cache path, a destination that is a file or does not end in ``.zarr``. CPU only.
"""

from __future__ import annotations

import argparse
import json
import sys

from cache_store.errors import UsageError
from cache_store.location import check_cache_dir
from spcache.cli.args import add_cache, add_json, json_object, location

__all__ = ["configure_parser", "run"]


#: ``--codec``'s help: the numbers are measured (docs/BENCHMARKS.md: spc_query
#: records of 0.13 and 3.2 MB on a 2-core VM).
CODEC_HELP = (
    "chunk codec (default: none for a local path, zstd for a URL). none: the records' own "
    "size, and a local read takes only a record's bytes (0.6-0.95x the LMDB cache's read "
    "rate); lz4: ~1.9x smaller, reads 0.15-0.45x; lz4hc: ~2.4x smaller, reads "
    "0.15-0.45x; zstd: ~2.7x smaller, reads 0.08-0.4x. Compressed chunks are "
    "decompressed whole on every read."
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    from cache_store.snapshot.zarr.export import CODECS, DEFAULT_CHUNK_BYTES, RAW_CHUNK_BYTES

    parser.add_argument("fingerprint", help="fingerprint of the dataset to export")
    add_cache(parser, "cache directory (LMDB)", local=True)
    parser.add_argument(
        "--to",
        required=True,
        dest="dest",
        type=location,
        metavar="DEST.zarr",
        help="destination: a *.zarr path or an fsspec URL (s3://.../x.zarr)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace this fingerprint if the destination already has it",
    )
    parser.add_argument(
        "--skip-bad",
        action="store_true",
        help="leave out missing or corrupt records instead of failing",
    )
    parser.add_argument(
        "--chunk-kib",
        type=int,
        default=None,
        help=f"smallest uncompressed chunk of a data array, KiB (default "
        f"{DEFAULT_CHUNK_BYTES // 1024}; {RAW_CHUNK_BYTES // 1024} with "
        f"--codec none)",
    )
    parser.add_argument(
        "--clevel",
        type=int,
        default=3,
        help="compression level 1-9 (default 3; 1 exports ~2x faster, ~5%% larger)",
    )
    # --level was this option's name; kept working, unlisted (demo --level is an octree level)
    parser.add_argument("--level", type=int, dest="clevel", help=argparse.SUPPRESS)
    parser.add_argument("--codec", default=None, choices=list(CODECS), help=CODEC_HELP)
    parser.add_argument(
        "--storage-options",
        default="{}",
        help="JSON object of fsspec options for a URL destination",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_json(parser, "print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from cache_store.snapshot.zarr.export import export_snapshot

    cache = check_cache_dir(args.cache, write=False)
    dest = args.dest
    if dest.is_local and dest.path().exists() and not dest.path().is_dir():
        raise UsageError(f"--to {dest}: is a file, not a Zarr snapshot directory")
    if dest.kind != "zarr":
        raise UsageError(
            f"--to {dest}: a snapshot's name must end in .zarr (e.g. {str(dest).rstrip('/')}.zarr)"
        )
    summary = export_snapshot(
        cache,
        args.fingerprint,
        dest,
        overwrite=args.overwrite,
        skip_bad=args.skip_bad,
        chunk_bytes=None if args.chunk_kib is None else args.chunk_kib * 1024,
        clevel=args.clevel,
        codec=args.codec,
        storage_options=json_object("--storage-options", args.storage_options),
        progress=not args.no_progress and sys.stderr.isatty(),
    )
    if args.json:
        print(json.dumps(summary.as_json(), sort_keys=True))
    else:
        for key, reason in summary.skipped.items():
            print(f"  skipped {key}: {reason}")
        print(
            f"exported {summary.samples} records of {summary.fingerprint} to "
            f"{summary.destination} in {summary.seconds:.1f} s"
        )
    return 0
