"""Sharded snapshots: many writers (one per GPU) append committed parts; readers see only
committed ones; one index is merged from the parts' manifests.

Layout, on a shared file system or any fsspec URL (``s3://bucket/prefix.zarr``)::

    DEST.zarr/
      spcache-sharded.json            root marker: {"kind": "spcache.sharded_root", ...}
      <fingerprint>/
        parts/<part>.bin              records (safetensors values) back to back
        commits/<part>.json           the part's manifest; its existence is the commit
        index.json                    merged index (optional; rewritten by ``merge``)

A writer writes ``parts/<part>.bin`` in full (a multipart upload on S3), then creates
``commits/<part>.json`` only if it does not exist (``If-None-Match: *`` on S3, a hard
link on a file system): a part without a manifest is never read, so a writer that dies
mid-part leaves an orphan, never half a dataset. Part names carry the writer's shard and
attempt and a random suffix (``s00012-a1-p0003-9f2c51d0``), so two attempts of one shard
never overwrite each other. A sample committed twice is read, in commit order
(``committed_at``, then part name), from its first commit while the source hash is the
same (a retry after an unreported commit: the other copy is ignored), and from the later
commit when the source hash differs (the source changed and was recomputed: it takes the
earlier one's place in the order).

A manifest lists, per record: sample id, offset, length, record checksum and source
hash; and ``descriptors``, the text of every descriptor its records name (by digest:
:mod:`cache_store.format.descriptor`), committed with them; ``index.json`` keeps those of
the manifests it merged. Readers list ``commits/`` (one LIST), read ``index.json`` and the manifests it
does not already include, and read a record by a range request into its part, checked
against its manifest (checksum, key) as any record is. The driver of a run merges the
manifests into ``index.json`` periodically and at the end; ``spcache merge`` does the
same by hand (idempotent). The dataset's order is the index's, then what was committed
after it, in commit order. A damaged ``index.json`` is read around (a warning; the
manifests rebuild the dataset, in commit order) and ``merge`` writes it again; a damaged
manifest's records are not read. Both are reported by ``verify`` as corrupt, by name.

Nothing is deleted on a failure path: :func:`orphan_parts` lists parts with no manifest
and the temporary files of a write cut short (older than a grace period, so nothing
still being written is taken), and ``spcache merge --remove-orphans`` deletes them.

Why one module: the sharded layout's writer, reader, merge and orphan sweep must agree
on every name and on the commit rule; kept together so they cannot drift apart.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from cache_store.errors import (
    CorruptRecord,
    FingerprintLookupError,
    InvalidSampleId,
    ParameterError,
    RecordNotFound,
    SpcacheError,
    UnsupportedFormat,
)
from cache_store.format.decode import Record, check_record
from cache_store.format.descriptor import (
    Descriptor,
    DescriptorLookup,
    bind_metadata,
    is_digest,
)
from cache_store.format.header import read_header
from cache_store.keys import (
    compute_fingerprint,
    is_fingerprint,
    split_key,
    validate_fingerprint,
    validate_sample_id,
)
from cache_store.location import parse_location
from cache_store.process_local import ProcessLocal
from cache_store.recipes.specs import get_recipe_spec
from cache_store.format.index import DatasetIndex
from cache_store.stores.base import RecordDecoder, Store, VerifyReport

__all__ = [
    "ROOT_MARKER",
    "ShardedSnapshot",
    "is_sharded",
    "merge",
    "orphan_parts",
]

log = logging.getLogger(__name__)

ROOT_MARKER = "spcache-sharded.json"
ROOT_KIND = "spcache.sharded_root"
COMMIT_KIND = "spcache.shard_commit"
INDEX_KIND = "spcache.sharded_index"
FORMAT_VERSION = 1
#: A part without a manifest younger than this may still be being written.
DEFAULT_ORPHAN_GRACE_S = 3600.0
#: A key not found is looked for again in a fresh listing at most this often (seconds).
MISS_RELIST_S = 1.0
#: S3 multipart part size for large parts (S3's minimum is 5 MiB).
MULTIPART_CHUNK = 16 * 1024 * 1024


class CommitConflict(SpcacheError):
    """A manifest of that name is already committed (a second attempt of one part)."""


@dataclass(frozen=True)
class Entry:
    """Where one committed record lies."""

    part: str
    offset: int
    length: int
    checksum: str
    source_hash: str


@dataclass
class _Dataset:
    """What a reader knows of one fingerprint: committed entries and their order."""

    recipe: str | None  # None until a record or the driver says what was computed
    recipe_version: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    entries: dict[str, Entry] = field(default_factory=dict)
    parts_seen: set[str] = field(default_factory=set)
    created: str = ""
    descriptors: dict[str, str] = field(default_factory=dict)  # digest -> text

    def admit(self, sample_id: str, entry: Entry) -> None:
        """Take a committed entry, given in commit order. A sample id seen before keeps
        its first entry while the source hash is the same (two attempts of one shard:
        the first committed wins), and takes the later one, in the same place of the
        order, when its source hash differs (the source changed and was recomputed)."""
        known = self.entries.get(sample_id)
        if known is None:
            self.entries[sample_id] = entry
            self.order.append(sample_id)
        elif known.source_hash != entry.source_hash:
            self.entries[sample_id] = entry


@dataclass
class _Problems:
    """What of one fingerprint could not be read at the last listing."""

    index: str | None = None  # why index.json was read around, if it was
    commits: dict[str, str] = field(default_factory=dict)  # part -> why its manifest was not


# -- file-system access ----------------------------------------------------------------
def _open_fs(location: str, storage_options: Mapping[str, Any]) -> tuple[Any, str]:
    import fsspec

    parsed = parse_location(location)
    if parsed.is_local:
        return fsspec.filesystem("file"), os.path.abspath(parsed.target)
    fs, root = fsspec.core.url_to_fs(
        parsed.target, skip_instance_cache=True, **dict(storage_options)
    )
    return fs, root.rstrip("/")


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol
    return "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))


def _write_temporary(directory: str, data: bytes) -> str:
    """``data`` in a new temporary file of ``directory``, on disk (fsynced); its path."""
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_local_exclusive(path: str, data: bytes) -> None:
    """Create ``path`` with ``data`` durably, failing if it exists (never overwriting)."""
    directory = os.path.dirname(path)
    tmp = _write_temporary(directory, data)
    try:
        os.link(tmp, path)  # atomic, and refuses an existing name
    except FileExistsError:
        raise CommitConflict(f"{path}: already committed") from None
    finally:
        os.unlink(tmp)
    _fsync_directory(directory)


def _write_local(path: str, data: bytes) -> None:
    """Write ``path`` durably (a temporary name, fsync, rename)."""
    directory = os.path.dirname(path)
    os.replace(_write_temporary(directory, data), path)
    _fsync_directory(directory)


def _loads(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptRecord(what, f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CorruptRecord(what, "not a JSON object")
    return value


def _parse_manifest(
    raw: bytes, fingerprint: str, part: str
) -> tuple[dict[str, Any], list[tuple[str, Entry]]]:
    what = f"{fingerprint}/commits/{part}.json"
    doc = _loads(raw, what)
    if doc.get("kind") != COMMIT_KIND:
        raise CorruptRecord(what, f"kind {doc.get('kind')!r} is not {COMMIT_KIND!r}")
    if doc.get("format_version") != FORMAT_VERSION:
        raise UnsupportedFormat(
            what,
            f"format_version {doc.get('format_version')!r}; this spcache reads {FORMAT_VERSION}",
        )
    if doc.get("fingerprint") != fingerprint or doc.get("part") != part:
        raise CorruptRecord(what, "names another fingerprint or part")
    size = doc.get("data_size")
    records = doc.get("records")
    if not isinstance(size, int) or size < 0 or not isinstance(records, list):
        raise CorruptRecord(what, "data_size or records missing")
    entries = []
    for row in records:
        if (
            not isinstance(row, list)
            or len(row) != 5
            or not isinstance(row[0], str)
            or not isinstance(row[1], int)
            or not isinstance(row[2], int)
            or not isinstance(row[3], str)
            or not isinstance(row[4], str)
        ):
            raise CorruptRecord(what, f"malformed record entry {row!r:.80}")
        sample_id, offset, length, checksum, source_hash = row
        if offset < 0 or length <= 0 or offset + length > size:
            raise CorruptRecord(
                what,
                f"{sample_id}: bytes [{offset}, {offset + length}) lie "
                f"outside the part's {size} bytes",
            )
        try:
            sample_id = validate_sample_id(sample_id)
        except InvalidSampleId as exc:
            raise CorruptRecord(what, str(exc)) from None
        entries.append((sample_id, Entry(part, offset, length, checksum, source_hash)))
    _descriptor_texts(doc, what)
    return doc, entries


def _descriptor_texts(doc: Mapping[str, Any], what: str) -> dict[str, str]:
    """A manifest's or index's ``descriptors`` (digest -> text; absent before format 2),
    their shape checked (each text is checked against its digest when it is used)."""
    found = doc.get("descriptors", {})
    if not isinstance(found, dict) or not all(
        is_digest(d) and isinstance(t, str) for d, t in found.items()
    ):
        raise CorruptRecord(what, "malformed descriptors")
    return found


def _commit_order(doc: Mapping[str, Any], part: str) -> tuple[str, str]:
    return (str(doc.get("committed_at", "")), part)


def _describe_from_metadata(meta: Mapping[str, str], fingerprint: str) -> dict[str, Any] | None:
    """recipe, version and parameters as the record names them (records written by the
    engine carry their parameters). A record without parameters is described only when
    its recipe's defaults give its fingerprint (the fingerprint proves them); else None."""
    try:
        recipe, version = meta["recipe"], int(meta["recipe_version"])
        if "params" in meta:
            return {
                "recipe": recipe,
                "recipe_version": version,
                "params": json.loads(meta["params"]),
            }
        spec = get_recipe_spec(recipe)
        params = spec.resolve({})
        if spec.version == version and compute_fingerprint(recipe, version, params) == fingerprint:
            return {"recipe": recipe, "recipe_version": version, "params": dict(params)}
    except (KeyError, ValueError, SpcacheError):
        pass
    return None


