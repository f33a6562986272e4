"""ZarrStore: a read-only store over a Zarr v3 snapshot written by ``spcache export``.

The layout is described in :mod:`cache_store.snapshot.format`.

``get(key)`` rebuilds the record value byte for byte (header + field bytes) and checks
it like any record (header checksum, per-field xxh3, metadata naming the key), so the
rest of the stack (``decode_record``, ``CachedDataset``, the service) works unchanged.
The descriptors its format-2 records name are in the group's ``descriptors`` attribute.

Process rules: nothing is opened in the constructor; the Zarr hierarchy is opened on
first use in the calling process and re-opened when ``os.getpid()`` changes, so a forked
DataLoader worker never uses its parent's handles (zarr itself replaces its IO loop and
thread in a forked child). The reads of one call (a record's header and fields, or a
whole batch) are issued together on zarr's IO loop.

A group is visible only once its ``complete`` attribute is true; the exporter publishes
local snapshots by renaming a finished directory into place and remote ones by setting
that attribute last (see :mod:`cache_store.snapshot.export`).

Why one module: the Store contract over one Zarr layout; the layout rule is in format.py
and direct chunk reads in chunks.py.
"""

from __future__ import annotations

import asyncio
import functools
import math
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cache_store.errors import (
    CacheNotFound,
    CorruptRecord,
    ReadOnlyStoreError,
    RecordNotFound,
    SpcacheError,
    UnsupportedFormat,
)
from cache_store.keys import (
    FINGERPRINT_HEX_CHARS,
    compute_fingerprint,
    is_fingerprint,
    validate_fingerprint,
)
from cache_store.process_local import ProcessLocal
from cache_store.format.decode import Record, check_record
from cache_store.format.header import HEADER_LENGTH, parse_stored_header
from cache_store.format.ids import unpack_ids
from cache_store.location import local_path, parse_location
from cache_store.snapshot.format import (
    ATTRS_KEY,
    SNAPSHOT_FORMAT_VERSION,
    SNAPSHOT_KIND,
    SNAPSHOT_ROOT_KIND,
    array_digest,
    records_digest,
    validate_field_name,
)
from cache_store.format.index import DatasetIndex
from cache_store.stores.base import RecordDecoder, Store, VerifyReport
from cache_store.snapshot.chunks import LocalChunkReader

__all__ = ["ZarrStore"]

log = logging.getLogger(__name__)

#: Records read per batch by :meth:`ZarrStore.verify`.
VERIFY_BATCH = 64
_READ_ERRORS = (ValueError, RuntimeError)  # codec failures: CRC mismatch, bad blosc frame


def _run(coro: Any) -> Any:
    """Run a coroutine on zarr's IO loop (this process's) and return its result."""
    from zarr.core.sync import sync

    return sync(coro)


async def _gather(calls: Sequence[Any]) -> list[Any]:
    return await asyncio.gather(*calls, return_exceptions=True)


@dataclass
class _Snapshot:
    """One fingerprint group, opened in this process: small index arrays in memory,
    handles (async arrays) for the rest."""

    fingerprint: str
    attrs: dict[str, Any]
    sample_ids: np.ndarray  # <U, index order
    sorted_ids: np.ndarray  # <U, code point (= UTF-8 byte) order
    order: np.ndarray  # int64: sorted position -> row
    header_offsets: np.ndarray  # int64 [n + 1]
    headers: Any  # AsyncArray uint8
    field_offsets: dict[str, np.ndarray]
    data: dict[str, Any]  # field -> AsyncArray
    row_bytes: dict[str, int]  # field -> bytes of one row of its data array
    local: dict[str, LocalChunkReader] | None = None  # "headers" and fields, when local

    def row(self, sample_id: str) -> int | None:
        pos = int(np.searchsorted(self.sorted_ids, sample_id))
        if pos < len(self.sorted_ids) and self.sorted_ids[pos] == sample_id:
            return int(self.order[pos])
        return None

    @property
    def fields(self) -> list[str]:
        return list(self.data)

    def data_len(self, row: int) -> int:
        """Bytes of record ``row``'s fields: the data section its header must tile."""
        return sum(
            (int(o[row + 1]) - int(o[row])) * self.row_bytes[name]
            for name, o in self.field_offsets.items()
        )


