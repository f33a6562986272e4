"""The ``spcache`` command line: ``spcache [-v|-q] COMMAND [ARGS ...]``.

COMMAND is looked up in :data:`COMMANDS`, a plain dict of name -> (``"module:attribute"``,
one-line help). The target is imported only when its command runs, so ``serve``,
``verify``, ``stats``, ``export`` and ``recipes`` never import torch or ``workers``. A
target is an object (or module) with ``configure_parser(parser)`` and ``run(args) -> int``,
and optionally ``log_level(args) -> str | None`` (the command's own ``--log-level``).

Logging is configured here, once, before the command runs: at the command's own level
if it has one, else WARNING lowered by ``-v`` (raised by ``-q``).

A process started by another spcache process (the service's worker, the demo's service)
finds its parent's pid in ``SPCACHE_PARENT_PID`` and ends when that parent dies
(:mod:`spcache.lifecycle`). SIGHUP is treated as SIGTERM by every command.

Exit status: 0 all good (``precompute --skip-failed``: failures known from an earlier run
and not retried do not count), 1 some samples failed (or the cache did not verify), 2 bad
usage or a bad path, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["COMMANDS", "main", "resolve", "subcommand_parser", "configure_logging"]

logger = logging.getLogger(__name__)

#: command name -> (import target, help). Targets are imported at dispatch time.
COMMANDS: dict[str, tuple[str, str]] = {
    "precompute": (
        "workers.precompute_cli",
        "compute a recipe over sources into a cache (GPU side)",
    ),
    "worker": ("workers.worker_cli", "run the long-lived GPU worker over the cache's job queue"),
    "serve": ("service.cli", "run the HTTP service (and its worker)"),
    "verify": (
        "spcache.cache_commands:VERIFY",
        "check every record of a cache decodes and matches its checksum",
    ),
    "stats": (
        "spcache.cache_commands:STATS",
        "summarise a cache: fingerprints, records, bytes, failed samples",
    ),
    "ls": (
        "spcache.housekeeping_cli:LS",
        "list a cache's fingerprints: records, bytes, last written, last read",
    ),
    "rm": ("spcache.housekeeping_cli:RM", "remove fingerprints from a cache"),
    "prune": (
        "spcache.housekeeping_cli:PRUNE",
        "remove least recently used fingerprints (--max-size, --unused-for, --keep)",
    ),
    "compact": (
        "spcache.housekeeping_cli:COMPACT",
        "give the disk back: rewrite the cache's file without its free pages",
    ),
    "export": ("spcache.export_cli", "export one fingerprint of a cache to a Zarr snapshot"),
    "merge": (
        "spcache.shards_cli:MERGE",
        "merge a sharded snapshot's committed parts into its index (idempotent)",
    ),
    "import": (
        "spcache.shards_cli:IMPORT",
        "copy a snapshot's records into a local cache directory (LMDB)",
    ),
    "recipes": (
        "spcache.recipes_cli",
        "list the recipes with their parameters, defaults and bounds",
    ),
    "demo": (
        "workers.demo",
        "make example shapes, precompute them, serve them, show where to look",
    ),
}

PARENT_PID_ENV = "SPCACHE_PARENT_PID"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # also while the command's modules import (torch: ~1 s)
        with contextlib.suppress(OSError, ValueError):  # stderr may be a closed pipe
            print("spcache: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `spcache ls --json | head -1`: the reader has had enough
        return _output_closed()


def _output_closed() -> int:
    """End quietly, as a tool killed by SIGPIPE does (a shell reports 128 + 13): what is
    left in stdout's buffer goes to /dev/null at exit rather than failing once more."""
    with contextlib.suppress(OSError, ValueError):  # (stdout replaced by a non-file)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    return 128 + signal.SIGPIPE


