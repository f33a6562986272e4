"""``spcache ls --cache LOCATION``: one row per fingerprint of a cache directory or a
Zarr snapshot (records, bytes, state, failed samples, last written, last read), least
recently used first (:func:`cache_store.housekeeping.ls`), or a JSON list.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from cache_store.housekeeping import format_size
from spcache.cli.args import add_cache, add_json

__all__ = ["configure_parser", "format_when", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_cache(parser, "cache directory or Zarr snapshot")
    add_json(parser, "print a JSON list of objects")


def run(args: argparse.Namespace) -> int:
    from cache_store.housekeeping import ls

    rows = ls(args.cache)
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


def format_when(text: str | None) -> str:
    """An ISO 8601 UTC time as ``2026-11-25 00:35:20``; ``-`` for none."""
    return "-" if not text else text.replace("T", " ").replace("+00:00", "")


def _per_sample(row: dict[str, Any]) -> str:
    """`` (4 x 6 variants)`` for a fingerprint whose samples have variants."""
    low, high = int(row.get("variants", 1)), int(row.get("variants_max", 1))
    if high <= 1:
        return ""
    many = f"{low}-{high}" if high > low else str(low)
    return f" ({row['indexed']} x {many} variants)"


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
                str(row["records"]) + _per_sample(row),
                format_size(row["bytes"]),
                row["state"],
                str(row["failed"]),
                format_when(row["last_written"]),
                format_when(row["last_read"]),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        )