@dataclass
class _Opened:
    """What one process has opened: the root group and the fingerprint groups read."""

    root: Any
    snapshots: dict[str, _Snapshot] = field(default_factory=dict)


def _zarr_store(location: str, storage_options: Mapping[str, Any]) -> Any:
    from zarr.storage import FsspecStore, LocalStore

    if parse_location(location).is_local:
        path = local_path(location)
        if not os.path.isdir(path):
            raise CacheNotFound(path, "no Zarr snapshot here (not a directory)")
        return LocalStore(path, read_only=True)
    return FsspecStore.from_url(
        location, read_only=True, storage_options=dict(storage_options) or None
    )


def _open_root(location: str, storage_options: Mapping[str, Any]) -> _Opened:
    """Open a snapshot's root group in this process (checked to be an spcache snapshot)."""
    import zarr

    store = _zarr_store(location, storage_options)
    try:
        root = zarr.open_group(store, mode="r")
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise CacheNotFound(location, f"no Zarr group here ({exc})") from None
    attrs = root.attrs.get(ATTRS_KEY)
    if not isinstance(attrs, dict) or attrs.get("kind") != SNAPSHOT_ROOT_KIND:
        raise CacheNotFound(
            location,
            f"a Zarr group, but not an spcache snapshot (no {ATTRS_KEY!r} root attributes)",
        )
    if attrs.get("format_version") != SNAPSHOT_FORMAT_VERSION:
        raise UnsupportedFormat(
            f"snapshot:{location}",
            f"format_version {attrs.get('format_version')!r} is not "
            f"supported (this reader knows {SNAPSHOT_FORMAT_VERSION})",
        )
    return _Opened(root)


