"""``spcache recipes [--json]``: the installed recipes (built-in and plugins), their
parameters, defaults, bounds and fields, and where each comes from (the same table as
``precompute --help``). A recipe that could not be loaded is named on stderr with the
reason, and the command exits 1."""

from __future__ import annotations

import argparse
import json
import sys

from cache_store.recipes.registry import installed_recipes
from cache_store.recipes.table import recipe_table
from spcache.cli.args import add_json

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_json(
        parser,
        "print every recipe's schema (params with type, default, bounds; output fields) as JSON",
    )


def run(args: argparse.Namespace) -> int:
    registry = installed_recipes()
    if args.json:
        print(
            json.dumps(
                {name: entry.as_json() for name, entry in registry.recipes.items()}, sort_keys=True
            )
        )
    else:
        print(recipe_table())
    for line in registry.problems:
        print(f"spcache recipes: {line}", file=sys.stderr)
    return 1 if registry.problems else 0
