"""ZarrStore: a read-only store over a Zarr v3 snapshot written by ``spcache export``.

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
that attribute last (see :mod:`cache_store.snapshot.zarr.publish`).

The groups and their reads are :mod:`cache_store.snapshot.zarr.group`'s; the layout rule
is :mod:`cache_store.snapshot.zarr.format`'s.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from cache_store.errors import CorruptRecord, ReadOnlyStoreError, RecordNotFound, SpcacheError
from cache_store.format.decode import Record, check_record
from cache_store.format.index import DatasetIndex
from cache_store.keys import (
    FINGERPRINT_HEX_CHARS,
    compute_fingerprint,
    is_fingerprint,
    split_record_id,
    validate_fingerprint,
    variant_counts,
)
from cache_store.location import local_path, parse_location
from cache_store.process_local import ProcessLocal
from cache_store.snapshot.zarr.format import ATTRS_KEY, records_digest
from cache_store.snapshot.zarr.group import (
    Located,
    OpenedGroup,
    OpenedRoot,
    decode_local,
    load_group,
    open_root,
    read_values,
    run,
    values_of,
)
from cache_store.stores.base import BlockLayout, RecordDecoder, Store, VerifyReport

__all__ = ["ZarrStore"]

log = logging.getLogger(__name__)

#: Records read per batch by :meth:`ZarrStore.verify`.
VERIFY_BATCH = 64


class ZarrStore(Store):
    """Records of a Zarr v3 snapshot, read-only (see the module doc).

    ``supports_writes`` is False: writes raise ``ReadOnlyStoreError``.

    Args:
        location: a ``*.zarr`` path, ``file://`` URL or fsspec URL (``s3://``, ``gs://``,
            ``memory://`` ...).
        readonly: must be True: snapshots are written by :func:`cache_store.snapshot.zarr.export.
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
        self._opened: ProcessLocal[OpenedRoot] = ProcessLocal(
            functools.partial(open_root, self.location, self.storage_options)
        )

    # -- opening -----------------------------------------------------------------------
    def _group(self) -> Any:
        """The root group, opened in this process."""
        return self._opened.get().root

    @property
    def _snapshots(self) -> dict[str, OpenedGroup]:
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

        return sorted(name for name in run(listing()) if is_fingerprint(name))

    def _open_group(self, fingerprint: str) -> tuple[Any, dict[str, Any]] | None:
        """(group, attrs) of a fingerprint group, or None when absent."""
        root = self._group()
        try:
            group = root[fingerprint]
        except (KeyError, FileNotFoundError):
            return None
        attrs = group.attrs.get(ATTRS_KEY)
        return group, attrs if isinstance(attrs, dict) else {}

    def _snapshot(self, fingerprint: str) -> OpenedGroup | None:
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
        local_dir = None
        if self.direct_reads and parse_location(self.location).is_local:
            local_dir = os.path.join(local_path(self.location), fingerprint)
        snap = load_group(fingerprint, group, attrs, local_dir)
        self._snapshots[fingerprint] = snap
        return snap

    # -- reading records ---------------------------------------------------------------
    def _locate(self, key: str) -> tuple[OpenedGroup, int] | None:
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
            value = values_of(self._located([key]), None)[0]
            check_record(value, key=key, lookup=self.descriptor)
            return bytes(value)

        return self._read_checked(read)

    def supply(
        self, keys: list[str], fields: list[str] | None, decoder: RecordDecoder
    ) -> list[Record]:
        def read() -> list[Record]:
            located = self._located(keys)
            if located and all(snap.local is not None for _, snap, _ in located):
                return decode_local(located, decoder)
            return decoder.values(values_of(located, fields))

        return self._read_checked(read)

    def _located(self, keys: Sequence[str]) -> list[Located]:
        located = []
        for key in keys:
            found = self._locate(key)
            if found is None:
                raise RecordNotFound(key, self.location)
            located.append((key, *found))
        return located

    def block_layout(self, fingerprint: str, sample_ids: Sequence[str]) -> BlockLayout | None:
        """Chunk ranges: a read fetches (and decompresses) whole chunks, most of them of
        the field with the most bytes, so a sample's block is the chunk of that field's
        data its first row lies in (``"<field>/<chunk>"``); an id not in the snapshot
        gets a block of its own, named ``""``."""
        snap = self._snapshot(fingerprint)
        if snap is None or not snap.fields:
            return None
        field = max(snap.fields, key=lambda f: int(snap.field_offsets[f][-1]) * snap.row_bytes[f])
        rows_per_chunk = max(int(snap.data[field].chunks[0]), 1)
        wanted = np.array(list(sample_ids), dtype=str)
        at = np.searchsorted(snap.sorted_ids, wanted)
        found = at < len(snap.sorted_ids)
        found[found] = snap.sorted_ids[at[found]] == wanted[found]
        chunk = snap.field_offsets[field][snap.order[np.where(found, at, 0)]] // rows_per_chunk
        labels = [f"{field}/{c}" if ok else "" for c, ok in zip(chunk.tolist(), found, strict=True)]
        return BlockLayout.of_labels(labels)

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
            ids, counts = snap.sample_ids, None
            if any(split_record_id(rid)[1] for rid in ids.tolist()):  # variants' rows (a1#v3)
                found = variant_counts(ids.tolist())
                ids = np.array(list(found), dtype=str)
                counts = np.array(list(found.values()), dtype=np.uint16)
            return DatasetIndex.from_trusted(
                fingerprint,
                attrs["recipe"],
                int(attrs["recipe_version"]),
                dict(attrs["params"]),
                ids,
                str(attrs.get("index_created", "")),
                counts,
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

    def _verify_snapshot(self, snap: OpenedGroup, report: VerifyReport) -> None:
        fp = snap.fingerprint
        checksums: list[str] = []
        n = len(snap.sample_ids)
        for start in range(0, n, VERIFY_BATCH):
            rows = range(start, min(n, start + VERIFY_BATCH))
            keys = [f"{fp}/{snap.sample_ids[r]}" for r in rows]
            values = read_values([(k, snap, r) for k, r in zip(keys, rows, strict=True)], None)
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
