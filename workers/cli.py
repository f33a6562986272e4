"""The ``spcache`` command line.

``spcache COMMAND ...`` where COMMAND is looked up in :data:`COMMANDS`, a plain dict of
name -> (import target, one-line help). A target is ``"package.module"`` or
``"package.module:attribute"`` naming an object with ``configure_parser(parser)`` and
``run(args) -> int``; it is imported only when its command runs, so ``spcache serve``
reaches ``service.cli`` without ``workers`` importing ``service``, and a command whose
module is missing fails with a clear message (exit 2).

Exit status: 0 all good, 1 some samples failed (or the cache did not verify), 2 bad
usage (unknown command or recipe, invalid parameter, no sources found), 130 interrupted.
Logging is configured here and nowhere else in the package.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cache_store.discovery import discover_sources
from cache_store.errors import (
    BackendUnavailable,
    ParameterError,
    SourceError,
    SpcacheError,
    UnknownName,
)

__all__ = ["COMMANDS", "main", "discover_sources", "parse_params"]

logger = logging.getLogger(__name__)

#: command name -> (import target, help). Targets are imported at dispatch time.
COMMANDS: dict[str, tuple[str, str]] = {
    "precompute": ("workers.cli:PRECOMPUTE", "compute a recipe over sources into a cache"),
    "verify": ("workers.cli:VERIFY", "check every record of a cache decodes and matches its checksum"),
    "stats": ("workers.cli:STATS", "summarise a cache: fingerprints, records, bytes"),
    "worker": ("workers.worker_loop", "run the long-lived GPU worker over the cache's job queue"),
    "serve": ("service.cli", "run the HTTP service (and its worker)"),
    "export": ("workers.export_cli", "export one fingerprint of a cache to a Zarr snapshot"),
    "demo": ("workers.demo", "make example shapes, precompute them, serve them, show where to look"),
}

class UsageError(SpcacheError, ValueError):
    """Bad command-line usage; reported on stderr with exit status 2."""


# --- entry point ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    try:
        ns = top.parse_args(argv)
    except SystemExit as exc:
        return _exit_code(exc)
    name = ns.command
    target = _resolve(name)
    if isinstance(target, str):
        print(f"spcache: {target}", file=sys.stderr)
        return 2
    sub = argparse.ArgumentParser(prog=f"spcache {name}", description=COMMANDS[name][1])
    target.configure_parser(sub)
    try:
        args = sub.parse_args(ns.rest)
    except SystemExit as exc:
        return _exit_code(exc)
    _configure_logging(ns.verbose + getattr(args, "verbose", 0) - ns.quiet)
    try:
        return int(target.run(args))
    except KeyboardInterrupt:
        print("spcache: interrupted", file=sys.stderr)
        return 130


def _top_parser() -> argparse.ArgumentParser:
    lines = [f"  {name:<12}{help_}" for name, (_, help_) in COMMANDS.items()]
    parser = argparse.ArgumentParser(
        prog="spcache", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Precompute and serve cached Kaolin SPC features.",
        epilog="commands:\n" + "\n".join(lines) + "\n\nRun 'spcache COMMAND --help' for a command's options.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (repeatable)")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="less logging")
    parser.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _resolve(name: str) -> Any:
    """The command object for ``name``, or a message saying why it is unavailable."""
    target = COMMANDS[name][0]
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return (f"command {name!r} is unavailable: cannot import {module_name} "
                f"({type(exc).__name__}: {exc})")
    obj = getattr(module, attribute) if attribute else module
    if not (callable(getattr(obj, "configure_parser", None)) and callable(getattr(obj, "run", None))):
        return f"command {name!r} is unavailable: {target} has no configure_parser() and run()"
    return obj


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 2


def _configure_logging(verbosity: int) -> None:
    level = logging.WARNING - 10 * verbosity
    logging.basicConfig(level=max(logging.DEBUG, min(logging.CRITICAL, level)),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _verbose_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")


# --- sources: discovery lives in cache_store.discovery (one definition) ----------------


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


# --- commands ------------------------------------------------------------------------------


class _Precompute:
    @staticmethod
    def configure_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("sources", nargs="+", metavar="SOURCE",
                            help="a file, a directory (searched recursively) or a manifest "
                                 "(.txt: one path a line; .jsonl: {\"id\": ..., \"path\": ...})")
        parser.add_argument("--recipe", required=True, help="recipe name (e.g. spc, spc_query)")
        parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                            help="recipe parameter (repeatable)")
        parser.add_argument("--cache", required=True, type=Path, help="cache directory")
        parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
        parser.add_argument("--backend", default="auto", choices=["auto", "torch", "kaolin"])
        parser.add_argument("--jobs", type=int, default=None,
                            help="loader processes (0: load in this process; default: one per "
                                 "core but one, at most 8; with --engine ray, per actor, "
                                 "default chosen by each actor from its node)")
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
                                 "or one per CPU without GPUs); --jobs is then per actor")
        _verbose_flag(parser)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from workers.engine import DEVICE_PATTERN
        from workers.recipes import get_recipe

        try:  # everything that can be checked without touching the cache or a device
            params = get_recipe(args.recipe).spec.resolve(parse_params(args.param))
            if not DEVICE_PATTERN.match(args.device):
                raise UsageError(f"--device {args.device!r}: expected auto, cpu, cuda or cuda:N")
            if args.jobs is not None and args.jobs < 0:
                raise UsageError(f"--jobs {args.jobs}: must be 0 or more")
            if args.engine == "local" and (args.address is not None or args.actors is not None):
                raise UsageError("--address and --actors need --engine ray")
            if args.actors is not None and args.actors < 1:
                raise UsageError(f"--actors {args.actors}: must be 1 or more")
            items = discover_sources(args.sources)
            if not items:
                raise UsageError("no supported source files found in "
                                 + ", ".join(map(str, args.sources)))
        except SpcacheError as exc:
            print(f"spcache precompute: {exc}", file=sys.stderr)
            return 2
        from cache_store.store import open_store

        try:
            store = open_store(args.cache, readonly=False)
        except (SpcacheError, OSError) as exc:
            print(f"spcache precompute: cannot open cache {args.cache}: {exc}", file=sys.stderr)
            return 2
        try:
            engine = _make_engine(args, store, params)
            # with --json, stdout carries the summary alone (Ray prints actor deaths there)
            with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
                summary = _run_engine(engine, items)
        except (ParameterError, UnknownName, BackendUnavailable) as exc:
            print(f"spcache precompute: {exc}", file=sys.stderr)
            return 2
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

        return RayEngine(store, args.recipe, params, jobs=args.jobs, address=args.address,
                         actors=args.actors, **options)
    from workers.engine import Engine

    jobs = max(1, min(8, (os.cpu_count() or 2) - 1)) if args.jobs is None else args.jobs
    return Engine(store, args.recipe, params, jobs=jobs, **options)


def _run_engine(engine: Any, items: list[tuple[str, str]]) -> Any:
    """``engine.run(items)``; SIGTERM (``docker stop``) ends it like Ctrl-C: what was
    computed is committed and indexed before the process exits with status 130."""
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


class _Verify:
    @staticmethod
    def configure_parser(parser: argparse.ArgumentParser) -> None:
        _cache_reader_arguments(parser, "print the report as JSON")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        data = _isolated(args.cache, "verify_cache")  # a child: an LMDB abort cannot kill us
        if data is None:
            return 2
        problems = [f"corrupt {key}: {reason}" for key, reason in data["corrupt"].items()]
        problems += [f"missing {key} (indexed, no record)" for key in data["missing"]]
        if data.get("damaged"):
            problems.append(str(data["damaged"]))
        if args.json:
            print(json.dumps(data, sort_keys=True))
        else:
            for problem in problems:
                print(f"  {problem}")
            print(f"checked {data['checked']} records: "
                  + ("cache verifies clean" if not problems else f"{len(problems)} problem(s)"))
        return 1 if problems else 0


class _Stats:
    @staticmethod
    def configure_parser(parser: argparse.ArgumentParser) -> None:
        _cache_reader_arguments(parser, "print the statistics as JSON")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from cache_store.errors import CacheDamaged

        try:
            stats = _isolated(args.cache, "stats_cache")
        except CacheDamaged as exc:
            print(f"spcache: {exc}", file=sys.stderr)
            return 1
        if stats is None:
            return 2
        if args.json:
            print(json.dumps(stats, sort_keys=True, default=str))
        else:
            _print_tree(stats)
        return 0


def _cache_reader_arguments(parser: argparse.ArgumentParser, json_help: str) -> None:
    parser.add_argument("--cache", required=True,
                        help="cache directory, Zarr snapshot (path or URL) or service URL")
    parser.add_argument("--json", action="store_true", help=json_help)
    _verbose_flag(parser)


def _isolated(cache: str, name: str) -> Any:
    """``cache_store.isolated.<name>(cache)``: the walk runs in a child process."""
    from cache_store import isolated
    from cache_store.errors import CacheDamaged

    if "://" not in cache and not Path(cache).exists():
        print(f"spcache: {cache}: no such cache directory", file=sys.stderr)
        return None
    try:
        return getattr(isolated, name)(cache)
    except CacheDamaged:
        raise
    except (SpcacheError, OSError) as exc:
        print(f"spcache: cannot open cache {cache}: {exc}", file=sys.stderr)
        return None


def _print_tree(data: Any, indent: str = "") -> None:
    if isinstance(data, dict):
        for key, value in data.items():
            if isinstance(value, dict | list):
                print(f"{indent}{key}:")
                _print_tree(value, indent + "  ")
            else:
                print(f"{indent}{key}: {value}")
    elif isinstance(data, list):
        for value in data:
            _print_tree(value, indent + "- ") if isinstance(value, dict | list) \
                else print(f"{indent}- {value}")
    else:
        print(f"{indent}{data}")


PRECOMPUTE = _Precompute
VERIFY = _Verify
STATS = _Stats
