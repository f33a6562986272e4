"""The read-through protocol's rules (cache_store.service_api.protocol) and the one HTTP
client both HTTP readers use (cache_store.service_api.client)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from cache_store.service_api import client as client_module
from cache_store.errors import NoWorkerAlive
from cache_store.service_api.protocol import (
    ERROR_HEADER,
    FAILED,
    MISSING,
    QUEUED,
    SAMPLE_STATES,
    no_worker_message,
    sample_state,
)
from cache_store.jobs.queue import JobQueue
from cache_store.jobs.rows import ITEM_STATUSES
from cache_store.service_api.client import error_of, new_client, send
from tests.helpers.service import InProcessServer


def test_every_queue_status_maps_to_a_sample_state() -> None:
    assert {s: sample_state(s) for s in ITEM_STATUSES} == {
        "pending": QUEUED,
        "running": QUEUED,
        "failed": FAILED,
        "done": MISSING,
        "cancelled": MISSING,
    }
    assert sample_state(None) == MISSING and sample_state("gone") == MISSING
    assert set(map(sample_state, ITEM_STATUSES)) == set(SAMPLE_STATES)


def test_the_no_worker_message_names_the_commands() -> None:
    text = no_worker_message("3 sample(s) missing", "/data/c", 90.0)
    assert text.startswith("3 sample(s) missing: ")
    assert "`spcache worker --cache /data/c`" in text and "90 s" in text


def test_a_supervisor_restart_counts_as_a_worker_for_its_window(tmp_path: Path) -> None:
    now = [1000.0]
    queue = JobQueue(tmp_path, clock=lambda: now[0])
    assert not queue.worker_expected(stale_s=5)
    queue.announce_restart("supervisor:x", within_s=10)
    assert queue.worker_expected(stale_s=5)
    assert queue.live_workers(stale_s=5) == [] and queue.heartbeats() == []  # not a worker
    now[0] += 11
    assert not queue.worker_expected(stale_s=5)  # the new worker never came
    queue.announce_restart("supervisor:x", within_s=10)
    queue.end_restarts("supervisor:x")
    assert not queue.worker_expected(stale_s=5)
    queue.heartbeat("w1", {"heartbeat_s": 1.0})
    assert queue.worker_expected(stale_s=5)
    queue.close()


def _service(answers: list[tuple[int, dict[str, str], bytes]]):
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    calls: list[str] = []

    async def answer(request):
        calls.append(request.method)
        status, headers, body = answers[min(len(calls), len(answers)) - 1]
        return Response(body, status_code=status, headers=headers)

    app = Starlette(routes=[Route("/x", answer, methods=["GET", "HEAD"])])
    return app, calls


def test_no_worker_alive_is_raised_at_once_even_from_a_bodiless_head() -> None:
    app, calls = _service([(503, {ERROR_HEADER: "NoWorkerAlive", "Retry-After": "0"}, b"")])
    with InProcessServer(None, app=app) as server:
        client = new_client(server.url, timeout_s=10, token=None, ca_file=None)
        with pytest.raises(NoWorkerAlive, match="spcache worker"):
            send(lambda: client, "HEAD", "/x", where=server.url, retries=5)
        client.close()
    assert calls == ["HEAD"]


def test_503_is_retried_until_the_deadline_then_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retried after each Retry-After, never sooner: the jitter of the client's own
    back-off (here at its shortest) does not shorten what the service asked for."""
    monkeypatch.setattr(client_module.random, "random", lambda: 0.0)
    busy = (
        503,
        {"Retry-After": "0.2", "content-type": "application/json"},
        b'{"error": "WaitingFull", "detail": "all slots taken"}',
    )
    app, calls = _service([busy])
    with InProcessServer(None, app=app) as server:
        client = new_client(server.url, timeout_s=60, token=None, ca_file=None)
        answered: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: answered.append(
                send(lambda: client, "GET", "/x", where=server.url, deadline=time.monotonic() + 2)
            )
        )
        sender.start()
        sender.join(120)  # past its deadline it stops asking (without one: forever)
        client.close()
    assert not sender.is_alive(), "the client kept retrying past its deadline"
    (response,) = answered
    assert response.status_code == 503 and error_of(response) == ("WaitingFull", "all slots taken")
    assert 2 <= len(calls) <= 2 / 0.2 + 1  # retried, each after Retry-After
