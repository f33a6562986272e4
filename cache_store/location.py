"""Checks of a cache path given on a command line, so a bad one is one clear line.

``spcache precompute --cache FILE`` used to end in a ``NotADirectoryError`` traceback from
deep inside LMDB; the commands now ask :func:`cache_dir_problem` first and print its
answer (naming the path and the reason) with exit status 2.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir_problem", "is_remote"]


def is_remote(cache: str | os.PathLike[str]) -> bool:
    """A URL (``http://``, ``s3://`` ...) rather than a local path."""
    return "://" in str(cache) and not str(cache).startswith("file://")


def cache_dir_problem(cache: str | os.PathLike[str], *, write: bool) -> str | None:
    """Why ``cache`` cannot be used as a local cache directory, or None.

    ``write=False``: it must exist, be a directory (or a ``*.zarr`` snapshot) and be
    readable. ``write=True``: it may be missing if it can be created; an existing one
    must be a writable directory.
    """
    path = Path(cache)
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
