"""A training job that keeps reading across a recompute and a reclaim reads every sample.

What users do: a training script (``CachedDataset`` over a sharded snapshot, forked
DataLoader workers) reads the dataset; a source changes and ``spcache precompute``
computes it again (its old copy is now superseded); ``spcache merge --remove-superseded
--orphan-age 0``, from a fresh directory, deletes the old copy's part; and the same
script, the same dataset object and workers (their listing of the commits from before
both), reads every sample again. Before, the changed sample was ``CorruptRecord``
("its committed part ... is missing"); now the reader lists the commits again once and
reads the recomputed copy (:meth:`ShardedSnapshot.read_located`).

On a directory (views, persistent workers), on moto's S3 server (persistent workers),
and on S3 through ``local_cache`` (workers forked each epoch, starting from the
training process's listing). Through ``local_cache`` the first pass leaves the sample
to change unread: a part with a copy here is read from it, as the listing says, without
asking the bucket (a warm epoch asks nothing), so only a part not here is looked for.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_store.snapshot.sharded import ShardedSnapshot
from tests.conftest import REPO_ROOT
from tests.data import corpus
from tests.helpers.procs import run_spcache, start
from tests.helpers.s3 import S3Server, moto_s3

#: the meshes precomputed (sample ids are their names without the extension)
MESHES = ["box_quads.obj", "icosphere.obj", "cone_ascii.stl", "capsule_ascii.ply"]
CHANGED = "box_quads"  # its source is replaced by another mesh, then recomputed

SCRIPT = r"""
import hashlib, json, sys

import spcache

LOCATION, FINGERPRINT, LOCAL, VIEWS, SKIP = sys.argv[1:6]


def digest(sample):
    h = hashlib.sha256()
    for name in sorted(sample):
        h.update(name.encode())
        h.update(sample[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    options = {"local_cache": LOCAL, "cache_limit": 64 << 20} if LOCAL != "-" else {}
    ds = spcache.CachedDataset(LOCATION, FINGERPRINT, views=VIEWS == "views", **options)
    loader = spcache.DataLoader(
        ds, batch_size=2, num_workers=2, multiprocessing_context="fork",
        persistent_workers=LOCAL == "-", collate_fn=list,
    )
    for phase in ("first", "again"):
        if phase == "again":
            sys.stdin.readline()  # the test has recomputed and reclaimed meanwhile
        read = {}
        for i in range(len(ds)):  # the training process itself
            if phase == "first" and ds.sample_id(i) == SKIP:
                continue
            read[ds.sample_id(i)] = digest(ds[i])
        loaded = {}
        if phase == "again" or SKIP == "-":  # loader workers
            for batch in loader:
                loaded.update((sample.sample_id, digest(sample)) for sample in batch)
        print(json.dumps({"phase": phase, "read": read, "loaded": loaded}), flush=True)


main()
"""


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_s3() as server:
        yield server


def _fresh_digests(location: str, fingerprint: str, options: dict[str, Any]) -> dict[str, str]:
    """Every sample's digest as a reader opened now reads it (the script's digest)."""
    import hashlib

    with ShardedSnapshot(location, storage_options=options) as snap:
        ids = snap.get_index(fingerprint).sample_ids.tolist()
        out = {}
        for sid in ids:
            tensors = snap.get_record(f"{fingerprint}/{sid}").tensors
            h = hashlib.sha256()
            for name in sorted(tensors):
                h.update(name.encode())
                h.update(tensors[name].contiguous().numpy().tobytes())
            out[sid] = h.hexdigest()
        return out


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3", "s3-local_cache"])
def test_a_long_lived_reader_reads_every_sample_after_a_recompute_and_a_reclaim(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    options: dict[str, Any] = {}
    if where == "local":
        location = str(tmp_path / "snap.zarr")
    else:
        server = request.getfixturevalue("s3")
        location = f"s3://{server.new_bucket()}/x/snap.zarr"
        options = server.storage_options()
    local_cache = where.endswith("local_cache")
    sources = tmp_path / "shapes"
    sources.mkdir()
    for name in MESHES:
        shutil.copy(corpus.ensure() / "meshes" / name, sources / name)
    work = tmp_path / "fresh"  # every command runs from a fresh directory
    work.mkdir()
    precompute = (
        "precompute",
        str(sources),
        "--recipe",
        "spc",
        "--param",
        "level=5",
        "--param",
        "surface_samples=2000",
        "--cache",
        location,
        "--write-batch",
        "1",  # a part per record: the changed sample's old copy is a part of its own
        "--loaders",
        "0",
        "--json",
    )
    first = run_spcache(*precompute, cwd=work)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout)
    fingerprint = summary["fingerprint"]
    assert summary["done"] == len(MESHES), summary
    before = _fresh_digests(location, fingerprint, options)

    script = work / "train.py"
    script.write_text(SCRIPT)
    argv = [
        sys.executable,
        str(script),
        location,
        fingerprint,
        str(tmp_path / "local") if local_cache else "-",
        "views" if where == "local" else "copies",
        CHANGED if local_cache else "-",
    ]
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with start(argv, cwd=work, env=env, stdin=True) as train:
        first_pass = json.loads(train.wait_line('^{"phase": "first"', 300, stream="stdout").string)
        (sources / f"{CHANGED}.obj").write_bytes((sources / "icosphere.obj").read_bytes())
        again = run_spcache(*precompute, cwd=work)
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads(again.stdout)["done"] == 1  # only the changed source
        reclaimed = run_spcache(
            "merge", location, "--remove-superseded", "--orphan-age", "0", "--json", cwd=work
        )
        assert reclaimed.returncode == 0, reclaimed.stderr[-3000:]
        removed = json.loads(reclaimed.stdout)["superseded_removed"]
        assert len(removed) == 1, removed  # the changed sample's old copy
        train.send("go")
        second_pass = json.loads(train.wait_line('^{"phase": "again"', 300, stream="stdout").string)
        assert train.wait(120) == 0, train.output()[-4000:]
    after = _fresh_digests(location, fingerprint, options)
    assert sorted(after) == sorted(before) == sorted(m.rsplit(".", 1)[0] for m in MESHES)
    assert after[CHANGED] != before[CHANGED]  # recomputed from the new source
    assert {s: d for s, d in after.items() if s != CHANGED} == {
        s: d for s, d in before.items() if s != CHANGED
    }
    expected_first = {s: d for s, d in before.items() if not (local_cache and s == CHANGED)}
    assert first_pass["read"] == expected_first
    if not local_cache:
        assert first_pass["loaded"] == before
    assert second_pass["read"] == after  # every sample, the changed one as its new version
    assert second_pass["loaded"] == after
    assert "CorruptRecord" not in train.stderr()
