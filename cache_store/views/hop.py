"""The DataLoader hop without the bytes: a worker sends where its verified records lie.

In a DataLoader worker, a ``CachedDataset(views=True)`` (without a ``transform``) reads
and checks each record as a view, then returns a :class:`LocatedSample`: the record's
key and where its checked bytes lie (file identity, offset, length, the version it
hashed), not the bytes. :func:`~cache_store.readers.collate.collate_spc` batches them
into a :class:`LocatedBatch`. Either one pickles (what crosses the DataLoader's queue)
as a call that runs in the training process as it unpickles: the records are looked up
in its own store, and where one is still that version at that place the worker's hash
counts (:func:`cache_store.views.records.view_record`'s ``checked``), else it is read
and hashed there; a batch is then packed by ``collate_spc`` (one copy into Kaolin's
layout, in the training process), a single sample returned as views.

A ``collate_fn`` other than ``collate_spc`` gets the located samples too; each reads
its record in the worker (as views of its own mapping, checked as every read) the first
time it is indexed (``sample["octree"]``), and ``default_collate`` collates the samples
(:func:`collate_located`), so a custom ``collate_fn`` batches tensors as it would from
``views=False``; its batch crosses as tensors. One that returns the samples themselves
hands them over as places.

Where views cannot be taken in the training process (the store lends no file), the
records are read as copies there. A ``transform`` runs in the worker on tensors, so a
dataset with one keeps today's hop (tensors in shared memory).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from cache_store.format.decode import Record
from cache_store.keys import split_key
from cache_store.views.records import Place

if TYPE_CHECKING:
    from cache_store.stores.base import Store

__all__ = [
    "LocatedBatch",
    "LocatedSample",
    "Source",
    "collate_located",
    "hands_over",
    "open_batch",
    "open_sample",
    "pack_in_slot",
    "packed",
    "pinned_buffer",
    "read_path",
    "read_records",
]

#: How the training process opens the worker's store and makes its samples: a picklable
#: ``open_store`` call, the fields read, ``verify``, the fields the recipe declares
#: variable, the sample class (``SpcSample``; given, so this module imports no reader),
#: and whether a batch is packed into pinned memory (``CachedDataset(pin_memory=True)``).
Source = tuple[Callable[[], "Store"], tuple[str, ...] | None, str, frozenset[str], Any, bool]


class LocatedSample:
    """One checked record, as a DataLoader worker hands it on: its key and
    ``(place, checksum)``. Unpickled in the training process as the sample's views.

    Indexed as the sample (``sample["octree"]``, ``keys()``, ``items()``,
    ``sample_id``, ...: a ``collate_fn`` other than ``collate_spc`` reading it), it is
    the sample read in this process on first use (:meth:`sample`); ``default_collate``
    collates the samples (:func:`collate_located`). It is no ``Mapping``: the
    DataLoader's ``default_convert`` (``batch_size=None``) hands it over as it is."""

    __slots__ = ("_sample", "checked", "key", "source")

    def __init__(self, source: Source, key: str, checked: tuple[Place, str]) -> None:
        self.source, self.key, self.checked = source, key, checked
        self._sample: Any = None

    def __reduce__(self) -> tuple[Any, ...]:
        return open_sample, (self.source, self.key, self.checked)

    def sample(self) -> Any:
        """The sample (an ``SpcSample``) as views of this process's own mapping of the
        record (its pages private to the sample, as ``ds[i]`` returns them), read once."""
        if self._sample is None:
            self._sample = open_sample(self.source, self.key, self.checked)
        return self._sample

    def __getitem__(self, name: str) -> Any:
        return self.sample()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.sample())

    def __len__(self) -> int:
        return len(self.sample())

    def __contains__(self, name: object) -> bool:
        return name in self.sample()

    def keys(self) -> Any:
        return self.sample().keys()

    def values(self) -> Any:
        return self.sample().values()

    def items(self) -> Any:
        return self.sample().items()

    def get(self, name: str, default: Any = None) -> Any:
        return self.sample().get(name, default)

    @property
    def sample_id(self) -> str | None:
        return self.sample().sample_id

    @property
    def variable(self) -> frozenset[str]:
        return self.sample().variable

    def __repr__(self) -> str:
        return f"LocatedSample({self.key!r}, {self.checked!r})"


