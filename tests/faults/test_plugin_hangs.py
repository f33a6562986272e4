"""Issue 34, case 2: a recipe whose ``compute`` or ``prepare`` never returns.

Before, it stalled everything for ever: under ``spcache serve`` the item stayed
"running" with its lease renewed, another job's items (higher priority) stayed pending,
a read-through reader of another fingerprint got ``MissTimeout``, and ``/readyz`` said
ready; ``spcache precompute`` never ended and printed nothing. Now every sample's
stages have a time limit (the recipe's ``time_limit_s``; here 2 s, and 20 s for
``stalls``):

* the service's worker ends itself past the limit of a ``compute`` (the attempt failed
  naming the limit, the other items handed back) and its supervisor starts a fresh one
  at once: the sample fails after its attempts, naming the limit, and everything else
  goes on; a ``prepare`` past the limit in a loader process gets the loaders replaced
  and fails at once; while a sample has run half its limit, ``/readyz`` names it;
* ``spcache precompute`` interrupts the stage in its own process (``--loaders 0``) or
  replaces the loaders (``--loaders 2``): those samples fail alone, naming the limit,
  and the run ends.

The plugin is installed as a user installs one that is not packaged: a module on
``PYTHONPATH``, named in ``SPCACHE_RECIPES``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cache_store import CachedDataset
from tests.helpers.faults import report
from tests.helpers.plugins import install, use_here
from tests.helpers.procs import run_spcache, wait_for
from tests.helpers.service import AUTH, TOKEN, start_server, stop_server

LIMIT = "time limit of 2 s"


def _clouds(folder: Path, *names: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    past = time.time() - 3600
    paths = []
    for n, name in enumerate(names):
        path = folder / f"{name}.npy"
        np.save(path, np.random.default_rng(n).uniform(-1, 1, size=(60 + n, 3)))
        os.utime(path, (past, past))
        paths.append(path)
    return paths


def _warm(url: str, recipe: str, paths: list[Path], priority: int = 0, **params: Any) -> str:
    answer = httpx.post(
        f"{url}/v1/warmup",
        json={
            "recipe": recipe,
            "params": params,
            "priority": priority,
            "items": [{"id": p.stem, "path": str(p)} for p in paths],
        },
        headers=AUTH,
        timeout=60,
    )
    assert answer.status_code == 202, answer.text
    return str(answer.json()["job_id"])


def _job(url: str, job: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/v1/jobs/{job}", timeout=30).json())


def _finished(url: str, job: str) -> dict[str, Any] | None:
    info = _job(url, job)
    return info if info["counts"]["pending"] + info["counts"]["running"] == 0 else None


@pytest.mark.slow
def test_a_hung_sample_fails_at_its_limit_and_the_service_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = tmp_path / "sources"
    stall = _clouds(sources, "stall0")
    hung = _clouds(sources, "hang0", "prep0", "ok0", "ok1")
    others = _clouds(sources, "other0", "other1")
    reader_cloud = _clouds(sources, "reader0")[0]
    env = install(tmp_path / "plugins", "hangs", "stalls")
    use_here(env, monkeypatch)
    server = start_server(
        tmp_path / "cache", sources, "--device", "cpu", "--backend", "torch", env=env
    )
    figures: dict[str, Any] = {}
    try:
        # /readyz names the sample the worker is stuck on (stalls: 20 s, stuck from 10 s)
        stalled = _warm(server.url, "stalls", stall)
        started = time.monotonic()

        def stuck() -> dict[str, Any] | None:
            worker = httpx.get(f"{server.url}/readyz", timeout=30).json().get("worker", {})
            return worker if worker.get("state") == "stuck" else None

        seen = wait_for(stuck, 120, "/readyz to say the worker is stuck", proc=server.proc)
        assert seen["sample_id"] == "stall0" and seen["stage"] == "compute", seen
        assert seen["limit_s"] == 20 and seen["since"] <= time.time(), seen
        figures["readyz_stuck_after_s"] = round(time.monotonic() - started, 1)
        httpx.delete(f"{server.url}/v1/jobs/{stalled}", headers=AUTH, timeout=30)

        # a job whose samples hang, another job of higher priority, a read-through reader
        hangs = _warm(server.url, "hangs", hung)
        wait_for(
            lambda: (Path(env["SPCACHE_TEST_CONTROL"]) / "entered-hang0").exists(),
            what="the worker computing hang0",
            proc=server.proc,
        )
        urgent = _warm(server.url, "spc", others, priority=10, level=3, surface_samples=200)
        got: dict[str, Any] = {}

        def read() -> None:
            ds = CachedDataset(
                server.url,
                "spc",
                sources=[reader_cloud],
                store_options={"token": TOKEN},
                miss_timeout=150,
                warm_ahead=0,
                level=3,
                surface_samples=100,
            )
            try:
                got["sample"] = ds[0]
            except Exception as exc:  # noqa: BLE001 - the test reports it
                got["error"] = exc
            finally:
                ds.close()

        reader = threading.Thread(target=read)
        reader.start()
        urgent_info = wait_for(
            lambda: _finished(server.url, urgent), 180, "the urgent job", proc=server.proc
        )
        reader.join(180)
        hangs_info = wait_for(
            lambda: _finished(server.url, hangs), 300, "the hanging job", proc=server.proc
        )
        ready = httpx.get(f"{server.url}/readyz", timeout=30)
    finally:
        stop_server(server)
    assert urgent_info["counts"]["done"] == len(others), urgent_info
    assert not reader.is_alive() and "error" not in got, got.get("error")
    assert int(got["sample"]["octree"].numel()) > 0
    errors = {e["sample_id"]: e["error"] for e in hangs_info["errors"]}
    assert set(errors) == {"hang0", "prep0"}, hangs_info
    assert "recipe 'hangs': compute() did not finish within its " + LIMIT in errors["hang0"]
    assert (
        "loading (read, parse, prepare()) did not finish within its " + LIMIT in (errors["prep0"])
    )
    assert hangs_info["counts"]["done"] == 2, hangs_info
    assert ready.status_code == 200, ready.text
    figures.update(
        hangs_job=hangs_info["counts"],
        urgent_job_done=urgent_info["counts"]["done"],
        reader="record",
        reasons=errors,
    )
    report("34.2 hung sample under the service", figures)


@pytest.mark.slow
@pytest.mark.parametrize("loaders", ["0", "2"])
def test_precompute_ends_with_the_hung_samples_failed(tmp_path: Path, loaders: str) -> None:
    sources = tmp_path / "sources"
    _clouds(sources, "hang0", "prep0", "ok0", "ok1")
    env = install(tmp_path / "plugins", "hangs")
    started = time.monotonic()
    ran = run_spcache(
        "precompute", sources, "--recipe", "hangs", "--cache", tmp_path / "cache",
        "--device", "cpu", "--backend", "torch", "--loaders", loaders,
        cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    seconds = round(time.monotonic() - started, 1)
    assert ran.returncode == 1, ran.stderr
    assert "done 2, skipped 0, failed 2" in ran.stdout, ran.stdout
    failed = [line for line in ran.stdout.splitlines() if line.strip().startswith("failed ")]
    assert any("hang0" in f and "compute() did not finish within its " + LIMIT in f for f in failed)
    assert any(
        "prep0" in f and "prepare()) did not finish within its " + LIMIT in f for f in failed
    )
    report("34.2 hung sample under precompute", {"loaders": int(loaders), "seconds": seconds})


@pytest.mark.slow
def test_serve_passes_its_time_limit_to_the_worker(tmp_path: Path) -> None:
    """``spcache serve --time-limit 3`` replaces a recipe's own 20 s: ``/readyz`` names the
    stuck sample with the 3 s limit, and the sample fails naming it (before: serve had no
    such option, so a recipe's own limit was the only one its worker knew)."""
    sources = tmp_path / "sources"
    stall = _clouds(sources, "stall0")
    env = install(tmp_path / "plugins", "stalls")
    server = start_server(
        tmp_path / "cache", sources, "--device", "cpu", "--backend", "torch",
        "--time-limit", "3", env=env,
    )  # fmt: skip
    try:
        job = _warm(server.url, "stalls", stall)

        def stuck() -> dict[str, Any] | None:
            worker = httpx.get(f"{server.url}/readyz", timeout=30).json().get("worker", {})
            return worker if worker.get("state") == "stuck" else None

        seen = wait_for(stuck, 120, "/readyz to say the worker is stuck", proc=server.proc)
        info = wait_for(lambda: _finished(server.url, job), 300, "the job", proc=server.proc)
    finally:
        stop_server(server)
    assert seen["sample_id"] == "stall0" and seen["limit_s"] == 3, seen
    [error] = info["errors"]
    assert "compute() did not finish within its time limit of 3 s" in error["error"], error
    report("34.2 spcache serve --time-limit", {"readyz_limit_s": seen["limit_s"], **info["counts"]})
