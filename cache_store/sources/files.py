"""Opening source files in the worker, which reads them later than the service checked them.

Between the service's check and the worker's read, a path can change under it: the file
may have been replaced by a FIFO (a read that never ends), a device, a directory, a
symbolic link to somewhere outside the allowed source roots, or a file far larger than
any shape. :func:`read_source_file` and :func:`hash_source_file` refuse all of that with
a :class:`~cache_store.errors.SourceError` naming the path and the reason, so the sample
fails alone:

- the path is resolved (every symbolic link followed) once, and the resolved path must
  lie inside one of ``roots`` when roots are given;
- the resolved path is opened with ``O_NOFOLLOW`` (a final component swapped for a link
  after resolving is refused) and ``O_NONBLOCK`` (opening a FIFO does not wait for a
  writer); on Linux the opened descriptor's own path is checked against the roots again,
  which also catches a swapped parent directory;
- the opened file must be a regular file, at most ``max_bytes`` long, and read within
  ``max_read_s`` seconds (checked between blocks).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

from cache_store.errors import SourceError
from cache_store.sources.hashing import HASH_PREFIX

__all__ = ["DEFAULT_MAX_SOURCE_BYTES", "DEFAULT_MAX_READ_S", "SourceLimits",
           "read_source_file", "hash_source_file"]

#: The default per-source size limit: 1 GiB.
DEFAULT_MAX_SOURCE_BYTES = 1 << 30
#: The default time limit for reading one source.
DEFAULT_MAX_READ_S = 300.0
_BLOCK = 1 << 20


@dataclass(frozen=True)
class SourceLimits:
    """Where sources may be read from and how much of them (plain values: it is handed to
    loader processes).

    Attributes:
        roots: resolved directories a source must lie in; empty allows any path.
        max_bytes: largest source file, in bytes.
        max_read_s: longest time reading one source may take.
    """

    roots: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_SOURCE_BYTES
    max_read_s: float = DEFAULT_MAX_READ_S

    @classmethod
    def of(cls, roots: Sequence[str | os.PathLike[str]] | None = None,
           max_bytes: int = DEFAULT_MAX_SOURCE_BYTES,
           max_read_s: float = DEFAULT_MAX_READ_S) -> SourceLimits:
        """Limits with ``roots`` resolved (a root that is a link counts as its target)."""
        return cls(tuple(os.path.realpath(r) for r in roots or ()), int(max_bytes),
                   float(max_read_s))


def read_source_file(path: str | os.PathLike[str], limits: SourceLimits | None = None) -> bytes:
    """The bytes of the regular file at ``path``, within ``limits``; raises SourceError."""
    return b"".join(_blocks(path, limits or SourceLimits()))


def hash_source_file(path: str | os.PathLike[str], limits: SourceLimits | None = None) -> str:
    """The content hash of the file at ``path`` (as :func:`cache_store.sources.hashing.hash_file`),
    read as :func:`read_source_file` reads it."""
    digest = xxhash.xxh3_128()
    for block in _blocks(path, limits or SourceLimits()):
        digest.update(block)
    return HASH_PREFIX + digest.hexdigest()


def _blocks(path: str | os.PathLike[str], limits: SourceLimits) -> Iterator[bytes]:
    resolved = resolve_source(path, limits)
    fd = open_resolved(path, resolved, limits)
    try:
        size = os.fstat(fd).st_size
        if size > limits.max_bytes:
            raise SourceError(path, f"file is {size} bytes, over the per-source limit of "
                                    f"{limits.max_bytes} bytes")
        os.set_blocking(fd, True)
        deadline = time.monotonic() + limits.max_read_s
        total = 0
        while True:
            try:
                block = os.read(fd, _BLOCK)
            except OSError as exc:
                raise SourceError(path, f"cannot read file: {exc.strerror or exc}") from exc
            if not block:
                return
            total += len(block)
            if total > limits.max_bytes:  # it grew while being read
                raise SourceError(path, f"file grew past the per-source limit of "
                                        f"{limits.max_bytes} bytes while being read")
            if time.monotonic() > deadline:
                raise SourceError(path, f"reading took longer than {limits.max_read_s:g}s")
            yield block
    finally:
        os.close(fd)


def resolve_source(path: str | os.PathLike[str], limits: SourceLimits) -> str:
    """``path`` with every link followed; SourceError when it lies outside the roots."""
    resolved = os.path.realpath(path)
    if limits.roots and not _inside(resolved, limits.roots):
        raise SourceError(path, f"resolves to {resolved}, outside the allowed source roots")
    return resolved


def open_resolved(path: str | os.PathLike[str], resolved: str, limits: SourceLimits) -> int:
    """Open the already resolved path without following a link there; a descriptor of a
    regular file inside the roots, else SourceError (``path`` names the input)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(resolved, flags)
    except OSError as exc:
        if os.path.islink(resolved):
            raise SourceError(path, "became a symbolic link after it was checked; "
                                    "refusing to follow it") from exc
        raise SourceError(path, f"cannot read file: {exc.strerror or exc}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SourceError(path, f"is not a regular file (it is a {_kind(mode)})")
        if limits.roots:
            opened = _opened_path(fd)
            if opened is not None and not _inside(opened, limits.roots):
                raise SourceError(path, f"opened {opened}, outside the allowed source roots "
                                        f"(a directory on its path changed after the check)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(os.path.commonpath([path, root]) == root for root in roots)


def _opened_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc (not Linux): the resolve-then-O_NOFOLLOW checks stand
        return None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"
