"""Case 10: oversized, unbounded and slow request bodies against a real ``spcache serve``.

The service runs as a subprocess with its worker child, a 64 KiB body limit and a 10 s
body deadline (long enough that a loaded machine answers the other requests well within
it). Against it, on every route that reads a body (warm-up, batch):

* bodies of twice the limit with a Content-Length: 413 before the body is read;
* chunked bodies without a length, twice the limit: 413 once the limit is passed;
* a garbage Content-Length: 400;
* clients sending one byte a second (``SLOW_CLIENTS`` at once): 408 at the deadline,
  while another request is answered before any of them is (it does not queue behind
  them; how long it took is reported);
* many oversized requests in a row.

Figures: answers by kind (must all be the promised status), the service's RSS before and
after (must stay within ``RSS_BUDGET_MIB``), and the service and its worker child still
the same live processes at the end.
"""

from __future__ import annotations

import concurrent.futures as cf
import socket
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest

from tests.helpers.faults import env_int, report
from tests.helpers.service import TOKEN, build_cache, start_server, stop_server

LIMIT = 64 * 1024
BODY_TIMEOUT_S = 10.0
SLOW_CLIENTS = env_int("SPCACHE_FAULT_SLOW_CLIENTS", 16)
FLOOD = env_int("SPCACHE_FAULT_BIG_BODIES", 200)
RSS_BUDGET_MIB = 64


def _send(
    port: int, head: str, chunks: list[bytes], pause_s: float = 0.0, timeout: float = 30.0
) -> int:
    """Write a request head and body pieces (pausing between them); return the status."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.encode())
        try:
            for piece in chunks:
                sock.sendall(piece)
                if pause_s:
                    time.sleep(pause_s)
                    sock.setblocking(False)
                    try:  # answered already? stop trickling
                        if sock.recv(1, socket.MSG_PEEK):
                            break
                    except BlockingIOError:
                        pass
                    finally:
                        sock.setblocking(True)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: read what it said
        data = b""
        try:
            while b"\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:
            pass
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0


def _head(method: str, path: str, extra: str) -> str:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    )


def _chunked(total: int) -> list[bytes]:
    piece = b"[" + b"1," * 4000
    out, sent = [], 0
    while sent < total:
        out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        sent += len(piece)
    return out + [b"0\r\n\r\n"]


@pytest.mark.slow
def test_big_chunked_and_slow_bodies_are_refused_within_a_memory_budget(tmp_path: Path) -> None:
    cache = build_cache(tmp_path, n=3)
    server = start_server(
        cache.root,
        cache.sources,
        "--max-body-bytes",
        str(LIMIT),
        "--device",
        "cpu",
        "--backend",
        "torch",
        env={"SPCACHE_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)},
    )
    try:
        port = int(server.url.rsplit(":", 1)[1])
        service = psutil.Process(server.proc.pid)
        deadline = time.monotonic() + 60
        while not service.children() and time.monotonic() < deadline:
            time.sleep(0.1)
        worker_pids = {c.pid for c in service.children()}
        rss_before = service.memory_info().rss
        routes = [("POST", "/v1/warmup"), ("POST", f"/v1/caches/{cache.fingerprint}/batch")]
        answers: Counter[str] = Counter()
        wrong: list[str] = []

        def expect(kind: str, status: int, allowed: set[int]) -> None:
            answers[f"{kind}: {status}"] += 1
            if status not in allowed:
                wrong.append(f"{kind}: {status}")

        big = b"[" + b"0," * LIMIT + b"0]"
        for method, path in routes:
            expect(
                "declared 2x limit",
                _send(port, _head(method, path, f"Content-Length: {len(big)}\r\n"), [big]),
                {413},
            )
            expect(
                "chunked 2x limit",
                _send(
                    port, _head(method, path, "Transfer-Encoding: chunked\r\n"), _chunked(2 * LIMIT)
                ),
                {413},
            )
            expect(
                "bad Content-Length",
                _send(port, _head(method, path, "Content-Length: lots\r\n"), [b"{}"]),
                {400},
            )

        def flood(i: int) -> int:
            method, path = routes[i % 2]
            return _send(port, _head(method, path, f"Content-Length: {len(big)}\r\n"), [big])

        with cf.ThreadPoolExecutor(8) as pool:
            for status in pool.map(flood, range(FLOOD)):
                expect("flood 2x limit", status, {413})

        def slow(i: int) -> int:
            method, path = routes[i % 2]
            body = b'{"ids": ["shapes/s0"]}'
            return _send(
                port,
                _head(method, path, f"Content-Length: {len(body) + 100}\r\n"),
                [body[j : j + 1] for j in range(len(body))],
                pause_s=1.0,
            )

        with cf.ThreadPoolExecutor(SLOW_CLIENTS + 1) as pool:
            started = time.monotonic()
            slow_results = [pool.submit(slow, i) for i in range(SLOW_CLIENTS)]
            time.sleep(0.5)
            with httpx.Client(base_url=server.url, timeout=120) as client:
                t0 = time.monotonic()
                meanwhile = client.get(f"/v1/caches/{cache.fingerprint}/records/shapes/s0")
                meanwhile_s = time.monotonic() - t0
            slow_answered_before = sum(f.done() for f in slow_results)
            for future in slow_results:
                expect("1 byte/s body", future.result(), {408})
            slow_s = time.monotonic() - started
        rss_after = service.memory_info().rss
        alive = service.is_running() and service.status() != psutil.STATUS_ZOMBIE
        children_after = {c.pid for c in service.children()}
        healthy = httpx.get(server.url + "/healthz", timeout=10).status_code
    finally:
        stop_server(server)
    growth_mib = (rss_after - rss_before) / 2**20
    report(
        "10 limits",
        {
            "body_limit_bytes": LIMIT,
            "body_timeout_s": BODY_TIMEOUT_S,
            "answers": dict(answers),
            "slow_clients": SLOW_CLIENTS,
            "slow_clients_answered_after_s": round(slow_s, 1),
            "other_request_during_slow_clients_s": round(meanwhile_s, 3),
            "service_rss_mib_before_after": [
                round(rss_before / 2**20, 1),
                round(rss_after / 2**20, 1),
            ],
            "rss_budget_mib": RSS_BUDGET_MIB,
            "worker_child_same": worker_pids == children_after and bool(worker_pids),
            "service_alive": alive,
        },
    )
    assert not wrong, wrong
    # answered while every slow client still waited for its 408 (each got it: see `wrong`)
    assert meanwhile.status_code == 200 and slow_answered_before == 0
    assert growth_mib < RSS_BUDGET_MIB
    assert alive and healthy == 200 and worker_pids and children_after == worker_pids
