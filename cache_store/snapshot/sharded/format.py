"""The sharded snapshot's layout: its files, the commit rule, and the documents.

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
earlier one's place in the order): :meth:`Dataset.admit`.

A part holds its records in order, each starting at a multiple of :data:`RECORD_ALIGN`
bytes (zero bytes between: :func:`part_bytes`), so a record mapped from its part has
every field aligned for its dtype (:mod:`cache_store.views`); parts written before that
lie back to back and read the same, by their manifests' offsets.

A manifest lists, per record: sample id, offset, length, record checksum and source
hash; and ``descriptors``, the text of every descriptor its records name (by digest:
:mod:`cache_store.format.descriptor`), committed with them; ``index.json`` keeps those of
the manifests it merged. Readers list ``commits/`` (one LIST), read ``index.json`` and the manifests it
does not already include, and read a record by a range request into its part, checked
against its manifest (checksum, key) as any record is. The dataset's order is the
index's, then what was committed after it, in commit order.

Every document carries its ``kind`` and ``format_version``; a reader meeting another
version raises :class:`UnsupportedFormat`, a malformed one :class:`CorruptRecord` naming
the file. The writer (:class:`~cache_store.snapshot.sharded.store.ShardedSnapshot`), the
readers and the merge (:mod:`~cache_store.snapshot.sharded.maintenance`) all build and
parse them here.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
from collections.abc import Mapping, Sequence
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import xxhash

from cache_store.errors import CorruptRecord, SpcacheError, UnsupportedFormat
from cache_store.format.descriptor import Descriptor, DescriptorLookup, bind_metadata, is_digest
from cache_store.format.header import read_header
from cache_store.keys import compute_fingerprint, split_key, validate_record_id
from cache_store.recipes.registry import get_recipe_spec

__all__ = [
    "COMMIT_KIND",
    "FORMAT_VERSION",
    "INDEX_KIND",
    "RECORD_ALIGN",
    "ROOT_KIND",
    "ROOT_MARKER",
    "Dataset",
    "Entry",
    "check_against_manifest",
    "check_description",
    "commit_order",
    "dataset_from_index",
    "descriptor_texts",
    "index_document",
    "load_json",
    "manifest",
    "parse_manifest",
    "part_bytes",
    "root_document",
]

ROOT_MARKER = "spcache-sharded.json"
ROOT_KIND = "spcache.sharded_root"
COMMIT_KIND = "spcache.shard_commit"
INDEX_KIND = "spcache.sharded_index"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Entry:
    """Where one committed record lies."""

    part: str
    offset: int
    length: int
    checksum: str
    source_hash: str


@dataclass
class Dataset:
    """What a reader knows of one fingerprint: committed entries and their order."""

    recipe: str | None  # None until a record or the driver says what was computed
    recipe_version: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    entries: dict[str, Entry] = field(default_factory=dict)
    parts_seen: set[str] = field(default_factory=set)
    created: str = ""
    descriptors: dict[str, str] = field(default_factory=dict)  # digest -> text

    def copy(self) -> Dataset:
        """A copy whose containers are its own (entries themselves are immutable)."""
        return dataclasses.replace(
            self,
            params=dict(self.params),
            order=list(self.order),
            entries=dict(self.entries),
            parts_seen=set(self.parts_seen),
            descriptors=dict(self.descriptors),
        )

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


def root_document() -> bytes:
    """The root marker's content."""
    return json.dumps({"kind": ROOT_KIND, "format_version": FORMAT_VERSION}).encode()


#: Where each record of a part starts: a multiple of this many bytes (the largest dtype).
RECORD_ALIGN = 8


