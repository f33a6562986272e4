"""A read-through loader and a worker that dies: restarted by ``spcache serve``, or left
unreaped as a zombie.

* The service's supervisor restarts its worker child after a crash. A loader waiting
  for a miss must wait for the new worker, not fail with ``NoWorkerAlive`` as soon as
  the dead pid is gone: the supervisor announces the restart in the job queue.
* A worker killed but not reaped by its parent is a zombie: ``kill(pid, 0)`` still
  succeeds for it. A waiting loader must take it for dead at once, not for alive for
  the whole heartbeat window (about 117 s with the default lease).

Real worker processes (CPU, torch backend), real LMDB and SQLite, real meshes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from cache_store import CachedDataset
from cache_store.errors import NoWorkerAlive
from cache_store.jobs.queue import JobQueue
from service.supervisor import WorkerSupervisor, worker_command
from tests.helpers.faults import report
from tests.helpers.plugins import install, use_here
from tests.helpers.procs import wait_for
from tests.helpers.service import TOKEN, start_server, stop_server
from tests.helpers.procs import start_spcache

PARAMS = {"level": 8, "surface_samples": 20_000, "uniform_queries": 1024, "surface_queries": 1024}
WORKER_ARGS = ["--loaders", "0", "--poll", "0.05", "--batch", "4", "--log-level", "warning"]


def _wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return chr(stat[stat.rfind(b")") + 2])


@pytest.mark.slow
def test_loaders_wait_while_the_service_restarts_its_worker(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    queue = JobQueue(cache)
    supervisor = WorkerSupervisor(
        worker_command(str(cache), device="cpu", backend="torch", extra=WORKER_ARGS),
        cache=cache,
        first_backoff_s=1.0,
    )
    supervisor.start()
    try:
        _wait_for(lambda: queue.live_workers(), 90, "the first worker's heartbeat")
        first = supervisor.pid
        assert first is not None
        # Frozen, it claims nothing: the loader's miss waits until the worker is killed.
        os.kill(first, signal.SIGSTOP)
        ds = CachedDataset(
            cache, "spc_query", sources=corpus_meshes[:2], miss_timeout=120, **PARAMS
        )
        got: dict[str, Any] = {}

        def load() -> None:
            try:
                got["sample"] = ds[0]
            except Exception as exc:  # noqa: BLE001 - the test reports it
                got["error"] = exc
            got["at"] = time.monotonic()

        loader = threading.Thread(target=load)
        loader.start()
        _wait_for(lambda: queue.counts()["pending"] >= 1, 30, "the loader to queue its miss")
        time.sleep(0.5)
        killed = time.monotonic()
        os.kill(first, signal.SIGKILL)
        loader.join(150)
        assert not loader.is_alive(), "the loader is still waiting"
        assert "error" not in got, f"the loader failed while the worker restarted: {got['error']!r}"
        assert "octree" in got["sample"]
        assert supervisor.restarts == 1 and supervisor.pid not in (None, first)
        report(
            "26.m worker restart",
            {"kill_to_record_s": round(got["at"] - killed, 2), "loader_errors": 0},
        )
        ds.close()
    finally:
        supervisor.stop()
        queue.close()
    assert not JobQueue(cache).worker_expected()  # a stopped service announces nothing


@pytest.mark.slow
def test_a_loader_does_not_wait_on_a_zombie_worker(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    queue = JobQueue(cache)
    with start_spcache(
        "worker", "--cache", cache, "--device", "cpu", "--backend", "torch", *WORKER_ARGS
    ) as proc:
        # (never proc.alive() or proc.wait() before the end: either would reap it)
        _wait_for(lambda: queue.live_workers(), 90, "the worker's heartbeat")
        os.kill(proc.pid, signal.SIGKILL)  # and not reaped: this process never waits yet
        _wait_for(lambda: _state(proc.pid) == "Z", 60, "the worker to be a zombie")
        # Taken for alive, the zombie would hold the miss until MissTimeout (after
        # miss_timeout): NoWorkerAlive instead says it was seen dead. How soon is reported.
        ds = CachedDataset(
            cache, "spc_query", sources=corpus_meshes[:1], miss_timeout=120, **PARAMS
        )
        start = time.monotonic()
        with pytest.raises(NoWorkerAlive, match=f"spcache worker --cache {cache}"):
            ds[0]
        waited = time.monotonic() - start
        report("26.m zombie worker", {"fail_after_s": round(waited, 2)})
        ds.close()
    queue.close()


@pytest.mark.slow
def test_the_restarted_worker_takes_over_the_dead_workers_leases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34, case 9: the worker child of ``spcache serve`` is killed while it holds
    the lease of the very sample a URL loader waits for. The supervisor knows its child
    died: it hands the child's leases back at restart (the attempt counted), so the new
    worker computes the sample at once instead of after the lease (120 s) runs out; the
    loader's ``miss_timeout`` (100 s) ends before that lease would."""
    sources, cache = tmp_path / "sources", tmp_path / "cache"
    sources.mkdir()
    cloud = sources / "held0.npy"
    np.save(cloud, np.random.default_rng(0).uniform(-1, 1, size=(200, 3)))
    past = time.time() - 3600
    os.utime(cloud, (past, past))
    env = install(tmp_path / "plugins", "held")
    use_here(env, monkeypatch)
    control = Path(env["SPCACHE_TEST_CONTROL"])
    (control / "hold").touch()
    server = start_server(cache, sources, "--device", "cpu", "--backend", "torch", env=env)
    queue = JobQueue(cache)
    got: dict[str, Any] = {}
    try:
        ds = CachedDataset(
            server.url,
            "held",
            sources=[cloud],
            store_options={"token": TOKEN},
            warm_ahead=0,
            miss_timeout=100,
        )

        def load() -> None:
            try:
                got["sample"] = ds[0]
            except Exception as exc:  # noqa: BLE001 - the test reports it
                got["error"] = exc
            got["at"] = time.monotonic()

        loader = threading.Thread(target=load)
        loader.start()
        wait_for((control / "entered-held0").exists, what="the worker computing the sample")
        held = queue.latest_item(ds.fingerprint, "held0")
        assert held is not None and held["status"] == "running", held
        worker = int(held["lease_owner"].rsplit(":", 1)[1])
        assert worker in {p.pid for p in psutil.Process(server.proc.pid).children()}
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        (control / "hold").unlink()
        loader.join(150)
        assert not loader.is_alive(), "the loader is still waiting"
        assert "error" not in got, f"the loader failed: {got['error']!r}"
        assert int(got["sample"]["count"][0]) == 200
        report(
            "34.9 restart takes over leases",
            {"kill_to_record_s": round(got["at"] - killed, 2), "loader_errors": 0},
        )
        ds.close()
    finally:
        (control / "hold").unlink(missing_ok=True)
        stop_server(server)
        queue.close()
