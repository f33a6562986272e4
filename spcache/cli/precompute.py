"""``spcache precompute SOURCE... --recipe NAME --cache LOCATION``: compute a recipe into a
cache directory or a sharded snapshot (``DEST.zarr``, ``s3://bucket/x.zarr``).

Parses the flags into the recipe's parameters and an
:class:`~cache_store.engine_options.EngineOptions`, calls
:func:`workers.precompute.run_precompute` (the run :func:`spcache.precompute` makes too)
and prints its summary. Exit 0 when every sample has a record (with ``--skip-failed``,
failures known from an earlier run do not count), 1 when some failed; errors are mapped
by :mod:`spcache.cli.exits`. SIGTERM and SIGHUP end a run like Ctrl-C: what was computed
is committed and indexed, the loader processes stop, and the exit status is 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from cache_store.engine_options import EngineOptions
from cache_store.errors import ParameterError, StoreFull, UnknownName
from cache_store.process_local import handle_unless_ignored
from cache_store.recipes.specs import RecipeSpec
from cache_store.recipes.registry import get_recipe_spec
from cache_store.recipes.table import recipe_table
from cache_store.sources.discover import KEEP_EXTENSION, describe_left_out
from spcache.cli.args import (
    add_backend,
    add_cache,
    add_device,
    add_json,
    add_loaders,
    add_time_limit,
)
from spcache.cli.exits import FAILED, exit_status

__all__ = ["configure_parser", "run", "parse_params"]

_DEFAULTS = EngineOptions()


def parse_params(pairs: Sequence[str], spec: RecipeSpec | None = None) -> dict[str, Any]:
    """``["level=8", "surface_sigma=0.02"]`` -> ``{"level": 8, "surface_sigma": 0.02}``.

    With the recipe's schema ``spec``, each value is read as its parameter's declared
    type, so ``--param tag=123`` is the string ``"123"`` for a ``str`` parameter (the
    fingerprint Python's ``tag="123"`` gives) and a ``bool`` parameter takes ``true`` or
    ``false``. Other values (and every value without ``spec``) are read as JSON where
    they are JSON, else kept as strings; the schema then reports any type problem.
    Raises ParameterError on malformed or repeated keys.
    """
    declared = {} if spec is None else {k: p.type for k, p in spec.params.items()}
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
        kind = declared.get(key)
        if kind is str:
            params[key] = raw
            continue
        if kind is bool and raw.strip().lower() in ("true", "false"):
            params[key] = raw.strip().lower() == "true"
            continue
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        params[key] = value
    if problems:
        raise ParameterError(problems, what="--param values")
    return params


def _schema(recipe: str) -> RecipeSpec | None:
    """The schema of ``recipe``; None when it is not installed (the run names it)."""
    try:
        return get_recipe_spec(recipe)
    except UnknownName:
        return None


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "recipes and their parameters (--param NAME=VALUE; type, default, "
        "bounds):\n" + recipe_table()
    )
    parser.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="a file, a directory (searched recursively) or a manifest "
        '(.txt: one path a line; .jsonl: {"id": ..., "path": ...})',
    )
    ids = parser.add_mutually_exclusive_group()
    ids.add_argument(
        "--id-template",
        default=None,
        metavar="TEMPLATE",
        help="sample ids from each file's path relative to its directory or "
        ".txt manifest: a format string over {path} (with extension), "
        "{id} (without: the default), {parts[N]} (its components), "
        '{parent}, {name}, {stem}, {ext}; e.g. "{parts[0]}/{parts[1]}" '
        "for ShapeNet's SYNSET/MODEL/models/model_normalized.obj. .jsonl "
        "manifests keep their ids",
    )
    ids.add_argument(
        "--id-keep-ext",
        action="store_true",
        help="keep the extension in sample ids (link_0.stl and link_0.obj "
        'become two samples); the same as --id-template "{path}"',
    )
    parser.add_argument("--recipe", required=True, help="recipe name (see below; spcache recipes)")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe parameter (repeatable; see below)",
    )
    add_cache(
        parser,
        "cache directory, or a sharded snapshot: DEST.zarr or a URL (s3://bucket/x.zarr)",
    )
    add_device(parser)
    add_backend(parser)
    add_loaders(parser, help="; with --engine ray, per actor, chosen from its node")
    add_time_limit(parser)
    parser.add_argument(
        "--variants",
        type=int,
        default=1,
        metavar="K",
        help="records per sample: variant 0 (the sample itself) and K-1 more, each from its "
        "own seeded generator, augmented as the recipe's rotation, scale_min/scale_max "
        "and jitter parameters say (default 1; not part of the fingerprint: asking for 6 "
        "after 4 computes the 2 new ones; done/skipped/failed count records)",
    )
    parser.add_argument(
        "--skip-failed",
        action="store_true",
        help="do not retry samples that failed in an earlier run of this recipe on this cache",
    )
    parser.add_argument(
        "--query-chunk",
        type=int,
        default=_DEFAULTS.query_chunk,
        metavar="N",
        help=f"queries per device call before any out-of-memory back-off "
        f"(default {_DEFAULTS.query_chunk})",
    )
    parser.add_argument(
        "--write-batch",
        type=int,
        default=_DEFAULTS.write_batch,
        metavar="N",
        help=f"records per transaction (default {_DEFAULTS.write_batch})",
    )
    add_json(parser, "print the summary as JSON on stdout")
    parser.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local: this process and its loaders; ray: Ray actors, one per "
        "GPU (or CPU), needs spcache[ray]",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (--engine ray; default: start a local one)",
    )
    parser.add_argument(
        "--actors",
        type=int,
        default=None,
        help="Ray actors (--engine ray; default: one per GPU of the cluster, "
        "or one per CPU without GPUs); --loaders is then per actor",
    )


def run(args: argparse.Namespace) -> int:
    from workers.precompute import run_precompute
    from workers.time_limits import own_the_process

    params = parse_params(args.param, _schema(args.recipe))
    options = EngineOptions(
        device=args.device,
        backend=args.backend,
        loaders=args.loaders,
        query_chunk=args.query_chunk,
        write_batch=args.write_batch,
        skip_failed=args.skip_failed,
        time_limit_s=args.time_limit_s,
    )
    own_the_process()  # a sample that cannot be stopped at its limit may end this process
    previous = _say_when_stopping()
    try:
        # with --json, stdout carries the summary alone (Ray prints actor deaths there)
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            summary = run_precompute(
                args.sources,
                args.recipe,
                args.cache,
                params=params,
                options=options,
                progress=sys.stderr.isatty(),
                engine=args.engine,
                address=args.address,
                actors=args.actors,
                id_template=KEEP_EXTENSION if args.id_keep_ext else args.id_template,
                variants=args.variants,
            )
    except StoreFull as exc:  # the one error with advice of its own
        print(
            f"spcache precompute: stopped: {exc}. The records committed before it are kept "
            f"(spcache stats --cache {args.cache}); free space (or raise the cache's size "
            f"bound) and run the same command again: stored samples are skipped.",
            file=sys.stderr,
        )
        return exit_status(exc) or FAILED
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if args.json:
        print(json.dumps(summary.as_json(), sort_keys=True))
    else:
        _print_summary(summary)
    # with --skip-failed, a failure known from an earlier run (not retried, or one found
    # before its source could be hashed, failing again the same way) is no news: exit 1
    # only when something failed anew
    known = (
        len(summary.repeats("skipped")) + len(summary.repeats("again")) if args.skip_failed else 0
    )
    return 1 if summary.failed > known else 0


STOPPING = b"spcache precompute: stopping: committing and indexing what was computed ...\n"


def _say_when_stopping() -> Any:
    """Ctrl-C says at once that the run is stopping (the loaders are stopped and what
    was computed is committed and indexed, which takes a moment, not a silent wait).
    Returns the previous SIGINT handler (None off the main thread: nothing changed)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stopping(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: as usual
        # Straight to the descriptor, so this handler raises nothing but the interrupt: it
        # may land in the middle of a log line (sys.stderr's buffer would refuse to be
        # re-entered), and a closed pipe or file costs the line, never the stop.
        with contextlib.suppress(OSError):
            os.write(2, STOPPING)
        raise KeyboardInterrupt

    return handle_unless_ignored(signal.SIGINT, stopping)


def _print_summary(summary: Any) -> None:
    print(
        f"recipe {summary.recipe} v{summary.recipe_version} "
        f"{json.dumps(summary.params, sort_keys=True)} on {summary.device} ({summary.backend})"
    )
    variants = getattr(summary, "variants", 1)
    records = f" records ({variants} variants per sample)" if variants > 1 else ""
    print(
        f"done {summary.done}, skipped {summary.skipped}, failed {summary.failed}{records} "
        f"in {summary.wall_s:.1f}s"
    )
    for error in summary.errors:
        print(f"  failed {error.id} ({error.path}): {error.reason}")
    if summary.left_out:
        print(f"  {describe_left_out(summary.left_out)}")
    if getattr(summary, "skipped_other_code", 0):
        print(
            f"  {summary.skipped_other_code} skipped record(s) were computed by other recipe "
            "code than the installed one (kept: bump the recipe's version to recompute)"
        )
    for line in summary.detail_lines() if hasattr(summary, "detail_lines") else ():
        print(line)
    print(f"fingerprint {summary.fingerprint}")
