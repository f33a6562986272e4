"""``spcache precompute SOURCE... --recipe NAME --cache DIR``: compute a recipe into a cache.

The device side of the command line (it imports torch and the engine); the dispatcher is
:mod:`spcache.cli`. Sources are found by :func:`cache_store.sources.discover.discover_sources`.
SIGTERM and SIGHUP end a run like Ctrl-C: what was computed is committed and indexed,
the loader processes stop, and the exit status is 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cache_store.errors import (
    BackendUnavailable,
    ParameterError,
    SpcacheError,
    StoreFull,
    UnknownName,
)
from cache_store.location import cache_dir_problem
from cache_store.recipes.table import recipe_table
from cache_store.sources.discover import discover_sources

__all__ = ["configure_parser", "run", "parse_params", "UsageError"]


class UsageError(SpcacheError, ValueError):
    """Bad command-line usage; reported on stderr with exit status 2."""


def parse_params(pairs: Sequence[str]) -> dict[str, Any]:
    """``["level=8", "surface_sigma=0.02"]`` -> ``{"level": 8, "surface_sigma": 0.02}``.

    Values are read as JSON numbers where they are one, else kept as strings (the recipe
    schema then reports the type problem). Raises ParameterError on malformed or repeated
    keys.
    """
    params: dict[str, Any] = {}
    problems = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"{pair!r}: expected KEY=VALUE")
            continue
        if key in params:
            problems.append(f"{key}: given more than once")
            continue
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        params[key] = value
    if problems:
        raise ParameterError(problems, what="--param values")
    return params


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("recipes and their parameters (--param NAME=VALUE; type, default, "
                     "bounds):\n" + recipe_table())
    parser.add_argument("sources", nargs="+", metavar="SOURCE",
                        help="a file, a directory (searched recursively) or a manifest "
                             "(.txt: one path a line; .jsonl: {\"id\": ..., \"path\": ...})")
    parser.add_argument("--recipe", required=True, help="recipe name (see below; spcache recipes)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe parameter (repeatable; see below)")
    parser.add_argument("--cache", required=True, type=Path, help="cache directory")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "kaolin"],
                        help="SPC ops: kaolin (needs Kaolin and CUDA), torch (pure PyTorch, "
                             "any device), auto (kaolin where it works, else torch)")
    parser.add_argument("--loaders", "--jobs", dest="loaders", type=int, default=None,
                        help="loader processes (0: load in this process; default: one per "
                             "core but one, at most 8; with --engine ray, per actor, "
                             "default chosen by each actor from its node). --jobs is an alias")
    parser.add_argument("--skip-failed", action="store_true",
                        help="do not retry samples that failed in an earlier run of this "
                             "recipe on this cache")
    parser.add_argument("--query-chunk", type=int, default=1 << 18,
                        help="queries per device call before any out-of-memory back-off")
    parser.add_argument("--write-batch", type=int, default=32, help="records per transaction")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    parser.add_argument("--engine", choices=["local", "ray"], default="local",
                        help="local: this process and its loaders; ray: Ray actors, one per "
                             "GPU (or CPU), needs spcache[ray]")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join (--engine ray; default: start a local one)")
    parser.add_argument("--actors", type=int, default=None,
                        help="Ray actors (--engine ray; default: one per GPU of the cluster, "
                             "or one per CPU without GPUs); --loaders is then per actor")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")


def run(args: argparse.Namespace) -> int:
    from workers.engine import DEVICE_PATTERN
    from workers.recipes import get_recipe

    try:  # everything that can be checked without touching the cache or a device
        params = get_recipe(args.recipe).spec.resolve(parse_params(args.param))
        if not DEVICE_PATTERN.match(args.device):
            raise UsageError(f"--device {args.device!r}: expected auto, cpu, cuda or cuda:N")
        if args.loaders is not None and args.loaders < 0:
            raise UsageError(f"--loaders {args.loaders}: must be 0 or more")
        if args.engine == "local" and (args.address is not None or args.actors is not None):
            raise UsageError("--address and --actors need --engine ray")
        if args.actors is not None and args.actors < 1:
            raise UsageError(f"--actors {args.actors}: must be 1 or more")
        problem = cache_dir_problem(args.cache, write=True)
        if problem:
            raise UsageError(problem)
        items = discover_sources(args.sources)
        if not items:
            raise UsageError("no supported source files found in "
                             + ", ".join(map(str, args.sources)))
    except SpcacheError as exc:
        print(f"spcache precompute: {exc}", file=sys.stderr)
        return 2
    from cache_store.stores.base import open_store

    try:
        store = open_store(args.cache, readonly=False)
        engine = _make_engine(args, store, params)
    except (SpcacheError, OSError) as exc:
        print(f"spcache precompute: cannot open cache {args.cache}: {exc}", file=sys.stderr)
        return 2
    try:
        # with --json, stdout carries the summary alone (Ray prints actor deaths there)
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            summary = _run_engine(engine, items)
    except (ParameterError, UnknownName, BackendUnavailable) as exc:
        print(f"spcache precompute: {exc}", file=sys.stderr)
        return 2
    except StoreFull as exc:
        print(f"spcache precompute: stopped: {exc}. The records committed before it are "
              f"kept (spcache stats {args.cache}); free space (or raise the cache's size "
              f"bound) and run the same command again: stored samples are skipped.",
              file=sys.stderr)
        return 1
    finally:
        store.close()
    if args.json:
        print(json.dumps(summary.as_json(), sort_keys=True))
    else:
        _print_summary(summary)
    return 1 if summary.failed else 0


def _make_engine(args: argparse.Namespace, store: Any, params: dict[str, Any]) -> Any:
    options = dict(device=args.device, backend=args.backend, query_chunk=args.query_chunk,
                   write_batch=args.write_batch, progress=sys.stderr.isatty())
    if args.engine == "ray":  # Ray is imported only on this path
        from workers.ray_engine import RayEngine

        return RayEngine(store, args.recipe, params, address=args.address, actors=args.actors,
                         loaders=args.loaders, skip_failed=args.skip_failed, **options)
    from workers.engine import Engine

    loaders = max(1, min(8, (os.cpu_count() or 2) - 1)) if args.loaders is None else args.loaders
    return Engine(store, args.recipe, params, loaders=loaders, skip_failed=args.skip_failed,
                  **options)


def _run_engine(engine: Any, items: list[tuple[str, str]]) -> Any:
    """``engine.run(items)``; SIGTERM (``docker stop``, or SIGHUP via the dispatcher) ends
    it like Ctrl-C: what was computed is committed and indexed before the process exits
    with status 130."""
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        if not engine.progress:
            return engine.run(items)
        from tqdm.contrib.logging import logging_redirect_tqdm

        with logging_redirect_tqdm():
            return engine.run(items)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _print_summary(summary: Any) -> None:
    print(f"recipe {summary.recipe} v{summary.recipe_version} "
          f"{json.dumps(summary.params, sort_keys=True)} on {summary.device} ({summary.backend})")
    print(f"done {summary.done}, skipped {summary.skipped}, failed {summary.failed} "
          f"in {summary.wall_s:.1f}s")
    for error in summary.errors:
        print(f"  failed {error.id} ({error.path}): {error.reason}")
    for line in summary.detail_lines() if hasattr(summary, "detail_lines") else ():
        print(line)
    print(f"fingerprint {summary.fingerprint}")
