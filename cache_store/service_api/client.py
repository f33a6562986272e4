"""Talking to the spcache service over HTTP: one client per process, retries, error bodies.

Used by both HTTP readers, :class:`cache_store.stores.http.HTTPStore` and
:class:`cache_store.readers.http_read_through.HTTPReadThrough`, so that both retry the
same answers the same way and read the same error bodies
(``{"error": <class name>, "detail": <reason>}``, or the ``X-Spcache-Error`` header of a
HEAD answer, which has no body).
"""

from __future__ import annotations

import logging
import os
import random
import ssl
import time
from collections.abc import Callable
from typing import Any

import httpx

from cache_store.errors import NoWorkerAlive, SpcacheError
from cache_store.service_api.protocol import (
    ERROR_HEADER,
    NO_WORKER_ERROR,
    RETRY_AFTER_HEADER,
    no_worker_message,
)

__all__ = ["tls_verify", "new_client", "json_body", "error_of", "retry_after", "send"]

log = logging.getLogger(__name__)

#: The longest back-off between two tries, and the longest ``Retry-After`` obeyed.
MAX_BACKOFF_S = 10.0
MAX_RETRY_AFTER_S = 30.0


def tls_verify(ca_file: str | os.PathLike[str] | None) -> ssl.SSLContext | bool:
    """What an httpx client verifies an https service against: the system's CAs, or only
    ``ca_file`` (PEM: the CA that signed the service's certificate, or a self-signed
    certificate itself) when given."""
    if ca_file is None:
        return True
    return ssl.create_default_context(cafile=os.fspath(ca_file))


def new_client(
    url: str,
    *,
    timeout_s: float,
    token: str | None,
    ca_file: str | os.PathLike[str] | None,
    max_connections: int | None = None,
) -> httpx.Client:
    """An httpx client for the service at ``url`` (bearer ``token`` sent when given)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    limits = (
        httpx.Limits()
        if max_connections is None
        else httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
    )
    return httpx.Client(
        base_url=url, timeout=timeout_s, headers=headers, verify=tls_verify(ca_file), limits=limits
    )


def json_body(response: httpx.Response) -> dict[str, Any]:
    """The answer's JSON object; anything else as ``{"error": "", "detail": <text>}``."""
    try:
        body = response.json()
    except ValueError:
        return {"error": response.headers.get(ERROR_HEADER, ""), "detail": response.text[:500]}
    return body if isinstance(body, dict) else {"error": "", "detail": str(body)[:500]}


def error_of(response: httpx.Response) -> tuple[str, str]:
    """``(error class name, detail)`` of an error answer (header only for a HEAD)."""
    body = json_body(response)
    error = str(body.get("error") or response.headers.get(ERROR_HEADER, ""))
    return error, str(body.get("detail", ""))


def retry_after(response: httpx.Response, default: float) -> float:
    """Seconds the answer asks us to wait (``Retry-After``), within [0, 30]."""
    try:
        wait = float(response.headers.get(RETRY_AFTER_HEADER, default))
    except ValueError:
        return default
    return min(max(wait, 0.0), MAX_RETRY_AFTER_S)


def send(
    http: Callable[[], httpx.Client],
    method: str,
    path: str,
    *,
    where: str,
    retries: int | None = None,
    deadline: float | None = None,
    backoff_s: float = 0.1,
    **kwargs: Any,
) -> httpx.Response:
    """One request, retried on connection errors and 503 answers.

    Back-off doubles from ``backoff_s`` (jittered, at most 10 s; a ``Retry-After``
    answer is obeyed instead) until ``retries`` more tries are spent or the next one
    would start past ``deadline`` (``time.monotonic()``). A 503 ``NoWorkerAlive`` is
    never retried: it is raised with the service's reason. Returns the last answer (a
    503 once the retries ran out); raises :class:`SpcacheError` naming ``where`` when
    the last try could not connect.
    """
    delay = backoff_s
    attempt = 0
    while True:
        response: httpx.Response | None
        try:
            answer = http().request(method, path, **kwargs)
        except httpx.TransportError as exc:
            response, wait = None, delay
            failure: BaseException = exc
        else:
            response = answer
            if answer.status_code != 503:
                return answer
            error, detail = error_of(answer)
            if error == NO_WORKER_ERROR:
                raise NoWorkerAlive(
                    detail or no_worker_message(f"{where}{path}", "<the service's cache>")
                )
            wait = retry_after(answer, delay)
        out_of_tries = retries is not None and attempt >= retries
        out_of_time = deadline is not None and time.monotonic() + wait >= deadline
        if out_of_tries or out_of_time:
            if response is not None:
                return response
            raise SpcacheError(
                f"{where}{path}: {type(failure).__name__}: {failure} (after {attempt + 1} attempts)"
            ) from failure
        if response is None or RETRY_AFTER_HEADER not in response.headers:
            wait *= 0.5 + random.random()  # our own back-off, jittered; Retry-After obeyed
        if deadline is not None:
            wait = min(wait, max(deadline - time.monotonic(), 0.0))
        log.debug("%s %s: retrying in %.2fs", method, path, wait)
        time.sleep(wait)
        delay = min(delay * 2 or 0.1, MAX_BACKOFF_S)
        attempt += 1
