"""The ``spcache`` command line: ``spcache [-v|-q] COMMAND [ARGS ...]``.

This package is the whole command-line layer; it reads as the list of commands.
:data:`COMMANDS` is a plain dict of name -> (module, one-line help); a command's module
(``spcache/cli/<command>.py``) is imported only when it runs, so ``serve``, ``verify``,
``stats``, ``export`` and ``recipes`` never import torch or ``workers``. A command module
is a thin adapter: ``configure_parser(parser)`` (built from the shared options of
:mod:`spcache.cli.args`), ``run(args) -> int`` (parse, call one library function, print)
and optionally ``log_level(args)`` (its own ``--log-level``, when given) and
``DEFAULT_LOG_LEVEL``.

What every command shares happens here, once, in this order:

1. ``-v``/``-q`` are read before or after the command name (repeatable);
2. logging is set up (:func:`cache_store.log_setup.configure_logging`): the command's own
   level if it has one, else its default (WARNING) lowered by each ``-v`` and raised by
   each ``-q``;
3. the installed recipes are found (a plugin that cannot load is named now);
4. a process started by another spcache process (the service's worker, the demo's
   service) finds its parent's pid in ``SPCACHE_PARENT_PID`` and ends when that parent
   dies (:mod:`cache_store.processes`); SIGHUP is treated as SIGTERM;
5. an error the command raises becomes one line ``spcache COMMAND: reason`` and the exit
   status of :data:`spcache.cli.exits.EXIT_BY_ERROR`; Ctrl-C exits 130; a closed stdout
   (``spcache ls | head -1``) ends the command quietly with 141, as a tool killed by
   SIGPIPE does.

``python -m spcache COMMAND`` and the ``spcache`` script are the only ways in.
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

__all__ = ["COMMANDS", "main", "resolve", "subcommand_parser"]

logger = logging.getLogger(__name__)

#: command name -> (module, help). Modules are imported at dispatch time.
COMMANDS: dict[str, tuple[str, str]] = {
    "precompute": (
        "spcache.cli.precompute",
        "compute a recipe over sources into a cache (GPU side)",
    ),
    "worker": (
        "spcache.cli.worker",
        "run the long-lived GPU worker over the cache's job queue",
    ),
    "serve": ("spcache.cli.serve", "run the HTTP service (and its worker)"),
    "verify": (
        "spcache.cli.verify",
        "check every record of a cache decodes and matches its checksum",
    ),
    "stats": (
        "spcache.cli.stats",
        "summarise a cache: fingerprints, records, bytes, failed samples",
    ),
    "ls": (
        "spcache.cli.ls",
        "list a cache's fingerprints: records, bytes, last written, last read",
    ),
    "rm": ("spcache.cli.rm", "remove fingerprints from a cache"),
    "prune": (
        "spcache.cli.prune",
        "remove least recently used fingerprints (--max-size, --unused-for, --keep)",
    ),
    "compact": (
        "spcache.cli.compact",
        "give the disk back: rewrite the cache's file without its free pages",
    ),
    "export": ("spcache.cli.export", "export one fingerprint of a cache to a Zarr snapshot"),
    "merge": (
        "spcache.cli.merge",
        "merge a sharded snapshot's committed parts into its index (idempotent)",
    ),
    "import": (
        "spcache.cli.import_",
        "copy a snapshot's records into a local cache directory (LMDB)",
    ),
    "recipes": (
        "spcache.cli.recipes",
        "list the recipes with their parameters, defaults and bounds",
    ),
    "demo": (
        "spcache.cli.demo",
        "make example shapes, precompute them, serve them, show where to look",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    try:
        status = _main(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return status
    except KeyboardInterrupt:  # also while the command's modules import (torch: ~1 s)
        with contextlib.suppress(OSError, ValueError):  # stderr may be a closed pipe
            print("spcache: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        from spcache.cli.exits import stdout_closed

        return stdout_closed()


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
    _set_up_logging(target, args, ns.verbose - ns.quiet)
    _load_recipes()
    logger.debug(
        "spcache %s: pid %d, log level %s",
        name,
        os.getpid(),
        logging.getLevelName(logging.getLogger().level),
    )
    from cache_store.processes import PARENT_PID_ENV, exit_with_parent

    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        exit_with_parent(parent)
    from cache_store.process_local import handle_unless_ignored  # here: the command runs now

    previous_hangup = handle_unless_ignored(signal.SIGHUP, _hangup_as_terminate)
    try:
        return _run(name, target, args)
    finally:
        signal.signal(signal.SIGHUP, previous_hangup)


def _run(name: str, target: Any, args: argparse.Namespace) -> int:
    """The command, its errors mapped to one line and an exit status."""
    from cache_store.errors import one_line
    from spcache.cli.exits import exit_status

    try:
        return int(target.run(args))
    except BrokenPipeError:
        raise
    except Exception as exc:
        status = exit_status(exc)
        if status is None:  # not an error a command reports: a bug, with its traceback
            raise
        print(f"spcache {name}: {one_line(exc)}", file=sys.stderr)
        return status


def _set_up_logging(target: Any, args: argparse.Namespace, louder: int) -> None:
    from cache_store.log_setup import configure_logging

    level = _command_level(target, args)
    if level is None:
        base = getattr(target, "DEFAULT_LOG_LEVEL", logging.WARNING)
        level = base - 10 * (louder + args.verbose - args.quiet)
    configure_logging(level)


def _load_recipes() -> None:
    """Find the installed recipes now, so a plugin that cannot be used is named (one
    ERROR line each) when the command starts, not when it is first needed."""
    try:
        from cache_store.recipes.registry import installed_recipes
    except ImportError:  # a broken install: the command itself reports it
        return
    installed_recipes()


def _add_verbosity(parser: argparse.ArgumentParser) -> None:
    """``-v``/``-q``: on the top parser and on every command's, so either place works."""
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (repeatable)"
    )
    parser.add_argument("-q", "--quiet", action="count", default=0, help="less logging")


def _top_parser() -> argparse.ArgumentParser:
    lines = [f"  {name:<12}{help_}" for name, (_, help_) in COMMANDS.items()]
    parser = argparse.ArgumentParser(
        prog="spcache",
        usage="spcache [-h] [--version] [-v] [-q] COMMAND [ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Precompute and serve cached Kaolin SPC features.",
        epilog="commands:\n"
        + "\n".join(lines)
        + "\n\n-v and -q work before or after COMMAND. Run 'spcache COMMAND --help' for a "
        "command's options.",
    )
    _add_verbosity(parser)
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
    from cache_store.version import __version__

    return __version__


def subcommand_parser(name: str, target: Any) -> argparse.ArgumentParser:
    """The argument parser of command ``name`` (``target`` from :func:`resolve`)."""
    parser = argparse.ArgumentParser(
        prog=f"spcache {name}",
        description=COMMANDS[name][1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target.configure_parser(parser)
    _add_verbosity(parser)
    return parser


def resolve(name: str) -> Any:
    """The command module for ``name`` (``"module"`` or ``"module:attribute"`` in
    :data:`COMMANDS`), or a message saying why it is unavailable."""
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


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 2


def _hangup_as_terminate(signum: int, frame: object) -> None:
    """SIGHUP (a closed terminal, a dead ssh session) ends a command as SIGTERM does, so
    whatever stops children on SIGTERM does so on SIGHUP too."""
    signal.raise_signal(signal.SIGTERM)
