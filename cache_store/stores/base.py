"""The store contract: where records and dataset indexes rest.

A :class:`Store` has a handful of primitives that each backend implements (``get``,
``put_many``, ``has``, ``keys``, ``close``, and the per-fingerprint index ``put_index``,
``get_index``, ``fingerprints``); everything else (``get_record``, ``stats``, ``verify``,
``find_fingerprints``, ``value_size``) is built on them once, here, and a backend may
override it where it has a cheaper way (LMDB's ``value_size`` reads a length, not bytes).

Reading records: a backend supplies bytes, the base decodes and checks them. The hook
:meth:`Store.supply` hands the values of the keys asked for (valid only during the call:
LMDB lends its map inside a read transaction) or a snapshot's headers and a fill
callback to a :class:`RecordDecoder`, which decodes them with the format's checks
(header, layout, each returned field's hash, BOOL bytes) and then binds every record to
its key (:func:`cache_store.format.descriptor.bind_metadata`: its metadata names the key;
a format-2 record's descriptor is added to its metadata): the one place a decoded record
is bound to its key. ``verify`` runs :func:`cache_store.format.decode.check_record`, the
whole-record check.

Descriptors (:mod:`cache_store.format.descriptor`): each backend keeps those of a
fingerprint with its records and implements ``load_descriptor`` (the stored text, or
None); the base's :meth:`Store.descriptor` checks and keeps them (they never change: a
descriptor is named by the digest of its text). Writes take them with the records:
:meth:`Store.check_items` resolves every descriptor a batch names (carried by the
records ``encode_record`` returns, given to ``put_many``, or stored already) and the
backend writes them in the same commit as the records.

``generation()`` is a change counter: it differs after any write that landed (LMDB: the
last committed transaction id), so a reader can tell "nothing changed" cheaply; None
where the backend cannot tell. Turning a location into a store (:func:`open_store`, the
backend registry) is :mod:`cache_store.stores.opener`'s job: this module names no
backend, so every backend can import it.

Every backend constructor takes ``(location, *, readonly=..., **options)``, only assigns
(nothing is opened before first use) and raises ``ReadOnlyStoreError`` on writes when
read-only.

Why one module: the contract and what is built once on its primitives (decoding and
binding reads, checking writes and the descriptors they carry, stats, verify) are what
every backend subclasses; apart, each half would need the other's every name.

What a backend cannot do at all it says with a capability flag instead of a method that
fakes it: ``supports_writes`` (False: Zarr snapshots, HTTP; ``put_many``/``put_index``
are left to the base, which raises ``ReadOnlyStoreError``) and ``supports_listing``
(False: ``keys()`` lists only what the backend can enumerate, e.g. HTTP lists indexed
records only). ``keys()`` order is the same on every backend: sorted by the keys'
UTF-8 bytes (= code point order).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cache_store.errors import (
    CacheDamaged,
    CorruptRecord,
    FingerprintLookupError,
    ParameterError,
    ReadOnlyStoreError,
    RecordNotFound,
    SpcacheError,
)
from cache_store.location import Location, LocationLike
from cache_store.format.decode import (
    Fill,
    Record,
    check_record,
    decode_filled,
    decode_record,
    decode_records,
)
from cache_store.format.descriptor import (
    Descriptor,
    DescriptorLookup,
    bind_metadata,
    descriptor_name,
    parse_descriptor,
)
from cache_store.format.header import RecordHeader, read_header
from cache_store.format.index import DatasetIndex, IndexPage
from cache_store.keys import FINGERPRINT_HEX_CHARS, split_key, validate_fingerprint
from cache_store.views.records import Pack, Place

__all__ = [
    "BlockLayout",
    "RecordDecoder",
    "Store",
    "VerifyReport",
    "WriteBatch",
]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- reports


@dataclass
class VerifyReport:
    """What :meth:`Store.verify` found: records checked, corrupt ones, missing ones,
    ``unindexed`` (fingerprint -> how many records it has while it has no index: its
    index went missing, e.g. a rolled-back LMDB commit, or a run that writes it is still
    going or was killed), and ``damaged`` (why the walk could not go on: the store itself
    is damaged) or None."""

    checked: int = 0
    corrupt: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unindexed: dict[str, int] = field(default_factory=dict)
    damaged: str | None = None

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.missing and not self.unindexed and self.damaged is None

    def as_json(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "ok": self.ok,
            "corrupt": dict(self.corrupt),
            "missing": list(self.missing),
            "unindexed": dict(self.unindexed),
            "damaged": self.damaged,
        }


@dataclass(frozen=True)
class BlockLayout:
    """How a backend reads one dataset's records: block by block. ``names`` (str,
    stable across processes and runs: a part's name, a chunk range) and ``of_sample``
    (np.ndarray int64 of shape (n,): the block of each sample, indexing ``names``)."""

    names: tuple[str, ...]
    of_sample: Any

    @classmethod
    def of_labels(cls, labels: Sequence[str]) -> BlockLayout:
        """The layout of samples whose blocks are named ``labels`` (one per sample)."""
        import numpy as np

        names, of_sample = np.unique(np.array(labels, dtype=str), return_inverse=True)
        return cls(tuple(str(n) for n in names), of_sample.astype(np.int64))


# --------------------------------------------------------------------------- decoding


class RecordDecoder:
    """Decodes the records of one read (``keys``, ``fields``) from what a backend
    supplies, and binds each to its key. Made by the base class, handed to
    :meth:`Store.supply`; ``batch`` False for :meth:`Store.get_record` (one record, laid
    out for itself), True for :meth:`Store.get_records` (one storage, field by field);
    ``lookup`` finds the descriptors format-2 records name (:meth:`Store.descriptor`)."""

    __slots__ = ("batch", "fields", "keys", "lookup")

    def __init__(
        self, keys: Sequence[str], fields: list[str] | None, batch: bool, lookup: DescriptorLookup
    ) -> None:
        self.keys = keys
        self.fields = fields
        self.batch = batch
        self.lookup = lookup

    def values(self, values: Sequence[Any]) -> list[Record]:
        """Records from whole values, one per key in order (bytes-like; a backend's own
        memory may be lent: nothing returned aliases it)."""
        keys = self.keys
        if self.batch:
            records = decode_records(zip(keys, values, strict=True), fields=self.fields)
        else:
            records = [decode_record(values[0], key=keys[0], fields=self.fields)]
        return self._bound(records)

    def filled(self, headers: Sequence[RecordHeader], fill: Fill) -> list[Record]:
        """Records stored in parts: checked headers, and ``fill`` writing each selected
        field's bytes into the returned storage (see ``decode_filled``)."""
        return self._bound(decode_filled(headers, self.keys, fill, fields=self.fields))

    def _bound(self, records: list[Record]) -> list[Record]:
        lookup = self.lookup
        for key, record in zip(self.keys, records, strict=True):
            record.metadata = bind_metadata(record.metadata, key, lookup)
        return records