def _main(argv: list[str]) -> int:
    top = _top_parser()
    split = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    try:
        ns = top.parse_args(argv[: split + 1])
    except SystemExit as exc:
        return _exit_code(exc)
    if ns.command is None:
        top.print_help(sys.stderr)
        return 2
    name, rest = ns.command, argv[split + 1 :]
    target = resolve(name)
    if isinstance(target, str):
        print(f"spcache: {target}", file=sys.stderr)
        return 2
    sub = subcommand_parser(name, target)
    try:
        args = sub.parse_args(rest)
    except SystemExit as exc:
        return _exit_code(exc)
    level = _command_level(target, args)
    if level is None:
        level = logging.WARNING - 10 * (ns.verbose + getattr(args, "verbose", 0) - ns.quiet)
    configure_logging(level)
    _load_recipes()
    logger.debug(
        "spcache %s: pid %d, log level %s",
        name,
        os.getpid(),
        logging.getLevelName(logging.getLogger().level),
    )
    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        from spcache.lifecycle import exit_with_parent

        exit_with_parent(parent)
    previous_hangup = signal.signal(signal.SIGHUP, _hangup_as_terminate)
    try:
        return int(target.run(args))
    finally:
        signal.signal(signal.SIGHUP, previous_hangup)


def _load_recipes() -> None:
    """Find the installed recipes now, so a plugin that cannot be used is named (one
    ERROR line each) when the command starts, not when it is first needed."""
    try:
        from cache_store.recipes.registry import installed_recipes
    except ImportError:  # a broken install: the command itself reports it
        return
    installed_recipes()


def _top_parser() -> argparse.ArgumentParser:
    lines = [f"  {name:<12}{help_}" for name, (_, help_) in COMMANDS.items()]
    parser = argparse.ArgumentParser(
        prog="spcache",
        usage="spcache [-h] [--version] [-v] [-q] COMMAND [ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Precompute and serve cached Kaolin SPC features.",
        epilog="commands:\n"
        + "\n".join(lines)
        + "\n\nRun 'spcache COMMAND --help' for a command's options.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (repeatable)"
    )
    parser.add_argument("-q", "--quiet", action="count", default=0, help="less logging")
    parser.add_argument(
        "--version",
        action="version",
        version=f"spcache {_version()}",
        help="print the version and exit",
    )
    parser.add_argument(
        "command",
        nargs="?",
        choices=list(COMMANDS),
        metavar="COMMAND",
        help="one of: " + ", ".join(COMMANDS),
    )
    return parser


def _version() -> str:
    from spcache import __version__

    return __version__


def subcommand_parser(name: str, target: Any) -> argparse.ArgumentParser:
    """The argument parser of command ``name`` (``target`` from :func:`resolve`)."""
    parser = argparse.ArgumentParser(
        prog=f"spcache {name}",
        description=COMMANDS[name][1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target.configure_parser(parser)
    return parser


def resolve(name: str) -> Any:
    """The command object for ``name``, or a message saying why it is unavailable."""
    target = COMMANDS[name][0]
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return (
            f"command {name!r} is unavailable: cannot import {module_name} "
            f"({type(exc).__name__}: {exc})"
        )
    obj = getattr(module, attribute) if attribute else module
    if not (
        callable(getattr(obj, "configure_parser", None)) and callable(getattr(obj, "run", None))
    ):
        return f"command {name!r} is unavailable: {target} has no configure_parser() and run()"
    return obj


def _command_level(target: Any, args: argparse.Namespace) -> int | None:
    getter = getattr(target, "log_level", None)
    level = getter(args) if callable(getter) else None
    if level is None:
        return None
    if isinstance(level, int):
        return level
    number = logging.getLevelName(str(level).upper())
    return number if isinstance(number, int) else None  # a bad name: the command reports it


def configure_logging(level: int) -> None:
    """Root logging to stderr at ``level``: the process's one logging set-up, done before
    any command code runs (a command's own later ``basicConfig`` is then a no-op). Where
    the root logger already has handlers (an embedding program, pytest) nothing changes."""
    level = max(logging.DEBUG, min(logging.CRITICAL, level))
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    # httpx/httpcore log every request at INFO: a polling client (the demo, HTTPStore)
    # would print a line per poll; they speak only at DEBUG, when asked for everything.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(
            max(level, logging.WARNING) if level > logging.DEBUG else level
        )


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 2


def _hangup_as_terminate(signum: int, frame: object) -> None:
    """SIGHUP (a closed terminal, a dead ssh session) ends a command as SIGTERM does, so
    whatever stops children on SIGTERM does so on SIGHUP too."""
    signal.raise_signal(signal.SIGTERM)
