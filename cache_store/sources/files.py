"""The source gate: the one way any process opens, stats or hashes a source file.

The worker reads a source later than the service checked it, and the service and the
readers compare stored records with sources; all of them go through here.

Between the service's check and the worker's read, a path can change under it: the file
may have been replaced by a FIFO (a read that never ends), a device, a directory, a
symbolic link to somewhere outside the allowed source roots, or a file far larger than
any shape. :func:`read_source_file` and :func:`hash_source_file` refuse all of that with
a :class:`~cache_store.errors.SourceError` naming the path and the reason, so the sample
fails alone:

- with roots, the path is resolved (every symbolic link followed) once, and the resolved
  path must lie inside one of them; it is then opened with ``O_NOFOLLOW`` (a final
  component swapped for a link after resolving is refused), and on Linux the opened
  descriptor's own path is checked against the roots again, which also catches a swapped
  parent directory (without roots any path may be read, links included);
- it is opened with ``O_NONBLOCK`` (opening a FIFO does not wait for a writer);
- the opened file must be a regular file, at most ``max_bytes`` long, and read within
  ``max_read_s`` seconds (checked between blocks).

:func:`check_source` opens and checks without reading (the service's check of a warm-up
path), and :func:`source_signature` gives the cheap stat signature (size, mtime_ns,
inode, device and ctime_ns of the opened file) that records store beside their
``source_hash``: a reader compares signatures first and hashes a source only when they
differ.
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

__all__ = [
    "DEFAULT_MAX_SOURCE_BYTES",
    "DEFAULT_MAX_READ_S",
    "SourceLimits",
    "SourceCheck",
    "check_source",
    "source_signature",
    "signature_of",
    "inside_roots",
    "narrow_roots",
    "read_source_file",
    "read_source",
    "hash_source_file",
    "hash_source",
    "resolve_source",
    "open_resolved",
]

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
    def of(
        cls,
        roots: Sequence[str | os.PathLike[str]] | None = None,
        max_bytes: int = DEFAULT_MAX_SOURCE_BYTES,
        max_read_s: float = DEFAULT_MAX_READ_S,
    ) -> SourceLimits:
        """Limits with ``roots`` resolved (a root that is a link counts as its target)."""
        return cls(
            tuple(os.path.realpath(r) for r in roots or ()), int(max_bytes), float(max_read_s)
        )


@dataclass(frozen=True)
class SourceCheck:
    """What :func:`check_source` found: the resolved path, its size and stat signature."""

    resolved: str
    size: int
    signature: str


def signature_of(st: os.stat_result) -> str:
    """``"size:mtime_ns:inode:device:ctime_ns"`` of a stat result: what changes when a
    file is edited, replaced or swapped for another one (a different file under the same
    name). The change time is the one no user call can set back: an edit in place whose
    mtime is put back (``touch -r``), or a file re-created with the same size and mtime
    on a reused inode, still moves it. (Signatures stored before it was added have four
    fields: they never equal a current one, so those records are hashed when checked.)"""
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_dev}:{st.st_ctime_ns}"


def check_source(
    path: str | os.PathLike[str], limits: SourceLimits | None = None, *, name_target: bool = True
) -> SourceCheck:
    """Open ``path`` as the gate opens it (inside the roots, no link at the end, a regular
    file within the size limit) and close it again without reading; SourceError otherwise.

    ``name_target=False`` leaves the resolved path out of the "outside the roots" message
    (the service answers strangers, and must not describe what lies outside).
    """
    limits = limits or SourceLimits()
    resolved = resolve_source(path, limits, name_target=name_target)
    fd = open_resolved(path, resolved, limits)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_size > limits.max_bytes:
        raise SourceError(
            path,
            f"file is {st.st_size} bytes, over the per-source limit of {limits.max_bytes} bytes",
        )
    return SourceCheck(resolved, st.st_size, signature_of(st))


def source_signature(path: str | os.PathLike[str], limits: SourceLimits | None = None) -> str:
    """The stat signature of the source at ``path`` (see :func:`signature_of`), opened
    through the gate; one ``open`` + ``fstat``, nothing read."""
    return check_source(path, limits).signature


def read_source_file(path: str | os.PathLike[str], limits: SourceLimits | None = None) -> bytes:
    """The bytes of the regular file at ``path``, within ``limits``; raises SourceError."""
    return read_source(path, limits)[0]


def read_source(
    path: str | os.PathLike[str], limits: SourceLimits | None = None
) -> tuple[bytes, str]:
    """The bytes of the file at ``path`` and the stat signature of the file read (taken
    when it was opened, so an edit during the read makes the signature stale, never the
    stored hash)."""
    seen: list[str] = []
    data = b"".join(_blocks(path, limits or SourceLimits(), seen))
    return data, seen[0]


def hash_source_file(path: str | os.PathLike[str], limits: SourceLimits | None = None) -> str:
    """The content hash of the file at ``path`` (``"xxh3_128:<32 hex>"``, as
    :func:`cache_store.sources.hashing.hash_bytes` of its bytes), read as
    :func:`read_source_file` reads it."""
    return hash_source(path, limits)[0]


def hash_source(
    path: str | os.PathLike[str], limits: SourceLimits | None = None
) -> tuple[str, str, int]:
    """``(content hash, stat signature, bytes read)`` of the file at ``path``."""
    digest = xxhash.xxh3_128()
    seen: list[str] = []
    total = 0
    for block in _blocks(path, limits or SourceLimits(), seen):
        digest.update(block)
        total += len(block)
    return HASH_PREFIX + digest.hexdigest(), seen[0], total


def _blocks(
    path: str | os.PathLike[str], limits: SourceLimits, seen: list[str] | None = None
) -> Iterator[bytes]:
    resolved = resolve_source(path, limits)
    fd = open_resolved(path, resolved, limits)
    try:
        st = os.fstat(fd)
        if seen is not None:
            seen.append(signature_of(st))
        size = st.st_size
        if size > limits.max_bytes:
            raise SourceError(
                path, f"file is {size} bytes, over the per-source limit of {limits.max_bytes} bytes"
            )
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
                raise SourceError(
                    path,
                    f"file grew past the per-source limit of "
                    f"{limits.max_bytes} bytes while being read",
                )
            if time.monotonic() > deadline:
                raise SourceError(path, f"reading took longer than {limits.max_read_s:g}s")
            yield block
    finally:
        os.close(fd)


def resolve_source(
    path: str | os.PathLike[str], limits: SourceLimits, *, name_target: bool = True
) -> str:
    """``path`` with every link followed; SourceError when it lies outside the roots
    (naming where it leads unless ``name_target`` is False). Without roots ``path`` as
    given: any path is allowed, and opening it follows its links."""
    if "\x00" in os.fspath(path):
        raise SourceError(repr(path), "not a usable path")
    if not limits.roots:  # any path: links are followed by open (resolving costs ~40 us)
        return os.fspath(path)
    try:
        resolved = os.path.realpath(path)
    except (OSError, ValueError) as exc:
        raise SourceError(path, f"cannot be resolved: {exc}") from None
    if limits.roots and not inside_roots(resolved, limits.roots):
        if not name_target:
            raise SourceError(
                path, f"resolves outside the allowed source roots ({', '.join(limits.roots)})"
            )
        raise SourceError(path, f"resolves to {resolved}, outside the allowed source roots")
    return resolved


def open_resolved(path: str | os.PathLike[str], resolved: str, limits: SourceLimits) -> int:
    """Open the already resolved path without following a link there; a descriptor of a
    regular file inside the roots, else SourceError (``path`` names the input)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
    if limits.roots:  # the path was resolved against them: a link there now is a swap
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(resolved, flags)
    except OSError as exc:
        if os.path.islink(resolved):
            raise SourceError(
                path, "became a symbolic link after it was checked; refusing to follow it"
            ) from exc
        if isinstance(exc, FileNotFoundError):
            raise SourceError(path, "cannot read file: it does not exist") from exc
        raise SourceError(path, f"cannot read file: {exc.strerror or exc}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SourceError(path, f"is not a regular file (it is a {_kind(mode)})")
        if limits.roots:
            opened = _opened_path(fd)
            if opened is not None and not inside_roots(opened, limits.roots):
                raise SourceError(
                    path,
                    f"opened {opened}, outside the allowed source roots "
                    f"(a directory on its path changed after the check)",
                )
    except BaseException:
        os.close(fd)
        raise
    return fd


def inside_roots(path: str, roots: Sequence[str | os.PathLike[str]]) -> bool:
    """True when the (resolved) ``path`` is one of the resolved ``roots`` or lies under one."""
    return any(os.path.commonpath([path, os.fspath(root)]) == os.fspath(root) for root in roots)


def narrow_roots(first: Sequence[str], second: Sequence[str]) -> tuple[str, ...] | None:
    """The roots inside both ``first`` and ``second`` (resolved paths; empty = any path):
    one side when the other is empty, else the deeper of each nested pair. None when
    both are given and share no directory (nothing may be read)."""
    if not first or not second:
        return tuple(first or second)
    both = {
        b if inside_roots(b, [a]) else a
        for a in first
        for b in second
        if inside_roots(b, [a]) or inside_roots(a, [b])
    }
    return tuple(sorted(both)) or None


def _opened_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc (not Linux): the resolve-then-O_NOFOLLOW checks stand
        return None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"