def collate_located(batch: Sequence[LocatedSample], *, collate_fn_map: Any = None) -> Any:
    """``default_collate`` of located samples: of their samples' tensors (registered in
    torch's ``default_collate_fn_map`` for :class:`LocatedSample` by the reader)."""
    from torch.utils.data._utils.collate import collate

    return collate([s.sample() for s in batch], collate_fn_map=collate_fn_map)


class LocatedBatch:
    """Checked records of one batch as ``collate_spc`` makes it in a worker; unpickled in
    the training process as the collated batch. In the worker it holds no tensors:
    indexing it (a ``collate_fn`` changing ``collate_spc``'s batch) raises a
    ``TypeError`` that names the fixes."""

    __slots__ = ("collate", "located", "slot", "source")

    def __init__(self, samples: Sequence[LocatedSample], collate: Callable[..., Any]) -> None:
        self.source = samples[0].source
        self.located = [(s.key, s.checked) for s in samples]
        self.collate = collate  # collate_spc: pickled by name
        self.slot = pack_in_slot(self.source, self.located)

    def __reduce__(self) -> tuple[Any, ...]:
        return open_batch, (self.source, self.located, self.collate, self.slot)

    def _refuse(self, *_: Any) -> Any:
        raise TypeError(
            "collate_spc in a DataLoader worker of CachedDataset(views=True) returns where "
            "the batch's records lie (a LocatedBatch), collated into tensors in the "
            "training process: change the batch there (in the training loop), or collate "
            "the samples' tensors in the worker: collate_spc([s.sample() for s in samples])"
        )

    __getitem__ = __setitem__ = __iter__ = __len__ = keys = items = values = _refuse


log = logging.getLogger(__name__)

_stores: dict[Any, tuple[int, Store]] = {}
_stores_lock = threading.Lock()


def _store(opener: Callable[[], Store]) -> Store:
    """This process's store for ``opener`` (one per distinct opener, opened once)."""
    key = (
        (opener.func, opener.args, tuple(sorted(opener.keywords.items(), key=repr)))
        if isinstance(opener, functools.partial)
        else opener
    )
    pid = os.getpid()
    with _stores_lock:
        found = _stores.get(repr(key))
        if found is None or found[0] != pid:
            found = _stores[repr(key)] = (pid, opener())
        return found[1]


def _records(
    source: Source, items: Sequence[tuple[str, tuple[Place, str]]], transient: bool
) -> list[Record]:
    opener, fields, verify = source[0], source[1], source[2]
    store = _store(opener)
    keys = [key for key, _ in items]
    names = None if fields is None else list(fields)
    viewed = store.view_records(keys, names, verify, checked=dict(items), transient=transient)
    if viewed is not None:
        return viewed
    return store.get_records(keys, fields=names)


def hands_over(transform: Any) -> bool:
    """Whether a record read as views here leaves as a :class:`LocatedSample` (the hop),
    never as tensors: in a DataLoader worker, for a dataset without a ``transform``. Its
    views then never leave this process's reader (``Store.view_records``' ``transient``)."""
    from cache_store.format.buffers import in_dataloader_worker

    return transform is None and in_dataloader_worker()


def open_sample(source: Source, key: str, checked: tuple[Place, str]) -> Any:
    """In the training process: the sample a worker located, as views (or a copy)."""
    record = _records(source, [(key, checked)], False)[0]
    return source[4](record.tensors, source[3], split_key(key)[1])


def open_batch(
    source: Source,
    items: Sequence[tuple[str, tuple[Place, str]]],
    collate: Callable[..., Any],
    slot: Slot | None = None,
) -> Any:
    """In the training process: the batch a worker located, collated by ``collate``
    (``collate_spc``: Kaolin's packed layout) over one copy of each record's fields,
    of which it takes views: the copy the worker packed into a ring ``slot``
    (:func:`pack_in_slot`) where it is still there, else one made here (:func:`packed`)."""
    sample, variable = source[4], source[3]
    tensors = None if slot is None else _slot_tensors(slot, len(items))
    if tensors is None:
        tensors = packed([r.tensors for r in _records(source, items, True)], source[5])
    ids = [split_key(key)[1] for key, _ in items]
    return collate([sample(t, variable, i) for t, i in zip(tensors, ids, strict=True)])


