"""``spcache recipes [--json]``: the recipes, their parameters, defaults, bounds and fields,
from the schemas in :mod:`cache_store.recipes.specs` (the same table as ``precompute --help``)."""

from __future__ import annotations

import argparse
import json

from cache_store.recipes.table import recipe_table
from cache_store.recipes.specs import RECIPE_SPECS

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print every recipe's schema (params with type, default, bounds; "
                             "output fields) as JSON")


def run(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({name: spec.as_json() for name, spec in RECIPE_SPECS.items()},
                         sort_keys=True))
    else:
        print(recipe_table())
    return 0
