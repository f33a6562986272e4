"""Where a cache is: the one parser of location strings, and checks of a local cache path.

Every opener (``open_store``, ``CachedDataset``, export, the snapshot reader, the CLI)
asks :func:`parse_location`, so a string means the same thing everywhere:

* ``http://`` / ``https://`` URL -> the service (``kind="http"``);
* anything ending in ``.zarr`` -> a snapshot, local or at any fsspec URL (``kind="zarr"``);
* a plain path -> an LMDB cache directory (``kind="lmdb"``).

Schemes are case-insensitive (``FILE://``, ``HTTP://``). ``file://`` names a local path
(``file:///tmp/x`` and ``file://localhost/tmp/x`` are ``/tmp/x``); it is stripped once,
here. Any other scheme is refused unless the location is a ``.zarr`` snapshot.

A :class:`Location` is the parsed value: where a location enters (a command-line option,
a function argument) it is parsed once, and every function here takes the
:class:`Location` as well as the string, returning it unchanged (never parsed again).
A location that may be a URL never goes through :class:`pathlib.Path`, which folds
``s3://b`` into ``s3:/b``; :meth:`Location.path` gives the local path of a local one.

:func:`cache_dir_problem` answers why a local path cannot be used as a cache directory
(naming the path and the reason), so a command prints one line instead of a traceback;
:func:`check_cache_dir` raises it as a :class:`~cache_store.errors.UsageError`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cache_store.errors import UnknownName, UsageError

__all__ = [
    "Location",
    "LocationLike",
    "cache_dir_problem",
    "check_cache_dir",
    "is_remote",
    "local_path",
    "parse_location",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
Kind = Literal["lmdb", "zarr", "http"]


@dataclass(frozen=True)
class Location:
    """A parsed location. ``target`` is the local path (no ``file://``) for a local
    location, else the URL with its scheme lower-cased."""

    text: str
    scheme: str  # "" for a local path (``file://`` included), else e.g. "http", "s3"
    target: str
    kind: Kind

    @property
    def is_local(self) -> bool:
        return self.scheme == ""

    def path(self) -> Path:
        """The local path (``file://`` stripped); ``ValueError`` for a remote location."""
        if not self.is_local:
            raise ValueError(f"{self.text}: not a local path")
        return Path(self.target)

    def __str__(self) -> str:
        return self.text


#: what every function here accepts: a string or path, or one already parsed
LocationLike = str | os.PathLike[str] | Location


def parse_location(location: LocationLike) -> Location:
    """Parse a cache location (see the module docstring); ``UnknownName`` for a URL
    scheme that is neither http(s), ``file`` nor a ``.zarr`` snapshot. A
    :class:`Location` is returned as it is."""
    if isinstance(location, Location):
        return location
    text = os.fspath(location)
    match = _SCHEME.match(text)
    scheme = match.group(1).lower() if match else ""
    rest = text[match.end() :] if match else text
    if scheme == "file":
        host, slash, path = rest.partition("/")
        if host not in ("", "localhost"):
            raise UnknownName("file:// host", host, ["localhost", "(empty: file:///path)"])
        scheme, target = "", slash + path
    elif scheme:
        target = f"{scheme}://{rest}"
    else:
        target = text
    if scheme in ("http", "https"):
        kind: Kind = "http"
    elif target.rstrip("/").lower().endswith(".zarr"):
        kind = "zarr"
    elif scheme:
        raise UnknownName(
            "store location scheme", scheme, ["http", "https", "file", "<any>://….zarr"]
        )
    else:
        kind = "lmdb"
    return Location(text=text, scheme=scheme, target=target, kind=kind)


def is_remote(location: LocationLike) -> bool:
    """A URL other than ``file://`` (``http://``, ``s3://...zarr``), rather than a path."""
    if isinstance(location, Location):
        return not location.is_local
    match = _SCHEME.match(os.fspath(location))
    return match is not None and match.group(1).lower() != "file"


def local_path(location: LocationLike) -> str:
    """The filesystem path of a local location (``file://`` stripped); ``ValueError`` for
    a remote one."""
    parsed = parse_location(location)
    if not parsed.is_local:
        raise ValueError(f"{parsed.text}: not a local path")
    return parsed.target


def cache_dir_problem(cache: LocationLike, *, write: bool) -> str | None:
    """Why ``cache`` cannot be used as a local cache directory, or None.

    ``write=False``: it must exist, be a directory (or a ``*.zarr`` snapshot) and be
    readable. ``write=True``: it may be missing if it can be created; an existing one
    must be a writable directory.
    """
    try:
        path = Path(local_path(cache))
    except (ValueError, UnknownName):
        return f"{cache}: not a local cache directory"
    try:
        exists = path.exists()
        is_dir = path.is_dir()
    except OSError as exc:
        return f"{path}: cannot be checked ({exc.strerror or exc})"
    if exists and not is_dir:
        return f"{path}: is a file, not a cache directory"
    if not exists:
        if not write:
            return f"{path}: no such cache directory"
        ancestor = path.absolute().parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            return f"{path}: cannot be created: {ancestor} is a file, not a directory"
        if not os.access(ancestor, os.W_OK | os.X_OK):
            return f"{path}: cannot be created: {ancestor} is not writable"
        return None
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{path}: cache directory is not readable (permission denied)"
    if write and not os.access(path, os.W_OK):
        return f"{path}: cache directory is read-only"
    return None


def check_cache_dir(cache: LocationLike, *, write: bool) -> Path:
    """The local path of ``cache`` when :func:`cache_dir_problem` finds nothing wrong;
    else :class:`~cache_store.errors.UsageError` with its one line."""
    problem = cache_dir_problem(cache, write=write)
    if problem:
        raise UsageError(problem)
    return Path(local_path(cache))