@dataclass
class WriteBatch:
    """A batch checked for writing (:meth:`Store.check_items`): the records, and every
    descriptor they name, which the backend writes with them (one it holds already is
    written again or skipped: the same digest is always the same text)."""

    records: list[tuple[str, bytes]]
    descriptors: list[Descriptor] = field(default_factory=list)
    #: each record's recipe code digest (``"none"``: it carries none), as summaries count
    codes: list[str] = field(default_factory=list)


def _field_list(fields: Iterable[str] | None) -> list[str] | None:
    if fields is None:
        return None
    return [fields] if isinstance(fields, str) else list(fields)


# --------------------------------------------------------------------------- store


def count_code_digest(
    entry: dict[str, Any], value: Any, fingerprint: str, lookup: DescriptorLookup
) -> None:
    """Count a record's recipe code digest (metadata ``code_digest``, a format-2
    record's from its descriptor) into a stats entry's ``code_digests``; records
    without one (or unreadable) count under ``"none"``."""
    try:
        meta = read_header(value).metadata
        digest = meta.get("descriptor")
        if digest is not None:
            meta = lookup(fingerprint, digest).metadata
        code = meta.get("code_digest", "none")
    except SpcacheError:
        code = "none"
    counts = entry.setdefault("code_digests", {})
    counts[code] = counts.get(code, 0) + 1


def note_mixed_code(entry: dict[str, Any]) -> None:
    """Say in a stats entry (``mixed_code``) that its records come from more than one
    version of the recipe's code."""
    digests = [d for d in entry.get("code_digests", {}) if d != "none"]
    if len(digests) > 1:
        entry["mixed_code"] = (
            f"records of this fingerprint were computed by "
            f"{len(digests)} different versions of the recipe's "
            "code under one recipe version: bump the recipe's "
            "version if its output changed"
        )


