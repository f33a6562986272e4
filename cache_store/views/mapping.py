"""Read-only mappings of byte ranges of cache files, owned by the views that read them.

A :class:`MappedRange` is the pages that hold one record of a file (an LMDB
``data.mdb``, a sharded snapshot's part) in this process's own private mapping
(``MAP_PRIVATE``), never LMDB's map: closing an environment (at a fork, a compaction's
retire, a store's close) or deleting the file never unmaps what a view reads. It is made
one of two ways:

- :func:`map_range`: a mapping of its own (read-write private pages: a refused write of
  torch's lands in them, never in the file or another view), unmapped when the last
  array viewing it is gone. For views handed to a user.
- :meth:`Windows.range`: a slice of one of this process's long-lived *windows* of the
  file (:func:`windows_of`), read-only mappings of ``2 * WINDOW`` bytes that stay mapped
  across reads, so a page faulted in once is not faulted again by the next read (a
  fresh mapping pays ~1.3 us per 4 KiB page, more than copying it). For reads whose
  views never leave the reader (the hop's pack in the training process copies them
  and drops them): a write through one would fault, so none is handed out.

Either way the range's ``on_release`` runs when the last array viewing it is gone (an
LMDB read lease counts its views down); a window is unmapped once it is retired (a
newer one replaces it, :data:`WINDOWS_MAX` are kept a file, the file changed, more than
:data:`FILES_MAX` files have windows) and no range uses it.

:meth:`MappedRange.detach` swaps the range's pages for a private copy of the same bytes
in one ``mremap`` (readers in other threads see the old pages or the copy, both the same
bytes, never a gap): what an LMDB lease does to its live views before its transaction
ends, so a view never shows bytes a writer put in a reused page. A window with a detached
range is never used again for a new range. Linux only (``mremap``), as the LMDB store's
compaction (``renameat2``) is.

:class:`PrivateMemory` is anonymous memory of this process that a forked child inherits
only while asked to (``MADV_DONTFORK``): what the training process's batch buffers are
made of (:data:`cache_store.format.buffers.BATCH_BUFFERS`), so that forking DataLoader
workers does not turn every page of an idle buffer copy-on-write for the parent's next
batch.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


__all__ = [
    "PAGE",
    "WINDOW",
    "WINDOWS_MAX",
    "FILES_MAX",
    "MappedRange",
    "PrivateMemory",
    "Window",
    "Windows",
    "map_range",
    "map_shared",
    "populate",
    "retire_windows",
    "windows_at",
    "windows_of",
]

PAGE = mmap.PAGESIZE
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_mprotect = _libc.mprotect
_mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_POPULATE_READ = 22  # Linux 5.14: fill the page tables in one call
_MADV_POPULATE_WRITE = 23
_MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", 10)
_MADV_DOFORK = getattr(mmap, "MADV_DOFORK", 11)
_mremap = _libc.mremap
_mremap.restype = ctypes.c_void_p
_mremap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_void_p,
]


def _os_error(what: str) -> OSError:
    code = ctypes.get_errno() or errno.EINVAL
    return OSError(code, f"{what}: {os.strerror(code)}")


class MappedRange:
    """``size`` bytes of a file from a page boundary, mapped for this process.

    ``base`` is the file offset of the first mapped byte; :meth:`array` is a uint8 NumPy
    view of the whole range whose base is this object (so every tensor built on it keeps
    the mapping alive). ``window``: the :class:`Window` it is a slice of (read-only
    pages), or None (a read-write private mapping of its own). Made by :func:`map_range`
    and :meth:`Windows.range`.
    """

    __slots__ = (
        "__weakref__",
        "addr",
        "base",
        "detached",
        "lock",
        "on_release",
        "pid",
        "size",
        "window",
    )

    def __init__(
        self,
        addr: int,
        base: int,
        size: int,
        on_release: Callable[[], None] | None,
        window: Window | None = None,
    ):
        self.addr, self.base, self.size = addr, base, size
        self.on_release = on_release
        self.window = window
        self.detached = False
        self.pid = _pid[0]
        self.lock = threading.Lock()

    @property
    def __array_interface__(self) -> dict[str, Any]:
        # reported writable: no NumPy or torch warning per view (a window's pages are
        # read-only, and its ranges are never handed to a user)
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.addr, False), "version": 3}

    def array(self) -> np.ndarray:
        """The range as a uint8 array (its base keeps this mapping alive)."""
        import numpy as np

        return np.asarray(self)

    def populate(self) -> None:
        """Map every page now, in one call, before all of them are read (a hash, a
        copy): one fault per page costs more (measured: 0.8 ms against 1.1-1.5 ms for a
        2.4 MB record). A window's range is populated once (the kernel may drop its page
        table entries later: they are then faulted in as read). A kernel without
        ``MADV_POPULATE_READ`` faults them in as read."""
        window = self.window
        if window is not None:
            if self.base in window.populated:
                return
            window.populated.add(self.base)
        if not self.detached:
            populate(self.addr, self.size, False)

    def detach(self) -> None:
        """Replace the mapped pages by a private copy of their bytes (atomic for
        concurrent readers, same protection); from then on the file may change under
        it freely. A window's detached range spoils the window for new ranges."""
        with self.lock:
            if self.detached or self.pid != _pid[0]:
                return
            size = -(-self.size // PAGE) * PAGE  # a window's range: whole pages
            copy = _mmap(
                None,
                size,
                mmap.PROT_READ | mmap.PROT_WRITE,
                mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                -1,
                0,
            )
            if copy in (None, _MAP_FAILED):
                raise _os_error("detaching a view (anonymous map)")
            ctypes.memmove(copy, self.addr, self.size)
            if self.window is not None:
                self.window.spoiled = True
                _mprotect(copy, size, mmap.PROT_READ)
            moved = _mremap(copy, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, self.addr)
            if moved in (None, _MAP_FAILED):
                error = _os_error("detaching a view (mremap)")
                _munmap(copy, size)
                raise error
            self.detached = True

    def __del__(self, _unmap: Any = _munmap) -> None:  # bound now: see Window.__del__
        if self.window is None:  # a window is unmapped by its own end
            _unmap(self.addr, self.size)  # a child that inherited it unmaps its own copy
        release, self.on_release = self.on_release, None
        if release is not None and self.pid == _pid[0]:
            release()


def map_range(
    fd: int, offset: int, length: int, on_release: Callable[[], None] | None = None
) -> tuple[MappedRange, int]:
    """Map ``length`` bytes of the file ``fd`` from ``offset`` (private: never written back).

    Returns the range (from the page that holds ``offset``) and where ``offset`` lies in
    it. ``on_release`` runs once, when the range is unmapped. Raises ``OSError``.
    """
    base = offset - offset % PAGE
    size = offset + max(length, 1) - base
    prot = mmap.PROT_READ | mmap.PROT_WRITE  # private: a write never reaches the file
    addr = _mmap(None, size, prot, mmap.MAP_PRIVATE, fd, base)
    if addr in (None, _MAP_FAILED):
        raise _os_error(f"mapping {length} bytes at {offset}")
    return MappedRange(addr, base, size, on_release), offset - base


#: A window maps ``2 * WINDOW`` bytes of a file from a multiple of ``WINDOW``: a range
#: of up to ``WINDOW`` bytes lies whole in the window of its first byte (a longer one is
#: mapped on its own).
WINDOW = 64 << 20
#: Windows kept mapped per file (the least recently used is retired past it): the pages
#: of a file this process keeps mapped stay under ``2 * WINDOW * WINDOWS_MAX`` (4 GiB).
WINDOWS_MAX = 32


class Window:
    """One read-only private mapping of ``size`` bytes of a file from ``base``, unmapped
    when the last reference (its :class:`Windows`, a range of it) is gone."""

    __slots__ = ("__weakref__", "addr", "base", "pid", "populated", "size", "spoiled")

    def __init__(self, addr: int, base: int, size: int) -> None:
        self.addr, self.base, self.size = addr, base, size
        self.populated: set[int] = set()  # file offsets of ranges populated in it
        self.spoiled = False  # a range of it was detached: its pages are not the file's
        self.pid = _pid[0]

    def __del__(self, _unmap: Any = _munmap) -> None:
        # bound at definition: at interpreter exit this module's globals may be gone first
        _unmap(self.addr, self.size)  # a child that inherited it unmaps its own copy


class Windows:
    """This process's windows of one file (see the module doc), made by
    :func:`windows_of`; ``identity`` is the file's ``(st_dev, st_ino)``."""

    def __init__(self, fd: int, identity: tuple[int, int]) -> None:
        self.fd = os.dup(fd)  # not inherited by an exec'd child
        self.identity = identity
        self.pid = _pid[0]
        self.open: OrderedDict[int, Window] = OrderedDict()
        self.lock = threading.Lock()
        self.retired = False

    def range(
        self, offset: int, length: int, on_release: Callable[[], None] | None = None
    ) -> tuple[MappedRange, int] | None:
        """``length`` bytes from ``offset`` as a slice of a window (mapped now if need
        be): the range and where ``offset`` lies in it; ``on_release`` as
        :func:`map_range`. None when longer than :data:`WINDOW` or these windows were
        retired (the caller maps the bytes on their own). Raises ``OSError``."""
        k = offset // WINDOW
        end = offset + max(length, 1)
        if end > (k + 2) * WINDOW:
            return None
        with self.lock:
            if self.retired:
                return None
            window = self.open.get(k)
            if window is None or window.spoiled:
                window = self._map(k)
            else:
                self.open.move_to_end(k)
        base = offset - offset % PAGE
        size = -(-(end - base) // PAGE) * PAGE
        addr = window.addr + base - window.base
        return MappedRange(addr, base, size, on_release, window), offset - base

    def _map(self, k: int) -> Window:
        # with self.lock held
        size = 2 * WINDOW  # past the end of the file: never read (a record lies in it)
        addr = _mmap(None, size, mmap.PROT_READ, mmap.MAP_PRIVATE, self.fd, k * WINDOW)
        if addr in (None, _MAP_FAILED):
            raise _os_error(f"mapping a window at {k * WINDOW}")
        window = self.open[k] = Window(addr, k * WINDOW, size)
        self.open.move_to_end(k)
        while len(self.open) > WINDOWS_MAX:
            self.open.popitem(last=False)
        return window

    def retire(self) -> None:
        """Map no new range: each window is unmapped once no range uses it."""
        with self.lock:
            self.retired = True
            self.open.clear()
            fd, self.fd = self.fd, -1
        if fd >= 0 and self.pid == _pid[0]:
            os.close(fd)


class PrivateMemory:
    """``size`` bytes of anonymous private memory (page-aligned, zero-filled) owned by
    this process; :meth:`array` is a uint8 NumPy view whose base keeps it mapped.

    A forked child inherits it (a copy-on-write copy, as any memory) only while
    :attr:`inherited`: :meth:`inherit` ``(False)`` marks it ``MADV_DONTFORK``, and a
    child then has no such pages at all (reading them there faults), while the parent
    keeps writing them without a copy-on-write fault per page after each fork. Only
    memory no object of the process refers to may be marked so (the caller's rule:
    :class:`cache_store.format.buffers.BufferPool` marks idle buffers only, just before
    each fork). Unmapped when the last reference is gone, in the process that mapped it
    or in a child that inherited it; never in a child that did not. Raises
    ``MemoryError`` where no memory is left (as NumPy's allocation does), else
    ``OSError``.
    """

    __slots__ = ("__weakref__", "addr", "inherited", "pid", "size")

    def __init__(self, size: int) -> None:
        try:
            addr = _anonymous(max(size, 1), mmap.MAP_PRIVATE, f"allocating {size} bytes")
        except OSError as error:
            if error.errno == errno.ENOMEM:  # as any allocation says it (np.empty's)
                raise MemoryError(str(error)) from None
            raise
        self.addr, self.size = addr, max(size, 1)
        self.pid = _pid[0]
        self.inherited = True

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.addr, False), "version": 3}

    def array(self) -> np.ndarray:
        """The memory as a uint8 array (its base keeps this mapping alive)."""
        import numpy as np

        return np.asarray(self)

    def inherit(self, inherited: bool) -> None:
        """Whether a child forked from now on inherits these pages (``MADV_DOFORK`` /
        ``MADV_DONTFORK``). Raises ``OSError``."""
        if inherited == self.inherited or self.pid != _pid[0]:
            return
        if _madvise(self.addr, self.size, _MADV_DOFORK if inherited else _MADV_DONTFORK):
            raise _os_error("marking memory for fork")
        self.inherited = inherited

    def __del__(self, _unmap: Any = _munmap) -> None:  # bound now: see Window.__del__
        # a child that did not inherit the pages has nothing there (or, later, another
        # mapping of its own): it unmaps nothing
        if self.pid == _pid[0] or self.inherited:
            _unmap(self.addr, self.size)


