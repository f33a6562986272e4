"""Sharded snapshots: committed parts only, first commit wins, orphans left alone until
asked, readers that see a growing and always valid dataset; on a directory and on S3
(moto's real S3 HTTP API on 127.0.0.1)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache_store.errors import CorruptRecord
from cache_store.recipes.specs import get_recipe_spec
from cache_store.snapshot.sharded import (
    CommitConflict,
    ShardedSnapshot,
    is_sharded,
    merge,
    orphan_parts,
)
from cache_store.format.index import DatasetIndex
from cache_store.stores.base import open_store
from tests.helpers.s3 import S3Server, moto_s3
from tests.helpers.synthetic import fingerprint_of, make_record

FP = fingerprint_of("spc")
SPEC = get_recipe_spec("spc")


def _index(ids: list[str]) -> DatasetIndex:
    return DatasetIndex(FP, "spc", SPEC.version, SPEC.resolve({}), np.array(ids, dtype=str))


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_s3() as server:
        yield server


@pytest.fixture(params=["local", "s3"])
def dest(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "local":
        return str(tmp_path / "snap.zarr"), {}
    server = request.getfixturevalue("s3")
    return (
        f"s3://{server.new_bucket()}/x/snap.zarr",
        {"endpoint_url": server.endpoint, "key": "testing", "secret": "testing"},
    )


def test_only_committed_parts_are_read_and_the_first_commit_wins(dest) -> None:
    location, options = dest
    first = ShardedSnapshot(location, readonly=False, storage_options=options, writer="s1-a1")
    second = ShardedSnapshot(location, readonly=False, storage_options=options, writer="s1-a2")
    original = make_record(FP, "a", seed=1)
    first.put_many([(f"{FP}/a", original), (f"{FP}/b", make_record(FP, "b", seed=2))])
    second.put_many([(f"{FP}/a", make_record(FP, "a", seed=99))])  # a retry's copy
    # A part whose manifest never came (its writer died): never read.
    first.fs.pipe_file(f"{first.root}/{FP}/parts/dead-p0001-0000.bin", b"half a record")
    first.put_index(_index(["b"]))
    assert is_sharded(location, options)
    with open_store(location, storage_options=options) as reader:
        assert isinstance(reader, ShardedSnapshot)
        assert reader.get_index(FP).sample_ids.tolist() == ["b", "a"]
        assert reader.get(f"{FP}/a") == original
        assert sorted(reader.keys()) == [f"{FP}/a", f"{FP}/b"]
        assert reader.verify().ok
    assert orphan_parts(location, storage_options=options, older_than_s=0) == [
        f"{first.root}/{FP}/parts/dead-p0001-0000.bin"
    ]
    assert orphan_parts(location, storage_options=options) == []  # too young to be dead
    orphan_parts(location, storage_options=options, older_than_s=0, remove=True)
    assert not first.fs.exists(f"{first.root}/{FP}/parts/dead-p0001-0000.bin")
    first.close()
    second.close()


def test_a_commit_is_never_overwritten(dest) -> None:
    location, options = dest
    store = ShardedSnapshot(location, readonly=False, storage_options=options)
    path = f"{store.root}/{FP}/commits/x.json"
    store.fs.makedirs(f"{store.root}/{FP}/commits", exist_ok=True)
    store._write_once(path, b'{"first": true}')
    with pytest.raises(CommitConflict):
        store._write_once(path, b'{"second": true}')
    assert json.loads(store.fs.cat_file(path)) == {"first": True}
    store.close()


def test_merge_is_idempotent_and_an_index_never_hides_later_commits(tmp_path: Path) -> None:
    location = str(tmp_path / "snap.zarr")
    store = ShardedSnapshot(location, readonly=False)
    store.put_many([(f"{FP}/a", make_record(FP, "a", seed=1))])
    store.put_index(_index(["a"]))
    index_file = tmp_path / "snap.zarr" / FP / "index.json"
    before = json.loads(index_file.read_text())
    assert merge(location) == {FP: 1}
    after = json.loads(index_file.read_text())
    assert {k: v for k, v in after.items() if k != "merged_at"} == {
        k: v for k, v in before.items() if k != "merged_at"
    }
    store.put_many([(f"{FP}/b", make_record(FP, "b", seed=2))])  # after the merge
    with ShardedSnapshot(location) as reader:
        assert reader.get_index(FP).sample_ids.tolist() == ["a", "b"]
    store.close()


def test_a_changed_part_is_refused_by_its_manifest(tmp_path: Path) -> None:
    location = str(tmp_path / "snap.zarr")
    with ShardedSnapshot(location, readonly=False) as store:
        store.put_many([(f"{FP}/a", make_record(FP, "a", seed=1))])
        store.put_index(_index(["a"]))
    (part,) = (tmp_path / "snap.zarr" / FP / "parts").iterdir()
    time.sleep(1.1)  # a later ``created``: same size, another checksum
    swapped = make_record(FP, "a", seed=1)  # a valid record, but not the committed one
    assert len(swapped) == part.stat().st_size
    part.write_bytes(swapped)
    with ShardedSnapshot(location) as reader:
        with pytest.raises(CorruptRecord, match="differs from its manifest"):
            reader.get(f"{FP}/a")
        assert not reader.verify().ok
    flipped = bytearray(swapped)
    flipped[-1] ^= 0xFF  # a damaged byte in the data: the field checksum catches it
    part.write_bytes(bytes(flipped))
    with ShardedSnapshot(location) as reader:
        with pytest.raises(CorruptRecord):
            reader.get_record(f"{FP}/a")
        assert not reader.verify().ok


def test_a_reader_sees_a_growing_always_valid_dataset(tmp_path: Path) -> None:
    location = str(tmp_path / "snap.zarr")
    writer = ShardedSnapshot(location, readonly=False)
    writer.put_many([(f"{FP}/s000", make_record(FP, "s000", seed=0))])
    writer.put_index(_index(["s000"]))
    done = threading.Event()
    seen: list[int] = []
    problems: list[str] = []

    def read() -> None:
        while not done.is_set():
            with ShardedSnapshot(location) as reader:
                ids = reader.get_index(FP).sample_ids.tolist()
                seen.append(len(ids))
                for sample_id in ids:
                    try:
                        reader.get_record(f"{FP}/{sample_id}")
                    except Exception as exc:  # noqa: BLE001 - collected, asserted below
                        problems.append(f"{sample_id}: {exc}")

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for i in range(1, 40):
            writer.put_many([(f"{FP}/s{i:03d}", make_record(FP, f"s{i:03d}", seed=i))])
            time.sleep(0.005)
    finally:
        done.set()
        thread.join(timeout=60)
    assert not problems
    assert seen == sorted(seen) and seen[-1] >= seen[0] and len(set(seen)) > 1
    with ShardedSnapshot(location) as reader:
        assert len(reader.get_index(FP)) == 40
    writer.close()


def test_a_large_part_goes_up_in_multipart_and_reads_by_range(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cache_store.snapshot import sharded

    monkeypatch.setattr(sharded, "MULTIPART_CHUNK", 5 * 1024 * 1024)  # S3's smallest part
    location = f"s3://{s3.new_bucket()}/big.zarr"
    options = {"endpoint_url": s3.endpoint, "key": "testing", "secret": "testing"}
    records = [
        (f"{FP}/r{i}", make_record(FP, f"r{i}", seed=i, level=10, num_points=200_000))
        for i in range(8)
    ]
    total = sum(len(v) for _, v in records)
    assert total > 2 * sharded.MULTIPART_CHUNK
    with ShardedSnapshot(location, readonly=False, storage_options=options) as store:
        store.put_many(records)  # one part above the multipart threshold
        (part,) = store.fs.ls(f"{store.root}/{FP}/parts", detail=True)
        assert part["size"] == total
    with ShardedSnapshot(location, storage_options=options) as reader:
        assert reader.get(f"{FP}/r5") == records[5][1]
        assert reader.get_many([f"{FP}/r7", f"{FP}/r0"]) == [records[7][1], records[0][1]]


def test_a_long_lived_reader_sees_later_commits(dest) -> None:
    """One reader object kept open (as a DataLoader worker keeps its store): parts
    committed after it first listed are found, on S3 too (s3fs caches listings)."""
    location, options = dest
    writer = ShardedSnapshot(location, readonly=False, storage_options=options)
    writer.put_many([(f"{FP}/a", make_record(FP, "a", seed=1))])
    writer.put_index(_index(["a"]))
    reader = ShardedSnapshot(location, storage_options=options)
    assert reader.get_index(FP).sample_ids.tolist() == ["a"]
    writer.put_many([(f"{FP}/b", make_record(FP, "b", seed=2))])
    time.sleep(1.1)  # past the one-listing-a-second bound on lookups of unknown keys
    assert reader.has(f"{FP}/b")
    assert reader.get_index(FP).sample_ids.tolist() == ["a", "b"]
    reader.close()
    writer.close()


def test_export_and_stats_read_a_sharded_snapshot(tmp_path: Path) -> None:
    """``spcache export`` turns a sharded snapshot into an exported one (the same records),
    and ``spcache stats`` reads it, through the CLI as a user runs them."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    location = str(tmp_path / "s.zarr")
    values = {f"a{i}": make_record(FP, f"a{i}", seed=i) for i in range(4)}
    with ShardedSnapshot(location, readonly=False) as store:
        store.put_many([(f"{FP}/{sid}", value) for sid, value in values.items()])
        store.put_index(_index(sorted(values)))
    exported = subprocess.run(
        [
            sys.executable,
            "-m",
            "spcache",
            "export",
            FP,
            "--cache",
            location,
            "--to",
            str(tmp_path / "out.zarr"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert exported.returncode == 0, exported.stderr
    with open_store(tmp_path / "out.zarr") as snapshot:
        assert not isinstance(snapshot, ShardedSnapshot)
        assert snapshot.get_index(FP).sample_ids.tolist() == sorted(values)
        assert all(snapshot.get(f"{FP}/{sid}") == value for sid, value in values.items())
    stats = subprocess.run(
        [sys.executable, "-m", "spcache", "stats", "--cache", location, "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["fingerprints"][FP]["records"] == 4


def test_lookups_of_unknown_keys_list_at_most_once_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's admission asks about every sample of an empty snapshot: that must not be
    one listing per sample (on S3, one LIST request each)."""
    store = ShardedSnapshot(str(tmp_path / "snap.zarr"), readonly=False)
    store.put_many([(f"{FP}/a", make_record(FP, "a", seed=1))])
    other = fingerprint_of("spc", level=5)
    listings = []
    real = ShardedSnapshot._commit_names

    def counting(self, fingerprint):
        listings.append(fingerprint)
        return real(self, fingerprint)

    monkeypatch.setattr(ShardedSnapshot, "_commit_names", counting)
    for i in range(50):
        assert store.source_hash_of(f"{other}/s{i}") is None  # nothing committed there
        assert store.source_hash_of(f"{FP}/s{i}") is None  # not among the commits
    assert listings.count(other) == 1 and listings.count(FP) == 1
    store.close()
