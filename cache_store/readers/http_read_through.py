"""Read-through over the service URL: a loader's misses, computed by the service's worker.

``CachedDataset("http://host:port", "spc_query", sources=..., level=8)`` hands its misses
to an :class:`HTTPReadThrough`, the HTTP twin of
:class:`cache_store.readers.queue_read_through.QueueReadThrough`. For each miss it

1. posts the missing samples, plus the next ``warm_ahead`` uncached ones, to
   ``POST /v1/warmup`` with ``dedupe`` (the service queues each through
   :meth:`JobQueue.enqueue_once`: once, however many loader processes miss it) and
   ``require_worker`` (no worker alive -> 503 ``NoWorkerAlive`` naming the command to
   start one, raised here as :class:`NoWorkerAlive` at once), at priority 100;
2. waits for each missing record with ``HEAD .../records/{id}?wait=S`` (the service
   holds the request until the record lands; see :mod:`service.read_through`), looping
   until ``miss_timeout`` (then :class:`MissTimeout`). A 404 whose state is ``failed``
   raises :class:`SampleFailed` with the id, the path and the worker's reason (read from
   ``GET .../items/{id}``); a 503 past the service's waiting bound is retried after its
   ``Retry-After``.

The source paths travel as absolute paths: the service must see the same files (same
machine or shared file system) inside one of its ``--source-root`` directories.
Nothing here imports torch's CUDA or ``workers``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

import httpx

from cache_store.errors import MissTimeout, ParameterError, SampleFailed, SpcacheError
from cache_store.service_api.protocol import (
    ERROR_HEADER,
    FAILED,
    MISSING,
    QUEUED,
    STATE_HEADER,
    WAIT_CHUNK_S,
)
from cache_store.keys import record_id, record_key
from cache_store.service_api.client import json_body, new_client, send

__all__ = ["HTTPReadThrough"]

log = logging.getLogger(__name__)


class HTTPReadThrough:
    """Misses of one fingerprint, queued on and waited for through the service at ``url``.

    Args:
        url: the service, ``http(s)://host:port``.
        recipe, params, fingerprint: the resolved recipe the records are computed with.
        token: bearer token (the service needs it for warm-ups when it has one).
        priority: of the warm-ups it posts (misses go ahead of ordinary warm-ups).
        miss_timeout: seconds to wait for a record before :class:`MissTimeout`.
        ca_file: the PEM file to trust for an ``https://`` service (see ``HTTPStore``).
        variants: records asked for per sample (the warm-ups' ``variants``).
    """

    def __init__(
        self,
        url: str,
        recipe: str,
        params: dict[str, Any],
        fingerprint: str,
        *,
        token: str | None = None,
        priority: int = 100,
        miss_timeout: float = 120.0,
        ca_file: str | None = None,
        variants: int = 1,
    ) -> None:
        self.url = url.rstrip("/")
        self.recipe = recipe
        self.params = dict(params)
        self.fingerprint = fingerprint
        self.token = token
        self.priority = priority
        self.miss_timeout = miss_timeout
        self.ca_file = ca_file
        self.variants = variants
        self._client: httpx.Client | None = None
        #: items the service queued for this process (reused ones not counted)
        self.queued = 0

    def _http(self) -> httpx.Client:
        if self._client is None:
            self._client = new_client(
                self.url, timeout_s=30.0, token=self.token, ca_file=self.ca_file
            )
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _request(self, method: str, path: str, deadline: float, **kwargs: Any) -> httpx.Response:
        """One request; connection errors and 503s other than ``NoWorkerAlive`` (raised)
        retried, after ``Retry-After``, until ``deadline``."""
        return send(self._http, method, path, where=self.url, deadline=deadline, **kwargs)

    def _warmup(self, items: Sequence[tuple[str, str]], deadline: float) -> list[dict[str, Any]]:
        body = {
            "recipe": self.recipe,
            "params": self.params,
            "priority": self.priority,
            "dedupe": True,
            "require_worker": True,
            "variants": self.variants,
            "items": [{"id": sid, "path": os.path.abspath(path)} for sid, path in items],
        }
        response = self._request("POST", "/v1/warmup", deadline, json=body)
        answer = json_body(response)
        if response.status_code == 422 and answer.get("problems"):
            raise ParameterError(
                [f"{self.url}: {p}" for p in answer["problems"]], what="read-through warm-up"
            )
        if response.status_code >= 400:
            raise SpcacheError(
                f"{self.url}/v1/warmup: HTTP {response.status_code} "
                f"{answer.get('error', '')}: {answer.get('detail', '')}"
            )
        if answer.get("fingerprint") != self.fingerprint:
            raise SpcacheError(
                f"{self.url}: the service computes {self.recipe} "
                f"{self.params} as fingerprint {answer.get('fingerprint')}, "
                f"this client as {self.fingerprint} (different versions?)"
            )
        self.queued += int(answer.get("queued", 0))
        return list(answer.get("items") or [])

    def fetch(
        self,
        has: Callable[[str], bool],
        wanted: Sequence[tuple[str, str]],
        ahead: Sequence[tuple[str, str]] = (),
        *,
        stale: Sequence[str] = (),
        picks: Mapping[str, int] | None = None,
    ) -> None:
        """Return once every ``(sample id, path)`` of ``wanted`` has a record (of the
        variant ``picks`` names for it, else variant 0).

        ``stale`` is accepted for the same call as the queue's: the service compares
        records with their sources itself and queues a stale one again.

        Raises :class:`NoWorkerAlive`, :class:`SampleFailed` (the first failed wanted
        sample) or :class:`MissTimeout`.
        """
        if not wanted:
            return
        deadline = time.monotonic() + self.miss_timeout
        rows = self._warmup([*wanted, *ahead], deadline)
        paths = dict(wanted)
        picked = picks or {}
        for row in rows:
            sid = row.get("id")
            if (
                sid in paths
                and row.get("status") == "failed"
                and not has(record_key(self.fingerprint, sid, picked.get(sid, 0)))
            ):
                raise SampleFailed(sid, paths[sid], row.get("error") or "failed")
        for sid, path in wanted:
            self._wait(sid, path, deadline, picked.get(sid, 0))

    def queue_ahead(self, items: Sequence[tuple[str, str]]) -> None:
        """Queue ``(sample id, path)`` items the caller will want soon, without waiting
        (a sampler's read-ahead): one deduplicated warm-up. Raises
        :class:`NoWorkerAlive`."""
        if items:
            self._warmup(items, time.monotonic() + self.miss_timeout)

    def _wait(self, sample_id: str, path: str, deadline: float, variant: int = 0) -> None:
        tail = record_id(sample_id, variant)
        record = f"/v1/caches/{self.fingerprint}/records/{quote(tail, safe='/')}"
        requeued = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MissTimeout(
                    f"record {record_key(self.fingerprint, sample_id, variant)!r} "
                    f"({path}) did not land on {self.url} within "
                    f"{self.miss_timeout:g} s; the worker may be busy with a "
                    f"long queue: raise miss_timeout or warm up first"
                )
            chunk = min(remaining, WAIT_CHUNK_S)
            response = self._request(
                "HEAD", record, deadline, params={"wait": f"{chunk:.3f}"}, timeout=chunk + 30.0
            )
            if response.status_code == 200:
                return
            state = response.headers.get(STATE_HEADER)
            if response.status_code == 404 and state == FAILED:
                raise SampleFailed(sample_id, path, self._reason(sample_id, deadline))
            if response.status_code == 404 and state == QUEUED:
                continue
            if response.status_code == 404 and state == MISSING:
                # not queued (or its job was cancelled): queue it again, once
                if requeued:
                    time.sleep(min(0.5, max(deadline - time.monotonic(), 0.0)))
                self._warmup([(sample_id, path)], deadline)
                requeued = True
                continue
            if response.status_code == 503:  # still past the waiting bound at the deadline
                continue
            raise SpcacheError(
                f"{self.url}{record}?wait=: HTTP {response.status_code} "
                f"{response.headers.get(ERROR_HEADER, '')}"
            )

    def _reason(self, sample_id: str, deadline: float) -> str:
        response = self._request(
            "GET",
            f"/v1/caches/{self.fingerprint}/items/{quote(sample_id, safe='/')}",
            max(deadline, time.monotonic() + 5.0),
        )
        if response.status_code != 200:
            return "failed (the service gave no reason)"
        return str(json_body(response).get("reason") or "failed")
