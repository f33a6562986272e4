"""Reading a cache through the spcache service: ``HTTPStore``.

``CachedDataset("http://host:port", fingerprint)`` ends up here (via ``open_store``).
The store is read-only. Each process gets its own connection pool, opened on first use
and opened anew after a fork (an inherited pool is parked, never used or closed: its
sockets are shared with the parent). Connection errors and 503 answers are retried with
exponential back-off (honouring ``Retry-After``); 4xx answers are not retried.

The batch responses it reads are framed as :mod:`cache_store.format.wire` describes.

Every record read is bound to its key: its metadata must name the fingerprint and
sample id asked for (a proxy swapping two records is caught), and with ``record_key``
its keyed tag must match (a proxy altering and re-checksumming one is caught; see
:mod:`cache_store.format.tag`). The descriptor a format-2 record names comes from
``GET /v1/caches/{fingerprint}/descriptors/{digest}``, once per process: its text must
have that digest, which the record's (checksummed, tagged) header holds.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import ssl
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np

from cache_store.errors import (
    CorruptRecord,
    FingerprintLookupError,
    ReadOnlyStoreError,
    RecordNotFound,
    SpcacheError,
)
from cache_store.keys import split_key
from cache_store.process_local import ProcessLocal
from cache_store.format.decode import Record
from cache_store.format.descriptor import bind_metadata
from cache_store.format.header import read_header, record_checksum
from cache_store.format.tag import (
    TAG_HEADER,
    as_secret,
    check_record_tag,
    check_signed_checksums,
)
from cache_store.format.index import DatasetIndex
from cache_store.stores.base import RecordDecoder, Store
from cache_store.service_api.client import error_of, new_client, send, tls_verify
from cache_store.format.wire import decode_batch

__all__ = [
    "HTTPStore",
]

log = logging.getLogger(__name__)

_INDEX_PAGE = 100_000


class HTTPStore(Store):
    """A read-only :class:`Store` over the spcache service at ``url``.

    Args:
        url: ``http(s)://host:port`` (a path prefix is allowed).
        timeout_s: per-request timeout.
        retries: attempts after the first on connection errors and 503s.
        backoff_s: first back-off; doubles each retry (with jitter), capped at 10 s.
        max_connections: connection pool size (per process).
        batch_size: ids per batch request in :meth:`get_many`.
        token: bearer token, sent if given (reads need none).
        record_key: secret shared with the service (``SPCACHE_RECORD_KEY``); when set,
            every record must come with a valid keyed tag (``CorruptRecord`` otherwise).
        ca_file: for an ``https://`` service whose certificate the system does not trust
            (a private CA, a self-signed certificate): the PEM file to trust instead.

    Lists (``keys``, ``fingerprints``) come from the service's dataset indexes: records
    not (yet) in an index are readable by key but not listed (``supports_listing`` is
    False). ``supports_writes`` is False: writes raise ``ReadOnlyStoreError``.
    """

    supports_writes = False
    supports_listing = False

    def __init__(
        self,
        url: str,
        *,
        readonly: bool = True,
        timeout_s: float = 30.0,
        retries: int = 5,
        backoff_s: float = 0.1,
        max_connections: int = 16,
        batch_size: int = 64,
        token: str | None = None,
        record_key: str | bytes | None = None,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"HTTPStore needs an http(s):// URL, got {url!r}")
        if not readonly:
            raise ReadOnlyStoreError(f"{url}: an HTTP store is read-only")
        if retries < 0 or backoff_s < 0 or timeout_s <= 0 or batch_size < 1:
            raise ValueError("retries and backoff_s must be >= 0, timeout_s > 0, batch_size >= 1")
        super().__init__(url, readonly=True)
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self.batch_size = batch_size
        self.token = token
        self.record_key = None if record_key is None else as_secret(record_key)
        self._told_signed = False
        self.ca_file = None if ca_file is None else os.fspath(ca_file)
        if self.ca_file is not None:  # a bad file is named now, not at the first request
            try:
                tls_verify(self.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(
                    f"ca_file {self.ca_file}: cannot load it as PEM "
                    f"certificates: {getattr(exc, 'strerror', None) or exc}"
                ) from None
        self._client = ProcessLocal(
            functools.partial(
                new_client,
                self.url,
                timeout_s=timeout_s,
                token=token,
                ca_file=self.ca_file,
                max_connections=max_connections,
            ),
            httpx.Client.close,
        )

    def __repr__(self) -> str:
        return f"HTTPStore({self.url!r})"

    # -- connection ----------------------------------------------------------------

    def _http(self) -> httpx.Client:
        return self._client.get()

    def close(self) -> None:
        self._client.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return send(
            self._http,
            method,
            path,
            where=self.url,
            retries=self.retries,
            backoff_s=self.backoff_s,
            **kwargs,
        )

    def _check(self, response: httpx.Response, key: str = "") -> httpx.Response:
        if response.status_code < 400:
            return response
        error, detail = error_of(response)
        if response.status_code == 404:
            if key and error in ("RecordNotFound", ""):
                raise RecordNotFound(key, self.url)
            raise FingerprintLookupError(f"{self.url}: {detail}")
        if key and error in ("CorruptRecord", "UnsupportedFormat"):  # same class as locally
            raise CorruptRecord(key, f"{self.url}: {detail}")
        raise SpcacheError(f"{self.url}: HTTP {response.status_code} {error}: {detail}")

    # -- Store primitives ----------------------------------------------------------

    def get(self, key: str) -> bytes:
        # Raw bytes leave the store here, undecoded: bound to their key first, as the
        # module doc promises (decoded reads are bound by the base class's decoder).
        value = self._fetch(key, None)
        bind_metadata(read_header(value, key=key).metadata, key, self.descriptor)
        return value

    def _fetch(self, key: str, fields: list[str] | None) -> Any:
        """The record under ``key`` (with ``fields``: the service's re-encoded subset),
        its tag checked and, whole, checked current when this reader holds the key."""
        params = None if fields is None else {"fields": ",".join(fields)}
        response = self.request_record(key, params=params)
        return self.verified(key, response.content, response, whole=fields is None)

    def request_record(self, key: str, **kwargs: Any) -> httpx.Response:
        """``GET`` of the record route for ``key`` (``kwargs``: httpx's ``params``,
        ``headers``), its error answers raised as errors (a 304 is an answer)."""
        fingerprint, sample_id = split_key(key)
        return self._check(
            self._request("GET", _record_path(fingerprint, sample_id), **kwargs), key
        )

    def verified(self, key: str, value: Any, response: httpx.Response, *, whole: bool) -> Any:
        """``value``, the record ``response`` answered for ``key`` (its body, or the copy
        its 304 confirmed), once its tag is checked and, ``whole``, checked current."""
        value = self._tagged(key, value, response.headers.get(TAG_HEADER))
        if whole:  # a subset's checksum is the subset's: not signed
            self._check_current({key: value})
        return value

    def _tagged(self, key: str, value: Any, tag: str | None) -> Any:
        """``value`` once its tag is checked (with a record key)."""
        if self.record_key is not None:
            check_record_tag(self.record_key, key, value, tag)
        elif tag and not self._told_signed:
            self._told_signed = True
            log.warning(
                "%s signs its records (%s), but this reader has no record_key: "
                "nothing binds what it reads to what the service holds. Pass "
                "record_key= (the service's SPCACHE_RECORD_KEY) to check them",
                self.url,
                TAG_HEADER,
            )
        return value

    def _check_current(self, values: dict[str, Any]) -> None:
        """With a record key: each whole record must be the one the service holds now.

        A tag binds a record to its key, so an older record of the same key, with its
        own valid tag, would pass it; the service's signed list of the checksums it
        holds now (``POST .../checksums``, bound to a fresh nonce so that list cannot be
        replayed either) refuses it. One extra request per read (per batch).
        """
        if self.record_key is None or not values:
            return
        by_fp: dict[str, list[tuple[str, str, str]]] = {}
        for key, value in values.items():
            fingerprint, sample_id = split_key(key)
            by_fp.setdefault(fingerprint, []).append(
                (sample_id, key, record_checksum(value, key=key))
            )
        for fingerprint, wanted in by_fp.items():
            for start in range(0, len(wanted), self.batch_size):
                chunk = wanted[start : start + self.batch_size]
                nonce = secrets.token_hex(16)
                path = f"/v1/caches/{fingerprint}/checksums"
                answer = self._check(
                    self._request(
                        "POST", path, json={"ids": [sid for sid, _, _ in chunk], "nonce": nonce}
                    )
                )
                signed = check_signed_checksums(
                    self.record_key, fingerprint, nonce, answer.json(), self.url + path
                )
                for sample_id, key, checksum in chunk:
                    if signed.get(sample_id) != checksum:
                        raise CorruptRecord(
                            key,
                            f"{self.url}: record with checksum "
                            f"{checksum} is not the one the service holds "
                            f"now ({signed.get(sample_id)}): a replayed "
                            f"or stale record",
                        )

    def has(self, key: str) -> bool:
        fingerprint, sample_id = split_key(key)
        response = self._request("HEAD", _record_path(fingerprint, sample_id))
        if response.status_code == 404:
            return False
        self._check(response, key)
        return True

    def get_many(
        self,
        keys: Iterable[str],
        fields: Iterable[str] | None = None,
    ) -> tuple[dict[str, memoryview], dict[str, str]]:
        """Records for ``keys`` through the batch route, ``batch_size`` ids a request.

        Returns ``({key: record bytes}, {key: why it is missing})``; with ``fields`` the
        service sends only those tensors (a smaller, re-checksummed record). Each is
        bound to its key as :meth:`get` binds one.
        """
        found, missing = self._fetch_many(keys, None if fields is None else list(fields))
        for key, value in found.items():
            bind_metadata(read_header(value, key=key).metadata, key, self.descriptor)
        return found, missing

    def _fetch_many(
        self,
        keys: Iterable[str],
        fields: list[str] | None,
    ) -> tuple[dict[str, memoryview], dict[str, str]]:
        body_fields = fields
        by_fp: dict[str, list[str]] = {}
        for key in keys:
            fingerprint, sample_id = split_key(key)
            by_fp.setdefault(fingerprint, []).append(sample_id)
        found_all: dict[str, memoryview] = {}
        missing_all: dict[str, str] = {}
        for fingerprint, ids in by_fp.items():
            for start in range(0, len(ids), self.batch_size):
                chunk = ids[start : start + self.batch_size]
                path = f"/v1/caches/{fingerprint}/batch"
                response = self._check(
                    self._request("POST", path, json={"ids": chunk, "fields": body_fields})
                )
                tags: dict[str, str] = {}
                found, missing = decode_batch(response.content, where=self.url + path, tags=tags)
                bound = {
                    f"{fingerprint}/{sid}": self._tagged(
                        f"{fingerprint}/{sid}", value, tags.get(sid)
                    )
                    for sid, value in found.items()
                }
                if fields is None:  # a subset's checksum is the subset's: not signed
                    self._check_current(bound)
                found_all.update(bound)
                missing_all.update({f"{fingerprint}/{sid}": why for sid, why in missing.items()})
        return found_all, missing_all

    def supply(
        self, keys: list[str], fields: list[str] | None, decoder: RecordDecoder
    ) -> list[Record]:
        """One record by its route, several through the batch route; with ``fields``
        only those tensors cross the wire (the service re-encodes the subset)."""
        if not decoder.batch:
            return decoder.values([self._fetch(keys[0], fields)])
        found, missing = self._fetch_many(keys, fields)
        for key in keys:
            if key not in found:
                raise RecordNotFound(key, f"{self.url} ({missing.get(key, 'not returned')})")
        return decoder.values([found[key] for key in keys])

    def load_descriptor(self, fingerprint: str, digest: str) -> bytes | None:
        response = self._request("GET", f"/v1/caches/{fingerprint}/descriptors/{digest}")
        if response.status_code == 404:
            return None
        return self._check(response).content

    def fingerprints(self) -> list[str]:
        body = self._check(self._request("GET", "/v1/caches")).json()
        return [c["fingerprint"] for c in body["caches"]]

    def get_index(self, fingerprint: str) -> DatasetIndex:
        ids: list[str] = []
        offset = 0
        while True:
            response = self._request(
                "GET", f"/v1/caches/{fingerprint}", params={"offset": offset, "limit": _INDEX_PAGE}
            )
            if response.status_code == 404 and not ids:  # like every backend: list the known
                raise self.index_missing(fingerprint)
            body = self._check(response).json()
            if body.get("index") is None:
                raise FingerprintLookupError(
                    f"{self.url}: fingerprint {fingerprint} has no "
                    f"index yet (its warm-up is still running?)"
                )
            page = body["index"]["sample_ids"]
            ids.extend(page)
            offset += len(page)
            if not page or offset >= body["index"]["total"]:
                break
        return DatasetIndex(
            fingerprint=fingerprint,
            recipe=body["recipe"],
            recipe_version=int(body["recipe_version"]),
            params=body["params"],
            sample_ids=np.array(ids, dtype=np.str_),
        )

    def keys(self, prefix: str = "") -> Iterator[str]:
        """Keys of indexed records (``supports_listing`` is False), in UTF-8 byte order."""
        for fingerprint in sorted(self.fingerprints()):
            if not (fingerprint.startswith(prefix[: len(fingerprint)])):
                continue
            for sample_id in sorted(self.get_index(fingerprint).sample_ids.tolist()):
                key = f"{fingerprint}/{sample_id}"
                if key.startswith(prefix):
                    yield key


def _record_path(fingerprint: str, sample_id: str) -> str:
    return f"/v1/caches/{fingerprint}/records/{quote(sample_id, safe='/')}"
