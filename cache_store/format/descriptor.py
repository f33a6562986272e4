"""Record descriptors: what the records of one fingerprint share, stored once.

A record of format 2 keeps in its own header only what is its own: sample id, source hash
and stat signature, when it was computed, its fields' layout and checksums, its header
checksum, and ``descriptor``, the digest of its *descriptor*. The descriptor holds what
every record made by one run of a recipe shares (:data:`DESCRIPTOR_METADATA`: recipe,
version, fingerprint, parameters, the fields' schema with their meanings, the recipe's
code digest, spcache's version, ops backend and device). A fingerprint has one descriptor
per recipe code, backend and device that computed its records (usually one).

A descriptor is a canonical JSON document (sorted keys, no spaces, ASCII)::

    {"format":"spcache.descriptor","format_version":"2","metadata":{str: str, ...}}

and its digest is the BLAKE2b-128 hex of exactly those bytes: a descriptor is named by
its content, so it never changes once written, every reader may keep the ones it has
read, and a record's header (whose checksum covers the digest, and whose HMAC tag covers
that checksum) pins the descriptor it was written with. Each store keeps the
descriptors of a fingerprint with it, written in the same commit as the first records
that name them (:meth:`cache_store.stores.base.Store.descriptor` reads them).

A record's metadata as every reader returns it is the descriptor's metadata and the
record's own, merged (:func:`bind_metadata`): the same keys a format-1 record carries in
its own header. :func:`bind_metadata` is also the one rule binding a record to its key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cache_store.errors import CorruptRecord, UnsupportedFormat
from cache_store.format.header import STRICT_DECODER, check_names_key, metadata_record_id
from cache_store.keys import FINGERPRINT_HEX_CHARS, is_fingerprint

__all__ = [
    "DESCRIPTOR_FORMAT",
    "DESCRIPTOR_VERSION",
    "DESCRIPTOR_METADATA",
    "DIGEST_HEX_CHARS",
    "DIGEST_PATTERN",
    "Descriptor",
    "DescriptorLookup",
    "make_descriptor",
    "parse_descriptor",
    "split_metadata",
    "is_digest",
    "descriptor_name",
    "bind_metadata",
]

DESCRIPTOR_FORMAT = "spcache.descriptor"
#: The record format a descriptor belongs to (records of format 2 name descriptors).
DESCRIPTOR_VERSION = "2"
#: Metadata that moves from each record into its descriptor: what every record of one
#: run shares. Anything else a writer gives stays in the record.
DESCRIPTOR_METADATA = (
    "recipe",
    "recipe_version",
    "fingerprint",
    "params",
    "schema",
    "code_digest",
    "spcache_version",
    "backend",
    "device",
)
#: A descriptor digest: 128 bits of BLAKE2b as lowercase hex.
DIGEST_HEX_CHARS = 32
#: A digest's syntax as a regular expression (for routes).
DIGEST_PATTERN = rf"[0-9a-f]{{{DIGEST_HEX_CHARS}}}"
#: a digest's text (one pattern match: checked for every record read)
_DIGEST_TEXT = re.compile(f"[0-9a-f]{{{DIGEST_HEX_CHARS}}}")


@dataclass(frozen=True, eq=False)
class Descriptor:
    """One descriptor: its metadata (``fingerprint`` among it), the text it is stored as,
    and the digest of that text (the name records give it)."""

    fingerprint: str
    digest: str
    text: str
    metadata: dict[str, str]


#: ``lookup(fingerprint, digest)``: the descriptor a store holds for ``fingerprint``
#: under ``digest``; raises :class:`CorruptRecord` naming it when absent or damaged.
DescriptorLookup = Callable[[str, str], Descriptor]


def is_digest(text: object) -> bool:
    """Whether ``text`` has a descriptor digest's syntax (32 lowercase hex digits)."""
    return isinstance(text, str) and _DIGEST_TEXT.fullmatch(text) is not None


def descriptor_name(fingerprint: str, digest: str) -> str:
    """How errors name a descriptor: ``descriptor <digest> of fingerprint <fingerprint>``."""
    return f"descriptor {digest} of fingerprint {fingerprint}"


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("ascii"), digest_size=DIGEST_HEX_CHARS // 2).hexdigest()


