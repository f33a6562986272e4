"""``spcache stats --cache LOCATION``: a cache's fingerprints, records, bytes, jobs and
failed samples (:func:`cache_store.cache_report.cache_stats`), printed one block per
fingerprint, or as JSON. CPU only, no torch.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from cache_store.housekeeping.units import format_size
from spcache.cli.args import add_cache, add_json

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_cache(parser, "cache directory, Zarr snapshot (path or URL) or service URL")
    add_json(parser, "print the statistics as JSON")


def run(args: argparse.Namespace) -> int:
    from cache_store.cache_report import cache_stats

    stats = cache_stats(args.cache)
    if args.json:
        print(json.dumps(stats, sort_keys=True, default=str))
    else:
        _print_stats(stats)
    return 0


def _print_stats(stats: dict[str, Any]) -> None:
    """The statistics, one block per fingerprint: what it is, when it was made, its
    records, its jobs by state and its failed samples (id, path, when, reason)."""
    fps = stats.get("fingerprints", {})
    print(
        f"cache {stats.get('location', '')}: {len(fps)} fingerprint(s), "
        f"{stats.get('records', 0)} records, {format_size(int(stats.get('bytes', 0)))}"
        + (f", {stats['failed']} failed sample(s)" if stats.get("failed") else "")
    )
    if stats.get("failures_error"):
        print(f"  ({stats['failures_error']})")
    for fp, entry in fps.items():
        what = (
            f"{entry['recipe']} v{entry['recipe_version']} "
            f"{json.dumps(entry.get('params', {}), sort_keys=True)}"
            if "recipe" in entry
            else "(no index)"
        )
        print(f"\nfingerprint {fp}  {what}")
        if entry.get("created"):
            print(f"  created  {entry['created']}")
        indexed = f", {entry['samples']} indexed" if "samples" in entry else ""
        if int(entry.get("variants_max", entry.get("variants", 1))) > 1:
            low = int(entry["variants"])
            high = int(entry.get("variants_max", low))
            indexed += f" x {low if high == low else f'{low}-{high}'} variants"
        print(
            f"  records  {entry.get('records', 0)} ({format_size(int(entry.get('bytes', 0)))}){indexed}"
        )
        if entry.get("index_error"):
            print(f"  index    unreadable: {entry['index_error']}")
        if entry.get("other_code"):
            print(
                f"  code     {entry['other_code']} of {entry.get('records', 0)} record(s) "
                "computed by other code than the installed recipe's "
                f"({entry['installed_code_digest']}): bump the recipe's version to recompute"
            )
        if entry.get("mixed_code"):
            counts = ", ".join(
                f"{n} by {d}" for d, n in sorted(entry.get("code_digests", {}).items())
            )
            print(f"  code     mixed ({counts}): {entry['mixed_code']}")
        for job in entry.get("jobs", []):
            counted = ", ".join(f"{v} {k}" for k, v in job["counts"].items())
            print(
                f"  job      {job['id']}  {job['status'].replace('_', ' ')}  "
                f"({counted}; {job['percent']:g}%)"
            )
        failed = entry.get("failed", {"count": 0, "items": []})
        if failed["count"]:
            print(f"  failed   {failed['count']}")
            for f in failed["items"]:
                again = f" ({f['times']} times)" if f.get("times", 1) > 1 else ""
                print(f"    {f['id']}  {f['path']}  {f['when']}{again}: {f['reason']}")
            if failed["count"] > len(failed["items"]):
                print(f"    ... and {failed['count'] - len(failed['items'])} more (--json)")
