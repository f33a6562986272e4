"""Issue 34, case 5: an edit that keeps the file's size and mtime is never served stale.

Records carry their source's stat signature so that a reader hashes a source only when
the signature changed. The signature was size, mtime, inode and device: an edit in place
followed by ``touch -r`` (the mtime put back), or a file deleted and re-created with the
same size and mtime on a reused inode, kept it, so ``on_stale="error"`` and
``"compute"`` returned the old record, the warm-up counted it "already ready" and the
item route said "ready". The signature now holds the inode's change time too, which no
user call can set back.

Real processes: the records come from ``spcache precompute``; the edits are made with
``touch -r`` as a user makes them; the stale records are read through ``CachedDataset``
(``on_stale="error"``) and through a live ``spcache serve`` (warm-up and item route),
whose worker then computes them again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from cache_store import CachedDataset
from cache_store.errors import StaleRecord
from cache_store.format.header import read_metadata
from cache_store.keys import compute_fingerprint, record_key
from cache_store.recipes.registry import get_recipe_spec
from cache_store.sources.files import hash_source_file
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.faults import report
from tests.helpers.procs import run, run_spcache, wait_for
from tests.helpers.service import AUTH, start_server, stop_server

PARAMS = {"level": 4, "surface_samples": 200}
IDS = ["edited", "recreated", "untouched"]


def _cloud(path: Path, seed: int) -> None:
    np.save(path, np.random.default_rng(seed).uniform(-1, 1, size=(300, 3)))


def _fingerprint() -> str:
    spec = get_recipe_spec("spc")
    return compute_fingerprint("spc", spec.version, spec.resolve(PARAMS))


def _stored_hash(cache: Path, sample_id: str) -> str:
    store = LMDBStore(cache, readonly=True)
    try:
        key = record_key(_fingerprint(), sample_id)
        return read_metadata(store.get(key), key=key)["source_hash"]
    finally:
        store.close()


def _edit_keeping_stat(sources: Path) -> dict[str, bool]:
    """Edit one source in place and put its mtime back (``touch -r``); delete another and
    re-create it with other bytes of the same size and mtime. Returns whether the size,
    mtime and inode (what the old signature held) stayed the same for each."""
    kept = {}
    reference = sources.parent / "reference"
    edited = sources / "edited.npy"
    run(["touch", "-r", edited, reference]).check_returncode()  # remember its times
    before = edited.stat()
    with open(edited, "r+b") as fh:  # in place: same inode, same size
        fh.seek(-8 * 3, os.SEEK_END)
        fh.write(np.array([0.5, -0.5, 0.25]).tobytes())
    run(["touch", "-r", reference, edited]).check_returncode()
    after = edited.stat()
    kept["edited"] = (before.st_size, before.st_mtime_ns, before.st_ino) == (
        after.st_size,
        after.st_mtime_ns,
        after.st_ino,
    )
    recreated = sources / "recreated.npy"
    before = recreated.stat()
    run(["touch", "-r", recreated, reference]).check_returncode()
    recreated.unlink()
    _cloud(recreated, 99)  # same shape: same size
    run(["touch", "-r", reference, recreated]).check_returncode()
    after = recreated.stat()
    kept["recreated"] = (before.st_size, before.st_mtime_ns, before.st_ino) == (
        after.st_size,
        after.st_mtime_ns,
        after.st_ino,
    )
    return kept


@pytest.mark.slow
def test_an_edit_that_keeps_size_and_mtime_is_stale_everywhere(tmp_path: Path) -> None:
    sources, cache = tmp_path / "sources", tmp_path / "cache"
    sources.mkdir()
    past = time.time() - 3600  # old enough for the stat signature to be stored
    for n, sid in enumerate(IDS):
        _cloud(sources / f"{sid}.npy", n)
        os.utime(sources / f"{sid}.npy", (past + n, past + n))
    params = [arg for k, v in PARAMS.items() for arg in ("--param", f"{k}={v}")]
    done = run_spcache(
        "precompute", sources, "--recipe", "spc", *params, "--cache", cache,
        "--device", "cpu", "--backend", "torch", "--loaders", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    old = {sid: _stored_hash(cache, sid) for sid in IDS}

    kept = _edit_keeping_stat(sources)
    assert kept["edited"], "touch -r did not keep the edited file's size, mtime and inode"
    changed = ["edited", "recreated"]
    for sid in changed:
        assert hash_source_file(sources / f"{sid}.npy") != old[sid]

    # a reader with on_stale="error" refuses both records, naming the source
    strict = CachedDataset(
        cache, "spc", sources=sources, on_miss="error", on_stale="error", **PARAMS
    )
    refused = []
    for i in range(len(strict)):
        sid = strict.sample_id(i)
        if sid in changed:
            with pytest.raises(StaleRecord, match=f"{sid}.npy"):
                strict[i]
            refused.append(sid)
        else:
            strict[i]  # the untouched one is served
    strict.close()

    # the service: the item route says stale, the warm-up queues both, its worker
    # computes them from the new bytes
    server = start_server(cache, sources, "--device", "cpu", "--backend", "torch")
    try:
        fp = _fingerprint()
        states = {}
        for sid in IDS:
            answer = httpx.get(
                f"{server.url}/v1/caches/{fp}/items/{sid}",
                params={"path": str(sources / f"{sid}.npy")},
                timeout=30,
            )
            assert answer.status_code == 200, answer.text
            states[sid] = answer.json()["state"]
        assert states == {"edited": "stale", "recreated": "stale", "untouched": "ready"}
        warm = httpx.post(
            f"{server.url}/v1/warmup",
            json={
                "recipe": "spc",
                "params": PARAMS,
                "items": [{"id": sid, "path": str(sources / f"{sid}.npy")} for sid in IDS],
            },
            headers=AUTH,
            timeout=60,
        )
        assert warm.status_code == 202, warm.text
        assert (warm.json()["queued"], warm.json()["already_ready"]) == (2, 1)
        job = warm.json()["job_id"]

        def finished() -> bool:
            info = httpx.get(f"{server.url}/v1/jobs/{job}", timeout=30).json()
            return info["status"] in ("done", "failed")

        wait_for(finished, 180, "the warm-up job", proc=server.proc)
    finally:
        stop_server(server)
    for sid in changed:
        assert _stored_hash(cache, sid) == hash_source_file(sources / f"{sid}.npy")
    recomputed = CachedDataset(
        cache, "spc", sources=sources, on_miss="error", on_stale="error", **PARAMS
    )
    assert len([recomputed[i] for i in range(len(IDS))]) == len(IDS)
    recomputed.close()
    report(
        "34.5 stale edits",
        {
            "edits": len(changed),
            "refused_on_stale_error": len(refused),
            "item_route": states,
            "warmup_queued": warm.json()["queued"],
            "recreated_kept_size_mtime_inode": kept["recreated"],
        },
    )
