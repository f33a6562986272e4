"""A bounded local directory of remote units, shared by every process on one machine.

A *unit* is what a remote store is fetched by: a sharded snapshot's part, a Zarr
snapshot's chunk file. :class:`LocalDisk` keeps verified copies
of units in ``DIR`` and never lets them outgrow the limit::

    DIR/spcache-local-cache.json     what the directory is (kind, format_version)
    DIR/lock                         the directory's lock (flock): counting, evicting, publishing
    DIR/fetch/<n>.lock               64 striped locks: one process fetches a unit, others wait
    DIR/data/<digest>                a unit's verified copy; its mtime is its last use
    DIR/tmp/<digest>.<bytes>.<token> a download in progress (its fetcher holds it locked),
                                     or a damaged copy set aside (``.bad-<token>``)

The directory is its own ledger: nothing is recorded but the files. What is in use is
the sum of every file under ``data/`` and ``tmp/`` (a download counts the bytes reserved
in its name from the start, whatever it holds yet), rounded up to whole blocks, and the
directories themselves; it is counted, and space is made, under ``DIR/lock`` only.

- **Fetched once.** A process that finds a unit absent takes the unit's fetch lock (a
  striped ``flock``), looks again (another process may just have fetched it), reserves
  its size (evicting), downloads into ``tmp/``, checks what it got (the caller's check:
  a part's manifest hash, a chunk's CRC), then publishes it by ``rename`` under the
  directory lock. Two processes after one unit end with one good copy; a fetcher that
  dies leaves a ``tmp/`` file whose lock the kernel released, removed at the next count.
- **Pins.** A reader holds a shared ``flock`` on a copy while it copies bytes out of it
  (:meth:`LocalDisk.pinned`); eviction takes the file only if it gets an exclusive lock
  without waiting, so a copy in use is never deleted, in this process or another. A
  reader that opened a copy just evicted sees it unlinked (``st_nlink == 0``) and fetches
  again. A process never waits for space while it holds a pin (pins are not nested), so
  waiting readers cannot deadlock each other.
- **Least recently used out.** A read sets the copy's mtime (at most once a second per
  unit and process); eviction takes the oldest unpinned copies first, then none: with
  every copy pinned a fetch waits (``wait_s``) for a reader to finish, then raises
  ``StoreFull`` naming the sizes.
- **Refused up front.** :meth:`LocalDisk.check_fits` raises ``LimitTooSmall`` naming the
  limit and the largest unit when one unit cannot fit.
- **Fork.** The object holds scalars; every file descriptor is opened and closed inside
  one call. One a thread has open at a fork (a download of the prefetch thread) is
  closed in the child at once (``os.register_at_fork``), so a child never keeps a lock
  of its parent's alive.

Every fetch, eviction and removal is logged at DEBUG under the directory lock with the
bytes in use after it (the bound can be checked at each event).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from cache_store.errors import CorruptRecord, LimitTooSmall, StoreFull, UsageError
from cache_store.housekeeping.units import format_size
from cache_store.local_cache.spec import LocalCache

__all__ = [
    "MARKER",
    "LocalDisk",
    "Unit",
    "directory_bytes",
]

log = logging.getLogger(__name__)

MARKER = "spcache-local-cache.json"
KIND = "spcache.local_cache"
FORMAT_VERSION = 1
FETCH_STRIPES = 64
#: a unit's mtime is set again (its last use) at most this often per process (seconds)
TOUCH_EVERY_S = 1.0

# File descriptors a thread of this process holds now; closed in a forked child.
_IN_FLIGHT: set[int] = set()


def _close_inherited() -> None:
    for fd in list(_IN_FLIGHT):
        with contextlib.suppress(OSError):
            os.close(fd)
    _IN_FLIGHT.clear()


os.register_at_fork(after_in_child=_close_inherited)


def _open(path: str, flags: int, mode: int = 0o644) -> int:
    fd = os.open(path, flags | os.O_CLOEXEC, mode)
    _IN_FLIGHT.add(fd)
    return fd


def _close(fd: int) -> None:
    _IN_FLIGHT.discard(fd)
    os.close(fd)


class Unit(Protocol):
    """What :class:`LocalDisk` fetches: a name unique to its bytes (a unit never changes
    under one name), its size, how to fetch it and how to check what was fetched."""

    @property
    def name(self) -> str: ...

    def size(self) -> int:
        """The unit's bytes (exact: a fetch of another size is refused)."""
        ...

    def fetch(self, path: str) -> None:
        """Write the unit into the new file ``path``."""
        ...

    def check(self, path: str) -> None:
        """Raise ``CorruptRecord`` when ``path`` does not hold the unit."""
        ...