def packed(
    records: Sequence[dict[str, Any]], pin: bool = False, spread: bool = False
) -> list[dict[str, Any]]:
    """The records' fields copied field by field into ONE buffer (a recently freed one
    of this process when it fits: :data:`cache_store.format.buffers.BATCH_BUFFERS`;
    page-locked memory with ``pin``: :func:`pinned_buffer`), each field's records end to
    end, so ``collate_spc`` concatenates and stacks them as views of it. The one copy of
    a batch in the training process; its tensors are normal (writable) tensors.

    Each field is copied from a NumPy view of its tensor and given back as a slice of
    one view of the buffer per dtype: four torch calls a field fewer than viewing each
    part by torch (a batch of 4 records of 5 fields made 60 of them).

    With ``spread`` (the process's cores are not taken by DataLoader workers: a loader
    with none), a field of :data:`SPREAD_BYTES` or more is copied by torch, which splits
    a large copy over its intra-op threads."""
    from cache_store.format.buffers import allocate

    slots, size = _layout(records)
    found = pinned_buffer(size) if pin else None
    base, buf = found if found is not None else allocate(size, False)
    _copy(base, buf, slots, spread)
    return _views(base, _described(slots), len(records))


def _copy(base: Any, buf: Any, slots: list[tuple[int, str, int, Any]], spread: bool) -> None:
    """Copy each field of :func:`_layout`'s ``slots`` to its offset in the uint8 tensor
    ``base`` (``buf``: a NumPy view of it); ``spread`` as :func:`packed`."""
    for _, _, offset, t in slots:
        if spread and t.nbytes >= SPREAD_BYTES:  # torch's copy runs on its intra-op threads
            base[offset : offset + t.nbytes].copy_(_flat_bytes(t))
        elif t.nbytes:
            buf[offset : offset + t.nbytes] = _bytes_of(t)


