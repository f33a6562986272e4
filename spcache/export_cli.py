"""``spcache export FINGERPRINT --cache DIR --to DEST.zarr``: publish a Zarr snapshot.

Writes the records of one fingerprint of an LMDB cache as a Zarr v3 group under ``DEST``
(a path or an fsspec URL), atomically for readers; see :mod:`cache_store.snapshot.zarr.export`.
Exit status: 0 exported, 1 not exported (bad records, existing export, another writer,
unknown fingerprint), 2 bad usage, a bad cache path or a destination not ending in
``.zarr``. CPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cache_store.errors import SpcacheError
from cache_store.location import cache_dir_problem, is_remote, local_path

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
    parser.add_argument("--cache", required=True, help="cache directory (LMDB)")
    parser.add_argument(
        "--to",
        required=True,
        dest="dest",
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
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")


def run(args: argparse.Namespace) -> int:
    from cache_store.snapshot.zarr.export import export_snapshot

    problem = cache_dir_problem(args.cache, write=False)
    if problem:
        print(f"spcache export: {problem}", file=sys.stderr)
        return 2
    cache = local_path(args.cache)
    if (
        not is_remote(args.dest)
        and Path(local_path(args.dest)).exists()
        and not Path(local_path(args.dest)).is_dir()
    ):
        print(
            f"spcache export: --to {args.dest}: is a file, not a Zarr snapshot directory",
            file=sys.stderr,
        )
        return 2
    if not str(args.dest).rstrip("/").endswith(".zarr"):
        print(
            f"spcache export: --to {args.dest}: a snapshot's name must end in .zarr "
            f"(e.g. {str(args.dest).rstrip('/')}.zarr)",
            file=sys.stderr,
        )
        return 2
    try:
        options = json.loads(args.storage_options)
        if not isinstance(options, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        print(f"spcache export: --storage-options: {exc}", file=sys.stderr)
        return 2
    chunk_bytes = None if args.chunk_kib is None else args.chunk_kib * 1024
    try:
        summary = export_snapshot(
            cache,
            args.fingerprint,
            args.dest,
            overwrite=args.overwrite,
            skip_bad=args.skip_bad,
            chunk_bytes=chunk_bytes,
            clevel=args.clevel,
            codec=args.codec,
            storage_options=options,
            progress=not args.no_progress and sys.stderr.isatty(),
        )
    except (SpcacheError, OSError) as exc:
        print(f"spcache export: export failed: {exc}", file=sys.stderr)
        return 1
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