def directory_bytes(directory: str) -> int:
    """Bytes ``directory`` takes on disk now: every file's and directory's blocks (what
    ``du`` says), for checking a bound from outside."""
    total = 0
    for root, dirs, files in os.walk(directory):
        for name in [*dirs, *files]:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    with contextlib.suppress(FileNotFoundError):
        total += os.lstat(directory).st_blocks * 512
    return total


@dataclass
class _Entry:
    path: str
    cost: int
    mtime: int


class LocalDisk:
    """The bounded directory of :class:`LocalCache` (see the module doc).

    Args:
        spec: the directory and its limit.
        wait_s: how long a fetch waits for space held by other readers' pins before
            ``StoreFull``.
    """

    def __init__(self, spec: LocalCache, *, wait_s: float = 120.0) -> None:
        self.spec = spec
        self.wait_s = float(wait_s)
        self._touched: dict[str, float] = {}
        self._touched_pid = os.getpid()
        self._ready = False

    def __repr__(self) -> str:
        return f"LocalDisk({self.spec.directory!r}, limit={format_size(self.spec.limit)})"

    # -- the directory --------------------------------------------------------------
    def _path(self, *parts: str) -> str:
        return os.path.join(self.spec.directory, *parts)

    def open(self) -> LocalDisk:
        """Make the directory (or check an existing one is a local cache); returns self."""
        if self._ready:
            return self
        directory = self.spec.directory
        try:
            os.makedirs(directory, exist_ok=True)
            marker = self._path(MARKER)
            if not os.path.exists(marker):
                foreign = [n for n in os.listdir(directory) if n not in ("data", "tmp", "fetch")]
                if foreign and "lock" not in foreign:
                    raise UsageError(
                        f"local_cache {directory}: not empty and not a local cache "
                        f"(holds {', '.join(sorted(foreign)[:3])}); give an empty or new directory"
                    )
                self._write_marker(marker)
            else:
                self._check_marker(marker)
            for sub in ("data", "tmp", "fetch"):
                os.makedirs(self._path(sub), exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"local_cache {directory}: cannot be used ({exc.strerror or exc})"
            ) from None
        self._ready = True
        return self

    def _write_marker(self, marker: str) -> None:
        doc = json.dumps({"kind": KIND, "format_version": FORMAT_VERSION}).encode()
        tmp = f"{marker}.{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(doc)
        os.replace(tmp, marker)

    def _check_marker(self, marker: str) -> None:
        try:
            with open(marker, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError) as exc:
            raise UsageError(
                f"local_cache {self.spec.directory}: unreadable {MARKER} ({exc})"
            ) from None
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            raise UsageError(f"local_cache {self.spec.directory}: {MARKER} is not a local cache's")
        if doc.get("format_version") != FORMAT_VERSION:
            raise UsageError(
                f"local_cache {self.spec.directory}: format_version "
                f"{doc.get('format_version')!r}; this spcache knows {FORMAT_VERSION} "
                f"(give another directory)"
            )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The directory lock: counting, evicting and publishing happen under it."""
        fd = _open(self._path("lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _close(fd)

    @contextlib.contextmanager
    def _fetch_lock(self, digest: str) -> Iterator[None]:
        fd = _open(self._path("fetch", f"{self.stripe(digest):02d}.lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _close(fd)

    @staticmethod
    def digest(name: str) -> str:
        """The file name of unit ``name``'s copy under ``data/``."""
        return hashlib.blake2b(name.encode("utf-8"), digest_size=16).hexdigest()

    @staticmethod
    def stripe(digest: str) -> int:
        """Which of the ``FETCH_STRIPES`` fetch locks the unit of ``digest`` takes (units
        of one stripe are fetched one at a time, by any process)."""
        return int(digest[:8], 16) % FETCH_STRIPES

    # -- counting -----------------------------------------------------------------
    def _block(self) -> int:
        try:
            return max(os.statvfs(self.spec.directory).f_frsize, 512)
        except OSError:
            return 4096

    def cost(self, size: int) -> int:
        """Bytes a unit of ``size`` bytes takes here (whole blocks)."""
        block = self._block()
        return -(-size // block) * block

    def _overhead(self) -> int:
        total = 0
        for name in ("", "data", "tmp", "fetch", MARKER, "lock"):
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(self._path(name)).st_blocks * 512
        return total

    def _scan(self) -> tuple[list[_Entry], list[_Entry], int]:
        """(copies, downloads and set-aside copies, bytes in use in all)."""
        block = self._block()
        found: dict[str, list[_Entry]] = {"data": [], "tmp": []}
        used = self._overhead()
        for sub, entries in found.items():
            with os.scandir(self._path(sub)) as listing:
                for item in listing:
                    try:
                        st = item.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    size = st.st_size
                    if sub == "tmp":  # a download counts what it reserved from the start
                        parts = item.name.split(".")
                        if len(parts) == 3 and parts[1].isdigit():
                            size = max(size, int(parts[1]))
                    cost = max(st.st_blocks * 512, -(-size // block) * block)
                    entries.append(_Entry(item.path, cost, st.st_mtime_ns))
                    used += cost
        return found["data"], found["tmp"], used

    def usage(self) -> int:
        """Bytes in use in the directory now, as eviction counts them."""
        self.open()
        with self._locked():
            return self._scan()[2]

    def bytes_on_disk(self) -> int:
        """Every block the directory takes now (:func:`directory_bytes`), counted under
        its lock, so at one moment (never a download in ``tmp/`` and, after its rename,
        the same file in ``data/``). The lock's descriptor is one a forked child closes."""
        self.open()
        with self._locked():
            return directory_bytes(self.spec.directory)

    def check_fits(self, largest: int, what: str) -> None:
        """Raise ``LimitTooSmall`` when one unit of ``largest`` bytes (``what`` names it:
        "part s00012-a1-...") cannot fit under the limit with the directory's own files."""
        self.open()
        need = self.cost(largest) + self._overhead()
        if need > self.spec.limit:
            raise LimitTooSmall(
                f"cache_limit {format_size(self.spec.limit)} ({self.spec.limit} bytes) "
                f"cannot hold {what} of {format_size(largest)} ({largest} bytes; "
                f"{need} bytes on disk with the directory's own files): "
                f"give local_cache a limit of at least {format_size(need)}"
            )

    def _take(self, entry: _Entry) -> bool:
        """Delete ``entry`` if nobody pins it (an exclusive lock got without waiting)."""
        try:
            fd = _open(entry.path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            _close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            pass
        finally:
            _close(fd)
        return True

    def _make_room(self, cost: int) -> tuple[bool, int, int]:
        """Under the directory lock: delete dead downloads, then the least recently used
        unpinned copies, until ``cost`` more bytes fit. ``(fits, used, pinned bytes)``."""
        limit = self.spec.limit
        copies, temporary, used = self._scan()
        if used + cost <= limit:
            return True, used, 0
        pinned = 0
        for entry in temporary:  # a dead fetcher's download, a damaged copy nobody reads
            if self._take(entry):
                used -= entry.cost
                log.debug("%s: removed %s; %d bytes in use", self, entry.path, used)
            else:
                pinned += entry.cost
        for entry in sorted(copies, key=lambda e: e.mtime):
            if used + cost <= limit:
                break
            if self._take(entry):
                used -= entry.cost
                log.debug("%s: evicted %s; %d bytes in use", self, entry.path, used)
            else:
                pinned += entry.cost
        return used + cost <= limit, used, pinned

    # -- reading ------------------------------------------------------------------
    def _open_pinned(self, path: str) -> int | None:
        """``path`` open with a shared lock (a pin), or None when there is no copy (or the
        one opened was evicted before the lock was had)."""
        try:
            fd = _open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_nlink == 0:  # evicted between open and lock
                _close(fd)
                return None
        except BaseException:
            _close(fd)
            raise
        return fd

    def _touch(self, name: str, fd: int) -> None:
        if self._touched_pid != os.getpid():  # a forked child's times are its own
            self._touched, self._touched_pid = {}, os.getpid()
        now = time.monotonic()
        if now - self._touched.get(name, -TOUCH_EVERY_S) >= TOUCH_EVERY_S:
            self._touched[name] = now
            with contextlib.suppress(OSError):
                os.utime(fd)

    def has(self, unit: Unit) -> bool:
        """Whether a copy of ``unit`` is here now."""
        self.open()
        return os.path.exists(self._path("data", self.digest(unit.name)))

    def copy_size(self, unit: Unit) -> int | None:
        """The bytes of ``unit``'s copy here (its size: a copy is published only at the
        size the unit gave), or None when there is none."""
        self.open()
        try:
            return os.stat(self._path("data", self.digest(unit.name))).st_size
        except FileNotFoundError:
            return None

    @contextlib.contextmanager
    def pinned(self, unit: Unit) -> Iterator[int]:
        """A file descriptor of ``unit``'s copy, pinned (never evicted) inside the block;
        fetched first when absent (waiting for space). Never nest: a process holds one
        pin at a time while it may wait. Raises what the unit's fetch or check raises,
        ``StoreFull`` when no space frees within ``wait_s``."""
        self.open()
        fd = self._open_pinned(self._path("data", self.digest(unit.name)))
        if fd is None:
            fd = self._fetch(unit, wait=True)
            assert fd is not None
        try:
            self._touch(unit.name, fd)
            yield fd
        finally:
            _close(fd)

    def prefetch(self, unit: Unit) -> bool:
        """Fetch ``unit`` when absent and there is room without waiting; True when a copy
        is here afterwards. A copy already here counts as used now."""
        self.open()
        fd = self._open_pinned(self._path("data", self.digest(unit.name)))
        if fd is None:
            fd = self._fetch(unit, wait=False)
            if fd is None:
                return False
        else:
            self._touch(unit.name, fd)
        _close(fd)
        return True

    def discard(self, unit: Unit) -> None:
        """Set a damaged copy of ``unit`` aside: it is never read again, and its bytes
        count until the last reader that has it open lets go."""
        self.open()
        digest = self.digest(unit.name)
        with self._locked():
            bad = self._path("tmp", f"{digest}.0.bad-{uuid.uuid4().hex[:8]}")
            try:
                os.rename(self._path("data", digest), bad)
            except FileNotFoundError:
                return
            log.warning("%s: the copy of %s was damaged; it is fetched again", self, unit.name)

    # -- fetching -----------------------------------------------------------------
    def _fetch(self, unit: Unit, *, wait: bool) -> int | None:
        digest = self.digest(unit.name)
        final = self._path("data", digest)
        with self._fetch_lock(digest):
            fd = self._open_pinned(final)  # fetched by another process meanwhile?
            if fd is not None:
                return fd
            size = unit.size()
            reserved = self._reserve(digest, size, unit.name, wait=wait)
            if reserved is None:
                return None
            fd, tmp = reserved
            try:
                unit.fetch(tmp)
                got = os.stat(tmp).st_size
                if got != size:
                    raise CorruptRecord(unit.name, f"fetched {got} bytes, expected {size}")
                unit.check(tmp)
                with self._locked():
                    fcntl.flock(fd, fcntl.LOCK_SH)  # safe: every eviction holds this lock
                    os.rename(tmp, final)
                    log.debug(
                        "%s: fetched %s (%d bytes); %d bytes in use",
                        self,
                        unit.name,
                        size,
                        self._scan()[2] if log.isEnabledFor(logging.DEBUG) else -1,
                    )
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                _close(fd)
                raise
            return fd

    def _reserve(self, digest: str, size: int, name: str, *, wait: bool) -> tuple[int, str] | None:
        """A new download file of ``size`` bytes reserved under the limit, locked
        exclusively (it is this fetcher's): ``(fd, path)``; None when ``wait`` is False
        and there is no room now."""
        cost = self.cost(size)
        if cost + self._overhead() > self.spec.limit:
            self.check_fits(size, name)
        deadline = time.monotonic() + self.wait_s
        delay = 0.05
        while True:
            with self._locked():
                fits, used, pinned = self._make_room(cost)
                if fits:
                    tmp = self._path("tmp", f"{digest}.{size}.{uuid.uuid4().hex[:8]}")
                    fd = _open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    return fd, tmp
            if not wait:
                return None
            if time.monotonic() >= deadline:
                raise StoreFull(
                    self.spec.directory,
                    f"local_cache limit {format_size(self.spec.limit)}: {name} needs "
                    f"{format_size(cost)}, {format_size(used)} are in use and "
                    f"{format_size(pinned)} of it held by readers for {self.wait_s:g} s; "
                    f"raise cache_limit or read with fewer processes",
                )
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
