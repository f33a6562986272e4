"""Case 12: soak: the service serves 8 forked DataLoader workers while its worker writes.

``spcache serve`` runs as a subprocess with its worker child (CPU, torch backend). After
a first warm-up, a feeder keeps submitting warm-ups of new samples, so the worker keeps
computing and committing records, while a ``DataLoader`` with 8 forked workers reads the
first samples through ``CachedDataset`` over HTTP (``HTTPStore``), epoch after epoch, and
checks every sample against what the service's store holds.

``SPCACHE_SOAK_SECONDS`` sets the duration (CI: 60; the full run: 600). RSS of every
process (the service, its worker child, the 8 loader workers, this process) is sampled
every couple of seconds; the first quarter is warm-up, and the mean of the last quarter
must stay within 10% of the mean of the second quarter. Figures: samples read, read
errors (must be 0), records written meanwhile, and RSS per process role.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import torch

from cache_store.readers.dataset import CachedDataset
from cache_store.keys import record_key
from cache_store.format.decode import decode_record
from tests.helpers.faults import env_float, report
from tests.helpers.service import AUTH, start_server, stop_server

SOAK_SECONDS = env_float("SPCACHE_SOAK_SECONDS", 60.0)
LOADER_WORKERS = 8
FIRST = 32
RSS_TOLERANCE = 0.10


def _mesh(path: Path, rng: np.random.Generator) -> None:
    v = rng.uniform(-1, 1, (4, 3))
    path.write_text(
        "".join(f"v {x:.6f} {y:.6f} {z:.6f}\n" for x, y, z in v)
        + "f 1 2 3\nf 1 2 4\nf 1 3 4\nf 2 3 4\n"
    )


def _warmup(client: httpx.Client, ids: list[str]) -> str:
    response = client.post(
        "/v1/warmup",
        headers=AUTH,
        json={
            "recipe": "spc",
            "params": {"level": 4, "surface_samples": 1000},
            "items": [{"id": sid, "path": f"{sid}.obj"} for sid in ids],
        },
    )
    assert response.status_code == 202, response.text
    return response.json()["job_id"]


def _wait_job(client: httpx.Client, job_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("done", "failed"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not finished in {timeout} s")


def _flat(series: list[tuple[float, int]], start: float, end: float) -> tuple[float, float]:
    """Mean RSS (MiB) over the second and over the last quarter of [start, end]."""
    span = end - start
    second = [r for t, r in series if start + span / 4 <= t < start + span / 2]
    last = [r for t, r in series if t >= start + 3 * span / 4]
    return (
        float(np.mean(second)) / 2**20 if second else 0.0,
        float(np.mean(last)) / 2**20 if last else 0.0,
    )


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.timeout(int(SOAK_SECONDS) + 600)
def test_soak_serves_loader_workers_while_the_worker_writes(tmp_path: Path) -> None:
    sources = tmp_path / "sources"
    (sources / "s").mkdir(parents=True)
    rng = np.random.default_rng(12)
    total = FIRST + 8 * int(SOAK_SECONDS + 60)
    for i in range(FIRST):
        _mesh(sources / "s" / f"m{i:05d}.obj", rng)
    cache = tmp_path / "cache"
    server = start_server(cache, sources, "--device", "cpu", "--backend", "torch")
    stop = threading.Event()
    fed = {"jobs": 0, "items": 0, "errors": 0}
    client = httpx.Client(base_url=server.url, timeout=60)
    try:
        first_ids = [f"s/m{i:05d}" for i in range(FIRST)]
        job = _wait_job(client, _warmup(client, first_ids), 300)
        assert job["counts"]["done"] == FIRST, job
        fingerprint = job["fingerprint"]
        service = psutil.Process(server.proc.pid)
        worker = service.children()[0]

        def feed() -> None:
            nxt = FIRST
            with httpx.Client(base_url=server.url, timeout=60) as feeder:
                while not stop.wait(1.0) and nxt + 8 <= total:
                    for i in range(nxt, nxt + 8):
                        _mesh(sources / "s" / f"m{i:05d}.obj", rng)
                    try:
                        _warmup(feeder, [f"s/m{i:05d}" for i in range(nxt, nxt + 8)])
                        fed["jobs"] += 1
                        fed["items"] += 8
                    except (AssertionError, httpx.HTTPError):
                        fed["errors"] += 1
                    nxt += 8

        # A job that reads "done" has every id in the dataset index.
        dataset = CachedDataset(server.url, fingerprint, fields=["octree", "point_hierarchy"])
        assert len(dataset) == FIRST
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        expected = {}
        with httpx.Client(base_url=server.url, timeout=60) as check:
            for sid in first_ids:
                body = check.get(f"/v1/caches/{fingerprint}/records/{sid}").content
                expected[sid] = decode_record(body, key=record_key(fingerprint, sid)).tensors
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=8,
            num_workers=LOADER_WORKERS,
            multiprocessing_context="fork",
            persistent_workers=True,
            timeout=120,
            collate_fn=list,
        )
        rss: dict[str, list[tuple[float, int]]] = {}
        me = psutil.Process()

        def sample(loader_pids: list[int]) -> None:
            now = time.monotonic()
            procs = {"service": service, "worker": worker, "test process": me}
            for i, pid in enumerate(loader_pids):
                procs[f"loader worker {i}"] = psutil.Process(pid)
            for role, proc in procs.items():
                rss.setdefault(role, []).append((now, proc.memory_info().rss))

        read, mismatched, epochs, position = 0, 0, 0, 0
        start = time.monotonic()
        last_sample = 0.0
        iterator = iter(loader)
        loader_pids = [w.pid for w in iterator._workers]
        while time.monotonic() - start < SOAK_SECONDS:
            try:
                batch = next(iterator)
            except StopIteration:
                epochs += 1
                iterator = iter(loader)
                position = 0
                continue
            for tensors in batch:  # in order (no shuffle): the position names the sample
                want = expected[first_ids[position % FIRST]]
                if not all(torch.equal(tensors[n], want[n]) for n in ("octree", "point_hierarchy")):
                    mismatched += 1
                position += 1
                read += 1
            if time.monotonic() - last_sample > 2.0:
                sample(loader_pids)
                last_sample = time.monotonic()
        end = time.monotonic()
        stop.set()
        feeder.join(70)
        del iterator, loader
        written = client.get(f"/v1/caches/{fingerprint}").json()["counts"]["records"]
        alive = service.is_running() and worker.is_running()
    finally:
        stop.set()
        client.close()
        stop_server(server)
    flat = {role: _flat(series, start, end) for role, series in rss.items()}
    ratios = {role: (b / a if a else 0.0) for role, (a, b) in flat.items()}
    figures = {
        "seconds": round(end - start),
        "loader_workers": LOADER_WORKERS,
        "samples_read": read,
        "epochs": epochs,
        "read_errors": mismatched,
        "warmups_submitted_meanwhile": fed["jobs"],
        "feed_errors": fed["errors"],
        "records_at_end": written,
        "records_written_meanwhile": written - FIRST,
        "rss_mib_second_vs_last_quarter": {
            role: [round(a, 1), round(b, 1)] for role, (a, b) in flat.items()
        },
        "worst_rss_ratio": round(max(ratios.values()), 3),
        "processes_alive": alive,
    }
    report("12 soak", figures)
    assert mismatched == 0 and read > 0 and fed["errors"] == 0
    assert written > FIRST  # the worker really wrote while the loaders read
    assert alive
    assert all(r <= 1 + RSS_TOLERANCE for r in ratios.values()), ratios
