"""``spcache ls``, ``rm``, ``prune`` and ``compact``: a cache that can shrink.

The logic lives in :mod:`cache_store.housekeeping`; these print it. A bad ``--cache``,
an unknown fingerprint or a refused limit is one line on stderr, exit 2; a cache busy
being compacted (or written, for ``compact``) is exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cache_store.errors import SpcacheError, StoreBusy
from cache_store.housekeeping import format_size

__all__ = ["LS", "RM", "PRUNE", "COMPACT"]


def _cache_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--cache", required=True, help=what)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")


def _fail(command: str, exc: BaseException) -> int:
    text = str(exc).strip().splitlines()
    print(f"spcache {command}: {text[0] if text else type(exc).__name__}", file=sys.stderr)
    return 1 if isinstance(exc, StoreBusy) else 2


def _when(text: str | None) -> str:
    return "-" if not text else text.replace("T", " ").replace("+00:00", "")


def _table(rows: list[dict[str, Any]]) -> None:
    head = (
        "FINGERPRINT",
        "RECIPE",
        "RECORDS",
        "SIZE",
        "STATE",
        "FAILED",
        "LAST WRITTEN",
        "LAST READ",
    )
    lines = [head]
    for row in rows:
        recipe = "-" if row["recipe"] is None else f"{row['recipe']} v{row['recipe_version']}"
        if row.get("recipe_changed"):
            recipe += " (version changed)"
        elif row.get("code_changed"):
            recipe += " (code changed)"
        lines.append(
            (
                row["fingerprint"],
                recipe,
                str(row["records"]),
                format_size(row["bytes"]),
                row["state"],
                str(row["failed"]),
                _when(row["last_written"]),
                _when(row["last_read"]),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        )


class LS:
    @staticmethod
    def configure_parser(parser: argparse.ArgumentParser) -> None:
        _cache_argument(parser, "cache directory or Zarr snapshot")
        parser.add_argument("--json", action="store_true", help="print a JSON list of objects")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from cache_store.housekeeping import ls

        try:
            rows = ls(args.cache)
        except (SpcacheError, OSError, ValueError) as exc:
            return _fail("ls", exc)
        if args.json:
            print(json.dumps(rows, sort_keys=True))
            return 0
        if not rows:
            print(f"no fingerprints in {args.cache}")
            return 0
        _table(rows)
        total = sum(r["bytes"] for r in rows)
        print(
            f"{len(rows)} fingerprint(s), {format_size(total)} ({total} bytes) of records; "
            f"least recently used first"
        )
        return 0


class RM:
    @staticmethod
    def configure_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "fingerprints",
            nargs="+",
            metavar="FINGERPRINT",
            help="fingerprint, or a unique prefix of at least 6 characters",
        )
        _cache_argument(parser, "cache directory")
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
        parser.add_argument("--json", action="store_true", help="print the report as JSON")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from cache_store.housekeeping import rm

        try:
            reports = rm(
                args.cache, args.fingerprints, failed=args.failed, compact_after=args.compact
            )
        except (SpcacheError, OSError, ValueError) as exc:
            return _fail("rm", exc)
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


class PRUNE:
    @staticmethod
    def configure_parser(parser: argparse.ArgumentParser) -> None:
        _cache_argument(parser, "cache directory")
        parser.add_argument(
            "--max-size",
            metavar="SIZE",
            help="remove least recently used fingerprints until the records "
            "fit in SIZE (bytes, or 500M, 2G, 1.5T)",
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
        parser.add_argument("--json", action="store_true", help="print the result as JSON")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from cache_store.housekeeping import prune

        if args.max_size is None and args.unused_for is None and args.keep is None:
            print(
                "spcache prune: give at least one of --max-size, --unused-for, --keep",
                file=sys.stderr,
            )
            return 2
        try:
            result = prune(
                args.cache,
                max_size=args.max_size,
                unused_for=args.unused_for,
                keep=args.keep,
                dry_run=args.dry_run,
                compact_after=args.compact,
            )
        except (SpcacheError, OSError, ValueError) as exc:
            return _fail("prune", exc)
        if args.json:
            print(json.dumps(result, sort_keys=True))
            return 0
        verb = "would remove" if args.dry_run else "removed"
        for row in result["removed"]:
            recipe = row["recipe"] or "unindexed"
            print(
                f"{verb} {row['fingerprint']} ({recipe}, {row['records']} records, "
                f"{format_size(row['bytes'])}, last used "
                f"{_when(row['last_read'] or row['last_written'] or row['created'])})"
            )
        print(
            f"{len(result['removed'])} fingerprint(s) {verb}; records "
            f"{format_size(result['bytes_before'])} -> {format_size(result['bytes_after'])}"
        )
        return 0


class COMPACT:
    @staticmethod
    def configure_parser(parser: argparse.ArgumentParser) -> None:
        _cache_argument(parser, "cache directory")
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
        parser.add_argument("--json", action="store_true", help="print the sizes as JSON")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from cache_store.housekeeping import compact

        try:
            sizes = compact(args.cache, wait_s=args.wait, rewrite_records=args.rewrite_records)
        except (SpcacheError, OSError, ValueError) as exc:
            return _fail("compact", exc)
        if args.json:
            print(json.dumps(sizes, sort_keys=True))
            return 0
        if args.rewrite_records:
            print(
                f"records: {sizes['rewritten']} of {sizes['records']} rewritten to format 2"
                + (
                    f", {sizes['unreadable']} unreadable left as they were"
                    if sizes["unreadable"]
                    else ""
                )
            )
        print(f"data.mdb: {format_size(sizes['before'])} -> {format_size(sizes['after'])}")
        return 0
