"""The worker loop: real queue, real LMDB, real engine (torch backend on the CPU)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from cache_store.keys import compute_fingerprint, record_key
from cache_store.jobs.item_state import item_state
from cache_store.jobs.queue import JobQueue, NewItem
from cache_store.stores.lmdb import LMDBStore
from cache_store.recipes.registry import get_recipe_spec
from cache_store.format.decode import decode_record
from tests.helpers.procs import Proc, run_spcache, start_spcache
from workers.worker_loop import WorkerLoop


def _submit(cache: Path, paths: list[Path], **params: int) -> tuple[JobQueue, str, str]:
    spec = get_recipe_spec("spc")
    resolved = spec.resolve(params)
    fp = compute_fingerprint("spc", spec.version, resolved)
    queue = JobQueue(cache)
    job_id = queue.submit("spc", resolved, fp, [NewItem(p.stem, str(p)) for p in paths])
    return queue, job_id, fp


def _worker(cache: Path, *extra: str) -> Proc:
    return start_spcache(
        "worker",
        "--cache",
        cache,
        "--device",
        "cpu",
        "--backend",
        "torch",
        "--loaders",
        "0",
        "--poll",
        "0.1",
        "--log-level",
        "warning",
        *extra,
    )


def _wait_done(queue: JobQueue, job_id: str, at_least: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while queue.job(job_id).counts["done"] < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} stuck at {queue.job(job_id).counts}")
        time.sleep(0.05)


def test_drain_computes_each_item_and_a_bad_sample_fails_alone(
    tmp_path: Path,
    corpus_meshes: list[Path],
    corpus_bad_inputs: list[Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = tmp_path / "cache"
    bad = next(p for p in corpus_bad_inputs if p.name == "nan_vertices.obj")
    queue, job_id, fp = _submit(cache, corpus_meshes[:3] + [bad], level=4, surface_samples=500)
    loop = WorkerLoop(cache, device="cpu", backend="torch", loaders=0, drain=True)
    with caplog.at_level(logging.INFO, logger="workers.worker_loop"):
        assert loop.run() == 0
    batches = [r.getMessage() for r in caplog.records if "this batch" in r.getMessage()]
    assert batches and f"job {job_id}: 4/4 items finished (1 failed)" in batches[-1], batches
    assert "samples/s" in batches[-1]
    info = queue.job(job_id)
    assert (
        info.counts["done"] == 3
        and info.counts["failed"] == 1
        and info.status == "done_with_errors"
    )
    assert info.errors[0].sample_id == "nan_vertices" and info.errors[0].error
    store = LMDBStore(cache)
    for mesh in corpus_meshes[:3]:
        record = decode_record(store.get(record_key(fp, mesh.stem)))
        assert record.metadata["sample_id"] == mesh.stem and record.tensors["octree"].numel() > 0
        assert item_state(store, queue, fp, mesh.stem).state == "ready"
    failed = item_state(store, queue, fp, "nan_vertices")
    assert failed.state == "failed" and failed.reason == info.errors[0].error
    assert queue.heartbeats()[0]["info"]["processed"] == 4
    store.close()


def test_a_full_cache_fails_a_job_item_only_after_its_retries(
    tmp_path: Path, corpus_meshes: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails for lack of space is the store's failure, not the sample's: the
    item goes back to pending and is tried again (a sample's own failure is final at
    once), and what was committed before stays readable."""
    import workers.worker_loop

    cache = tmp_path / "cache"
    queue, job_id, fp = _submit(cache, corpus_meshes, level=6, surface_samples=4000)
    monkeypatch.setattr(
        workers.worker_loop,
        "open_store",
        lambda path, readonly: LMDBStore(
            path, readonly=readonly, map_size=64 * 1024, max_map_size=192 * 1024
        ),
    )
    loop = WorkerLoop(cache, device="cpu", backend="torch", loaders=0, drain=True)
    loop.run()
    rows = queue.items(job_id)
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and any(r["status"] == "done" for r in rows)
    assert all(r["attempts"] == queue.max_attempts for r in failed), failed
    assert all("no space left" in r["last_error"] for r in failed), failed
    store = LMDBStore(cache)
    assert store.verify().ok
    done = {r["sample_id"] for r in rows if r["status"] == "done"}
    stored = {k.split("/", 1)[1] for k in store.keys(fp + "/")}
    assert done <= stored
    # a record can be stored by a run whose index write then found the cache full: its
    # item fails for that (the store's reason, after its retries) and a later run, with
    # room, finds the record and writes the index without computing it again
    assert all("no space left" in r["last_error"] for r in rows if r["sample_id"] in stored - done)
    store.close()


