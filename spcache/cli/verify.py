"""``spcache verify --cache LOCATION``: check that every record of a cache decodes and
matches its checksums, and that every indexed sample has one
(:func:`cache_store.cache_report.verify_location`), and that no fingerprint has records
but no index. Exit 0 clean, 1 when a problem was found. CPU only, no torch.
"""

from __future__ import annotations

import argparse
import json

from spcache.cli.args import add_cache, add_json

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_cache(parser, "cache directory, Zarr snapshot (path or URL) or service URL")
    add_json(parser, "print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from cache_store.cache_report import verify_location

    data = verify_location(args.cache)
    problems = [f"corrupt {key}: {reason}" for key, reason in data["corrupt"].items()]
    problems += [f"missing {key} (indexed, no record)" for key in data["missing"]]
    problems += [
        f"unindexed {fp}: {count} record(s) of this fingerprint and no index (its index "
        "went missing, e.g. a rolled-back commit, or a run that writes it was killed or is "
        "still going: running the same precompute again writes it)"
        for fp, count in data.get("unindexed", {}).items()
    ]
    if data.get("damaged"):
        problems.append(str(data["damaged"]))
    if args.json:
        print(json.dumps(data, sort_keys=True))
    else:
        for problem in problems:
            print(f"  {problem}")
        for fp, count in data.get("unindexed_live", {}).items():
            print(
                f"  note: {fp}: {count} record(s) and no index yet, while "
                f"{data['writers'][fp]} is live (a run in progress: not counted)"
            )
        print(
            f"checked {data['checked']} records: "
            + ("cache verifies clean" if not problems else f"{len(problems)} problem(s)")
        )
    return 1 if problems else 0
