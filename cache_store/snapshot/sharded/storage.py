"""Where a sharded snapshot's bytes go: a local directory or any fsspec URL.

Reads and the two kinds of write the layout needs: :func:`write` (a part or an index,
whole: a temporary name, fsync and rename on a file system; a multipart upload for a
large object on S3) and :func:`write_once` (a manifest, created only if absent: a hard
link on a file system, ``If-None-Match: *`` on S3), which raises :class:`CommitConflict`
when the name exists: the commit rule of :mod:`cache_store.snapshot.sharded.format`
rests on it.
"""

from __future__ import annotations

import datetime as _dt
import os
import uuid
from collections.abc import Mapping
from typing import Any

from cache_store.disk import fsync_path
from cache_store.errors import CommitConflict, CorruptRecord
from cache_store.location import parse_location

__all__ = [
    "MULTIPART_CHUNK",
    "CommitConflict",
    "full_location",
    "is_local",
    "mtime",
    "older_than",
    "open_fs",
    "read",
    "write",
    "write_once",
]

#: S3 multipart part size for large parts (S3's minimum is 5 MiB).
MULTIPART_CHUNK = 16 * 1024 * 1024


def open_fs(location: str, storage_options: Mapping[str, Any]) -> tuple[Any, str]:
    """The file system of ``location`` and the snapshot's root path on it."""
    import fsspec

    parsed = parse_location(location)
    if parsed.is_local:
        return fsspec.filesystem("file"), os.path.abspath(parsed.target)
    fs, root = fsspec.core.url_to_fs(
        parsed.target, skip_instance_cache=True, **dict(storage_options)
    )
    return fs, root.rstrip("/")


def is_local(fs: Any) -> bool:
    protocol = fs.protocol
    return "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))


def read(fs: Any, path: str, start: int | None = None, end: int | None = None) -> bytes:
    """The bytes of ``path`` (``[start, end)`` when given); ``FileNotFoundError`` as is,
    any other failure to read is a :class:`CorruptRecord` naming the path."""
    try:
        if start is None:
            return bytes(fs.cat_file(path))
        return bytes(fs.cat_file(path, start=start, end=end))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CorruptRecord(path, f"cannot be read ({exc})") from exc


def write_once(fs: Any, path: str, data: bytes) -> None:
    """Create ``path`` with ``data``, or raise :class:`CommitConflict` if it exists."""
    if is_local(fs):
        _write_local_exclusive(path, data)
        return
    try:
        fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        raise CommitConflict(f"{path}: already committed") from None
    except Exception as exc:  # botocore's PreconditionFailed when not translated
        if "PreconditionFailed" in repr(exc) or "412" in str(exc):
            raise CommitConflict(f"{path}: already committed") from None
        raise


def write(fs: Any, path: str, data: bytes) -> None:
    """Write ``path`` whole (replacing it), durably on a file system."""
    if is_local(fs):
        _write_local(path, data)
    elif len(data) > 2 * MULTIPART_CHUNK:
        fs.pipe_file(path, data, chunksize=MULTIPART_CHUNK)
    else:
        fs.pipe_file(path, data)


def mtime(info: Mapping[str, Any]) -> float | None:
    """The last-modified time of a listing entry (seconds; None: not given)."""
    value = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    if value is None:
        return None
    if isinstance(value, _dt.datetime):
        return value.timestamp()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def older_than(info: Mapping[str, Any], age_s: float, now: float) -> bool:
    """Whether a listing entry was last modified ``age_s`` seconds or more before ``now``
    (an entry without a time counts as old): the age rule of everything maintenance
    deletes (the orphan sweep's and the superseded parts' ``--orphan-age``)."""
    modified = mtime(info)
    return modified is None or now - modified >= age_s


def full_location(fs: Any, path: str) -> str:
    """``path`` on ``fs`` as a user names it: a local path, or a URL with its scheme
    (``s3://bucket/...``)."""
    return path if is_local(fs) else str(fs.unstrip_protocol(path))


def _write_temporary(path: str, data: bytes) -> str:
    """``data`` in a new temporary file beside ``path``, on disk (fsynced); its path.
    Named ``.tmp-<name of path>-<random>``: the orphan sweep tells whose it is
    (:func:`cache_store.snapshot.sharded.claims.part_of`)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{os.path.basename(path)}-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def _write_local_exclusive(path: str, data: bytes) -> None:
    """Create ``path`` with ``data`` durably, failing if it exists (never overwriting)."""
    directory = os.path.dirname(path)
    tmp = _write_temporary(path, data)
    try:
        os.link(tmp, path)  # atomic, and refuses an existing name
    except FileExistsError:
        raise CommitConflict(f"{path}: already committed") from None
    finally:
        os.unlink(tmp)
    fsync_path(directory)


def _write_local(path: str, data: bytes) -> None:
    """Write ``path`` durably (a temporary name, fsync, rename)."""
    directory = os.path.dirname(path)
    os.replace(_write_temporary(path, data), path)
    fsync_path(directory)