@functools.lru_cache(maxsize=64)
def _made(items: tuple[tuple[str, str], ...]) -> Descriptor:
    metadata = dict(items)
    text = json.dumps(
        {"format": DESCRIPTOR_FORMAT, "format_version": DESCRIPTOR_VERSION, "metadata": metadata},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return Descriptor(metadata["fingerprint"], _digest(text), text, metadata)


def make_descriptor(metadata: Mapping[str, str]) -> Descriptor:
    """The descriptor of ``metadata`` (str -> str, ``fingerprint`` a fingerprint).

    The same metadata always gives the same text and digest (a writer makes the one of
    its run for every record it encodes: the last few are kept).
    """
    fingerprint = metadata.get("fingerprint")
    if not is_fingerprint(fingerprint):
        raise ValueError(f"a descriptor needs a fingerprint, got {fingerprint!r}")
    items = tuple(sorted(metadata.items()))
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in items):
        raise ValueError("descriptor metadata must map str to str")
    return _made(items)


def parse_descriptor(text: str | bytes, *, fingerprint: str, digest: str) -> Descriptor:
    """The stored descriptor ``text``, checked: its digest is ``digest``, it is a
    descriptor of this format naming ``fingerprint``.

    Raises:
        CorruptRecord: naming the descriptor (:func:`descriptor_name`) and what is wrong.
        UnsupportedFormat: a descriptor of another format version.
    """
    where = descriptor_name(fingerprint, digest)
    if isinstance(text, bytes | bytearray | memoryview):
        try:
            text = bytes(text).decode("ascii")
        except UnicodeDecodeError:
            raise CorruptRecord(where, "is damaged: not ASCII text") from None
    if not isinstance(text, str) or not text.isascii():
        raise CorruptRecord(where, "is damaged: not ASCII text")
    if _digest(text) != digest:
        raise CorruptRecord(where, f"is damaged: its text's digest is {_digest(text)}")
    try:
        doc = STRICT_DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        raise CorruptRecord(where, f"is damaged: not valid JSON ({exc})") from None
    if type(doc) is not dict or doc.get("format") != DESCRIPTOR_FORMAT:
        raise CorruptRecord(where, f"is not an {DESCRIPTOR_FORMAT} document")
    if doc.get("format_version") != DESCRIPTOR_VERSION:
        raise UnsupportedFormat(
            where,
            f"has format_version {doc.get('format_version')!r}, not supported "
            f"(this reader knows {DESCRIPTOR_VERSION!r})",
        )
    metadata = doc.get("metadata")
    if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
        raise CorruptRecord(where, "is damaged: its 'metadata' is not a map of str -> str")
    if metadata.get("fingerprint") != fingerprint:
        raise CorruptRecord(where, f"names fingerprint {metadata.get('fingerprint')!r}")
    return Descriptor(fingerprint, digest, text, metadata)


def split_metadata(metadata: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``(descriptor's part, record's own part)`` of a record's whole metadata."""
    shared = {k: v for k, v in metadata.items() if k in DESCRIPTOR_METADATA}
    own = {k: v for k, v in metadata.items() if k not in DESCRIPTOR_METADATA}
    return shared, own


def bind_metadata(
    metadata: Mapping[str, str], key: str, lookup: DescriptorLookup
) -> dict[str, str]:
    """A record's metadata as readers see it, once the record is bound to ``key``.

    A record naming a descriptor (``descriptor`` in its own metadata): its sample id (and
    ``variant``, for a variant's record) must be the key's, and the descriptor, looked up
    under the key's fingerprint, must name that fingerprint; returns the descriptor's
    metadata with the record's own over it.
    A record without one (format 1) names its key itself (``check_names_key``); its
    metadata is returned as it is.

    Raises:
        CorruptRecord: naming ``key``: a record of another key, or a descriptor the store
            does not hold for this fingerprint, or a damaged one (the reason names it).
    """
    digest = metadata.get("descriptor")
    if digest is None:
        check_names_key(metadata, key)
        return dict(metadata)
    # the record id: the sample id, with #v<k> for a variant's record (keys.record_id)
    fingerprint, sample_id = key[:FINGERPRINT_HEX_CHARS], key[FINGERPRINT_HEX_CHARS + 1 :]
    named = metadata_record_id(metadata)
    if named != sample_id or key[FINGERPRINT_HEX_CHARS : FINGERPRINT_HEX_CHARS + 1] != "/":
        raise CorruptRecord(key, f"record metadata names {fingerprint}/{named}")
    if not is_digest(digest):
        raise CorruptRecord(key, f"its descriptor digest {digest!r} is not 32 hex digits")
    try:
        descriptor = lookup(fingerprint, digest)
    except CorruptRecord as exc:
        raise type(exc)(key, f"its {exc.key} {exc.reason}") from None
    merged = {**descriptor.metadata, **metadata}
    if merged.get("fingerprint") != fingerprint or descriptor.fingerprint != fingerprint:
        raise CorruptRecord(key, f"record metadata names {merged.get('fingerprint')}/{sample_id}")
    return merged