class ZarrStore(Store):
    """Records of a Zarr v3 snapshot, read-only (see the module doc).

    ``supports_writes`` is False: writes raise ``ReadOnlyStoreError``.

    Args:
        location: a ``*.zarr`` path, ``file://`` URL or fsspec URL (``s3://``, ``gs://``,
            ``memory://`` ...).
        readonly: must be True: snapshots are written by :func:`cache_store.snapshot.export.
            export_snapshot`, never through the store contract.
        storage_options: passed to fsspec for URLs (credentials, endpoint ...).
        direct_reads: read a local snapshot's chunk files directly (default) rather than
            through zarr's async pipeline; same bytes and checks, several times faster
            per sample. Ignored for URLs.
    """

    supports_writes = False

    def __init__(
        self,
        location: str | os.PathLike[str],
        *,
        readonly: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        direct_reads: bool = True,
    ) -> None:
        super().__init__(location, readonly=True)
        if not readonly:
            raise ReadOnlyStoreError(
                f"{self.location}: Zarr snapshots are read-only; write them with 'spcache export'"
            )
        self.storage_options = dict(storage_options or {})
        self.direct_reads = bool(direct_reads)
        self._opened: ProcessLocal[_Opened] = ProcessLocal(
            functools.partial(_open_root, self.location, self.storage_options)
        )

    # -- opening -----------------------------------------------------------------------
    def _group(self) -> Any:
        """The root group, opened in this process."""
        return self._opened.get().root

    @property
    def _snapshots(self) -> dict[str, _Snapshot]:
        """This process's opened fingerprint groups (another process's are never used)."""
        return self._opened.get().snapshots

    def open(self) -> ZarrStore:
        """Open now (otherwise the first access does). Returns self."""
        self._group()
        return self

    def close(self) -> None:
        """Drop this process's handles; the store re-opens on next use."""
        self._opened.close()

    def _child_names(self) -> list[str]:
        store = self._group().store

        async def listing() -> list[str]:
            return [name async for name in store.list_dir("")]

        return sorted(name for name in _run(listing()) if is_fingerprint(name))

    def _open_group(self, fingerprint: str) -> tuple[Any, dict[str, Any]] | None:
        """(group, attrs) of a fingerprint group, or None when absent."""
        root = self._group()
        try:
            group = root[fingerprint]
        except (KeyError, FileNotFoundError):
            return None
        attrs = group.attrs.get(ATTRS_KEY)
        return group, attrs if isinstance(attrs, dict) else {}

    def _snapshot(self, fingerprint: str) -> _Snapshot | None:
        """The opened snapshot of ``fingerprint``; None when absent or incomplete."""
        snap = self._snapshots.get(fingerprint)
        if snap is not None:
            return snap
        found = self._open_group(fingerprint)
        if found is None:
            return None
        group, attrs = found
        if not attrs.get("complete"):
            return None
        snap = self._load(fingerprint, group, attrs)
        self._snapshots[fingerprint] = snap
        return snap

    def _load(self, fingerprint: str, group: Any, attrs: dict[str, Any]) -> _Snapshot:
        where = f"snapshot:{fingerprint}"
        if attrs.get("kind") != SNAPSHOT_KIND or attrs.get("fingerprint") != fingerprint:
            raise CorruptRecord(where, "group attributes do not describe this fingerprint")
        if attrs.get("format_version") != SNAPSHOT_FORMAT_VERSION:
            raise UnsupportedFormat(
                where,
                f"format_version {attrs.get('format_version')!r} "
                f"is not supported (this reader knows "
                f"{SNAPSHOT_FORMAT_VERSION})",
            )
        try:
            fields = [validate_field_name(f) for f in attrs["fields"]]
            n = int(attrs["samples"])
            digests = dict(attrs["digests"])
            small = {
                "sample_ids": group["sample_ids"],
                "sample_id_offsets": group["sample_id_offsets"],
                "header_offsets": group["header_offsets"],
            }
            small |= {f"offsets/{f}": group[f"offsets/{f}"] for f in fields}
            data = {f: group[f"data/{f}"] for f in fields}
            headers = group["headers"]
        except (KeyError, TypeError, ValueError, SpcacheError) as exc:
            raise CorruptRecord(where, f"snapshot layout incomplete: {exc}") from None
        names = list(small)
        results = _run(_gather([small[name].async_array.getitem(slice(None)) for name in names]))
        arrays: dict[str, np.ndarray] = {}
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, _READ_ERRORS):
                    raise CorruptRecord(where, f"array {name!r} unreadable: {result}")
                raise result
            arrays[name] = np.asarray(result)
            if digests.get(name) != array_digest(arrays[name]):
                raise CorruptRecord(where, f"array {name!r} does not match its digest")
        self._check_offsets(where, "header_offsets", arrays["header_offsets"], n, headers.shape[0])
        self._check_offsets(
            where,
            "sample_id_offsets",
            arrays["sample_id_offsets"],
            n,
            arrays["sample_ids"].shape[0],
        )
        for f in fields:
            self._check_offsets(
                where,
                f"offsets/{f}",
                arrays[f"offsets/{f}"],
                n,
                data[f].shape[0] if data[f].ndim else 0,
            )
        ids = unpack_ids(arrays["sample_ids"], arrays["sample_id_offsets"])
        order = np.argsort(ids, kind="stable")
        return _Snapshot(
            fingerprint,
            attrs,
            ids,
            ids[order],
            order.astype(np.int64),
            arrays["header_offsets"],
            headers.async_array,
            {f: arrays[f"offsets/{f}"] for f in fields},
            {f: data[f].async_array for f in fields},
            {f: math.prod(data[f].shape[1:]) * np.dtype(data[f].dtype).itemsize for f in fields},
            self._local_readers(fingerprint, headers, data),
        )

    def _local_readers(
        self, fingerprint: str, headers: Any, data: dict[str, Any]
    ) -> dict[str, LocalChunkReader] | None:
        if not (self.direct_reads and parse_location(self.location).is_local):
            return None
        arrays = {"headers": (headers, "headers")}
        arrays |= {f: (a, f"data/{f}") for f, a in data.items()}
        if not all(LocalChunkReader.supports(a) for a, _ in arrays.values()):
            return None
        base = os.path.join(local_path(self.location), fingerprint)
        return {
            name: LocalChunkReader(os.path.join(base, *path.split("/")), array)
            for name, (array, path) in arrays.items()
        }

    @staticmethod
    def _check_offsets(where: str, name: str, offsets: np.ndarray, n: int, total: int) -> None:
        if (
            offsets.dtype != np.int64
            or offsets.shape != (n + 1,)
            or offsets[0] != 0
            or offsets[-1] != total
            or np.any(np.diff(offsets) < 0)
        ):
            raise CorruptRecord(
                where, f"array {name!r} does not index {n} records over {total} rows"
            )

    # -- reading records ---------------------------------------------------------------
    def _locate(self, key: str) -> tuple[_Snapshot, int] | None:
        if (
            not isinstance(key, str)
            or len(key) <= FINGERPRINT_HEX_CHARS + 1
            or key[FINGERPRINT_HEX_CHARS] != "/"
        ):
            return None
        fingerprint, sample_id = key[:FINGERPRINT_HEX_CHARS], key[FINGERPRINT_HEX_CHARS + 1 :]
        if not is_fingerprint(fingerprint):
            return None
        snap = self._snapshot(fingerprint)
        if snap is None:
            return None
        row = snap.row(sample_id)
        return None if row is None else (snap, row)

    def _read_values(
        self, located: Sequence[tuple[str, _Snapshot, int]], fields: Iterable[str] | None
    ) -> list[bytearray | CorruptRecord]:
        """Record values of ``(key, snapshot, row)``, rebuilt from the arrays (local
        snapshots: from the chunk files directly; others: one batch of concurrent reads
        on zarr's IO loop). Fields not in ``fields`` are left zero (not read); each entry
        is the value or the ``CorruptRecord`` that stopped it."""
        wanted = None if fields is None else set(fields)
        plan = [
            (key, snap, row, [f for f in snap.fields if wanted is None or f in wanted])
            for key, snap, row in located
        ]
        if all(snap.local is not None for _, snap, _, _ in plan):
            results = iter(self._read_local(plan))
        else:
            results = iter(_run(_gather(self._read_calls(plan))) if plan else [])
        return [
            self._join_record(key, snap, row, names, [next(results) for _ in range(len(names) + 1)])
            for key, snap, row, names in plan
        ]

    @staticmethod
    def _read_calls(plan: list[tuple[str, _Snapshot, int, list[str]]]) -> list[Any]:
        calls = []
        for _, snap, row, names in plan:
            h = snap.header_offsets
            calls.append(snap.headers.getitem(slice(int(h[row]), int(h[row + 1]))))
            for f in names:
                o = snap.field_offsets[f]
                calls.append(snap.data[f].getitem(slice(int(o[row]), int(o[row + 1]))))
        return calls

    @staticmethod
    def _read_local(plan: list[tuple[str, _Snapshot, int, list[str]]]) -> list[Any]:
        out: list[Any] = []
        for _, snap, row, names in plan:
            local = snap.local
            assert local is not None
            for name in ["headers", *names]:
                o = snap.header_offsets if name == "headers" else snap.field_offsets[name]
                try:
                    out.append(local[name].rows(int(o[row]), int(o[row + 1])))
                except ValueError as exc:
                    out.append(exc)
        return out

    @staticmethod
    def _join_record(
        key: str, snap: _Snapshot, row: int, names: list[str], parts: list[Any]
    ) -> bytearray | CorruptRecord:
        for what, part in zip(["headers", *(f"data/{n}" for n in names)], parts, strict=True):
            if isinstance(part, BaseException):
                if isinstance(part, _READ_ERRORS):
                    return CorruptRecord(key, f"cannot read {snap.fingerprint}/{what}: {part}")
                raise part
        text = np.asarray(parts[0]).tobytes()
        try:
            header = parse_stored_header(text, snap.data_len(row), key=key)
        except CorruptRecord as exc:
            return exc
        value = bytearray(header.data_start + snap.data_len(row))  # unread fields stay zero
        value[: HEADER_LENGTH.size] = HEADER_LENGTH.pack(len(text))
        value[HEADER_LENGTH.size : header.data_start] = text
        target = np.frombuffer(value, dtype=np.uint8)  # writable view of value
        for name, part in zip(names, parts[1:], strict=True):
            raw = np.ascontiguousarray(part).view(np.uint8).reshape(-1)
            info = header.tensors.get(name)
            if info is None or info.end - info.begin != raw.size:
                return CorruptRecord(key, f"field {name!r} does not fit the stored header")
            target[info.begin : info.end] = raw
        return value

    def _values(
        self, located: Sequence[tuple[str, _Snapshot, int]], fields: Iterable[str] | None
    ) -> list[bytearray]:
        out = []
        for value in self._read_values(located, fields):
            if isinstance(value, CorruptRecord):
                raise value
            out.append(value)
        return out

    def _drop_replaced(self) -> bool:
        """Forget this process's opened fingerprints whose group has been exported again
        (another writer token) or removed since they were opened; True if any was."""
        stale = []
        for fingerprint, snap in list(self._snapshots.items()):
            found = self._open_group(fingerprint)
            if found is None or found[1].get("writer") != snap.attrs.get("writer"):
                stale.append(fingerprint)
        for fingerprint in stale:
            log.info(
                "%s: fingerprint %s was exported again; re-opening it", self.location, fingerprint
            )
            self._snapshots.pop(fingerprint, None)
        return bool(stale)

    def _read_checked(self, action: Any) -> Any:
        """Run ``action()``; if a record reads as corrupt because its fingerprint was
        re-exported under this reader (``overwrite``), re-open and run it once more."""
        try:
            return action()
        except CorruptRecord:
            if not self._drop_replaced():
                raise
        return action()

    def get(self, key: str) -> bytes:
        def read() -> bytes:
            value = self._values(self._located([key]), None)[0]
            check_record(value, key=key, lookup=self.descriptor)
            return bytes(value)

        return self._read_checked(read)

    def supply(
        self, keys: list[str], fields: list[str] | None, decoder: RecordDecoder
    ) -> list[Record]:
        def read() -> list[Record]:
            located = self._located(keys)
            if located and all(snap.local is not None for _, snap, _ in located):
                return self._decode_local(located, decoder)
            return decoder.values(self._values(located, fields))

        return self._read_checked(read)

    @staticmethod
    def _decode_local(
        located: Sequence[tuple[str, _Snapshot, int]], decoder: RecordDecoder
    ) -> list[Record]:
        """Records of a local snapshot decoded straight from its chunk files: each field's
        rows are read into the tensors' own storage (no record value is assembled), then
        verified against the stored header's checksums like any read."""
        headers = []
        for key, snap, row in located:
            local = snap.local
            assert local is not None
            h = snap.header_offsets
            try:
                text = local["headers"].rows(int(h[row]), int(h[row + 1])).tobytes()
            except _READ_ERRORS as exc:
                raise CorruptRecord(key, f"cannot read {snap.fingerprint}/headers: {exc}") from None
            headers.append(parse_stored_header(text, snap.data_len(row), key=key))

        def fill(j: int, name: str, info: Any, out: memoryview) -> None:
            key, snap, row = located[j]
            reader = snap.local.get(name) if snap.local is not None else None
            if reader is None:
                raise CorruptRecord(key, f"field {name!r} is not in snapshot {snap.fingerprint}")
            o = snap.field_offsets[name]
            try:
                reader.read_into(int(o[row]), int(o[row + 1]), out)
            except _READ_ERRORS as exc:
                raise CorruptRecord(
                    key, f"cannot read {snap.fingerprint}/data/{name}: {exc}"
                ) from None

        return decoder.filled(headers, fill)

    def _located(self, keys: Sequence[str]) -> list[tuple[str, _Snapshot, int]]:
        located = []
        for key in keys:
            found = self._locate(key)
            if found is None:
                raise RecordNotFound(key, self.location)
            located.append((key, *found))
        return located

    def has(self, key: str) -> bool:
        return self._locate(key) is not None

    def keys(self, prefix: str = "") -> Iterator[str]:
        for fingerprint in self.fingerprints():
            head = fingerprint + "/"
            if not (head.startswith(prefix) or prefix.startswith(head)):
                continue
            snap = self._snapshot(fingerprint)
            if snap is None:
                continue
            id_prefix = prefix[len(head) :] if prefix.startswith(head) else ""
            start = int(np.searchsorted(snap.sorted_ids, id_prefix)) if id_prefix else 0
            for sample_id in snap.sorted_ids[start:].tolist():
                if not sample_id.startswith(id_prefix):
                    break
                yield head + sample_id

    def load_descriptor(self, fingerprint: str, digest: str) -> str | None:
        """From the snapshot's ``descriptors`` attribute (checked against ``digest`` when
        used, like a descriptor from any store)."""
        snap = self._snapshot(fingerprint)
        found = None if snap is None else snap.attrs.get("descriptors", {})
        text = found.get(digest) if isinstance(found, dict) else None
        return text if isinstance(text, str) else None

    # -- indexes -----------------------------------------------------------------------
    def fingerprints(self) -> list[str]:
        found = []
        for name in self._child_names():
            entry = self._open_group(name)
            if entry is not None and entry[1].get("complete"):
                found.append(name)
        return found

    def incomplete_fingerprints(self) -> list[str]:
        """Fingerprint groups present but not marked complete (an export that did not
        finish writing to an object store)."""
        out = []
        for name in self._child_names():
            entry = self._open_group(name)
            if entry is not None and not entry[1].get("complete"):
                out.append(name)
        return out

    def get_index(self, fingerprint: str) -> DatasetIndex:
        validate_fingerprint(fingerprint)
        snap = self._snapshot(fingerprint)
        if snap is None:
            raise self.index_missing(fingerprint)
        attrs = snap.attrs
        try:
            # The ids were checked against their digest when the snapshot was opened.
            return DatasetIndex.from_trusted(
                fingerprint,
                attrs["recipe"],
                int(attrs["recipe_version"]),
                dict(attrs["params"]),
                snap.sample_ids,
                str(attrs.get("index_created", "")),
            )
        except (KeyError, TypeError, ValueError, SpcacheError) as exc:
            raise CorruptRecord(f"index:{fingerprint}", f"bad snapshot attributes: {exc}") from None

    # -- conveniences done natively ----------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Records and record bytes per fingerprint (from the snapshot's attributes)."""
        per_fp: dict[str, dict[str, Any]] = {}
        for fingerprint in self.fingerprints():
            entry = self._open_group(fingerprint)
            attrs = entry[1] if entry else {}
            per_fp[fingerprint] = {
                "records": int(attrs.get("samples", 0)),
                "bytes": int(attrs.get("record_bytes", 0)),
                "exported": attrs.get("exported", ""),
            }
        out = self._finish_stats(per_fp)
        out["zarr"] = {"incomplete": self.incomplete_fingerprints()}
        return out

    def verify(self, fingerprint: str | None = None) -> VerifyReport:
        """Read and check every record (every chunk of every field), never raising for
        bad data: unreadable chunks (CRC mismatch), records whose checksums fail, index
        arrays that do not match their digests and unfinished exports are reported."""
        report = VerifyReport()
        if fingerprint is None:
            targets = self.fingerprints()
            for fp in self.incomplete_fingerprints():
                report.corrupt[f"index:{fp}"] = "export did not finish (group not complete)"
        else:
            targets = [validate_fingerprint(fingerprint)]
        for fp in targets:
            try:
                snap = self._snapshot(fp)
            except CorruptRecord as exc:
                report.corrupt[f"index:{fp}"] = exc.reason
                log.warning("verify: %s", exc)
                continue
            if snap is not None:
                self._verify_snapshot(snap, report)
        return report

    def _verify_snapshot(self, snap: _Snapshot, report: VerifyReport) -> None:
        fp = snap.fingerprint
        checksums: list[str] = []
        n = len(snap.sample_ids)
        for start in range(0, n, VERIFY_BATCH):
            rows = range(start, min(n, start + VERIFY_BATCH))
            keys = [f"{fp}/{snap.sample_ids[r]}" for r in rows]
            values = self._read_values(
                [(k, snap, r) for k, r in zip(keys, rows, strict=True)], None
            )
            for key, value in zip(keys, values, strict=True):
                report.checked += 1
                try:
                    if isinstance(value, CorruptRecord):
                        raise value
                    checksums.append(check_record(value, key=key, lookup=self.descriptor).checksum)
                except CorruptRecord as exc:
                    report.corrupt[key] = exc.reason
                    log.warning("verify: %s", exc)
        expected = snap.attrs.get("records_digest")
        if len(checksums) == n and records_digest(checksums) != expected:
            report.corrupt[f"index:{fp}"] = "records digest does not match the records"
        try:
            index = self.get_index(fp)
            if compute_fingerprint(index.recipe, index.recipe_version, index.params) != fp:
                report.corrupt[f"index:{fp}"] = "recipe and params do not give the fingerprint"
        except (CorruptRecord, ValueError) as exc:
            report.corrupt[f"index:{fp}"] = str(exc)
