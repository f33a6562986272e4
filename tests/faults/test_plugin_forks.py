"""Issue 34, case 4: a recipe that forks, inside the worker.

* A ``multiprocessing.Pool`` (fork context) in ``compute`` hung the service's worker
  (0 of 10 done after 180 s; fine under ``spcache precompute``): the pool's children
  inherited the worker's SIGTERM handler, which only asks the worker loop to stop, so
  ``Pool.terminate()`` (the ``with`` block's end) waited for ever on children that never
  ended. Every handler spcache installs now acts only in the process that installed it
  (``cache_store.process_local.this_process_only``); in a forked child the signal does
  what it does by default. Against a live ``spcache serve``, the plugin installed from a
  module on ``PYTHONPATH`` named in ``SPCACHE_RECIPES``; and a recipe calling
  ``os.fork()`` 10 times per sample next to it.
* ``os.fork()`` while the engine's writer thread is inside a write transaction: the
  at-fork hook closed every environment of the process, that one too, so the write
  failed ("Attempt to operate on closed/deleted/dropped object", or "environment already
  open in this process" on the re-open). An environment with a write under way now
  stays open over the fork; the child, which cannot open that cache itself (py-lmdb
  allows one open per process), is told so in one line. The race is made certain here:
  a real LMDB write held open in a thread of this process while it forks, as the writer
  thread is when a recipe forks in ``compute``.
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

from cache_store.stores.lmdb import LMDBStore
from tests.helpers.faults import report
from tests.helpers.plugins import install
from tests.helpers.procs import wait_for
from tests.helpers.service import AUTH, start_server, stop_server

SAMPLES = 10


def _clouds(folder: Path, prefix: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    past = time.time() - 3600
    paths = []
    for n in range(SAMPLES):
        path = folder / f"{prefix}{n}.npy"
        np.save(path, np.random.default_rng(n).uniform(-1, 1, size=(50 + n, 3)))
        os.utime(path, (past, past))
        paths.append(path)
    return paths


@pytest.mark.slow
def test_a_recipe_with_a_process_pool_or_a_fork_finishes_under_the_worker(tmp_path: Path) -> None:
    sources = tmp_path / "sources"
    pooled, forked = _clouds(sources, "p"), _clouds(sources, "f")
    env = install(tmp_path / "plugins", "pooled", "forks")
    server = start_server(
        tmp_path / "cache", sources, "--device", "cpu", "--backend", "torch", env=env
    )
    infos: dict[str, Any] = {}
    try:
        for recipe, paths in (("pooled", pooled), ("forks", forked)):
            warm = httpx.post(
                f"{server.url}/v1/warmup",
                json={"recipe": recipe, "items": [{"id": p.stem, "path": str(p)} for p in paths]},
                headers=AUTH,
                timeout=60,
            )
            assert warm.status_code == 202, warm.text
            job = warm.json()["job_id"]
            started = time.monotonic()

            def finished(job: str = job) -> dict | None:
                info = httpx.get(f"{server.url}/v1/jobs/{job}", timeout=30).json()
                return (
                    info if info["counts"]["done"] + info["counts"]["failed"] == SAMPLES else None
                )

            infos[recipe] = wait_for(finished, 180, f"the {recipe} job", proc=server.proc)
            infos[recipe]["seconds"] = round(time.monotonic() - started, 1)
    finally:
        stop_server(server)
    for recipe, info in infos.items():
        assert info["counts"]["done"] == SAMPLES, (recipe, info["counts"], info["errors"])
    report(
        "34.4 pool and fork in a recipe",
        {
            recipe: {"done": info["counts"]["done"], "seconds": info["seconds"]}
            for recipe, info in infos.items()
        },
    )


FIRST, SECOND = "0" * 32 + "/first", "0" * 32 + "/second"


def test_a_fork_during_a_write_leaves_the_write_whole(tmp_path: Path) -> None:
    store = LMDBStore(tmp_path / "cache", readonly=False)
    store.open()
    inside, release = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def action(txn: Any, dbs: dict[bytes, Any]) -> int:
        txn.put(FIRST.encode(), b"1", db=dbs[b"records"])
        inside.set()
        release.wait(60)  # the fork happens here, as a recipe's would mid-commit
        txn.put(SECOND.encode(), b"2", db=dbs[b"records"])
        return 2

    def write() -> None:
        try:
            # the store's one raw write transaction, held open on purpose
            outcome["written"] = store._write(action)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            outcome["error"] = repr(exc)

    writer = threading.Thread(target=write)
    writer.start()
    assert inside.wait(60)
    child_said = _in_a_forked_child(lambda: LMDBStore(tmp_path / "cache").open() and "opened")
    release.set()
    writer.join(60)
    assert outcome == {"written": 2}, outcome
    assert store.get(SECOND) == b"2"
    assert "forked while another thread of its parent was writing to it" in child_said
    # with no write under way the environment is closed before a fork: the child reads
    assert _in_a_forked_child(lambda: LMDBStore(tmp_path / "cache").get(FIRST).decode()) == "1"
    store.close()
    report(
        "34.4 fork during a write",
        {"write": "committed", "child_open": child_said.split(": ", 1)[-1][:60]},
    )


def _in_a_forked_child(work: Any) -> str:
    """What ``work()`` returns (or the error it raises, as text) in a forked child."""
    read, sent = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            said = str(work())
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            said = str(exc)
        os.write(sent, said.encode())
        os._exit(0)
    os.close(sent)
    os.waitpid(pid, 0)
    with os.fdopen(read) as fh:
        return fh.read()
