"""Records bound to their key in transit: an optional keyed tag (HMAC-SHA256).

A record's header checksum already covers its tensors and metadata, and every read
path checks that the metadata names the key asked for (``check_names_key``), so a
record swapped for another one is refused. A party that can rewrite bytes in transit
could still alter a record and recompute its checksums; the tag stops that: with a
secret shared by the service (``SPCACHE_RECORD_KEY``) and the reader
(``HTTPStore(record_key=...)``), the service sends, per record::

    tag = hex(HMAC-SHA256(secret, "<fingerprint>/<sample id>\\n<record checksum>"))

in the ``X-Spcache-Record-Tag`` response header (batch responses: a ``tag`` in each
record's entry), and a reader holding the secret refuses a record whose tag is absent
or wrong. The tag binds the key too, so a swapped record with its own valid tag fails.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from cache_store.errors import CorruptRecord, SpcacheError
from cache_store.format.header import record_checksum
from cache_store.service_api.protocol import TAG_HEADER

__all__ = [
    "TAG_HEADER",
    "record_tag",
    "tag_for_checksum",
    "check_record_tag",
    "as_secret",
    "sign_checksums",
    "check_signed_checksums",
]


def as_secret(key: str | bytes) -> bytes:
    secret = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    if len(secret) < 16:
        raise ValueError("a record key must be at least 16 bytes")
    return secret


def tag_for_checksum(secret: bytes, key: str, checksum: str) -> str:
    message = f"{key}\n{checksum}".encode("utf-8", "surrogatepass")
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def record_tag(secret: bytes, key: str, value: Any) -> str:
    """The tag of record bytes ``value`` stored under ``key``."""
    return tag_for_checksum(secret, key, record_checksum(value, key=key))


def check_record_tag(secret: bytes, key: str, value: Any, tag: str | None) -> None:
    """Raise :class:`CorruptRecord` naming ``key`` unless ``tag`` is the record's tag."""
    if not tag:
        raise CorruptRecord(
            key, "no record tag in the answer, and this reader requires one (record_key is set)"
        )
    if not hmac.compare_digest(record_tag(secret, key, value), tag.strip()):
        raise CorruptRecord(
            key,
            "record tag does not match: the record was altered or "
            "swapped in transit (or the keys differ)",
        )


def _checksums_message(fingerprint: str, nonce: str, checksums: dict[str, str | None]) -> bytes:
    body = {"fingerprint": fingerprint, "nonce": nonce, "checksums": checksums}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )


def sign_checksums(
    secret: bytes, fingerprint: str, nonce: str, checksums: dict[str, str | None]
) -> str:
    """The service's signature over the checksums of the records it holds now for some
    ids of ``fingerprint`` (None: no record), bound to the reader's ``nonce``."""
    return hmac.new(
        secret, _checksums_message(fingerprint, nonce, checksums), hashlib.sha256
    ).hexdigest()


def check_signed_checksums(
    secret: bytes, fingerprint: str, nonce: str, answer: dict[str, Any], where: str
) -> dict[str, str | None]:
    """The checksums of a signed answer, once its signature and nonce check out;
    SpcacheError naming ``where`` otherwise (an answer replayed, altered or unsigned)."""
    checksums = answer.get("checksums")
    if (
        not isinstance(checksums, dict)
        or answer.get("fingerprint") != fingerprint
        or answer.get("nonce") != nonce
        or not isinstance(answer.get("signature"), str)
        or not hmac.compare_digest(
            sign_checksums(secret, fingerprint, nonce, checksums), answer["signature"]
        )
    ):
        raise SpcacheError(
            f"{where}: the signed list of record checksums does not check "
            f"out (altered, replayed, or the record keys differ)"
        )
    return checksums