def _aligned(offset: int) -> int:
    return -(-offset // RECORD_ALIGN) * RECORD_ALIGN


def part_bytes(group: Sequence[tuple[str, bytes]]) -> bytes:
    """The bytes of a part holding the records of ``group`` in order, each from a
    multiple of :data:`RECORD_ALIGN` (the gaps zero)."""
    chunks, offset = [], 0
    for _, value in group:
        pad = _aligned(offset) - offset
        if pad:
            chunks.append(bytes(pad))
        chunks.append(value)
        offset += pad + len(value)
    return b"".join(chunks)


def manifest(
    fingerprint: str,
    part: str,
    group: Sequence[tuple[str, bytes]],
    data: bytes,
    writer: str,
    descriptors: Mapping[str, Descriptor],
) -> bytes:
    """The manifest of ``part``, whose bytes ``data`` (:func:`part_bytes`) hold the
    records of ``group`` (``(key, record)`` pairs, in that order), naming
    ``descriptors`` (by digest: those the records name)."""
    rows, offset = [], 0
    for key, value in group:
        meta = read_header(value, key=key).metadata
        offset = _aligned(offset)
        rows.append(
            [split_key(key)[1], offset, len(value), meta["checksum"], meta.get("source_hash", "")]
        )
        offset += len(value)
    first = read_header(group[0][1], key=group[0][0]).metadata  # (checked by put_many)
    named = descriptors.get(first.get("descriptor", ""))
    if named is not None:  # what the dataset is, as the records say it
        first = {**named.metadata, **first}
    doc = {
        "kind": COMMIT_KIND,
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "part": part,
        "data_size": len(data),
        "data_xxh3": xxhash.xxh3_64_hexdigest(data),
        "committed_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds"),
        "writer": {"host": socket.gethostname(), "pid": os.getpid(), "label": writer},
        "dataset": _describe_from_metadata(first, fingerprint),
        "records": rows,
        "descriptors": {d.digest: d.text for d in descriptors.values()},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def index_document(
    fingerprint: str, dataset: Dataset, ids: Sequence[str], info: Mapping[str, Any]
) -> bytes:
    """``index.json`` of ``fingerprint``: the records of ``ids`` (in that order) as
    ``dataset`` holds them, described by ``info`` (recipe, version, parameters)."""
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
    return json.dumps(doc, separators=(",", ":")).encode()


def load_json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptRecord(what, f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CorruptRecord(what, "not a JSON object")
    return value


def parse_manifest(
    raw: bytes, fingerprint: str, part: str
) -> tuple[dict[str, Any], list[tuple[str, Entry]]]:
    what = f"{fingerprint}/commits/{part}.json"
    doc = load_json(raw, what)
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
            sample_id = validate_record_id(sample_id)  # a variant's record: a1#v3
        except SpcacheError as exc:
            raise CorruptRecord(what, str(exc)) from None
        entries.append((sample_id, Entry(part, offset, length, checksum, source_hash)))
    descriptor_texts(doc, what)
    check_description(doc.get("dataset"), fingerprint, what)
    return doc, entries


def descriptor_texts(doc: Mapping[str, Any], what: str) -> dict[str, str]:
    """A manifest's or index's ``descriptors`` (digest -> text; absent before format 2),
    their shape checked (each text is checked against its digest when it is used)."""
    found = doc.get("descriptors", {})
    if not isinstance(found, dict) or not all(
        is_digest(d) and isinstance(t, str) for d, t in found.items()
    ):
        raise CorruptRecord(what, "malformed descriptors")
    return found


def check_description(described: Any, fingerprint: str, what: str) -> None:
    """A manifest's ``dataset`` (None: not described) must be a recipe, version and
    parameters whose fingerprint is ``fingerprint``; else :class:`CorruptRecord` naming
    ``what``. One planted manifest describing anything else would otherwise become the
    fingerprint's dataset (issue 34: ``{"bogus": 1}`` made it unreadable, other
    parameters were merged into ``index.json``)."""
    if described is None:
        return
    try:
        recipe, version, params = (
            described["recipe"],
            described["recipe_version"],
            described["params"],
        )
        if (
            not isinstance(recipe, str)
            or not isinstance(version, int)
            or not isinstance(params, dict)
        ):
            raise TypeError("recipe, recipe_version or params of the wrong type")
        computed = compute_fingerprint(recipe, version, params)
    except (KeyError, TypeError, ValueError, SpcacheError) as exc:
        raise CorruptRecord(what, f"malformed dataset description ({exc})") from None
    if computed != fingerprint:
        raise CorruptRecord(
            what,
            f"its dataset description ({recipe!r} v{version}, its parameters) is that of "
            f"fingerprint {computed}, not {fingerprint}",
        )


def commit_order(doc: Mapping[str, Any], part: str) -> tuple[str, str]:
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


def check_against_manifest(value: bytes, key: str, entry: Entry, lookup: DescriptorLookup) -> bytes:
    """``value`` if it is the record ``entry`` committed for ``key`` (its checksum is the
    manifest's, it is bound to ``key``: ``bind_metadata``); else :class:`CorruptRecord`."""
    header = read_header(value, key=key)
    if header.metadata.get("checksum") != entry.checksum:
        raise CorruptRecord(key, "record checksum differs from its manifest's")
    bind_metadata(header.metadata, key, lookup)
    return value


def dataset_from_index(fingerprint: str, doc: Mapping[str, Any]) -> Dataset:
    """The dataset an ``index.json`` document holds (CorruptRecord or UnsupportedFormat
    when it is not this fingerprint's, or malformed)."""
    what = f"{fingerprint}/index.json"
    if doc.get("kind") != INDEX_KIND or doc.get("fingerprint") != fingerprint:
        raise CorruptRecord(what, "not this fingerprint's sharded index")
    if doc.get("format_version") != FORMAT_VERSION:
        raise UnsupportedFormat(what, f"format_version {doc.get('format_version')!r}")
    try:
        dataset = Dataset(
            doc["recipe"],
            int(doc["recipe_version"]),
            dict(doc["params"]),
            created=str(doc.get("created", "")),
        )
        for sample_id, part, offset, length, checksum, source_hash in doc["records"]:
            dataset.admit(
                validate_record_id(sample_id),
                Entry(str(part), int(offset), int(length), str(checksum), str(source_hash)),
            )
        dataset.parts_seen = set(doc["parts"])
        dataset.descriptors = dict(descriptor_texts(doc, what))
    except (KeyError, TypeError, ValueError) as exc:  # invalid ids are ValueErrors
        raise CorruptRecord(what, f"malformed ({exc})") from None
    described = {k: doc[k] for k in ("recipe", "recipe_version", "params")}
    check_description(described, fingerprint, what)
    return dataset
