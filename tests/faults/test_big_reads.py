"""Unauthenticated reads of the largest records do not grow the service's memory.

12 concurrent GETs of a ~256 MB record took the service from 67 to 3,647 MiB (the record
was copied on the event loop and its read-budget reservation released once uvicorn had
buffered the body, not once it had left), and 12 previews of it 4,459 MiB (each copied
the whole record, with no budget). Now a large record is streamed from the LMDB map one
chunk at a time with its reservation held until the last chunk is sent, and a preview
reads only the fields it draws, through the same budget, with rendered pictures cached
by ETag.

Against a real ``spcache serve --no-worker`` with a read budget of two records (plus 16 MiB), its
anonymous RSS (RSS less file-backed pages: the map's pages are page cache) sampled every
10 ms while ``CLIENTS`` GETs and ``CLIENTS`` previews (each a different picture size, so
none is served from the picture cache) of one ``RECORD_MIB`` MiB record run at once
(scaled down from 256 MB for a shared 2-core VM: every copy the old code made scales
with the record, the new code's memory with the chunk size):

* every GET answers 200 with the whole record, or 503 (budget); every preview 200 or 503;
* peak growth stays within the configured budget plus ``SLACK_MIB``;
* ``/healthz`` answers 200 throughout (each probe waits up to 120 s: a bound, not a goal;
  1.3-1.8 s measured on the loaded VM, reported as ``healthz_max_s``).
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest

from cache_store.format.encode import encode_record
from cache_store.keys import compute_fingerprint, record_key
from cache_store.recipes.registry import get_recipe_spec
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.faults import env_int, report
from tests.helpers.service import start_server, stop_server

MIB = 1 << 20
RECORD_MIB = env_int("SPCACHE_FAULT_BIG_RECORD_MIB", 64)
CLIENTS = env_int("SPCACHE_FAULT_BIG_CLIENTS", 12)
SLACK_MIB = 48  # imports warmed by the first requests, chunks in flight, PNGs


def _big_record(fp: str, sample_id: str) -> bytes:
    import torch

    pyramid = torch.tensor([[1, 1, 0], [0, 1, 2]], dtype=torch.int32)  # level 1, one voxel
    return encode_record(
        {
            "point_hierarchy": torch.tensor([[0, 0, 0], [1, 1, 1]], dtype=torch.int16),
            "pyramid": pyramid,
            "features": torch.zeros(RECORD_MIB * MIB, dtype=torch.uint8),
        },
        {
            "recipe": "spc",
            "recipe_version": "1",
            "fingerprint": fp,
            "sample_id": sample_id,
            "source_hash": "xxh3_128:" + "0" * 32,
            "backend": "torch",
            "device": "cpu",
        },
    )


class _PeakAnonRSS:
    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.base = self.peak = self._anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _anon(self) -> int:
        info = self.proc.memory_info()
        return info.rss - info.shared

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._anon())
            time.sleep(0.01)

    def __enter__(self) -> _PeakAnonRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl (apt-get install curl)")
def test_big_reads_and_previews_stay_within_the_read_budget(tmp_path: Path) -> None:
    spec = get_recipe_spec("spc")
    fp = compute_fingerprint("spc", spec.version, spec.resolve({"level": 4}))
    (tmp_path / "sources").mkdir()
    value = _big_record(fp, "big")
    with LMDBStore(tmp_path / "cache", readonly=False) as store:
        store.put_many([(record_key(fp, "big"), value)])
    size = len(value)
    del value
    budget = 2 * size + 16 * MIB  # two records, and room for the pictures' fields
    server = start_server(
        tmp_path / "cache",
        tmp_path / "sources",
        "--no-worker",
        env={"SPCACHE_MAX_READ_BYTES_IN_FLIGHT": str(budget)},
    )
    record = f"{server.url}/v1/caches/{fp}/records/big"
    preview = f"{server.url}/v1/caches/{fp}/previews/big"
    try:
        httpx.get(preview, params={"size": 64}, timeout=60)  # warm the renderer's imports
        health: list[float] = []
        health_codes: list[str] = []
        stop = threading.Event()

        def poll_health() -> None:
            # from another process (curl): this one's GIL is busy with 24 clients
            while not stop.is_set():
                probe = subprocess.run(
                    [
                        "curl",
                        "-s",
                        "-o",
                        "/dev/null",
                        "-w",
                        "%{http_code} %{time_total}",
                        "--max-time",
                        "120",
                        f"{server.url}/healthz",
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout.split()
                code, took = probe if len(probe) == 2 else ("none", "120")
                health_codes.append(code)
                health.append(float(took))
                time.sleep(0.05)

        def read(_: int) -> str:
            with httpx.stream("GET", record, timeout=120) as r:
                got = sum(len(c) for c in r.iter_bytes())
            return f"GET {r.status_code}" + (
                "" if r.status_code != 200 or got == size else f" short ({got})"
            )

        def picture(i: int) -> str:
            r = httpx.get(preview, params={"size": 72 + 8 * i}, timeout=120)
            return f"preview {r.status_code}"

        with _PeakAnonRSS(server.proc.pid) as rss, cf.ThreadPoolExecutor(2 * CLIENTS) as pool:
            watcher = threading.Thread(target=poll_health, daemon=True)
            watcher.start()
            futures = [pool.submit(read, i) for i in range(CLIENTS)]
            futures += [pool.submit(picture, i) for i in range(CLIENTS)]
            answers = Counter(f.result() for f in futures)
            stop.set()
            watcher.join(30)
        growth_mib = (rss.peak - rss.base) / MIB
    finally:
        stop_server(server)
    assert set(answers) <= {"GET 200", "GET 503", "preview 200", "preview 503"}, answers
    assert answers["GET 200"] >= 1 and answers["preview 200"] >= 1, answers
    assert growth_mib <= budget / MIB + SLACK_MIB, (growth_mib, answers)
    assert health_codes and set(health_codes) == {"200"}, Counter(health_codes)
    report(
        "big_reads",
        {
            "record_mib": round(size / MIB, 1),
            "clients": CLIENTS,
            "budget_mib": budget // MIB,
            "answers": dict(answers),
            "peak_rss_growth_mib": round(growth_mib, 1),
            "healthz_max_s": round(max(health), 2),
        },
    )