@pytest.mark.slow
def test_kill_9_mid_job_then_a_new_worker_finishes_without_recomputing(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    cache = tmp_path / "cache"
    meshes = corpus_meshes[:8]
    queue, job_id, fp = _submit(cache, meshes, level=6, surface_samples=20_000)
    with _worker(cache, "--batch", "1", "--lease", "1") as first:
        _wait_done(queue, job_id, 2)
        first.send_signal(signal.SIGKILL)
        first.wait()
    store = LMDBStore(cache)
    before = {k: store.get(k) for k in store.keys(prefix=f"{fp}/")}
    store.close()
    assert 2 <= len(before) < len(meshes)
    with _worker(cache, "--batch", "2", "--lease", "1", "--drain") as second:
        assert second.wait(240) == 0, second.output()[-3000:]
    info = queue.job(job_id)
    assert info.counts["done"] == len(meshes), info.counts
    store = LMDBStore(cache)
    for key, value in before.items():
        assert store.get(key) == value  # computed once: the survivor's records are untouched
    assert sorted(store.keys(prefix=f"{fp}/")) == sorted(record_key(fp, m.stem) for m in meshes)
    report = store.verify()
    assert report.ok and report.checked == len(meshes)
    store.close()


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_leaves_nothing_running(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    cache = tmp_path / "cache"
    queue, job_id, _ = _submit(cache, corpus_meshes[:10], level=6, surface_samples=20_000)
    with _worker(cache, "--batch", "1") as worker:
        _wait_done(queue, job_id, 1)
        assert worker.stop(signal.SIGTERM) == 0, worker.output()[-3000:]
    counts = queue.job(job_id).counts
    assert counts["running"] == 0 and counts["failed"] == 0
    assert counts["done"] >= 1 and counts["done"] + counts["pending"] == 10
    assert os.path.exists(cache / "jobs.sqlite")


def test_service_and_workers_hash_sources_the_same_way(corpus_meshes: list[Path]) -> None:
    # The service counts "already ready" with cache_store.sources.hashing; records carry the
    # workers' source hash. If these ever differ, every warm-up recomputes everything.
    from cache_store.sources.files import hash_source_file
    from workers.source_load import load_source

    for mesh in corpus_meshes[:3]:
        assert hash_source_file(mesh) == load_source(mesh).source_hash


def test_kaolin_on_a_cpu_device_is_refused_before_anything_is_claimed(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """--device cpu --backend kaolin cannot work (Kaolin's SPC ops are CUDA-only): one line,
    exit 2, and the queue never hears of it (no attempt spent, no failure remembered)."""
    cache = tmp_path / "cache"
    queue, job_id, _ = _submit(cache, corpus_meshes[:2], level=4, surface_samples=500)
    proc = run_spcache(
        "worker",
        "--cache",
        cache,
        "--device",
        "cpu",
        "--backend",
        "kaolin",
        "--drain",
        "--loaders",
        "0",
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        (
            "spcache worker: backend 'kaolin' is unavailable: device cpu is not a CUDA "
            "device (Kaolin's SPC ops are CUDA-only); use --backend torch or auto there"
        )
    ]
    rows = queue.items(job_id)
    assert [(r["status"], r["attempts"]) for r in rows] == [("pending", 0), ("pending", 0)]
    assert queue.heartbeats() == []
    loop = WorkerLoop(cache, device="cpu", backend="kaolin", loaders=0, drain=True)
    from cache_store.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="not a CUDA device"):
        loop.run()  # used as a library: refused the same way, before claiming
    assert [r["attempts"] for r in queue.items(job_id)] == [0, 0]


def test_the_worker_says_which_backend_runs_and_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    JobQueue(cache).close()
    with caplog.at_level(logging.INFO, logger="workers.worker_loop"):
        assert WorkerLoop(cache, device="cpu", backend="auto", loaders=0, drain=True).run() == 0
    lines = [r.getMessage() for r in caplog.records if "backend: " in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith(
        "backend: torch (device cpu: Kaolin's SPC ops are CUDA-only); device cpu"
    ), lines
    # a CUDA machine whose Kaolin does not import: the fall-back is a WARNING with the reason
    import torch

    from workers.ops import kaolin_spc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = "kaolin not importable (ImportError: undefined symbol)"
    monkeypatch.setattr(kaolin_spc, "import_spc", lambda: (None, reason))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="workers.worker_loop"):
        WorkerLoop(cache, device="cuda:0", backend="auto").log_backend()
    (record,) = [r for r in caplog.records if "backend: " in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.getMessage().endswith(
        "backend: torch (kaolin not importable (ImportError: undefined symbol)); device cuda:0"
    )


def test_on_a_cpu_only_machine_the_worker_says_so(tmp_path: Path) -> None:
    """``spcache worker`` as a user starts it here (a CPU-only torch): the start line says
    there is no CUDA device, never "device cuda"; ``--backend kaolin`` is refused saying
    why no Kaolin can run here, not advising an install that does not exist."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: this is the CPU-only machine's message")
    (tmp_path / "cache").mkdir()
    JobQueue(tmp_path / "cache").close()
    drain = ["worker", "--cache", "cache", "--drain"]
    started = run_spcache(*drain, cwd=tmp_path)
    assert started.returncode == 0, started.stderr
    (line,) = [x for x in started.stderr.splitlines() if "backend: " in x]
    assert "backend: torch (no CUDA device here (torch " in line
    assert line.endswith("; device auto (cpu here)") and "device cuda" not in line
    kaolin = run_spcache(*drain, "--backend", "kaolin", cwd=tmp_path)
    assert kaolin.returncode == 2
    (said,) = kaolin.stderr.strip().splitlines()
    assert said.startswith("spcache worker: backend 'kaolin' is unavailable: no CUDA device here")
    assert "use --backend torch" in said and "install" not in said


# A worker whose process dies on one sample the way Kaolin's CubDebugExit kills it (exit(1)
# from native code: no exception, no cleanup), started the way `spcache serve` starts it.
_DIES_ON_POISON = """
import os, sys
import workers.engine as engine
compute = engine.LocalRun._compute
def dies_on_poison(self, item, *args, **kwargs):
    if item.sample_id == "poison":
        os._exit(1)
    return compute(self, item, *args, **kwargs)
engine.LocalRun._compute = dies_on_poison
from spcache.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_sample_that_kills_the_worker_fails_alone_after_its_attempts(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """The supervisor restarts the dead worker; the poison sample is claimed again only
    while it has attempts, and the samples claimed with it are finished, not dragged down."""
    from service.supervisor import WorkerSupervisor

    cache = tmp_path / "cache"
    spec = get_recipe_spec("spc")
    params = spec.resolve({"level": 4, "surface_samples": 500})
    fp = compute_fingerprint("spc", spec.version, params)
    queue = JobQueue(cache)
    names = ["first", "poison", "second", "third"]
    job_id = queue.submit(
        "spc", params, fp, [NewItem(n, str(p)) for n, p in zip(names, corpus_meshes, strict=False)]
    )
    command = [
        sys.executable,
        "-c",
        _DIES_ON_POISON,
        "worker",
        "--cache",
        str(cache),
        "--device",
        "cpu",
        "--backend",
        "torch",
        "--loaders",
        "0",
        "--poll",
        "0.1",
        "--lease",
        "1",
        "--batch",
        "4",
        "--max-attempts",
        "3",
        "--log-level",
        "warning",
    ]
    supervisor = WorkerSupervisor(
        command, first_backoff_s=0.1, max_backoff_s=0.2, stop_grace_s=10, cache=cache
    )
    supervisor.start()
    try:
        deadline = time.monotonic() + 240
        while sum(queue.job(job_id).counts.get(s, 0) for s in ("done", "failed")) < len(names):
            assert time.monotonic() < deadline, queue.items(job_id)
            time.sleep(0.2)
    finally:
        supervisor.stop()
    rows = {r["sample_id"]: r for r in queue.items(job_id)}
    assert rows["poison"]["status"] == "failed" and rows["poison"]["attempts"] == 3
    assert "lease expired after the last attempt" in rows["poison"]["last_error"]
    for name in ("first", "second", "third"):
        assert rows[name]["status"] == "done", rows[name]
        assert rows[name]["attempts"] < 3, rows[name]
    assert supervisor.restarts == 3  # three deaths, each followed by a restart


def test_a_cuda_device_this_machine_lacks_is_refused_before_anything_is_claimed(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """``--device cuda:99`` (no CUDA here, or fewer devices): one line naming the device,
    exit 2, and the queue never hears of it, instead of a worker that starts and fails
    every claimed sample for a reason that is not the sample's."""
    cache = tmp_path / "cache"
    queue, job_id, _ = _submit(cache, corpus_meshes[:2], level=4, surface_samples=500)
    proc = run_spcache("worker", "--cache", cache, "--device", "cuda:99", "--drain")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "device: 'cuda:99' requested but" in lines[0], lines
    rows = queue.items(job_id)
    assert [(r["status"], r["attempts"]) for r in rows] == [("pending", 0), ("pending", 0)]
    assert queue.heartbeats() == []