#: this process's windows by file path, the most recently asked for last
_windows: dict[str, Windows] = {}
_windows_lock = threading.Lock()
#: Files this process keeps windows of (the least recently asked for is retired past
#: it): a sharded snapshot has a part file per writer's shard, each of which would keep a
#: descriptor and its windows otherwise.
FILES_MAX = 64


def windows_of(path: str, fd: int) -> Windows:
    """This process's windows of the file ``path``, open as ``fd``: the same while it is
    the same file (device and inode) and they were not retired; otherwise the old ones
    are retired and new ones made (a compaction's new ``data.mdb``, a child after a
    fork). Raises ``OSError``."""
    st = os.fstat(fd)
    identity = (st.st_dev, st.st_ino)
    dropped = []
    with _windows_lock:
        found = _windows.pop(path, None)
        if found is not None:
            if found.identity == identity and found.pid == _pid[0] and not found.retired:
                _windows[path] = found
                return found
            dropped.append(found)
        made = _windows[path] = Windows(fd, identity)
        while len(_windows) > FILES_MAX:
            dropped.append(_windows.pop(next(iter(_windows))))
    for old in dropped:
        if old.pid == _pid[0]:
            old.retire()
    return made


def retire_windows(path: str, identity: tuple[int, int] | None = None) -> None:
    """Retire this process's windows of ``path`` (only if they map the file ``identity``,
    device and inode, when given): it is no longer read here."""
    with _windows_lock:
        found = _windows.get(path)
        if found is None or identity not in (None, found.identity):
            return
        del _windows[path]
    if found.pid == _pid[0]:
        found.retire()