def _layout(records: Sequence[dict[str, Any]]) -> tuple[list[tuple[int, str, int, Any]], int]:
    """Where :func:`packed` puts each field of each record: ``(record, name, offset,
    tensor)`` in packing order (each field's records end to end, a field from an 8-byte
    boundary, each part aligned for its dtype), and the bytes in all (a multiple of 8)."""
    slots, size = [], 0
    for name in records[0]:
        size = (size + 7) & ~7
        for j, fields in enumerate(records):
            t = fields[name]
            item = t.element_size()
            size = -(-size // item) * item
            slots.append((j, name, size, t))
            size += t.nbytes
    return slots, (size + 7) & ~7


#: a packed batch's fields: ``(record, name, offset, dtype, shape)`` each
Layout = list[tuple[int, str, int, Any, Any]]


def _described(slots: list[tuple[int, str, int, Any]]) -> Layout:
    """:func:`_layout`'s slots without their tensors: what rebuilds the views."""
    return [(j, name, offset, t.dtype, t.shape) for j, name, offset, t in slots]


def _views(base: Any, layout: Layout, count: int) -> list[dict[str, Any]]:
    """The ``count`` records' fields as views of the packed uint8 tensor ``base``: one
    view of it per dtype, sliced (four torch calls a field fewer than viewing each part
    of ``base`` itself)."""
    out: list[dict[str, Any]] = [{} for _ in range(count)]
    typed: dict[Any, Any] = {}  # dtype -> the buffer viewed as that dtype (8-byte multiple)
    for j, name, offset, dtype, shape in layout:
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = base.view(dtype)
        at = offset // whole.element_size()
        out[j][name] = whole[at : at + shape.numel()].view(shape)
    return out


#: a batch packed in a ring slot, as a worker sends it: ``(slot, version, bytes, layout)``
Slot = tuple[int, int, int, Layout]


def pack_in_slot(source: Source, items: Sequence[tuple[str, tuple[Place, str]]]) -> Slot | None:
    """In a DataLoader worker: the located records of a batch packed (as :func:`packed`
    lays them out) into a slot of the ring the training process made before forking it
    (:mod:`cache_store.views.ring`), read again here as views pinned while the copy runs
    (hashed as every read: a version this run hashed is not hashed again). None where
    there is no ring to use, no slot free, ``pin_memory`` asked for (the training
    process packs into pinned memory), or the records cannot be viewed here: the batch
    then crosses as places."""
    import torch

    from cache_store.views.ring import ring

    found = ring()
    if found is None or source[5] or not found.usable_here():
        return None
    claimed: list[Slot] = []

    def into_slot(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        slots, size = _layout(records)
        got = found.claim(size)
        if got is None:
            return records
        claimed.append((*got, size, _described(slots)))
        buf = found.writable(got[0], size)
        _copy(torch.from_numpy(buf), buf, slots, False)
        return records

    keys = [key for key, _ in items]
    names = None if source[1] is None else list(source[1])
    try:
        viewed = _store(source[0]).view_records(
            keys, names, source[2], transient=True, pack=into_slot
        )
    except Exception:  # noqa: BLE001 - the training process reads them, and says why
        viewed = None
    if viewed is None:  # (a worker that dies instead leaves its claim to be claimed again)
        for slot, version, _, _ in claimed:
            found.unclaim(slot, version)
    return claimed[0] if viewed is not None and claimed else None


def _slot_tensors(slot: Slot, count: int) -> list[dict[str, Any]] | None:
    """In the training process: the ``count`` records a worker packed into ``slot``, as
    views of it (None: not there any more, or no ring here)."""
    import torch

    from cache_store.views.ring import ring

    found = ring()
    if found is None:
        return None
    index, version, size, layout = slot
    memory = found.open(index, version, size)
    if memory is None:
        return None
    return _views(torch.from_numpy(memory.array()), layout, count)


#: a field this large is copied by torch's threads where the pack may ``spread``
SPREAD_BYTES = 256 << 10


def _bytes_of(t: Any) -> Any:
    """A flat uint8 NumPy view of tensor ``t``'s bytes (a copy where it is not
    contiguous)."""
    import numpy as np

    try:  # (reshape keeps a strided 1-d tensor strided: contiguous first)
        return np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8)
    except TypeError:  # a dtype NumPy lacks (bfloat16)
        return _flat_bytes(t).numpy()


def _flat_bytes(t: Any) -> Any:
    """A flat uint8 tensor of ``t``'s bytes (a copy where it is not contiguous)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


_unpinned_told = threading.Event()


def pinned_buffer(size: int) -> tuple[Any, Any] | None:
    """A uint8 tensor of ``size`` bytes in page-locked (pinned) memory and a NumPy view
    of it: a batch packed there is copied to the GPU without blocking (``.to(device,
    non_blocking=True)``), and the DataLoader's ``pin_memory=True`` finds it pinned (no
    second copy). None where no accelerator can pin memory (said once per process): the
    caller packs into ordinary memory."""
    import torch

    try:
        base = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        if not _unpinned_told.is_set():
            _unpinned_told.set()
            log.warning(
                "pin_memory=True: no pinned memory here (%s); batches are packed "
                "into ordinary memory",
                str(exc).splitlines()[0],
            )
        return None
    return base, base.numpy()


def read_records(
    store: Any,
    keys: list[str],
    fields: list[str] | None,
    views: bool,
    verify: str,
    batch: bool,
    transient: bool = False,
    pin: bool = False,
) -> list[Record]:
    """The records of ``keys`` in ``store``: views where asked for and the store lends
    them (``Store.view_records``; ``transient`` as there), else copies (a batch in one
    storage, or one record).

    A batch read as views in the process that uses it (``batch``, not ``transient``: a
    DataLoader with no workers) is read through the long-lived windows (or, for a
    record LMDB was just asked for, from LMDB's map, which that lookup paged in) and
    packed at once into one buffer (:func:`packed`, the hop's one copy), as a worker's batch is
    packed in the training process: its tensors are plain copies, each field's records
    end to end, which ``collate_spc`` batches without a copy (in page-locked memory with
    ``pin``, as ``CachedDataset(pin_memory=True)`` asks)."""
    if views and batch and not transient:
        pack = functools.partial(packed, pin=pin, spread=True)
        viewed = store.view_records(keys, fields, verify, transient=True, pack=pack)
        if viewed is not None:
            return [Record(r.tensors, r.metadata) for r in viewed]
    if views:
        viewed = store.view_records(keys, fields, verify, transient=transient)
        if viewed is not None:
            return viewed
    if batch:
        return store.get_records(keys, fields=fields)
    return [store.get_record(keys[0], fields=fields)]


def read_path(store: Any, views: bool) -> str:
    """Which path :func:`read_records` takes in ``store``: ``"views"``, or ``"copies"``
    and why views are not taken."""
    if not views:
        return "copies (views=False)"
    refused = store.views_refused()
    return "views" if refused is None else f"copies ({refused})"