# -- the store --------------------------------------------------------------------------
class ShardedSnapshot(Store):
    """A sharded snapshot (see the module doc) as a :class:`Store`.

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
        self._fs = ProcessLocal(lambda: _open_fs(self.location, self.storage_options))
        self._datasets: dict[str, _Dataset] = {}
        self._listed_at: dict[str, float] = {}  # fingerprint -> when commits were last listed
        self._problems: dict[str, _Problems] = {}  # fingerprint -> what could not be read
        self._lock = threading.Lock()

    # -- paths ----------------------------------------------------------------------
    @property
    def fs(self) -> Any:
        return self._fs.get()[0]

    @property
    def root(self) -> str:
        return self._fs.get()[1]

    def _path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            if start is None:
                return bytes(self.fs.cat_file(path))
            return bytes(self.fs.cat_file(path, start=start, end=end))
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise CorruptRecord(path, f"cannot be read ({exc})") from exc

    def _write_once(self, path: str, data: bytes) -> None:
        if _is_local(self.fs):
            _write_local_exclusive(path, data)
            return
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            raise CommitConflict(f"{path}: already committed") from None
        except Exception as exc:  # botocore's PreconditionFailed when not translated
            if "PreconditionFailed" in repr(exc) or "412" in str(exc):
                raise CommitConflict(f"{path}: already committed") from None
            raise

    def _write(self, path: str, data: bytes) -> None:
        if _is_local(self.fs):
            _write_local(path, data)
        elif len(data) > 2 * MULTIPART_CHUNK:
            self.fs.pipe_file(path, data, chunksize=MULTIPART_CHUNK)
        else:
            self.fs.pipe_file(path, data)

    def _ensure_root(self) -> None:
        marker = self._path(ROOT_MARKER)
        if self.fs.exists(marker):
            return
        body = json.dumps({"kind": ROOT_KIND, "format_version": FORMAT_VERSION}).encode()
        with contextlib.suppress(CommitConflict):  # another writer made it
            self._write_once(marker, body)

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
        return len(checked)

    def _commit_part(
        self, fingerprint: str, group: list[tuple[str, bytes]], descriptors: dict[str, Descriptor]
    ) -> str:
        self._parts_written += 1
        part = f"{self.writer}-p{self._parts_written:04d}-{uuid.uuid4().hex[:8]}"
        rows, offset, chunks = [], 0, []
        for key, value in group:
            meta = read_header(value, key=key).metadata
            rows.append(
                [
                    split_key(key)[1],
                    offset,
                    len(value),
                    meta["checksum"],
                    meta.get("source_hash", ""),
                ]
            )
            chunks.append(value)
            offset += len(value)
        data = b"".join(chunks)
        self._write(self._path(fingerprint, "parts", f"{part}.bin"), data)
        first = bind_metadata(
            read_header(group[0][1], key=group[0][0]).metadata,
            group[0][0],
            lambda _, digest: descriptors[digest],
        )
        manifest = {
            "kind": COMMIT_KIND,
            "format_version": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "part": part,
            "data_size": len(data),
            "data_xxh3": xxhash.xxh3_64_hexdigest(data),
            "committed_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds"),
            "writer": {"host": socket.gethostname(), "pid": os.getpid(), "label": self.writer},
            "dataset": _describe_from_metadata(first, fingerprint),
            "records": rows,
            "descriptors": {d.digest: d.text for d in descriptors.values()},
        }
        self._write_once(
            self._path(fingerprint, "commits", f"{part}.json"),
            json.dumps(manifest, separators=(",", ":")).encode(),
        )
        return part

    def put_index(self, index: DatasetIndex) -> None:
        """Merge the committed manifests into ``index.json``: ``index``'s ids first (those
        committed), then every other committed id in commit order."""
        self.check_writable()
        self._ensure_root()
        merge_into(
            self,
            index.fingerprint,
            order=index.sample_ids.tolist(),
            describe={
                "recipe": index.recipe,
                "recipe_version": index.recipe_version,
                "params": dict(index.params),
            },
        )

    # -- reading ----------------------------------------------------------------------
    def _commit_names(self, fingerprint: str) -> list[str]:
        try:
            # refresh: s3fs caches listings, and a reader must see commits made since
            names = self.fs.ls(self._path(fingerprint, "commits"), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        parts = []
        for name in names:
            base = str(name).rstrip("/").rsplit("/", 1)[-1]
            if base.endswith(".json") and not base.startswith("."):
                parts.append(base[: -len(".json")])
        return sorted(parts)

    def _load(
        self, fingerprint: str, *, refresh: bool = False, describe: Mapping[str, Any] | None = None
    ) -> _Dataset | None:
        with self._lock:
            known = self._datasets.get(fingerprint)
            if known is not None and not refresh:
                return known
        dataset = known
        problems = self._problems.setdefault(fingerprint, _Problems())
        if dataset is None:
            dataset = self._read_index(fingerprint, problems)
        new = [
            p
            for p in self._commit_names(fingerprint)
            if dataset is None or p not in dataset.parts_seen
        ]
        docs = []
        unreadable: dict[str, str] = {}
        for part in new:
            try:
                raw = self._read(self._path(fingerprint, "commits", f"{part}.json"))
                docs.append(_parse_manifest(raw, fingerprint, part) + (part,))
            except FileNotFoundError:
                continue
            except CorruptRecord as exc:  # UnsupportedFormat too
                unreadable[part] = exc.reason
                if problems.commits.get(part) != exc.reason:  # once, not at every listing
                    log.warning("%s: commit %s ignored: %s", self.location, part, exc)
        # A part not read again was read before (it is in the dataset): only the parts
        # listed as new can still be unreadable.
        problems.commits = unreadable
        docs.sort(key=lambda d: _commit_order(d[0], d[2]))
        if dataset is None:
            described = [d[0]["dataset"] for d in docs if isinstance(d[0].get("dataset"), dict)]
            if describe is not None and docs:
                described.insert(0, dict(describe))
            if not docs:
                with self._lock:  # nothing committed yet: a lookup lists again in a second
                    self._listed_at[fingerprint] = time.monotonic()
                return None
            if not described:
                described = [{"recipe": None}]  # records readable, index not yet
            try:
                dataset = _Dataset(**described[0], created=str(docs[0][0].get("committed_at", "")))
            except TypeError as exc:
                raise CorruptRecord(
                    f"{fingerprint}/commits", f"malformed dataset description ({exc})"
                ) from None
        for doc, entries, part in docs:
            described_here = doc.get("dataset")
            if dataset.recipe is None and isinstance(described_here, dict):
                try:
                    dataset.recipe = str(described_here["recipe"])
                    dataset.recipe_version = int(described_here["recipe_version"])
                    dataset.params = dict(described_here["params"])
                except (KeyError, TypeError, ValueError):
                    log.warning(
                        "%s: commit %s has a malformed dataset description", self.location, part
                    )
            dataset.parts_seen.add(part)
            dataset.descriptors.update(doc.get("descriptors", {}))  # checked by _parse_manifest
            for sample_id, entry in entries:
                dataset.admit(sample_id, entry)
        with self._lock:
            self._datasets[fingerprint] = dataset
            self._listed_at[fingerprint] = time.monotonic()
        return dataset

    def _read_index(self, fingerprint: str, problems: _Problems) -> _Dataset | None:
        """The dataset ``index.json`` holds, or None: none yet, or one that cannot be
        read (noted in ``problems``; the manifests then rebuild it, and ``merge``
        writes it again)."""
        what = f"{fingerprint}/index.json"
        try:
            raw = self._read(self._path(fingerprint, "index.json"))
        except FileNotFoundError:
            problems.index = None
            return None
        try:
            dataset = _dataset_from_index(fingerprint, _loads(raw, what))
        except CorruptRecord as exc:  # UnsupportedFormat too
            if problems.index != exc.reason:
                log.warning(
                    "%s: %s; its committed manifests are read instead (spcache merge "
                    "writes it again)",
                    self.location,
                    exc,
                )
            problems.index = exc.reason
            return None
        problems.index = None
        return dataset

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

    def get(self, key: str) -> bytes:
        entry = self._entry(key)
        if entry is None:
            raise RecordNotFound(key, self.location)
        fingerprint = split_key(key)[0]
        path = self._path(fingerprint, "parts", f"{entry.part}.bin")
        try:
            value = self._read(path, entry.offset, entry.offset + entry.length)
        except FileNotFoundError:
            raise CorruptRecord(key, f"its committed part {entry.part}.bin is missing") from None
        return _checked(value, key, entry, self.descriptor)

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """Values of ``keys`` (range reads grouped per request batch)."""
        located = []
        for key in keys:
            entry = self._entry(key)
            if entry is None:
                raise RecordNotFound(key, self.location)
            located.append((key, entry))
        paths = [self._path(split_key(k)[0], "parts", f"{e.part}.bin") for k, e in located]
        starts = [e.offset for _, e in located]
        ends = [e.offset + e.length for _, e in located]
        values = self.fs.cat_ranges(paths, starts, ends)
        out = []
        for (key, entry), value in zip(located, values, strict=True):
            if isinstance(value, BaseException):
                raise CorruptRecord(key, f"cannot be read ({value})")
            out.append(_checked(bytes(value), key, entry, self.descriptor))
        return out

    def supply(
        self, keys: list[str], fields: list[str] | None, decoder: RecordDecoder
    ) -> list[Record]:
        # the values, range reads grouped; the base's decoder decodes and key-checks them
        return decoder.values(self.get_many(keys))

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

    def keys(self, prefix: str = "") -> Iterator[str]:
        found = []
        for fingerprint in self._fingerprint_dirs():
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

    def _fingerprint_dirs(self) -> list[str]:
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
        for fingerprint in self._fingerprint_dirs():
            dataset = self._load(fingerprint)
            if dataset is not None and dataset.recipe is not None:
                found.append(fingerprint)
        return found

    def get_index(self, fingerprint: str) -> DatasetIndex:
        validate_fingerprint(fingerprint)
        dataset = self._load(fingerprint, refresh=True)
        if dataset is None or dataset.recipe is None:
            raise self.index_missing(fingerprint)
        return DatasetIndex(
            fingerprint,
            dataset.recipe,
            dataset.recipe_version,
            dataset.params,
            np.array(dataset.order, dtype=str),
            created=dataset.created,
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
        for fp in [fingerprint] if fingerprint is not None else self._fingerprint_dirs():
            for name, reason in self.unreadable(fp).items():
                report.corrupt[name] = f"cannot be read ({reason})"
                log.warning("verify: %s: %s", name, reason)

    def close(self) -> None:
        self.refresh()
        self._fs.close()


def _checked(value: bytes, key: str, entry: Entry, lookup: DescriptorLookup) -> bytes:
    header = read_header(value, key=key)
    if header.metadata.get("checksum") != entry.checksum:
        raise CorruptRecord(key, "record checksum differs from its manifest's")
    bind_metadata(header.metadata, key, lookup)
    return value


def _dataset_from_index(fingerprint: str, doc: Mapping[str, Any]) -> _Dataset:
    what = f"{fingerprint}/index.json"
    if doc.get("kind") != INDEX_KIND or doc.get("fingerprint") != fingerprint:
        raise CorruptRecord(what, "not this fingerprint's sharded index")
    if doc.get("format_version") != FORMAT_VERSION:
        raise UnsupportedFormat(what, f"format_version {doc.get('format_version')!r}")
    try:
        dataset = _Dataset(
            doc["recipe"],
            int(doc["recipe_version"]),
            dict(doc["params"]),
            created=str(doc.get("created", "")),
        )
        for sample_id, part, offset, length, checksum, source_hash in doc["records"]:
            dataset.admit(
                validate_sample_id(sample_id),
                Entry(str(part), int(offset), int(length), str(checksum), str(source_hash)),
            )
        dataset.parts_seen = set(doc["parts"])
        dataset.descriptors = dict(_descriptor_texts(doc, what))
    except (KeyError, TypeError, ValueError) as exc:  # InvalidSampleId is a ValueError
        raise CorruptRecord(what, f"malformed ({exc})") from None
    return dataset


# -- merge and housekeeping ---------------------------------------------------------------
def snapshot_kind(
    location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> str | None:
    """What a ``*.zarr`` location holds: ``"sharded"`` (its root marker exists),
    ``"exported"`` (a Zarr hierarchy that ``spcache export`` wrote: read-only), or None
    (nothing yet)."""
    fs, root = _open_fs(os.fspath(location), storage_options or {})
    if fs.exists(f"{root}/{ROOT_MARKER}"):
        return "sharded"
    return "exported" if fs.exists(f"{root}/zarr.json") else None


def is_sharded(
    location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> bool:
    """Whether ``location`` holds a sharded snapshot (its root marker exists)."""
    return snapshot_kind(location, storage_options) == "sharded"


def merge_into(
    store: ShardedSnapshot,
    fingerprint: str,
    *,
    order: Sequence[str] = (),
    describe: Mapping[str, Any] | None = None,
) -> int:
    """Write ``index.json`` for ``fingerprint`` from every committed manifest (``order``'s
    ids first); returns the records indexed. Idempotent: merging again with nothing new
    writes the same index."""
    validate_fingerprint(fingerprint)
    store.refresh()
    dataset = store._load(fingerprint, describe=describe)
    if dataset is None:
        if describe is None:
            raise FingerprintLookupError(
                f"no committed part of {fingerprint} in {store.location}", store.fingerprints()
            )
        return 0
    if dataset.recipe is None and describe is None:
        raise FingerprintLookupError(
            f"the committed parts of {fingerprint} in {store.location} "
            f"do not say what computed them; merge with the run's "
            f"recipe and parameters",
            store.fingerprints(),
        )
    first = [sid for sid in order if sid in dataset.entries]
    seen = set(first)
    ids = first + [sid for sid in dataset.order if sid not in seen]
    info = (
        dict(describe)
        if describe is not None
        else {
            "recipe": dataset.recipe,
            "recipe_version": dataset.recipe_version,
            "params": dataset.params,
        }
    )
    doc = {
        "kind": INDEX_KIND,
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        **info,
        "created": dataset.created,
        "merged_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "parts": sorted(dataset.parts_seen),
        "descriptors": dict(sorted(dataset.descriptors.items())),
        "records": [
            [sid, e.part, e.offset, e.length, e.checksum, e.source_hash]
            for sid in ids
            for e in (dataset.entries[sid],)
        ],
    }
    # The index lists fewer parts than exist only if parts were committed meanwhile:
    # readers read those manifests themselves, so a stale index is never wrong.
    store._write(
        store._path(fingerprint, "index.json"), json.dumps(doc, separators=(",", ":")).encode()
    )
    store.refresh()
    return len(ids)


def merge(
    location: str | os.PathLike[str],
    *,
    fingerprint: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """Merge the manifests of every fingerprint (or one) into its ``index.json``;
    returns ``{fingerprint: records indexed}``."""
    store = ShardedSnapshot(location, readonly=False, storage_options=storage_options)
    try:
        if not store.fs.exists(store._path(ROOT_MARKER)):
            raise ParameterError(
                [f"{store.location}: not a sharded snapshot (no {ROOT_MARKER})"], what="merge"
            )
        if fingerprint:
            fingerprints = [validate_fingerprint(fingerprint)]
        else:
            fingerprints = store.fingerprints()
            # a damaged index whose manifests do not say what computed them: an error
            # (from merge_into) rather than an index silently left damaged
            fingerprints += [
                fp
                for fp in store._fingerprint_dirs()
                if fp not in fingerprints and f"{fp}/index.json" in store.unreadable(fp)
            ]
        return {fp: merge_into(store, fp) for fp in fingerprints}
    finally:
        store.close()


def orphan_parts(
    location: str | os.PathLike[str],
    *,
    older_than_s: float = DEFAULT_ORPHAN_GRACE_S,
    storage_options: Mapping[str, Any] | None = None,
    remove: bool = False,
) -> list[str]:
    """What writers that died left behind, last modified more than ``older_than_s`` ago
    (so nothing still being written is taken): parts with no manifest, and the
    temporary files (``parts/.tmp-*``, ``commits/.tmp-*``) of a writer killed while
    writing one. With ``remove``, delete them. Returns their full locations (with the
    URL's scheme: ``s3://bucket/...``), sorted."""
    store = ShardedSnapshot(location, readonly=not remove, storage_options=storage_options)
    try:
        found: list[str] = []
        fs, now = store.fs, time.time()
        for fingerprint in store._fingerprint_dirs():
            committed = set(store._commit_names(fingerprint))
            for folder in ("parts", "commits"):
                try:
                    listing = fs.ls(store._path(fingerprint, folder), detail=True, refresh=True)
                except FileNotFoundError:
                    continue
                for info in listing:
                    name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
                    leftover = name.startswith(".tmp-") or (
                        folder == "parts" and name.endswith(".bin") and name[:-4] not in committed
                    )
                    if not leftover or info.get("type") == "directory":
                        continue
                    modified = _mtime(info)
                    if modified is not None and now - modified < older_than_s:
                        continue
                    found.append(str(info["name"]))
        found.sort()
        if remove:
            for path in found:
                fs.rm_file(path)
        return [path if _is_local(fs) else fs.unstrip_protocol(path) for path in found]
    finally:
        store.close()


def _mtime(info: Mapping[str, Any]) -> float | None:
    value = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    if value is None:
        return None
    if isinstance(value, _dt.datetime):
        return value.timestamp()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