#: this process's id (``os.getpid`` is a system call: a view's hot path asks often)
_pid = [os.getpid()]


def _forked() -> None:
    global _windows_lock
    _pid[0] = os.getpid()
    _windows_lock = threading.Lock()  # it may have been held by a thread of the parent


os.register_at_fork(after_in_child=_forked)


def windows_at(path: str) -> Windows | None:
    """This process's windows of the file ``path`` (None: none made here)."""
    found = _windows.get(path)
    return found if found is not None and found.pid == _pid[0] else None


def map_shared(size: int) -> int:
    """The address of ``size`` bytes of anonymous memory shared with every child this
    process forks from now on (``MAP_SHARED``; ``MAP_NORESERVE``: a page is memory only
    once written), mapped for the process's life. Raises ``OSError``."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_NORESERVE", 0x4000)
    return _anonymous(size, flags, f"mapping {size} bytes of shared memory")


def _anonymous(size: int, flags: int, what: str) -> int:
    """The address of ``size`` bytes of new anonymous read-write memory mapped with
    ``flags`` (``MAP_PRIVATE`` or ``MAP_SHARED``, and more). Raises ``OSError`` saying
    ``what`` failed."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    addr = _mmap(None, size, prot, flags | mmap.MAP_ANONYMOUS, -1, 0)
    if addr in (None, _MAP_FAILED):
        raise _os_error(what)
    return int(addr)


def populate(addr: int, size: int, write: bool) -> None:
    """Map the pages of ``size`` bytes at ``addr`` in one call, to be written or read
    (a shared mapping's pages are mapped anew in each process: one fault each costs
    more). A kernel without ``MADV_POPULATE_*`` (before 5.14) faults them in on use."""
    _madvise(addr, -(-size // PAGE) * PAGE, _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ)
