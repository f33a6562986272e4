"""The options many commands take, declared once: ``--cache``, ``--device``, ``--backend``,
``--loaders``, ``--time-limit``, ``--source-root``, ``--max-size``, ``--json``. (``-v``/``-q`` are the
dispatcher's: :mod:`spcache.cli`.)

A location is parsed here, where it enters, into a
:class:`~cache_store.location.Location` (:func:`cache_store.location.parse_location`,
the one parser) and never passes through ``Path`` while it may be a URL. The defaults
are the library's: :class:`cache_store.engine_options.EngineOptions`'s for the engine
options. Nothing here imports torch or ``workers``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from cache_store.engine_options import (
    BACKENDS,
    DEFAULT_TIME_LIMIT_S,
    EngineOptions,
    check_device,
    time_limit_problem,
)
from cache_store.errors import SpcacheError, UsageError
from cache_store.location import Location, parse_location

__all__ = [
    "add_backend",
    "add_cache",
    "add_device",
    "add_json",
    "add_loaders",
    "add_max_size",
    "add_source_roots",
    "add_time_limit",
    "json_object",
]

_DEFAULTS = EngineOptions()


def location(text: str) -> Location:
    """``--cache`` and other locations: parsed once (``file://`` stripped, the scheme
    checked); argparse reports a bad one (exit 2)."""
    try:
        return parse_location(text)
    except SpcacheError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc}") from None


def local_location(text: str) -> Location:
    """A location that must be on this machine (a cache directory a command writes or
    locks): a URL is refused by name instead of being read as a relative path."""
    parsed = location(text)
    if not parsed.is_local:
        raise argparse.ArgumentTypeError(
            f"{text}: not a local cache directory (give a path, or file:///path)"
        )
    return parsed


def add_cache(
    parser: argparse.ArgumentParser,
    help: str,
    *,
    required: bool = True,
    local: bool = False,
) -> None:
    """``--cache`` (one declaration for every command): a
    :class:`~cache_store.location.Location`; ``local``: a URL is refused (a cache
    directory this command writes, locks or serves)."""
    parser.add_argument(
        "--cache",
        required=required,
        type=local_location if local else location,
        metavar="DIR" if local else "LOCATION",
        help=help,
    )


def add_device(parser: argparse.ArgumentParser, help: str | None = None, **options: Any) -> None:
    """``--device`` (default ``auto``: CUDA where it works, else the CPU)."""
    parser.add_argument(
        "--device",
        type=_checked(check_device),
        default=options.pop("default", _DEFAULTS.device),
        help=help or "auto (CUDA where it works, else cpu), cpu, cuda or cuda:N",
        **options,
    )


def add_backend(parser: argparse.ArgumentParser, **options: Any) -> None:
    """``--backend``: the SPC ops (default ``auto``)."""
    parser.add_argument(
        "--backend",
        choices=list(BACKENDS),
        default=options.pop("default", _DEFAULTS.backend),
        help="SPC ops: kaolin (needs Kaolin and CUDA), torch (pure PyTorch, any device), "
        "auto (kaolin where it works, else torch)",
        **options,
    )


def add_loaders(parser: argparse.ArgumentParser, help: str = "") -> None:
    """``--loaders N`` (default: one per core but one, at most 8)."""
    parser.add_argument(
        "--loaders",
        type=int,
        default=_DEFAULTS.loaders,
        metavar="N",
        help="loader processes reading sources ahead of the device (0: read in the "
        "engine's process; default: one per core but one, at most 8)" + help,
    )


def add_time_limit(parser: argparse.ArgumentParser) -> None:
    """``--time-limit SECONDS`` (default: each recipe's own, 600 s unless it says)."""
    parser.add_argument(
        "--time-limit",
        dest="time_limit_s",
        type=_checked(_seconds),
        default=_DEFAULTS.time_limit_s,
        metavar="SECONDS",
        help="longest a sample's loading (with prepare) or compute may take; past it the "
        "sample fails naming the limit (default: the recipe's time_limit_s, "
        f"{DEFAULT_TIME_LIMIT_S:g} s unless it declares one)",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    problem = time_limit_problem(value)
    if problem:
        raise UsageError(f"{text!r}: {problem.split(': ', 1)[-1]}")
    return value


def add_source_roots(parser: argparse.ArgumentParser, help: str) -> None:
    """``--source-root DIR`` (repeatable) into ``args.source_roots`` (None: not given)."""
    parser.add_argument(
        "--source-root",
        action="append",
        dest="source_roots",
        default=None,
        metavar="DIR",
        help=help,
    )


def add_max_size(parser: argparse.ArgumentParser, help: str) -> None:
    """``--max-size SIZE``: bytes, or ``500M``, ``2G``, ``1.5T`` (read by
    :func:`cache_store.housekeeping.parse_size` where it is used)."""
    parser.add_argument("--max-size", metavar="SIZE", help=help)


def add_json(parser: argparse.ArgumentParser, help: str = "print the result as JSON") -> None:
    """``--json``: the result as one JSON value on stdout (nothing else there)."""
    parser.add_argument("--json", action="store_true", help=help)


def json_object(option: str, text: str) -> dict[str, Any]:
    """The JSON object an option holds (``--storage-options``); UsageError naming it."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{option}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{option}: not a JSON object")
    return value


def _checked(check: Any) -> Any:
    """An argparse ``type`` from a library check that raises a SpcacheError."""

    def parse(text: str) -> Any:
        try:
            return check(text)
        except SpcacheError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = getattr(check, "__name__", "value")
    return parse
