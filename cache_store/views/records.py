"""Records as read-only tensors viewing their mapped bytes, each version hashed once.

:func:`view_record` builds a record's tensors over a :class:`~cache_store.views.mapping.
MappedRange` without copying: the header is parsed and checked (strict parse, header
checksum, layout) on every read, and bound to its key as every read is; the selected
fields' bytes are hashed against their checksums the first time this process reads that
version of the record at that place (:data:`VERIFIED`), or on every read with
``verify="always"``.

What "once" trusts: a place is (file identity, offset, length) and a version is the
record's checksum (its header's digest, which covers every field's checksum). Bytes of
a place that stay pinned (an LMDB read lease; a committed snapshot part never changes)
change only by damage below the store (the disk, or a process writing the file behind
LMDB's back) after they were hashed once; ``verify="always"`` hashes every read for who
wants that caught too. A record written anew (another place) or of another version is
hashed again. "This process" includes the processes forked from it after this module
was imported, which share one table of what was hashed (:class:`VerifiedOnce`): a
DataLoader's workers, persistent or not, and the training process do not hash again
what one of them hashed.

Views are inference tensors (``torch.inference_mode``): torch refuses an in-place update
of one (``RuntimeError``), and their pages are mapped read-only, so nothing written
through a view can reach the cache. A model that saves its input for backward needs a
normal tensor: ``.clone()``, or ``.to(device)``; ``collate_spc``'s packed fields are
copies already.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable
from typing import Any

import xxhash

from cache_store.errors import CorruptRecord
from cache_store.format.decode import Record, selected_fields, verified_field
from cache_store.format.descriptor import DescriptorLookup, bind_metadata
from cache_store.format.header import (
    HEADER_LENGTH,
    ITEMSIZE,
    TORCH_DTYPES,
    RecordHeader,
    parse_view,
)
from cache_store.views.mapping import MappedRange

__all__ = [
    "Pack",
    "Place",
    "VERIFIED",
    "VERIFY_CHOICES",
    "VerifiedOnce",
    "repacked",
    "view_record",
]

#: Where a record's bytes lie: the file's device and inode, the offset, the length.
Place = tuple[int, int, int, int]

#: A batch's copy (``views.hop.packed``): the records' tensors in, their copies out.
Pack = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]

#: ``verify=``: hash a record's fields the first time this process reads that version at
#: that place ("once"), or on every read ("always").
VERIFY_CHOICES = ("once", "always")


class VerifiedOnce:
    """The record versions at places hashed by this process or one forked from the one
    that made this object, and which fields.

    One table shared by all of them (an anonymous shared mapping of ``slots`` 64-bit
    digests of a version and its field names, made empty when this module is imported,
    so before any DataLoader forks its workers; a page is memory once written): a worker
    finds there what its sibling or the training process hashed, and no process keeps a
    copy of its own (at a million records a dict of them was hundreds of MB in each).
    A digest is written only after the hash passed; one that finds its few slots taken
    is dropped (hashed again when read again), and one process's write racing another's
    loses an entry, never trusts a version nobody hashed (but for a 64-bit digest
    collision). A read of other fields than those hashed hashes its own.
    """

    PROBES = 8

    def __init__(self, slots: int = 1 << 22) -> None:
        self.slots = slots  # a power of two
        self._map = mmap.mmap(-1, slots * 8)  # MAP_SHARED | MAP_ANONYMOUS: pages on use
        self.shared = memoryview(self._map).cast("Q")

    def _digest(self, place: tuple[Any, ...], names: Iterable[str]) -> int:
        text = repr((place, sorted(names))).encode()
        return xxhash.xxh3_64_intdigest(text) | 1  # 0 marks a free slot

    def covers(self, place: tuple[Any, ...], names: Iterable[str]) -> bool:
        digest = self._digest(place, names)
        for i in range(self.PROBES):
            found = self.shared[(digest + i) & (self.slots - 1)]
            if found == digest:
                return True
            if found == 0:
                return False
        return False

    def add(self, place: tuple[Any, ...], names: Iterable[str]) -> None:
        digest = self._digest(place, names)
        for i in range(self.PROBES):
            slot = (digest + i) & (self.slots - 1)
            if self.shared[slot] in (0, digest):
                self.shared[slot] = digest
                return

    def clear(self) -> None:
        """Forget every version, in every process that shares the table."""
        try:  # its pages given back (read as zeros)
            self._map.madvise(mmap.MADV_REMOVE)
        except (AttributeError, OSError):
            self._map[:] = bytes(len(self._map))


#: The record versions hashed once by this process and those forked from it (a child
#: maps the bytes its parent hashed as they are at those places), :class:`VerifiedOnce`.
VERIFIED = VerifiedOnce()


class ParsedHeaders:
    """The headers this process parsed at places, by their exact bytes: a view's header
    is parsed (JSON, header checksum, layout) only when its bytes differ from the last
    parse at that place, as parsing is a function of the bytes, the length and the key
    (the cost of a parse is a third of a view's). Bounded (``limit`` places)."""

    def __init__(self, limit: int = 8192) -> None:
        self.limit = limit
        self.seen: dict[Place, tuple[bytes, str, RecordHeader]] = {}

    def parse(self, view: memoryview, key: str, place: Place) -> RecordHeader:
        """The header of the record value ``view`` of ``key`` (``parse_view``)."""
        size = HEADER_LENGTH.size
        raw = b""
        if view.nbytes >= size:
            (n,) = HEADER_LENGTH.unpack_from(view, 0)
            raw = bytes(view[size : size + min(n, view.nbytes)])
            found = self.seen.get(place)
            if found is not None and found[0] == raw and found[1] == key:
                return found[2]
        header = parse_view(view, key)
        if len(self.seen) >= self.limit:
            self.seen.clear()
        self.seen[place] = (raw, key, header)
        return header


#: This process's parsed headers (a dict's single get and set are atomic).
HEADERS = ParsedHeaders()


def aligned(mapped: MappedRange, at: int, header: RecordHeader, names: list[str]) -> bool:
    """Whether every field lies aligned for its dtype in memory (a small LMDB value in a
    leaf page may be 2-byte aligned only: such a record is read as a copy)."""
    start = mapped.addr + at
    return all(
        (start + header.tensors[n].begin) % ITEMSIZE[header.tensors[n].dtype] == 0 for n in names
    )


def view_record(
    mapped: MappedRange,
    at: int,
    length: int,
    *,
    key: str,
    fields: list[str] | None,
    lookup: DescriptorLookup,
    place: Place,
    verify: str,
    expect_checksum: str | None = None,
    checked: tuple[Place, str] | None = None,
    same_bytes: Any = None,
    over_same_bytes: bool = False,
) -> Record | None:
    """The record of ``length`` bytes at ``at`` in ``mapped``, as views; None when a field
    is not aligned for its dtype (the caller reads a copy).

    ``place`` names where it lies (file identity, offset, length); ``expect_checksum``:
    the version the caller's index says is there (a snapshot's manifest); ``checked``:
    ``(place, checksum)`` another process hashed (a DataLoader worker), which counts as
    hashed here where this is that version at that place. ``same_bytes``: the same
    ``length`` bytes of the same file, pinned by the same lease, where this process has
    them mapped and already read (LMDB's map after a lookup: py-lmdb touched every
    page), hashed instead of ``mapped`` (whose pages would be faulted in only for the
    hash: 0.7 ms a 2.4 MB record, more than the hash); with ``over_same_bytes`` the
    tensors view them too, for a caller that copies the tensors before those pages may
    go (LMDB's map, inside the lookup transaction), so ``mapped``'s pages are never
    faulted in.

    Raises:
        CorruptRecord: naming ``key`` (a bad header or field, another key's record, not
            the expected version).
        UnknownName: a requested field the record does not hold.
    """
    import numpy as np
    import torch

    array = mapped.array()
    view = array[at : at + length].data  # a memoryview of the mapped bytes
    if same_bytes is not None and len(same_bytes) != length:
        same_bytes = None
    # its length is in ``place``; read from the bytes already mapped where given
    header = HEADERS.parse(view if same_bytes is None else memoryview(same_bytes), key, place)
    if expect_checksum is not None and header.checksum != expect_checksum:
        raise CorruptRecord(key, "record checksum differs from its manifest's")
    names = selected_fields(header, fields, key)
    if not aligned(mapped, at, header, names):
        return None
    version = (*place, header.checksum)
    if checked is not None:  # handed over by a worker: copied whole next (the hop's pack)
        mapped.populate()
    if verify == "always" or not VERIFIED.covers(version, names):
        # a worker's hash of this very version here counts, once (not with "always")
        if verify == "always" or checked != (place, header.checksum):
            hashed = view
            if same_bytes is not None:
                hashed = memoryview(same_bytes)
            elif checked is None:
                mapped.populate()
            for name in names:
                verified_field(hashed, header, name, key)
        VERIFIED.add(version, names)
    metadata = bind_metadata(header.metadata, key, lookup)
    if over_same_bytes and same_bytes is not None:  # copied before those pages may go
        array, at = np.asarray(_Borrowed(same_bytes)), 0
    return Record(tensors_of(array, at, header, names, torch), metadata, place)


class _Borrowed:
    """A read-only buffer as an array NumPy and torch take without a warning (reported
    writable, as a window's range is: its tensors are only copied from)."""

    __slots__ = ("interface", "value")

    def __init__(self, value: Any) -> None:
        import numpy as np

        self.value = value
        addr = np.frombuffer(value, np.uint8).ctypes.data
        self.interface = {"shape": (len(value),), "typestr": "|u1", "data": (addr, False)}

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {**self.interface, "version": 3}


def repacked(records: list[Record], pack: Pack) -> list[Record]:
    """``records`` with their tensors replaced by ``pack`` of them (the hop's pack: one
    copy into one buffer), metadata and places kept."""
    tensors = pack([record.tensors for record in records])
    return [Record(t, r.metadata, r.place) for t, r in zip(tensors, records, strict=True)]


def tensors_of(
    array: Any, at: int, header: RecordHeader, names: list[str], torch: Any
) -> dict[str, Any]:
    """The named fields of the record at ``at`` in ``array`` as inference-tensor views."""
    tensors = {}
    with torch.inference_mode():
        whole = torch.from_numpy(array)
        for name in names:
            dtype, shape, begin, end = header.tensors[name]
            if begin == end:
                tensors[name] = torch.empty(shape, dtype=TORCH_DTYPES[dtype])
            else:
                part = whole[at + begin : at + end]
                tensors[name] = part.view(TORCH_DTYPES[dtype]).view(shape)
    return tensors
