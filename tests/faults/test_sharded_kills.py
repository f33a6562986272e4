"""Sharded Ray writes: SIGKILL the driver mid-run, then run again.

``spcache precompute --engine ray --cache DEST.zarr`` starts a local Ray with two CPU
actors that commit their own parts. The test kills the driver's whole process tree
(driver, raylet, actors) with SIGKILL once some parts are committed, then:

* every committed part is readable and no uncommitted bytes are ever read,
* the same command again computes only what was not committed (``done`` of the second
  run + parts committed before the kill = every good sample) and indexes everything,
* every sample is present exactly once, ``verify`` is clean, ``merge`` is idempotent,
* ``spcache import`` copies the snapshot into a local LMDB cache with the same records.
"""

from __future__ import annotations

import contextlib
import json
import signal
from collections import Counter
from pathlib import Path

import psutil
import pytest
import trimesh

from cache_store.snapshot.sharded import ShardedSnapshot
from cache_store.stores.opener import open_store
from tests.helpers.faults import report
from tests.helpers.procs import run_spcache, start_spcache, tree, wait_for, wait_gone

PARAMS = ["--param", "level=6", "--param", "surface_samples=300000"]


def _committed(dest: Path) -> int:
    return sum(1 for _ in dest.glob("*/commits/*.json"))


def _commits_per_sample(dest: Path, fingerprint: str) -> Counter[str]:
    """How many committed manifests list each sample id (a manifest's rows are
    ``[sample_id, offset, length, checksum, source_hash]``)."""
    counts: Counter[str] = Counter()
    for manifest in sorted((dest / fingerprint / "commits").glob("*.json")):
        counts.update(row[0] for row in json.loads(manifest.read_text())["records"])
    return counts


@pytest.mark.slow
def test_a_killed_driver_loses_no_commit_and_the_rerun_computes_only_the_rest(
    tmp_path: Path,
) -> None:
    sources = tmp_path / "sources"
    sources.mkdir()
    for i in range(16):
        trimesh.creation.icosphere(subdivisions=2, radius=1 + i / 10).export(
            sources / f"s{i:02d}.obj"
        )
    (sources / "broken.obj").write_text("v 0 0 0\nf 1 2 3\n")  # fails alone, every run
    dest = tmp_path / "snap.zarr"
    args = (
        "precompute",
        str(sources),
        "--recipe",
        "spc",
        *PARAMS,
        "--cache",
        str(dest),
        "--engine",
        "ray",
        "--actors",
        "2",
        "--device",
        "cpu",
        "--loaders",
        "0",
        "--json",
    )
    with start_spcache(*args) as proc:
        wait_for(lambda: _committed(dest) >= 3, 240, "three committed parts", proc=proc)
        procs = tree(proc.pid)
        for p in procs:  # the driver and everything it started, at once
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert wait_gone(procs) == []
    with ShardedSnapshot(dest) as snap:
        fingerprints = [p.name for p in dest.iterdir() if p.is_dir()]
        (fp,) = fingerprints
        before = {k.split("/", 1)[1] for k in snap.keys(f"{fp}/")}
        assert snap.verify().ok
    assert 1 <= len(before) < 16
    # every actor died with the driver: no attempt was retried, so no sample twice
    assert _commits_per_sample(dest, fp) == Counter(dict.fromkeys(before, 1))

    second = run_spcache(*args)
    assert second.returncode == 1, second.stderr[-3000:]  # broken.obj failed, as it must
    summary = json.loads(second.stdout)
    assert summary["skipped"] == len(before)
    assert summary["done"] == 16 - len(before)
    assert [e["id"] for e in summary["errors"]] == ["broken"]

    # Every sample present exactly once over the committed manifests: the re-run
    # recomputed only what had no commit, and nothing was committed twice (a second
    # commit of one id, from a retried attempt, would be read from its first one only:
    # the check below would show it, and get() still gives one record per id).
    per_sample = _commits_per_sample(dest, fp)
    good = {f"s{i:02d}" for i in range(16)}
    assert set(per_sample) == good and set(per_sample.values()) == {1}, per_sample
    with ShardedSnapshot(dest) as snap:
        keys = list(snap.keys(f"{fp}/"))
        assert sorted(keys) == sorted(f"{fp}/{sid}" for sid in good)
        for key in keys:  # one record per id, and the one its id names
            assert snap.get_record(key).metadata["sample_id"] == key.split("/", 1)[1]
        assert sorted(snap.get_index(fp).sample_ids.tolist()) == sorted(
            k.split("/", 1)[1] for k in keys
        )
        report_ = snap.verify()
        assert report_.ok and report_.checked == 16
    merged = run_spcache("merge", dest, "--json")
    assert merged.returncode == 0 and json.loads(merged.stdout)["merged"] == {fp: 16}
    verified = run_spcache("verify", "--cache", dest)
    assert verified.returncode == 0, verified.stdout + verified.stderr

    cache = tmp_path / "cache"
    imported = run_spcache("import", dest, "--cache", cache, "--json")
    assert imported.returncode == 0, imported.stderr
    assert json.loads(imported.stdout) == {fp: {"copied": 16, "present": 0, "bad": {}}}
    with open_store(cache) as lmdb_cache, ShardedSnapshot(dest) as snap:
        assert (
            lmdb_cache.get_index(fp).sample_ids.tolist() == snap.get_index(fp).sample_ids.tolist()
        )
        assert all(lmdb_cache.get(k) == snap.get(k) for k in keys)
    report(
        "sharded_driver_kill",
        {
            "committed_before_kill": len(before),
            "recomputed_after": summary["done"],
            "present_once": len(keys),
        },
    )