class Store(abc.ABC):
    """Base of every store. Subclasses implement the primitives; see the module doc."""

    #: True when writes raise :class:`ReadOnlyStoreError`.
    readonly: bool = True
    #: False for backends that can never write (their writes raise ReadOnlyStoreError).
    supports_writes: ClassVar[bool] = True
    #: False when :meth:`keys` may omit stored records (it lists what it can enumerate).
    supports_listing: ClassVar[bool] = True

    def __init__(self, location: LocationLike, *, readonly: bool = True) -> None:
        # a parsed Location is its target (file:// stripped): a URL never becomes a path
        self.location = location.target if isinstance(location, Location) else os.fspath(location)
        self.readonly = bool(readonly)

    def __repr__(self) -> str:
        mode = "readonly" if self.readonly else "writable"
        return f"{type(self).__name__}({self.location!r}, {mode})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- primitives ------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The value under ``key``; raises :class:`RecordNotFound` naming key and store."""

    @contextlib.contextmanager
    def read_view(self, key: str) -> Iterator[Any]:
        """The value under ``key`` as a bytes-like object valid only inside the ``with``
        block: a backend that can lend its own memory (LMDB's map) does, so a caller that
        only inspects a value (an export's first pass) copies nothing. Raises like
        :meth:`get`."""
        yield self.get(key)

    def put_many(
        self, items: Iterable[tuple[str, bytes]], descriptors: Iterable[Descriptor] = ()
    ) -> int:
        """Write ``(key, record bytes)`` pairs atomically (all or none), and the
        descriptors they name; returns the count.

        A format-2 record's descriptor must be carried by the record (what
        ``encode_record`` returns does), given in ``descriptors`` (a copy from another
        store: :meth:`descriptors_for` there), or stored here already. Writable backends
        implement it and validate with :meth:`check_items` first; the base refuses
        (``supports_writes`` False).
        """
        raise self._cannot_write()

    @abc.abstractmethod
    def has(self, key: str) -> bool:
        """Whether a record is stored under ``key``."""

    @abc.abstractmethod
    def keys(self, prefix: str = "") -> Iterator[str]:
        """Record keys starting with ``prefix``, sorted by their UTF-8 bytes (on every
        backend; with ``supports_listing`` False, only the keys it can enumerate)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release handles; the store may be used again (it re-opens lazily)."""

    def put_index(self, index: DatasetIndex) -> None:
        """Record (or replace) the index of ``index.fingerprint`` (writable backends)."""
        raise self._cannot_write()

    @abc.abstractmethod
    def get_index(self, fingerprint: str) -> DatasetIndex:
        """The index of ``fingerprint``; raises :class:`FingerprintLookupError`."""

    def get_index_page(self, fingerprint: str, offset: int, limit: int) -> IndexPage:
        """Ids ``offset .. offset + limit`` of the index of ``fingerprint`` and what
        describes it; raises as :meth:`get_index`. Backends that can decode one page of a
        stored index (LMDB) do, instead of every id."""
        return IndexPage.of(self.get_index(fingerprint), offset, limit)

    @abc.abstractmethod
    def fingerprints(self) -> list[str]:
        """Fingerprints that have an index, sorted."""

    def load_descriptor(self, fingerprint: str, digest: str) -> str | bytes | None:
        """The stored text of the descriptor ``digest`` of ``fingerprint``; None when this
        store holds none such. Backends that keep descriptors implement it; the default
        holds none (a store of format-1 records only)."""
        return None

    # -- descriptors -------------------------------------------------------------------
    def descriptor(self, fingerprint: str, digest: str) -> Descriptor:
        """The descriptor ``digest`` of ``fingerprint``, checked (its text has that
        digest and names that fingerprint), kept by this process once read.

        Raises:
            CorruptRecord: naming the descriptor: not stored here, or damaged.
        """
        known = self.__dict__.setdefault("_descriptors_read", {})
        found = known.get((fingerprint, digest))
        if found is None:
            text = self.load_descriptor(fingerprint, digest)
            if text is None:
                raise CorruptRecord(
                    descriptor_name(fingerprint, digest), f"is not stored in {self.location}"
                )
            found = known[(fingerprint, digest)] = parse_descriptor(
                text, fingerprint=fingerprint, digest=digest
            )
        return found

    def descriptors_for(self, items: Iterable[tuple[str, Any]]) -> list[Descriptor]:
        """The descriptors, stored here, that the format-2 records among ``items``
        (``(key, value)``) name: what a copy of those records into another store gives
        its ``put_many``. Raises ``CorruptRecord`` as :meth:`descriptor`."""
        found: dict[tuple[str, str], Descriptor] = {}
        for key, value in items:
            digest = read_header(value, key=key).metadata.get("descriptor")
            fingerprint = split_key(key)[0]
            if digest is not None and (fingerprint, digest) not in found:
                found[(fingerprint, digest)] = self.descriptor(fingerprint, digest)
        return list(found.values())

    def record_metadata(self, key: str) -> dict[str, str]:
        """The metadata of the record under ``key`` as a decoded read returns it (a
        format-2 record's with its descriptor's), reading its header only. Raises
        :class:`RecordNotFound`, or ``CorruptRecord`` for a record that does not check
        out or is not bound to ``key``."""
        with self.read_view(key) as value:
            metadata = read_header(value, key=key).metadata
        return bind_metadata(metadata, key, self.descriptor)

    def records_metadata(self, keys: Sequence[str]) -> list[dict[str, str] | SpcacheError]:
        """:meth:`record_metadata` of each of ``keys``, in order, the error in its place
        (``RecordNotFound``, ``CorruptRecord``) where it raises one: what a run admitting
        many samples asks (a backend answers it in few transactions, and may check the
        header as :func:`~cache_store.format.header.read_own_metadata` does, without
        taking its field table apart)."""
        out: list[dict[str, str] | SpcacheError] = []
        for key in keys:
            try:
                out.append(self.record_metadata(key))
            except (RecordNotFound, CorruptRecord) as exc:
                out.append(exc)
        return out

    # -- helpers for implementations -------------------------------------------------
    def _cannot_write(self) -> ReadOnlyStoreError:
        return ReadOnlyStoreError(
            f"{self.location}: a {type(self).__name__} is read-only (this backend cannot write)"
        )

    def check_writable(self) -> None:
        if self.readonly:
            raise ReadOnlyStoreError(f"{self.location}: store is open read-only")

    def check_items(
        self, items: Iterable[tuple[str, bytes]], descriptors: Iterable[Descriptor] = ()
    ) -> WriteBatch:
        """Validate keys and record headers before a write; nothing is written on error.

        Each key must be ``<fingerprint>/<sample id>`` and the record must be bound to it
        (:func:`~cache_store.format.descriptor.bind_metadata`: a record can never land
        under a wrong key). The descriptor each format-2 record names is found where
        :meth:`put_many` says; all of them are returned with the records, for the backend
        to write in the same commit.
        """
        given = {(d.fingerprint, d.digest): d for d in descriptors}
        named: dict[tuple[str, str], Descriptor] = {}

        def lookup_for(value: Any) -> DescriptorLookup:
            carried = getattr(value, "descriptor", None)

            def lookup(fingerprint: str, digest: str) -> Descriptor:
                found = given.get((fingerprint, digest))
                if isinstance(carried, Descriptor) and found is None:
                    found = carried if carried.digest == digest else None
                found = found or named.get((fingerprint, digest))
                if found is None:
                    try:
                        found = self.descriptor(fingerprint, digest)
                    except CorruptRecord as exc:
                        raise CorruptRecord(
                            exc.key,
                            f"{exc.reason}; a writer hands it over with the record "
                            f"(encode_record's value carries it; a copy from another store "
                            f"passes descriptors=source.descriptors_for(items))",
                        ) from None
                named[(fingerprint, digest)] = found
                return found

            return lookup

        checked = []
        codes = []
        for key, value in items:
            split_key(key)  # validates both parts
            meta = read_header(value, key=key).metadata
            try:
                bound = bind_metadata(meta, key, lookup_for(value))
            except CorruptRecord as exc:
                raise ParameterError([f"{key}: {exc.reason}"], what="record key") from None
            checked.append((key, value if isinstance(value, bytes) else bytes(value)))
            codes.append(str(bound.get("code_digest", "none")))
        return WriteBatch(checked, list(named.values()), codes)

    def index_missing(self, fingerprint: str) -> FingerprintLookupError:
        known = self.fingerprints()
        return FingerprintLookupError(
            f"no dataset index for fingerprint {fingerprint!r} in {self.location} "
            f"(indexed: {', '.join(known) or 'none'})",
            known,
        )

    # -- conveniences built on the primitives ----------------------------------------
    def put(self, key: str, value: bytes) -> None:
        self.put_many([(key, value)])

    def get_record(self, key: str, fields: Iterable[str] | None = None) -> Record:
        """Decoded record under ``key`` (``fields``: subset to decode and verify); its
        metadata must name ``key`` (``CorruptRecord`` otherwise)."""
        fields = _field_list(fields)
        return self.supply([key], fields, RecordDecoder([key], fields, False, self.descriptor))[0]

    def get_records(self, keys: Iterable[str], fields: Iterable[str] | None = None) -> list[Record]:
        """Decoded records in ``keys`` order, in one storage laid out field by field (see
        ``decode_records``); checked as :meth:`get_record` checks one. A missing one
        raises :class:`RecordNotFound` naming its key."""
        keys = list(keys)
        fields = _field_list(fields)
        return self.supply(keys, fields, RecordDecoder(keys, fields, True, self.descriptor))

    def supply(
        self, keys: list[str], fields: list[str] | None, decoder: RecordDecoder
    ) -> list[Record]:
        """Backend hook behind :meth:`get_record`/:meth:`get_records`: hand the records of
        ``keys`` to ``decoder`` (``decoder.values(values)`` or ``decoder.filled(headers,
        fill)``) and return what it returns. Raise :class:`RecordNotFound` for a missing
        key. ``fields`` may let a backend skip (or not fetch) other fields' bytes.
        Default: each value through :meth:`get`."""
        return decoder.values([self.get(key) for key in keys])

    def view_records(
        self,
        keys: list[str],
        fields: list[str] | None,
        verify: str,
        checked: Mapping[str, tuple[Place, str]] | None = None,
        transient: bool = False,
        pack: Pack | None = None,
    ) -> list[Record] | None:
        """The records of ``keys`` as read-only tensors viewing this store's own file
        (no copy), checked as :meth:`get_records` checks them, their fields hashed as
        ``verify`` says (:mod:`cache_store.views.records`); each view's bytes stay those
        verified for as long as any tensor views them, and each record's ``place`` says
        where they lie. ``checked``: key -> ``(place, checksum)`` another process hashed
        (a DataLoader worker's), trusted where the record is still that version there.
        ``transient``: the caller copies the views and drops them before it hands
        anything on (the hop's pack): they may be slices of read-only mappings kept
        across reads (:class:`~cache_store.views.mapping.Windows`), which a write
        through would fault. ``pack``: the records come back with ``pack`` of their
        tensors (a batch's one copy) instead, made while the bytes it reads are held,
        which may then be the backend's own (LMDB's map, just read by a lookup).
        None: this backend has no local file to lend (:meth:`views_refused` says why),
        or a record lies where no view can be made; the caller reads copies. Raises
        like :meth:`get_records`."""
        return None

    def views_refused(self) -> str | None:
        """Why :meth:`view_records` cannot lend views of this store, or None when it
        can (a record it cannot view is still read as a copy)."""
        return f"a {type(self).__name__} keeps no local file to map"

    def prefetch(self, keys: Sequence[str]) -> None:
        """A hint: ``keys`` are read soon, in this order. A backend that reads through a
        local copy (``local_cache``) fetches their units ahead; others ignore it."""
        return None

    def value_size(self, key: str) -> int:
        """Bytes of the value under ``key`` (raises like :meth:`get`). Default: the
        length of :meth:`get`; backends that can read a length without the bytes do."""
        return len(self.get(key))

    def generation(self) -> int | None:
        """A change counter: a different value after any write has landed since the last
        call, the same while nothing was written. None: this backend cannot tell (treat
        every call as a change)."""
        return None

    def block_layout(self, fingerprint: str, sample_ids: Sequence[str]) -> BlockLayout | None:
        """The blocks this backend reads the records of ``sample_ids`` (of
        ``fingerprint``) in, or None: any record is read as cheaply as any other (the
        default). A backend that fetches a block at a time (a part, a chunk) says which
        block holds each sample, so a sampler can keep a block's samples together."""
        return None

    def iter_values(self, prefix: str = "") -> Iterator[tuple[str, bytes]]:
        for key in self.keys(prefix):
            try:
                yield key, self.get(key)
            except RecordNotFound:  # deleted meanwhile
                continue

    def stats(self) -> dict[str, Any]:
        """Records and bytes in all, and per fingerprint (with its recipe when indexed)."""
        per_fp: dict[str, dict[str, Any]] = {}
        for key, value in self.iter_values():
            entry = per_fp.setdefault(key[:FINGERPRINT_HEX_CHARS], {"records": 0, "bytes": 0})
            entry["records"] += 1
            entry["bytes"] += len(value)
            count_code_digest(entry, value, key[:FINGERPRINT_HEX_CHARS], self.descriptor)
        return self._finish_stats(per_fp)

    def _finish_stats(self, per_fp: dict[str, dict[str, Any]]) -> dict[str, Any]:
        for entry in per_fp.values():
            note_mixed_code(entry)
        for fingerprint in self.fingerprints():
            entry = per_fp.setdefault(fingerprint, {"records": 0, "bytes": 0})
            try:
                entry.update(self.get_index(fingerprint).describe())
            except CorruptRecord as exc:
                entry["index_error"] = str(exc)
        return {
            "location": self.location,
            "records": sum(e["records"] for e in per_fp.values()),
            "bytes": sum(e["bytes"] for e in per_fp.values()),
            "fingerprints": dict(sorted(per_fp.items())),
        }

    def verify(self, fingerprint: str | None = None) -> VerifyReport:
        """Check every record (of ``fingerprint``, or all) as a decode would, building no
        tensors (:func:`cache_store.format.decode.check_record`; no torch import).

        Also reports records whose metadata names another key, unreadable indexes,
        indexed sample ids without a record (``missing``), and fingerprints that have
        records but no index (``unindexed``: each index compared with the records of its
        fingerprint; a lost index hides every one of them from readers). Damage to the store itself
        (``CacheDamaged``: an unreadable LMDB page) ends the walk and is reported in
        ``damaged``. Damage that makes LMDB abort the process cannot be caught here: walk
        a cache that may be damaged with :func:`cache_store.housekeeping.isolated.verify_cache`.
        """
        report = VerifyReport()
        try:
            self._verify_into(report, fingerprint)
        except CacheDamaged as exc:
            report.damaged = str(exc)
            log.error("verify: %s", exc)
        return report

    def _verify_into(self, report: VerifyReport, fingerprint: str | None) -> None:
        prefix = "" if fingerprint is None else validate_fingerprint(fingerprint) + "/"
        records_of: dict[str, int] = {}
        for key in self.keys(prefix):
            fp_of_key = key[:FINGERPRINT_HEX_CHARS]
            records_of[fp_of_key] = records_of.get(fp_of_key, 0) + 1
            try:
                with self.read_view(key) as value:  # checked in place where a backend lends it
                    check_record(value, key=key, lookup=self.descriptor)
            except RecordNotFound:  # deleted meanwhile
                continue
            except CorruptRecord as exc:  # from check_record, or from a get that checks
                report.corrupt[key] = exc.reason
                log.warning("verify: %s", exc)
            report.checked += 1
        fingerprints = self.fingerprints() if fingerprint is None else [fingerprint]
        removing = self.removals()  # a killed rm leaves records on purpose: ls says "removing"
        for fp in sorted(set(records_of) - set(fingerprints) - set(removing)):
            report.unindexed[fp] = records_of[fp]
        for fp in fingerprints:
            try:
                index = self.get_index(fp)
            except FingerprintLookupError:
                if records_of.get(fp) and fp not in removing:
                    report.unindexed[fp] = records_of[fp]
                continue
            except CorruptRecord as exc:
                report.corrupt[f"index:{fp}"] = exc.reason
                continue
            report.missing += [
                f"{fp}/{sid}" for sid in index.sample_ids.tolist() if not self.has(f"{fp}/{sid}")
            ]

    def removals(self) -> dict[str, float]:
        """Fingerprints being removed (``spcache rm``, tombstoned) -> when. Default: none
        (a backend without tombstones)."""
        return {}

    def find_fingerprints(self, recipe: str, **params: Any) -> list[DatasetIndex]:
        """Indexes of ``recipe`` whose parameters equal every given one (others may be
        anything), sorted by fingerprint.

        Values are compared as given: a caller holding a user's values checks them by the
        recipe's schema first (``level=numpy.int64(8)`` -> ``8``; ``level=8.0`` refused),
        as :func:`cache_store.readers.selection.resolve_index` does.
        """
        found = []
        for fp in self.fingerprints():
            index = self.get_index(fp)
            if index.recipe == recipe and all(
                name in index.params and index.params[name] == value
                for name, value in params.items()
            ):
                found.append(index)
        return found
