"""Sharded snapshots: committed parts only, first commit wins (a changed source's later
one replaces it), damaged index and manifests reported, orphans left alone until
asked, readers that see a growing and always valid dataset; on a directory and on S3
(moto's real S3 HTTP API on 127.0.0.1). The shared store contract runs on both."""

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
from cache_store.format.encode import encode_record
from cache_store.format.header import read_header
from cache_store.recipes.registry import get_recipe_spec
from cache_store.snapshot.sharded import (
    CommitConflict,
    ShardedSnapshot,
    is_sharded,
    merge,
    orphan_parts,
)
from cache_store.format.index import DatasetIndex
from cache_store.snapshot.sharded import storage
from cache_store.snapshot.sharded.format import manifest, part_bytes
from cache_store.snapshot.sharded.storage import write_once
from cache_store.stores.base import Store
from cache_store.testing import WritableStoreContract
from cache_store.stores.opener import open_store
from tests.helpers.procs import run_spcache
from tests.helpers.s3 import S3Server, moto_s3, snapshot_destination
from tests.helpers.synthetic import fingerprint_of, make_record, record_metadata, spc_fields

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
    return snapshot_destination(request, tmp_path)


class TestShardedSnapshotContract(WritableStoreContract):
    """The shared contract, reads and writes, on a sharded snapshot in a directory."""

    #: its index lists every committed record, the given ids first (see the format)
    put_index_keeps_given_ids = False

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path) -> None:
        self.root, self.options = str(tmp_path), {}

    def location(self) -> str:
        return f"{self.root}/snap{len(self.made)}.zarr"

    def make_empty_store(self) -> Store:
        return self.keep(
            ShardedSnapshot(self.location(), readonly=False, storage_options=self.options)
        )

    def reopen(self, store: Store, readonly: bool) -> Store:
        return ShardedSnapshot(store.location, readonly=readonly, storage_options=self.options)

    def plant(self, store: Store, key: str, value: bytes) -> Store:
        """Commit a part holding ``value`` under ``key`` as if its source had changed
        (so it takes the place of the committed one), written past every check."""
        assert isinstance(store, ShardedSnapshot)
        fingerprint, sample_id = key.split("/", 1)
        part = "planted-p0001-00000000"
        digest = read_header(value).metadata.get("descriptor")  # the one stored with it
        named = {} if digest is None else {digest: store.descriptor(fingerprint, digest)}
        doc = json.loads(manifest(fingerprint, part, [(key, value)], value, "planted", named))
        doc["records"] = [[sample_id, 0, len(value), doc["records"][0][3], "f" * 16]]
        storage.write(store.fs, store.path(fingerprint, "parts", f"{part}.bin"), value)
        storage.write_once(
            store.fs, store.path(fingerprint, "commits", f"{part}.json"), json.dumps(doc).encode()
        )
        return self.reopen(store, readonly=True)


