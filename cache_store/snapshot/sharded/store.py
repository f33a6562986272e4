"""ShardedSnapshot: a sharded snapshot on the :class:`Store` contract.

Writes commit one part per call and fingerprint (the part's bytes, then its manifest,
created only if absent); reads list the commits, read ``index.json`` and the manifests
it does not include yet, and fetch a record by a range read into its part, checked
against its manifest. What a process has read is kept per fingerprint and listed again
when a key is missed (at most once a second), so a reader sees a growing dataset.
A part the listing names that a read finds gone (a superseded copy reclaimed since:
:mod:`cache_store.snapshot.sharded.superseded`) has the commits listed afresh once, and
the copy that listing names read (:meth:`ShardedSnapshot.read_located`).
The layout and the documents are :mod:`cache_store.snapshot.sharded.format`'s, the
bytes' home :mod:`cache_store.snapshot.sharded.storage`'s, what one listing reads
:mod:`cache_store.snapshot.sharded.listing`'s.

A damaged ``index.json`` is read around (a warning; the manifests rebuild the dataset,
in commit order) and :meth:`ShardedSnapshot.merge_index` writes it again; a damaged
manifest's records are not read. Both are reported by ``verify`` as corrupt, by name
(:meth:`ShardedSnapshot.unreadable`).

Why one module: what this process knows of each fingerprint (its listing, entries and
unreadable files) is state that writing, reading, verifying and merging the index all
update under one lock; the layout, the bytes' home and how a listing reads the commits
are modules of their own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from cache_store.errors import CorruptRecord, FingerprintLookupError, RecordNotFound
from cache_store.format.decode import Record, check_record
from cache_store.format.descriptor import Descriptor
from cache_store.format.index import DatasetIndex, append_ids
from cache_store.keys import is_fingerprint, split_key, validate_fingerprint, variant_counts
from cache_store.process_local import ProcessLocal
from cache_store.snapshot.sharded import storage
from cache_store.snapshot.sharded.claims import claimed
from cache_store.snapshot.sharded.listing import Problems, list_commits
from cache_store.snapshot.sharded.format import (
    ROOT_MARKER,
    Dataset,
    Entry,
    check_against_manifest,
    index_document,
    manifest,
    part_bytes,
    root_document,
)
from cache_store.stores.base import BlockLayout, RecordDecoder, Store, VerifyReport
from cache_store.views.mapping import map_range, windows_of
from cache_store.views.records import Pack, Place, repacked, view_record

__all__ = ["MISS_RELIST_S", "PartMissing", "ShardedSnapshot"]

log = logging.getLogger(__name__)

#: A key not found is looked for again in a fresh listing at most this often (seconds).
MISS_RELIST_S = 1.0

T = TypeVar("T")


class PartMissing(Exception):
    """A committed part that a listing names is not there: raised by the reads that
    :meth:`ShardedSnapshot.read_located` runs, which lists again or reports it."""

    def __init__(self, key: str, part: str) -> None:
        super().__init__(key, part)
        self.key = key
        self.part = part

    def error(self) -> CorruptRecord:
        """The error a reader gets: the part is missing after a fresh listing too."""
        return CorruptRecord(self.key, f"its committed part {self.part}.bin is missing")


class ShardedSnapshot(Store):
    """A sharded snapshot (see :mod:`cache_store.snapshot.sharded.format`) as a :class:`Store`.

    Writable: :meth:`put_many` writes one part (a ``.bin`` and its manifest) per call and
    per fingerprint and returns once it is committed; :meth:`put_index` merges the
    manifests into ``index.json``, with the given order first. Any number of writers may
    write at once (each of its own parts). Readable by any number of readers, each of
    which sees committed parts only.

    Args:
        location: ``DEST.zarr`` path or URL.
        readonly: refuse writes.
        storage_options: fsspec options (``s3`` credentials, ``endpoint_url``...).
        writer: a label naming this writer's parts (``s00012-a1``: shard 12, attempt 1);
            default ``w<random>``.
    """

    supports_writes = True

    def __init__(
        self,
        location: str | os.PathLike[str],
        *,
        readonly: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        writer: str | None = None,
        **_ignored: Any,
    ) -> None:
        super().__init__(location, readonly=readonly)
        self.storage_options = dict(storage_options or {})
        self.writer = writer or f"w{uuid.uuid4().hex[:8]}"
        self._parts_written = 0
        self._fs = ProcessLocal(lambda: storage.open_fs(self.location, self.storage_options))
        self._datasets: dict[str, Dataset] = {}
        self._listed_at: dict[str, float] = {}  # fingerprint -> when commits were last listed
        self._problems: dict[str, Problems] = {}  # fingerprint -> what could not be read
        self._lost: dict[str, set[str]] = {}  # fingerprint -> parts missing after a relist
        self._lock = threading.Lock()

    # -- paths ----------------------------------------------------------------------
    @property
    def fs(self) -> Any:
        return self._fs.get()[0]

    @property
    def root(self) -> str:
        return self._fs.get()[1]

    def path(self, *parts: str) -> str:
        """The full path of ``parts`` under the snapshot's root."""
        return "/".join((self.root, *parts))

    def _ensure_root(self) -> None:
        marker = self.path(ROOT_MARKER)
        if self.fs.exists(marker):
            return
        with contextlib.suppress(storage.CommitConflict):  # another writer made it
            storage.write_once(self.fs, marker, root_document())

    # -- writing ----------------------------------------------------------------------
    def start_writer(self, label: str) -> None:
        """Name the parts written from now on after ``label`` (a shard and its attempt:
        ``s00012-a2``); each part still gets a random suffix, so no two ever collide."""
        self.writer = f"{label}-{uuid.uuid4().hex[:4]}"
        self._parts_written = 0

    def put_many(
        self, items: Iterable[tuple[str, bytes]], descriptors: Iterable[Descriptor] = ()
    ) -> int:
        """Write the records as one committed part per fingerprint (its manifest holding
        the descriptors they name); returns the count."""
        self.check_writable()
        batch = self.check_items(items, descriptors)
        checked = batch.records
        if not checked:
            return 0
        self._ensure_root()
        by_fp: dict[str, list[tuple[str, bytes]]] = {}
        for key, value in checked:
            by_fp.setdefault(split_key(key)[0], []).append((key, value))
        for fingerprint, group in by_fp.items():
            named = {d.digest: d for d in batch.descriptors if d.fingerprint == fingerprint}
            self._commit_part(fingerprint, group, named)
            with self._lock:  # this writer reads what it wrote: the next read lists again
                self._datasets.pop(fingerprint, None)
                self._listed_at.pop(fingerprint, None)
        return len(checked)

    def _commit_part(
        self, fingerprint: str, group: list[tuple[str, bytes]], descriptors: dict[str, Descriptor]
    ) -> str:
        self._parts_written += 1
        part = f"{self.writer}-p{self._parts_written:04d}-{uuid.uuid4().hex[:8]}"
        data = part_bytes(group)
        with claimed(self.fs, self.path(fingerprint), part, self.writer):  # not an orphan
            storage.write(self.fs, self.path(fingerprint, "parts", f"{part}.bin"), data)
            storage.write_once(
                self.fs,
                self.path(fingerprint, "commits", f"{part}.json"),
                manifest(fingerprint, part, group, data, self.writer, descriptors),
            )
        return part

    def put_index(self, index: DatasetIndex) -> None:
        """Merge the committed manifests into ``index.json``: ``index``'s ids first (those
        committed), then every other committed id in commit order."""
        self.check_writable()
        self._ensure_root()
        self.merge_index(
            index.fingerprint,
            order=index.sample_ids.tolist(),
            describe={
                "recipe": index.recipe,
                "recipe_version": index.recipe_version,
                "params": dict(index.params),
            },
        )

    # -- reading ----------------------------------------------------------------------
    def commit_names(self, fingerprint: str) -> list[str]:
        """The parts of ``fingerprint`` committed now (a fresh listing), sorted."""
        try:
            # refresh: s3fs caches listings, and a reader must see commits made since
            names = self.fs.ls(self.path(fingerprint, "commits"), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        parts = []
        for name in names:
            base = str(name).rstrip("/").rsplit("/", 1)[-1]
            if base.endswith(".json") and not base.startswith("."):
                parts.append(base[: -len(".json")])
        return sorted(parts)

    def _load(
        self,
        fingerprint: str,
        *,
        refresh: bool = False,
        describe: Mapping[str, Any] | None = None,
        rebuild: bool = False,
        fresh: bool = False,
    ) -> Dataset | None:
        """What ``fingerprint`` holds: ``index.json`` and the manifests committed since,
        or with ``rebuild`` every manifest that exists now (the index is not read). The
        listing kept is used (``refresh``: with the manifests committed since added)
        unless ``fresh``: then it is listed as if for the first time."""
        with self._lock:
            known = None if fresh else self._datasets.get(fingerprint)
            if known is not None and not refresh and not rebuild:
                return known
        if (
            known is None
            and not rebuild
            and not fresh
            and (earlier := self.known_listing(fingerprint))
        ):
            known, at = earlier
            with self._lock:
                self._datasets[fingerprint] = known
                self._listed_at[fingerprint] = at
            if not refresh:
                return known
        problems = self._problems.setdefault(fingerprint, Problems())
        dataset = list_commits(
            self.fs,
            self.path,
            fingerprint,
            known=None if rebuild else known,
            committed=lambda: self.commit_names(fingerprint),
            problems=problems,
            location=self.location,
            describe=describe,
            with_index=not rebuild,
        )
        if dataset is None:
            with self._lock:  # nothing committed yet: a lookup lists again in a second
                self._listed_at[fingerprint] = time.monotonic()
            return None
        now = time.monotonic()
        with self._lock:
            self._datasets[fingerprint] = dataset
            self._listed_at[fingerprint] = now
        self.note_listing(fingerprint, dataset, now)
        return dataset

    def known_listing(self, fingerprint: str) -> tuple[Dataset, float] | None:
        """What this process knew of ``fingerprint`` before this store listed it, and when
        (``time.monotonic()``) it was listed: a store starts from it instead of listing.
        None here: a plain snapshot lists afresh (a read-through store keeps its
        process's listing, :mod:`cache_store.local_cache.sharded`)."""
        return None

    def note_listing(self, fingerprint: str, dataset: Dataset, at: float) -> None:
        """Called with what each listing found (nothing here; see :meth:`known_listing`)."""

    def merge_index(
        self,
        fingerprint: str,
        *,
        order: Sequence[str] = (),
        describe: Mapping[str, Any] | None = None,
    ) -> int:
        """Write ``index.json`` for ``fingerprint`` from every committed manifest (``order``'s
        ids first); returns the records indexed. Idempotent: merging again with nothing new
        writes the same index."""
        validate_fingerprint(fingerprint)
        self.refresh()
        dataset = self._load(fingerprint, describe=describe)
        before: list[str] = []
        gone = (
            set() if dataset is None else dataset.parts_seen - set(self.commit_names(fingerprint))
        )
        if dataset is not None and any(e.part in gone for e in dataset.entries.values()):
            # A part read from has no manifest now (deleted, or set aside): rebuild from
            # the manifests that exist, so its ids leave the index; the old index still
            # gives the order. (Else the index and the new manifests are all.)
            before = dataset.order
            dataset = self._load(fingerprint, describe=describe, rebuild=True)
        elif dataset is not None:  # reclaimed parts (superseded.py): nothing was read from them
            dataset.parts_seen -= gone
        if dataset is None:
            if describe is None:
                raise FingerprintLookupError(
                    f"no committed part of {fingerprint} in {self.location}", self.fingerprints()
                )
            return 0
        if dataset.recipe is None and describe is None:
            raise FingerprintLookupError(
                f"the committed parts of {fingerprint} in {self.location} "
                f"do not say what computed them; merge with the run's "
                f"recipe and parameters",
                self.fingerprints(),
            )
        first = [sid for sid in [*order, *before] if sid in dataset.entries]
        ids = append_ids(list(dict.fromkeys(first)), dataset.order)
        info = (
            dict(describe)
            if describe is not None
            else {
                "recipe": dataset.recipe,
                "recipe_version": dataset.recipe_version,
                "params": dataset.params,
            }
        )
        # The index lists fewer parts than exist only if parts were committed meanwhile:
        # readers read those manifests themselves, so a stale index is never wrong.
        storage.write(
            self.fs,
            self.path(fingerprint, "index.json"),
            index_document(fingerprint, dataset, ids, info),
        )
        self.refresh()
        return len(ids)

    def unreadable(self, fingerprint: str) -> dict[str, str]:
        """What of ``fingerprint`` could not be read at the last listing: ``{file: reason}``
        for a damaged ``index.json`` (read around: the manifests rebuild it) and for
        damaged manifests (their records are not read). Files are named as
        ``<fingerprint>/index.json`` and ``<fingerprint>/commits/<part>.json``."""
        problems = self._problems.get(fingerprint)
        if problems is None:
            return {}
        found = {f"{fingerprint}/commits/{p}.json": r for p, r in problems.commits.items()}
        if problems.index is not None:
            found[f"{fingerprint}/index.json"] = problems.index
        return dict(sorted(found.items()))

    def refresh(self) -> None:
        """Forget what was read: the next access lists the commits again."""
        with self._lock:
            self._datasets.clear()
            self._listed_at.clear()
            self._problems.clear()
            self._lost.clear()

    def _entry(self, key: str) -> Entry | None:
        fingerprint, sample_id = split_key(key)
        listed = self._listed_at.get(fingerprint, 0.0)
        if fingerprint not in self._datasets and time.monotonic() - listed <= MISS_RELIST_S:
            return None  # listed a moment ago, and nothing was committed
        dataset = self._load(fingerprint)
        entry = dataset.entries.get(sample_id) if dataset else None
        listed = self._listed_at.get(fingerprint, 0.0)
        if entry is None and time.monotonic() - listed > MISS_RELIST_S:
            # committed since this process looked? (at most one listing a second: a run's
            # admission asks for every sample it has not computed yet)
            dataset = self._load(fingerprint, refresh=True)
            entry = dataset.entries.get(sample_id) if dataset else None
        return entry

    def entry_of(self, key: str) -> Entry | None:
        """Where the committed record of ``key`` lies (its part, offset and length, its
        checksum), or None when no commit holds it."""
        return self._entry(key)

    def checked(self, value: bytes, key: str, entry: Entry) -> bytes:
        """``value`` read for ``key`` from where ``entry`` says, if it is the committed
        record (:func:`~cache_store.snapshot.sharded.format.check_against_manifest`)."""
        return check_against_manifest(value, key, entry, self.descriptor)

    def located(self, keys: Sequence[str]) -> list[tuple[str, Entry]]:
        """Each of ``keys`` with where its committed record lies, as this process's
        listing says; ``RecordNotFound`` for a key no commit holds."""
        found = []
        for key in keys:
            entry = self._entry(key)
            if entry is None:
                raise RecordNotFound(key, self.location)
            found.append((key, entry))
        return found

    def read_located(self, keys: Sequence[str], read: Callable[[list[tuple[str, Entry]]], T]) -> T:
        """``read`` of ``keys`` located by this process's listing: every read of records
        runs through here. A part the listing names that ``read`` finds missing
        (:class:`PartMissing`) was reclaimed since it was listed (a superseded copy,
        :mod:`cache_store.snapshot.sharded.superseded`) or is lost: the commits are
        listed afresh once and ``read`` runs again on the copies that listing names. A
        part missing then is ``CorruptRecord``, and so is it at once when read again
        (a lost part does not cost a listing at every read)."""
        try:
            return read(self.located(keys))
        except PartMissing as exc:
            fingerprint = split_key(exc.key)[0]
            with self._lock:
                if exc.part in self._lost.get(fingerprint, ()):
                    raise exc.error() from None
            log.info(
                "%s: part %s of %s is gone since this process listed its commits; "
                "listing them again",
                self.location,
                exc.part,
                fingerprint,
            )
            self._load(fingerprint, fresh=True)
        try:
            return read(self.located(keys))
        except PartMissing as exc:
            with self._lock:
                self._lost.setdefault(split_key(exc.key)[0], set()).add(exc.part)
            raise exc.error() from None

    def read_range(self, located: list[tuple[str, Entry]]) -> list[bytes]:
        """The value of one located record, by a range read into its part."""
        [(key, entry)] = located
        path = self.path(split_key(key)[0], "parts", f"{entry.part}.bin")
        try:
            value = storage.read(self.fs, path, entry.offset, entry.offset + entry.length)
        except FileNotFoundError:
            raise PartMissing(key, entry.part) from None
        return [self.checked(value, key, entry)]

    def read_ranges(self, located: list[tuple[str, Entry]]) -> list[bytes]:
        """The values of located records, by range reads grouped in one request batch."""
        paths = [self.path(split_key(k)[0], "parts", f"{e.part}.bin") for k, e in located]
        starts = [e.offset for _, e in located]
        ends = [e.offset + e.length for _, e in located]
        values = self.fs.cat_ranges(paths, starts, ends)
        out = []
        for (key, entry), value in zip(located, values, strict=True):
            if isinstance(value, FileNotFoundError):
                raise PartMissing(key, entry.part)
            if isinstance(value, BaseException):
                raise CorruptRecord(key, f"cannot be read ({value})")
            out.append(self.checked(bytes(value), key, entry))
        return out

    def get(self, key: str) -> bytes:
        return self.read_located([key], self.read_range)[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """Values of ``keys`` (range reads grouped per request batch)."""
        return self.read_located(keys, self.read_ranges)

    def supply(
        self, keys: list[str], fields: list[str] | None, decoder: RecordDecoder
    ) -> list[Record]:
        # the values, range reads grouped; the base's decoder decodes and key-checks them
        return decoder.values(self.get_many(keys))

    def views_refused(self) -> str | None:
        if not storage.is_local(self.fs):
            return f"{self.location} is not on this machine's file system"
        return None

    def view_records(
        self,
        keys: list[str],
        fields: list[str] | None,
        verify: str,
        checked: Mapping[str, tuple[Place, str]] | None = None,
        transient: bool = False,
        pack: Pack | None = None,
    ) -> list[Record] | None:
        if self.views_refused():
            return None
        records = self.read_located(
            keys, lambda located: self._view_located(located, fields, verify, checked, transient)
        )
        return records if records is None or pack is None else repacked(records, pack)

    def _view_located(
        self,
        located: list[tuple[str, Entry]],
        fields: list[str] | None,
        verify: str,
        checked: Mapping[str, tuple[Place, str]] | None,
        transient: bool,
    ) -> list[Record] | None:
        # A committed part never changes (written whole, renamed, then committed): its
        # pages need no pin, and a mapping outlives the file's removal. A transient view
        # (the hop's pack, a worker's check) is a slice of this process's windows of the
        # part (views/mapping.py), kept across reads; others get a mapping of their own.
        records = []
        for key, entry in located:
            path = self.path(split_key(key)[0], "parts", f"{entry.part}.bin")
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise PartMissing(key, entry.part) from None
            try:
                st = os.fstat(fd)
                if st.st_size < entry.offset + entry.length:
                    raise CorruptRecord(key, f"its committed part {entry.part}.bin is cut short")
                found = (
                    windows_of(path, fd).range(entry.offset, entry.length) if transient else None
                )
                mapped, at = (
                    found if found is not None else map_range(fd, entry.offset, entry.length)
                )
            finally:
                os.close(fd)
            record = view_record(
                mapped,
                at,
                entry.length,
                key=key,
                fields=fields,
                lookup=self.descriptor,
                place=(st.st_dev, st.st_ino, entry.offset, entry.length),
                verify=verify,
                expect_checksum=entry.checksum,
                checked=None if checked is None else checked.get(key),
            )
            if record is None:
                return None
            records.append(record)
        return records

    def load_descriptor(self, fingerprint: str, digest: str) -> str | None:
        """From the committed manifests (or the merged index) of ``fingerprint``."""
        dataset = self._load(fingerprint)
        if dataset is None or digest not in dataset.descriptors:
            dataset = self._load(fingerprint, refresh=True)  # committed since?
        return None if dataset is None else dataset.descriptors.get(digest)

    def source_hash_of(self, key: str) -> str | None:
        """The source hash a committed record was computed from (from its manifest)."""
        entry = self._entry(key)
        return None if entry is None else entry.source_hash

    def has(self, key: str) -> bool:
        return self._entry(key) is not None

    def block_layout(self, fingerprint: str, sample_ids: Sequence[str]) -> BlockLayout | None:
        """Parts: a record is a range of its part's file, so a reader that fetches parts
        whole (a bounded local cache) reads each once when a part's samples come
        together. A sample no commit holds gets a block of its own, named ``""``."""
        dataset = self._load(fingerprint)
        if dataset is None:
            return None
        entries = dataset.entries
        return BlockLayout.of_labels(
            [entry.part if (entry := entries.get(sid)) is not None else "" for sid in sample_ids]
        )

    def keys(self, prefix: str = "") -> Iterator[str]:
        found = []
        for fingerprint in self.fingerprint_dirs():
            if not (f"{fingerprint}/".startswith(prefix) or prefix.startswith(f"{fingerprint}/")):
                continue
            dataset = self._load(fingerprint, refresh=True)
            if dataset is None:
                continue
            found += [
                k
                for k in (f"{fingerprint}/{sid}" for sid in dataset.entries)
                if k.startswith(prefix)
            ]
        return iter(sorted(found, key=lambda k: k.encode("utf-8")))

    def fingerprint_dirs(self) -> list[str]:
        """The fingerprints with a directory here (committed or not), sorted."""
        try:
            names = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(
            n for n in (str(p).rstrip("/").rsplit("/", 1)[-1] for p in names) if is_fingerprint(n)
        )

    def fingerprints(self) -> list[str]:
        """Fingerprints with committed records that say what computed them."""
        found = []
        for fingerprint in self.fingerprint_dirs():
            dataset = self._load(fingerprint)
            if dataset is not None and dataset.recipe is not None:
                found.append(fingerprint)
        return found

    def get_index(self, fingerprint: str) -> DatasetIndex:
        validate_fingerprint(fingerprint)
        dataset = self._load(fingerprint, refresh=True)
        if dataset is None or dataset.recipe is None:
            raise self.index_missing(fingerprint)
        counts = variant_counts(dataset.order)  # a variant's record (a1#v3) is no sample
        return DatasetIndex(
            fingerprint,
            dataset.recipe,
            dataset.recipe_version,
            dataset.params,
            np.array(list(counts), dtype=str),
            created=dataset.created,
            variants=np.array(list(counts.values()), dtype=np.uint16),
        )

    def stats(self) -> dict[str, Any]:
        per_fp = {}
        for fingerprint in self.fingerprints():
            dataset = self._load(fingerprint, refresh=True)
            assert dataset is not None
            per_fp[fingerprint] = {
                "records": len(dataset.entries),
                "bytes": sum(e.length for e in dataset.entries.values()),
                "parts": len(dataset.parts_seen),
            }
        return self._finish_stats(per_fp)

    def _verify_into(self, report: VerifyReport, fingerprint: str | None) -> None:
        """Every committed record read as a reader would (against its manifest, then the
        whole-record check); a part that cannot be read is a corrupt record, never a
        stopped walk."""
        prefix = "" if fingerprint is None else validate_fingerprint(fingerprint) + "/"
        for key in self.keys(prefix):  # lists every fingerprint's commits afresh
            report.checked += 1
            try:
                check_record(self.get(key), key=key, lookup=self.descriptor)
            except CorruptRecord as exc:
                report.corrupt[key] = exc.reason
                log.warning("verify: %s", exc)
        # Damaged manifests (their records go unread: a silent loss otherwise) and a
        # damaged index (read around, but ``spcache merge`` should write it again).
        for fp in [fingerprint] if fingerprint is not None else self.fingerprint_dirs():
            for name, reason in self.unreadable(fp).items():
                report.corrupt[name] = f"cannot be read ({reason})"
                log.warning("verify: %s: %s", name, reason)

    def close(self) -> None:
        self.refresh()
        self._fs.close()
