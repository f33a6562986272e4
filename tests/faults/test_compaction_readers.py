"""Readers of the LMDB map while ``spcache compact`` swaps it, or another process grows it.

A record read with ``LMDBStore.read_view`` (and the service's stream of a large record)
points into the environment's memory map. A compaction swaps a new file in and retires
the old environment; growing the map re-maps it. Neither may unmap memory a view still
points into: the retired map stays until its last user is done, a re-map waits until no
transaction of the process uses the map (and readers reserve enough address space that
it practically never has to), and a slow client is cut off by the stream's time limit,
never by the process dying. Before issue 34 all three ended in SIGSEGV.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from pathlib import Path

import httpx

from cache_store.stores.lmdb import LMDBStore
from tests.helpers.fault_children import FAULT_FINGERPRINT, make_small_record
from tests.helpers.faults import Child, report
from tests.helpers.housekeeping import add_fingerprint
from tests.helpers.procs import run_spcache, serve, wait_for

BIG = 24 << 20  # the record: 24 MiB


def _add_big(cache: Path, fingerprint: str, nbytes: int = BIG, **options: int) -> str:
    key = f"{fingerprint}/big"
    with LMDBStore(cache, readonly=False, **options) as store:
        store.put_many([(key, make_small_record(key, nbytes, 7))])
    return key


def _stored(cache: Path, key: str) -> bytes:
    with LMDBStore(cache) as store:
        return store.get(key)


def _stored_sha(cache: Path, key: str) -> str:
    return hashlib.sha256(_stored(cache, key)).hexdigest()


def _deleted_maps(pid: int) -> int:
    """Deleted LMDB data files process ``pid`` still maps (swapped-out generations)."""
    with open(f"/proc/{pid}/maps", encoding="utf-8") as fh:
        return len({line.split(None, 5)[-1] for line in fh if "data.mdb (deleted)" in line})


def test_a_view_held_across_spcache_compact_stays_readable_until_released(
    tmp_path: Path, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    add_fingerprint(cache, 3, n=40, nbytes=4096)
    key = _add_big(cache, FAULT_FINGERPRINT)
    holder = Child("hold-view", str(cache), key, "4", stdin=True)
    children.append(holder)
    held = holder.expect("holding ").split()[1]
    compact = run_spcache("compact", "--cache", str(cache), "--json")
    assert compact.returncode == 0, compact.stderr
    holder.send("go")  # it now reads on, adopting the compacted file, for 4 s
    while_held = int(holder.expect("retired-maps ").split()[1])
    _, again, _, reads = holder.expect("view ").split()
    after_release = int(holder.expect("released retired-maps ").split()[2])
    code = holder.wait(60)
    figures = {
        "view_bytes": BIG,
        "reads_while_held": int(reads),
        "view_unchanged": again == held == _stored_sha(cache, key),
        "retired_maps_while_held": while_held,
        "retired_maps_after_release": after_release,
        "exit_status": code,
    }
    report("34.1 view held across compact", figures)
    assert code == 0 and again == held == _stored_sha(cache, key)
    assert int(reads) > 0
    assert while_held == 1  # the swapped-out file is still mapped for the view
    assert after_release == 0  # and unmapped with its last user


def test_a_view_held_while_another_process_grows_the_map_stays_readable(
    tmp_path: Path, children: list[Child]
) -> None:
    """A writer process grows the data far past what the reader had mapped; the reader
    then reads the new records while holding its view (before: LMDB re-mapped under it)."""
    cache = tmp_path / "cache"
    key = _add_big(cache, FAULT_FINGERPRINT, 4 << 20, map_size=1 << 20)
    holder = Child("hold-view", str(cache), key, "2", stdin=True)
    children.append(holder)
    held = holder.expect("holding ").split()[1]
    before = os.stat(cache / "records" / "data.mdb").st_size
    writer = Child(
        "writer", str(cache), "--batches", "4", "--size", "40", "--record-bytes", str(256 << 10)
    )
    children.append(writer)
    assert writer.wait(300) == 0, writer.describe()
    after = os.stat(cache / "records" / "data.mdb").st_size
    holder.send("go")
    _, again, _, reads = holder.expect("view ").split()
    code = holder.wait(60)
    figures = {
        "data_bytes_when_viewed": before,
        "data_bytes_after_growth": after,
        "records_read_while_held": int(reads),
        "view_unchanged": again == held,
        "exit_status": code,
    }
    report("34.1 view held while the map grows", figures)
    assert after > 4 * before  # far past the reader's mapping of before
    assert code == 0 and again == held and int(reads) >= 160


class _SlowClient(threading.Thread):
    """A GET over a raw socket with a small receive buffer, read at ``rate`` bytes/s."""

    def __init__(self, port: int, path: str, rate: int) -> None:
        super().__init__(daemon=True)
        self.port, self.path, self.rate = port, path, rate
        self.head = b""
        self.body = 0
        self.length: int | None = None
        self.ended_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._read()
        except (OSError, AssertionError, ValueError) as exc:  # reported by the test
            self.error = exc
        self.ended_at = time.monotonic()

    def _read(self) -> None:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
            sock.connect(("127.0.0.1", self.port))
            request = f"GET {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            sock.sendall(request.encode())
            step = self.rate // 10
            while True:
                data = sock.recv(step)
                if not data:
                    return
                if self.length is None:
                    self.head += data
                    if b"\r\n\r\n" not in self.head:
                        continue
                    head, _, rest = self.head.partition(b"\r\n\r\n")
                    self.head = head
                    lines = head.decode("latin-1").split("\r\n")
                    assert lines[0].startswith("HTTP/1.1 200"), lines[0]
                    fields = dict(line.split(": ", 1) for line in lines[1:])
                    self.length = int(fields.get("content-length", fields.get("Content-Length")))
                    data = rest
                self.body += len(data)
                time.sleep(len(data) / self.rate)


def test_spcache_compact_under_a_slow_client_never_kills_the_service(tmp_path: Path) -> None:
    """The issue's run: a client reading a 24 MiB record at 160 KiB/s while ``spcache
    compact`` runs (before: SIGSEGV 67 s after the service adopted the compacted file).
    Now the stream is cut off at its time limit (here 10 s + 24 MiB at 1 MiB/s), the
    service lives on and serves the record from the compacted file, and the old file is
    unmapped once the stream let go of it."""
    cache = tmp_path / "cache"
    fp = add_fingerprint(cache, 3, n=40, nbytes=4096)
    key = _add_big(cache, fp)
    log = tmp_path / "serve.log"
    env = {"SPCACHE_MIN_STREAM_BYTES_PER_S": str(1 << 20)}
    with serve("--cache", str(cache), "--no-worker", env=env, log=log) as server:
        client = _SlowClient(server.port, f"/v1/caches/{fp}/records/big", 160 << 10)
        started = time.monotonic()
        client.start()
        wait_for(lambda: client.body >= 1 << 20 or not client.is_alive(), 120, "1 MiB read")
        compact = run_spcache("compact", "--cache", str(cache), "--json")
        assert compact.returncode == 0, compact.stderr
        compacted_at = time.monotonic()
        served_meanwhile = 0
        while client.is_alive() and time.monotonic() - started < 300:
            # other reads go on (and make the service adopt the compacted file)
            answer = httpx.get(f"{server.url}/v1/caches/{fp}/records/s000001", timeout=30)
            assert answer.status_code == 200, server.proc.describe()
            served_meanwhile += 1
            time.sleep(0.5)
        assert not client.is_alive(), "the slow client was never cut off"
        assert client.error is None, client.error
        assert server.proc.alive(), server.proc.describe()
        whole = httpx.get(f"{server.url}/v1/caches/{fp}/records/big", timeout=120)
        unmapped = wait_for(
            lambda: _deleted_maps(server.proc.pid) == 0 or None, 60, "the old map to go"
        )
        assert server.proc.alive(), server.proc.describe()
        logged = log.read_text()
    assert client.ended_at is not None
    figures = {
        "record_bytes": client.length,
        "client_bytes_read": client.body,
        "client_rate_bytes_per_s": 160 << 10,
        "cut_after_s": round(client.ended_at - started, 1),
        "compacted_after_s": round(compacted_at - started, 1),
        "other_reads_meanwhile": served_meanwhile,
        "service_alive": True,
        "whole_read_after": whole.status_code,
        "old_map_unmapped": unmapped is True,
    }
    report("34.1 slow client while compacting", figures)
    stored = _stored(cache, key)
    assert client.length == len(stored) and client.body < client.length  # cut short
    assert "the client took too long" in logged and "connection closed" in logged
    assert whole.status_code == 200 and whole.content == stored
    assert unmapped is True