class TestShardedSnapshotContractOnS3(TestShardedSnapshotContract):
    """The same, in a bucket of moto's S3 server."""

    @pytest.fixture(autouse=True)
    def _where(self, s3: S3Server) -> None:
        self.root = f"s3://{s3.new_bucket()}/x"
        self.options = {"endpoint_url": s3.endpoint, "key": "testing", "secret": "testing"}


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
    scheme = "s3://" if options else ""
    assert orphan_parts(location, storage_options=options, older_than_s=0) == [
        f"{scheme}{first.root}/{FP}/parts/dead-p0001-0000.bin"
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
    write_once(store.fs, path, b'{"first": true}')
    with pytest.raises(CommitConflict):
        write_once(store.fs, path, b'{"second": true}')
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
    monkeypatch.setattr(storage, "MULTIPART_CHUNK", 5 * 1024 * 1024)  # S3's smallest part
    location = f"s3://{s3.new_bucket()}/big.zarr"
    options = {"endpoint_url": s3.endpoint, "key": "testing", "secret": "testing"}
    records = [
        (f"{FP}/r{i}", make_record(FP, f"r{i}", seed=i, level=10, num_points=200_000))
        for i in range(8)
    ]
    total = sum(len(v) for _, v in records)
    assert total > 2 * storage.MULTIPART_CHUNK
    with ShardedSnapshot(location, readonly=False, storage_options=options) as store:
        store.put_many(records)  # one part above the multipart threshold
        (part,) = store.fs.ls(f"{store.root}/{FP}/parts", detail=True)
        assert part["size"] == len(part_bytes(records))  # records 8-byte aligned in it
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

    location = str(tmp_path / "s.zarr")
    values = {f"a{i}": make_record(FP, f"a{i}", seed=i) for i in range(4)}
    with ShardedSnapshot(location, readonly=False) as store:
        store.put_many([(f"{FP}/{sid}", value) for sid, value in values.items()])
        store.put_index(_index(sorted(values)))
    exported = run_spcache("export", FP, "--cache", location, "--to", tmp_path / "out.zarr")
    assert exported.returncode == 0, exported.stderr
    with open_store(tmp_path / "out.zarr") as snapshot:
        assert not isinstance(snapshot, ShardedSnapshot)
        assert snapshot.get_index(FP).sample_ids.tolist() == sorted(values)
        assert all(snapshot.get(f"{FP}/{sid}") == value for sid, value in values.items())
    stats = run_spcache("stats", "--cache", location, "--json")
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
    real = ShardedSnapshot.commit_names

    def counting(self, fingerprint):
        listings.append(fingerprint)
        return real(self, fingerprint)

    monkeypatch.setattr(ShardedSnapshot, "commit_names", counting)
    for i in range(50):
        assert store.source_hash_of(f"{other}/s{i}") is None  # nothing committed there
        assert store.source_hash_of(f"{FP}/s{i}") is None  # not among the commits
    assert listings.count(other) == 1 and listings.count(FP) == 1
    store.close()


def _engine_record(sample_id: str, seed: int, source_hash: str) -> bytes:
    """A record as the engine writes it: its parameters and its source's hash named."""
    meta = record_metadata(FP, sample_id)
    meta["params"] = json.dumps(SPEC.resolve({}), sort_keys=True)
    meta["source_hash"] = source_hash
    return encode_record(spc_fields(seed), meta)


def test_a_changed_source_replaces_its_record_and_a_retry_does_not(dest) -> None:
    """Two commits of one sample id: the later one is served when its source hash
    differs (the source changed), the first one when it is the same (a retry)."""
    location, options = dest
    writer = ShardedSnapshot(location, readonly=False, storage_options=options)
    old = _engine_record("a", 1, "1" * 16)
    writer.put_many([(f"{FP}/a", old), (f"{FP}/b", _engine_record("b", 2, "1" * 16))])
    writer.put_many([(f"{FP}/a", _engine_record("a", 3, "1" * 16))])  # a retry's copy
    writer.put_index(_index(["a", "b"]))  # the index holds the first copy
    reader = ShardedSnapshot(location, storage_options=options)  # kept open throughout
    assert reader.get(f"{FP}/a") == old and reader.source_hash_of(f"{FP}/a") == "1" * 16
    new = _engine_record("a", 4, "2" * 16)
    writer.put_many([(f"{FP}/a", new)])  # the source changed: recomputed
    writer.put_many([(f"{FP}/a", _engine_record("a", 5, "2" * 16))])  # and retried
    reader.refresh()  # the long-lived reader, from its index plus the new manifests
    with ShardedSnapshot(location, storage_options=options) as fresh:
        for store in (reader, fresh):
            assert store.source_hash_of(f"{FP}/a") == "2" * 16
            assert store.get(f"{FP}/a") == new
            assert store.get_index(FP).sample_ids.tolist() == ["a", "b"]  # same place
            assert store.verify().ok
    assert merge(location, storage_options=options) == {FP: 2}
    with ShardedSnapshot(location, storage_options=options) as merged:
        assert merged.get(f"{FP}/a") == new
        assert merged.get_index(FP).sample_ids.tolist() == ["a", "b"]
    reader.close()
    writer.close()


def test_a_rerun_after_a_source_changed_serves_the_new_record(tmp_path: Path) -> None:
    """The local engine into a sharded snapshot: a changed mesh is recomputed once, then
    served (skipped) with its new tensors."""
    import torch
    import trimesh

    from workers.engine import Engine

    params = {"level": 4, "surface_samples": 2000}
    source = tmp_path / "a.obj"

    def run(dest: Path) -> tuple[Any, dict[str, torch.Tensor]]:
        with ShardedSnapshot(str(dest), readonly=False) as store:
            engine = Engine(store, "spc", params, device="cpu", backend="torch", loaders=0)
            result = engine.run([("a", str(source))])
        with ShardedSnapshot(str(dest)) as store:
            return result, store.get_record(f"{result.fingerprint}/a").tensors

    trimesh.creation.icosphere(subdivisions=1, radius=1).export(source)
    first, old = run(tmp_path / "s.zarr")
    assert first.done == 1
    trimesh.creation.icosphere(subdivisions=2, radius=2).export(source)
    second, _ = run(tmp_path / "s.zarr")
    assert second.done == 1 and second.skipped == 0
    third, served = run(tmp_path / "s.zarr")
    assert third.done == 0 and third.skipped == 1
    _, expected = run(tmp_path / "fresh.zarr")  # the new mesh alone
    assert served.keys() == expected.keys()
    assert all(torch.equal(served[name], expected[name]) for name in expected)
    assert not all(
        old[name].shape == served[name].shape and torch.equal(old[name], served[name])
        for name in expected
    )


def test_a_damaged_index_is_read_around_and_merge_writes_it_again(dest) -> None:
    location, options = dest
    with ShardedSnapshot(location, readonly=False, storage_options=options) as writer:
        writer.put_many([(f"{FP}/a", _engine_record("a", 1, "1" * 16))])
        writer.put_many([(f"{FP}/b", _engine_record("b", 2, "1" * 16))])
        writer.put_index(_index(["b", "a"]))
        path = f"{writer.root}/{FP}/index.json"
        raw = writer.fs.cat_file(path)
        writer.fs.pipe_file(path, raw[: len(raw) // 2])  # truncated
    with ShardedSnapshot(location, storage_options=options) as reader:
        assert sorted(reader.get_index(FP).sample_ids.tolist()) == ["a", "b"]
        assert reader.has(f"{FP}/a") and reader.get_record(f"{FP}/b").metadata["sample_id"] == "b"
        report_ = reader.verify()
        assert not report_.ok and report_.checked == 2
        assert list(report_.corrupt) == [f"{FP}/index.json"]
        assert "not JSON" in report_.corrupt[f"{FP}/index.json"]
    if options:
        assert merge(location, storage_options=options) == {FP: 2}
    else:
        merged = run_spcache("merge", location, "--json")
        assert merged.returncode == 0, merged.stderr
        assert json.loads(merged.stdout)["merged"] == {FP: 2}
        verified = run_spcache("verify", "--cache", location)
        assert verified.returncode == 0, verified.stdout + verified.stderr
    with ShardedSnapshot(location, storage_options=options) as reader:
        json.loads(reader.fs.cat_file(f"{reader.root}/{FP}/index.json"))  # valid again
        assert reader.verify().ok
        assert sorted(reader.get_index(FP).sample_ids.tolist()) == ["a", "b"]


def test_a_damaged_manifest_is_reported_by_verify(dest) -> None:
    location, options = dest
    with ShardedSnapshot(location, readonly=False, storage_options=options) as writer:
        writer.put_many([(f"{FP}/a", _engine_record("a", 1, "1" * 16))])
        writer.put_many([(f"{FP}/b", _engine_record("b", 2, "1" * 16))])
        commits = sorted(writer.fs.ls(f"{writer.root}/{FP}/commits", detail=False))
        assert len(commits) == 2
        writer.fs.pipe_file(commits[1], b"{")
    name = f"{FP}/commits/{commits[1].rsplit('/', 1)[-1]}"
    with ShardedSnapshot(location, storage_options=options) as reader:
        assert list(reader.keys()) == [f"{FP}/a"]  # its records cannot be found
        report_ = reader.verify()
        assert not report_.ok and report_.checked == 1
        assert list(report_.corrupt) == [name] and "not JSON" in report_.corrupt[name]
        assert reader.verify(FP).corrupt == report_.corrupt  # again, and per fingerprint


def test_the_orphan_sweep_finds_the_temporary_files_of_a_killed_writer(dest) -> None:
    """A writer killed while writing a part or a manifest leaves ``.tmp-*`` files (on a
    file system); the sweep lists them with full locations and removes them, never a
    committed file."""
    location, options = dest
    store = ShardedSnapshot(location, readonly=False, storage_options=options)
    store.put_many([(f"{FP}/a", make_record(FP, "a", seed=1))])
    leftovers = [
        f"{store.root}/{FP}/parts/.tmp-0123abcd",
        f"{store.root}/{FP}/commits/.tmp-4567ef01",
        f"{store.root}/{FP}/parts/dead-p0001-0000.bin",
    ]
    for path in leftovers:
        store.fs.pipe_file(path, b"cut short")
    scheme = "" if not options else "s3://"
    expected = sorted(f"{scheme}{path}" for path in leftovers)
    assert orphan_parts(location, storage_options=options, older_than_s=0) == expected
    assert orphan_parts(location, storage_options=options) == []  # too young to be dead
    if options:
        removed = orphan_parts(location, storage_options=options, older_than_s=0, remove=True)
        assert removed == expected
    else:  # the command prints what it removed, as located
        done = run_spcache("merge", location, "--remove-orphans", "--orphan-age", "0", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["orphans"] == expected
    assert not any(store.fs.exists(path) for path in leftovers)
    assert orphan_parts(location, storage_options=options, older_than_s=0) == []
    with ShardedSnapshot(location, storage_options=options) as reader:
        assert list(reader.keys()) == [f"{FP}/a"]
        assert reader.verify().ok and reader.verify().checked == 1
    store.close()
