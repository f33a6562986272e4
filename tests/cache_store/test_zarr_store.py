"""ZarrStore and the exporter: LMDB -> export -> snapshot reads the same records."""

from __future__ import annotations

import contextlib

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_store import CachedDataset, collate_spc
from cache_store.errors import (
    CacheNotFound,
    CorruptRecord,
    FingerprintLookupError,
    ReadOnlyStoreError,
    RecordNotFound,
    SpcacheError,
)
from cache_store.snapshot.zarr.export import CODECS, export_snapshot
from cache_store.snapshot.zarr.publish import export_lock, sweep_leftovers
from cache_store.keys import compute_fingerprint
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.decode import decode_record
from cache_store.format.encode import encode_record
from cache_store.format.header import read_header
from cache_store.format.index import DatasetIndex
from cache_store.stores.opener import open_store
from cache_store.snapshot.zarr.store import ZarrStore
from cache_store.snapshot.zarr.format import ATTRS_KEY, array_digest
from cache_store.testing import (
    FP_A,
    FP_B,
    IDS_A,
    SWAPPED_FOR,
    SWAPPED_KEY,
    StoreContract,
    sample_content,
)
from tests.helpers.synthetic import make_record, record_metadata

REPO = Path(__file__).resolve().parents[2]


def fill_lmdb(path: Path, records: dict[str, bytes], indexes: list[DatasetIndex]) -> LMDBStore:
    store = LMDBStore(path, readonly=False, map_size=1 << 22)
    store.put_many(records.items())
    for index in indexes:
        store.put_index(index)
    return store


def export_all(cache: LMDBStore, dest: Path | str, **options) -> None:
    for fp in cache.fingerprints():
        export_snapshot(cache, fp, dest, **options)


@pytest.fixture(scope="module")
def contract_content():
    return sample_content()


@pytest.fixture(scope="module")
def contract_snapshot(tmp_path_factory, contract_content) -> Path:
    root = tmp_path_factory.mktemp("contract")
    cache = fill_lmdb(root / "cache", *contract_content)
    export_all(cache, root / "snap.zarr")
    cache.close()
    return root / "snap.zarr"


@pytest.fixture(scope="module")
def swapped_snapshot(tmp_path_factory, contract_content) -> Path:
    """The contract snapshot with the ids of SWAPPED_KEY and SWAPPED_FOR swapped in its
    id array (and the array's digest recomputed): each key finds the other's record."""
    root = tmp_path_factory.mktemp("swapped")
    cache = fill_lmdb(root / "cache", *contract_content)
    export_all(cache, root / "snap.zarr")
    cache.close()
    group = zarr.open_group(str(root / "snap.zarr" / FP_A), mode="r+")
    blob, offsets = group["sample_ids"][:], group["sample_id_offsets"][:]
    rows = [IDS_A.index(k.split("/", 1)[1]) for k in (SWAPPED_KEY, SWAPPED_FOR)]
    spans = [(int(offsets[i]), int(offsets[i + 1])) for i in rows]
    first, second = (blob[a:b].copy() for a, b in spans)
    assert first.size == second.size
    blob[spans[0][0] : spans[0][1]], blob[spans[1][0] : spans[1][1]] = second, first
    group["sample_ids"][:] = blob
    attrs = dict(group.attrs[ATTRS_KEY])
    attrs["digests"] = {**attrs["digests"], "sample_ids": array_digest(blob)}
    group.attrs[ATTRS_KEY] = attrs
    return root / "snap.zarr"


class _ExportedSnapshotContract(StoreContract):
    """The shared read contract on snapshots exported once for the module; subclasses
    name the snapshot and how it is read."""

    direct_reads = True

    @pytest.fixture(autouse=True)
    def _snapshots(self, contract_content, contract_snapshot, swapped_snapshot) -> None:
        self.exported, self.snapshot, self.swapped = (
            contract_content,
            contract_snapshot,
            swapped_snapshot,
        )

    def content(self):
        return self.exported

    def make_store(self, records, indexes) -> ZarrStore:
        assert records is self.exported[0]
        return ZarrStore(self.snapshot, direct_reads=self.direct_reads)

    def make_swapped_store(self, records, indexes) -> ZarrStore:
        return ZarrStore(self.swapped, direct_reads=self.direct_reads)


class TestZarrStoreContract(_ExportedSnapshotContract):
    """The shared read contract, on a snapshot exported from an LMDB cache (once)."""


class TestZarrStoreContractThroughZarr(_ExportedSnapshotContract):
    """The same, reading through zarr's own pipeline (as for URLs), not the chunk files."""

    direct_reads = False


@pytest.fixture(scope="module")
def uncompressed_snapshot(tmp_path_factory, contract_content) -> Path:
    root = tmp_path_factory.mktemp("uncompressed")
    cache = fill_lmdb(root / "cache", *contract_content)
    export_all(cache, root / "snap.zarr", codec="none", chunk_bytes=64)
    cache.close()
    return root / "snap.zarr"


class TestZarrStoreContractUncompressed(_ExportedSnapshotContract):
    """The same, on a ``codec="none"`` snapshot with small chunks: records read in place
    with ``pread``, several records per chunk and records across chunk boundaries."""

    @pytest.fixture(autouse=True)
    def _uncompressed(self, uncompressed_snapshot) -> None:
        self.snapshot = uncompressed_snapshot


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(records, indexes, lmdb cache dir, snapshot dir), exported once for the module."""
    root = tmp_path_factory.mktemp("exported")
    records, indexes = sample_content()
    cache = fill_lmdb(root / "cache", records, indexes)
    # compressed (the default is "none" locally): tests below count on whole chunks
    # holding many records, each decoded and CRC-checked at once
    export_all(cache, root / "snap.zarr", codec="zstd")
    cache.close()
    return records, indexes, root / "cache", root / "snap.zarr"


def copy_snapshot(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_open_store_picks_zarr_and_refuses_writes(exported) -> None:
    *_, snap = exported
    for location in (str(snap), f"file://{snap}"):
        store = open_store(location)
        assert isinstance(store, ZarrStore)
        assert store.get_index(FP_A).sample_ids.tolist() == IDS_A
    with pytest.raises(ReadOnlyStoreError):
        open_store(str(snap), readonly=False)
    store = ZarrStore(snap)
    with pytest.raises(ReadOnlyStoreError):
        store.put_many([(f"{FP_A}/x", make_record(FP_A, "x", 1))])


def test_missing_snapshot_is_cache_not_found(tmp_path: Path) -> None:
    store = ZarrStore(tmp_path / "nothing.zarr")  # constructing opens nothing
    with pytest.raises(CacheNotFound, match="nothing.zarr"):
        store.fingerprints()
    zarr.create_group(str(tmp_path / "foreign.zarr"))
    with pytest.raises(CacheNotFound, match="not an spcache snapshot"):
        ZarrStore(tmp_path / "foreign.zarr").get(f"{FP_A}/a")
    assert not (tmp_path / "nothing.zarr").exists()


def test_snapshot_records_equal_lmdb_records(exported) -> None:
    records, _, cache_dir, snap = exported
    lmdb_store, zarr_store = LMDBStore(cache_dir), ZarrStore(snap)
    try:
        assert list(zarr_store.keys()) == list(lmdb_store.keys())
        for key in records:
            a, b = lmdb_store.get_record(key), zarr_store.get_record(key)
            assert a.metadata == b.metadata
            assert set(a.tensors) == set(b.tensors)
            for name, tensor in a.tensors.items():
                assert b.tensors[name].dtype == tensor.dtype
                assert b.tensors[name].shape == tensor.shape
                assert torch.equal(b.tensors[name], tensor)
        batch = zarr_store.get_records(list(records), fields=["center", "scale"])
        assert [r.metadata["sample_id"] for r in batch] == [k.split("/", 1)[1] for k in records]
        assert all(set(r.tensors) == {"center", "scale"} for r in batch)
        assert zarr_store.stats()["bytes"] == lmdb_store.stats()["bytes"]
    finally:
        lmdb_store.close()
        zarr_store.close()


def test_keys_that_look_like_paths_are_never_paths(exported) -> None:
    *_, snap = exported
    store = ZarrStore(snap)
    for key in [
        f"{FP_A}/../{FP_B}/chairs/a1",
        f"{FP_A}/chairs/../zeta",
        "../../etc/passwd",
        f"{FP_A}",
        f"{FP_A}/",
        "x" * 40,
        f"{FP_A.upper()}/zeta",
        f"{FP_A}/data/octree",
    ]:
        assert not store.has(key)
        with pytest.raises(RecordNotFound):
            store.get(key)


def test_plain_zarr_client_reads_arrays_and_attributes(exported) -> None:
    records, indexes, _, snap = exported
    root = zarr.open_group(str(snap), mode="r")
    assert sorted(root.group_keys()) == sorted(i.fingerprint for i in indexes)
    group = root[FP_B]
    attrs = group.attrs["spcache"]
    assert attrs["complete"] is True and attrs["fingerprint"] == FP_B
    assert attrs["recipe"] == "spc_query" and attrs["params"]["level"] == 4
    assert attrs["fields"]["query_pidx"]["dtype"] == "I32"
    assert attrs["fields"]["query_pidx"]["shape"] == [None, 5]
    assert attrs["fields"]["scale"]["shape"] == []
    # Rebuild sample 1 ("lamps/l1") from offsets, as a client that is not ours would.
    ids = bytes(group["sample_ids"][:])
    id_off = group["sample_id_offsets"][:]
    assert ids[id_off[1] : id_off[2]].decode() == "lamps/l1"
    off = group["offsets/query_pidx"][:]
    pidx = group["data/query_pidx"][off[1] : off[2]]
    expected = decode_record(records[f"{FP_B}/lamps/l1"]).tensors
    assert np.array_equal(pidx, expected["query_pidx"].numpy())
    assert np.float32(group["data/scale"][1]) == expected["scale"].item()
    hdr_off = group["header_offsets"][:]
    header = json.loads(bytes(group["headers"][hdr_off[1] : hdr_off[2]]))
    assert header["__metadata__"]["checksum"] == read_header(records[f"{FP_B}/lamps/l1"]).checksum


@pytest.mark.parametrize("codec", CODECS)
def test_all_dtypes_and_shapes_round_trip(tmp_path: Path, codec: str) -> None:
    params = {"level": 3}
    fp = compute_fingerprint("custom", 2, params)
    ids = ["a", "b", "c/d"]
    records = {}
    for i, sid in enumerate(ids):
        tensors = {
            "bf": torch.randn(i + 1, 2).to(torch.bfloat16),
            "flag": torch.tensor([True, False, True][: i + 1]),
            "zero_d": torch.tensor(float(i), dtype=torch.float64),
            "empty": torch.zeros((0, 3), dtype=torch.int64),
            "no_width": torch.zeros((i + 2, 0), dtype=torch.float32),
            "vary": torch.arange(i * 4, dtype=torch.int16).reshape(i * 2, 2),
        }
        meta = record_metadata(fp, sid) | {"recipe": "custom", "recipe_version": "2"}
        records[f"{fp}/{sid}"] = encode_record(tensors, meta)
    cache = fill_lmdb(tmp_path / "cache", records, [DatasetIndex(fp, "custom", 2, params, ids)])
    export_snapshot(cache, fp, tmp_path / "s.zarr", codec=codec, chunk_bytes=16)
    store = ZarrStore(tmp_path / "s.zarr")
    assert zarr.open_group(str(tmp_path / "s.zarr"), mode="r")[f"{fp}/data/vary"].chunks[0] > 1
    for key, value in records.items():
        assert store.get(key) == value
        a, b = decode_record(value), store.get_record(key)
        for name in a.tensors:
            assert b.tensors[name].dtype == a.tensors[name].dtype
            assert torch.equal(b.tensors[name], a.tensors[name])
    assert store.verify().ok
    cache.close()


def test_empty_index_exports(tmp_path: Path) -> None:
    params = {"level": 4, "surface_samples": 100_000}
    cache = fill_lmdb(tmp_path / "cache", {}, [DatasetIndex(FP_A, "spc", 1, params, [])])
    assert export_snapshot(cache, FP_A, tmp_path / "s.zarr").samples == 0
    store = ZarrStore(tmp_path / "s.zarr")
    assert len(store.get_index(FP_A)) == 0 and list(store.keys()) == []
    assert store.verify().ok
    cache.close()


def test_bad_records_fail_the_export_unless_skipped(tmp_path: Path) -> None:
    records, indexes = sample_content()
    bad_key = f"{FP_A}/chairs/a2"
    value = bytearray(records[bad_key])
    value[read_header(bytes(value)).tensors["point_hierarchy"].begin] ^= 0x40
    records[bad_key] = bytes(value)
    cache = fill_lmdb(tmp_path / "cache", records, indexes)
    ghost = DatasetIndex(FP_A, "spc", 1, indexes[0].params, [*IDS_A, "ghost"])
    cache.put_index(ghost)
    with pytest.raises(SpcacheError, match="2 record") as err:
        export_snapshot(cache, FP_A, tmp_path / "s.zarr")
    assert bad_key in str(err.value) and "ghost" in str(err.value)
    assert not (tmp_path / "s.zarr" / FP_A).exists()
    summary = export_snapshot(cache, FP_A, tmp_path / "s.zarr", skip_bad=True)
    assert set(summary.skipped) == {bad_key, f"{FP_A}/ghost"}
    assert "point_hierarchy" in summary.skipped[bad_key]
    store = ZarrStore(tmp_path / "s.zarr")
    assert store.get_index(FP_A).sample_ids.tolist() == [i for i in IDS_A if i != "chairs/a2"]
    assert not store.has(bad_key) and store.verify().ok
    cache.close()


def test_existing_export_needs_overwrite(tmp_path: Path) -> None:
    records, indexes = sample_content()
    cache = fill_lmdb(tmp_path / "cache", records, indexes)
    dest = tmp_path / "s.zarr"
    export_snapshot(cache, FP_A, dest)
    reader = ZarrStore(dest, direct_reads=False)  # no chunk cache: every read hits files
    assert reader.get_index(FP_A).sample_ids.tolist() == IDS_A
    with pytest.raises(SpcacheError, match="already exported"):
        export_snapshot(cache, FP_A, dest)
    newer = make_record(FP_A, "zeta", seed=777)
    cache.put_many([(f"{FP_A}/zeta", newer)])
    old_value = reader.get(f"{FP_A}/zeta")
    export_snapshot(cache, FP_A, dest, overwrite=True)
    assert ZarrStore(dest).get(f"{FP_A}/zeta") == newer
    assert old_value != newer
    assert reader.get(f"{FP_A}/zeta") == newer  # the open reader notices and re-opens
    assert reader.get_record(f"{FP_A}/chairs/a1").metadata["sample_id"] == "chairs/a1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "s.zarr"]  # no leftovers
    cache.close()


def test_one_writer_per_local_snapshot(tmp_path: Path, exported) -> None:
    *_, cache_dir, snap = exported
    dest = copy_snapshot(snap, tmp_path / "s.zarr")
    with export_lock(dest):
        with pytest.raises(SpcacheError, match="another export"):
            export_snapshot(cache_dir, FP_A, dest, overwrite=True)


def test_refuses_to_write_into_a_foreign_directory(tmp_path: Path, exported) -> None:
    *_, cache_dir, _ = exported
    (tmp_path / "x.zarr").mkdir()
    (tmp_path / "x.zarr" / "keep.txt").write_text("mine")
    with pytest.raises(SpcacheError, match="not a Zarr snapshot"):
        export_snapshot(cache_dir, FP_A, tmp_path / "x.zarr")
    zarr.create_group(str(tmp_path / "y.zarr"))
    with pytest.raises(SpcacheError, match="not an spcache snapshot"):
        export_snapshot(cache_dir, FP_A, tmp_path / "y.zarr")
    assert (tmp_path / "x.zarr" / "keep.txt").read_text() == "mine"


def _chunk_files(group_dir: Path, array: str) -> list[Path]:
    return sorted(p for p in (group_dir / array / "c").rglob("*") if p.is_file())


@pytest.mark.parametrize("direct_reads", [True, False])
def test_flipped_bytes_in_a_chunk_are_reported(tmp_path: Path, exported, direct_reads) -> None:
    records, *_, snap = exported
    dest = copy_snapshot(snap, tmp_path / "s.zarr")
    (chunk,) = _chunk_files(dest / FP_A, "data/point_hierarchy")
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    chunk.write_bytes(bytes(raw))
    store = ZarrStore(dest, direct_reads=direct_reads)
    with pytest.raises(CorruptRecord, match="point_hierarchy"):
        store.get(f"{FP_A}/zeta")
    report = store.verify()
    assert not report.ok and report.checked == len(records)
    # One chunk holds every record of this small field: all of FP_A, nothing else.
    assert sorted(report.corrupt) == sorted(f"{FP_A}/{s}" for s in IDS_A)
    assert all("point_hierarchy" in reason for reason in report.corrupt.values())
    assert store.verify(FP_B).ok
    assert store.get(f"{FP_B}/lamps/l1") == records[f"{FP_B}/lamps/l1"]


def test_uncompressed_chunks_damaged_fail_only_their_records(tmp_path: Path) -> None:
    # codec "none": a record's rows are read in place, so a flipped byte fails the
    # record whose rows hold it (its field's xxh3), and a truncated chunk file is named
    records, indexes = sample_content()
    cache = fill_lmdb(tmp_path / "cache", records, indexes)
    export_all(cache, tmp_path / "s.zarr", codec="none")
    cache.close()
    store = ZarrStore(tmp_path / "s.zarr")
    group = zarr.open_group(str(tmp_path / "s.zarr" / FP_A), mode="r")
    offsets = group["offsets/point_hierarchy"][:]
    victim = int(np.flatnonzero(np.diff(offsets))[0])  # a record with rows in this field
    row_bytes = 3 * np.dtype(group["data/point_hierarchy"].dtype).itemsize
    (chunk,) = _chunk_files(tmp_path / "s.zarr" / FP_A, "data/point_hierarchy")
    raw = bytearray(chunk.read_bytes())
    raw[int(offsets[victim]) * row_bytes] ^= 0x01
    chunk.write_bytes(bytes(raw))
    ids = group["sample_ids"][:].tobytes().decode()
    id_offsets = group["sample_id_offsets"][:]
    victim_key = f"{FP_A}/{ids[id_offsets[victim] : id_offsets[victim + 1]]}"
    fresh = ZarrStore(tmp_path / "s.zarr")
    with pytest.raises(CorruptRecord, match="point_hierarchy"):
        fresh.get(victim_key)
    report = fresh.verify()
    assert sorted(report.corrupt) == [victim_key]
    for key, value in records.items():
        if key != victim_key:
            assert fresh.get(key) == value
    chunk.write_bytes(bytes(raw[:-9]))  # truncated
    with pytest.raises(CorruptRecord, match="bytes, expected"):
        ZarrStore(tmp_path / "s.zarr").get(victim_key)
    store.close()


def test_flipped_bytes_in_headers_and_ids_are_reported(tmp_path: Path, exported) -> None:
    *_, snap = exported
    dest = copy_snapshot(snap, tmp_path / "s.zarr")
    for array in ("headers", "sample_ids"):
        group = FP_B if array == "headers" else FP_A
        (chunk,) = _chunk_files(dest / group, array)
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 3] ^= 0x08
        chunk.write_bytes(bytes(raw))
    store = ZarrStore(dest)
    report = store.verify()
    assert f"index:{FP_A}" in report.corrupt  # ids unreadable: no record can be located
    assert sorted(k for k in report.corrupt if k.startswith(FP_B)) == [
        f"{FP_B}/chairs/a1",
        f"{FP_B}/lamps/l1",
    ]
    with pytest.raises(CorruptRecord):
        store.get_index(FP_A)


_KILLED_EXPORT = textwrap.dedent("""
    import os, signal, sys
    import cache_store.snapshot.zarr.export as export
    import cache_store.snapshot.zarr.write as write
    def dying(real):
        def write(self, *args):
            real(self, *args)
            os.kill(os.getpid(), signal.SIGKILL)  # die with chunks half written
        return write
    # compressed chunks go through FieldWriter, uncompressed (the local default) are
    # appended by RawChunkAppender: die in either
    write.FieldWriter.flush = dying(write.FieldWriter.flush)
    write.RawChunkAppender.add = dying(write.RawChunkAppender.add)
    export.export_snapshot(sys.argv[1], sys.argv[2], sys.argv[3])
""")


def test_killed_local_export_is_never_visible_and_is_swept(tmp_path: Path, exported) -> None:
    records, _, cache_dir, _ = exported
    dest = tmp_path / "s.zarr"
    export_snapshot(cache_dir, FP_B, dest)
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_EXPORT, str(cache_dir), FP_A, str(dest)],
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    leftovers = list(tmp_path.glob(".s.zarr.*.staging"))
    assert len(leftovers) == 1
    (dest / FP_B / "zarr.json.0123.partial").write_bytes(b"half")  # as zarr would leave it
    store = ZarrStore(dest)
    assert store.fingerprints() == [FP_B]
    assert not store.has(f"{FP_A}/zeta")
    with pytest.raises(FingerprintLookupError):
        store.get_index(FP_A)
    export_snapshot(cache_dir, FP_A, dest)  # sweeps, then publishes
    assert not list(tmp_path.glob(".s.zarr.*")) and not list(dest.rglob("*.partial"))
    assert ZarrStore(dest).get(f"{FP_A}/zeta") == records[f"{FP_A}/zeta"]
    assert sweep_leftovers(dest) == 0


def test_url_destination_and_unfinished_remote_export(exported, monkeypatch) -> None:
    records, _, cache_dir, _ = exported
    url = f"memory://spcache-test-{os.getpid()}/snap.zarr"
    export_snapshot(cache_dir, FP_B, url)
    store = open_store(url)
    assert isinstance(store, ZarrStore)
    for sid in ("chairs/a1", "lamps/l1"):
        assert store.get(f"{FP_B}/{sid}") == records[f"{FP_B}/{sid}"]

    import cache_store.snapshot.zarr.write as write

    def broken(self, final):
        raise RuntimeError("connection lost")

    monkeypatch.setattr(write.FieldWriter, "flush", broken)
    with pytest.raises(RuntimeError, match="connection lost"):
        export_snapshot(cache_dir, FP_A, url)
    monkeypatch.undo()
    store = ZarrStore(url)
    assert store.fingerprints() == [FP_B]
    assert store.incomplete_fingerprints() == [FP_A]
    assert not store.has(f"{FP_A}/zeta")
    report = store.verify()
    assert report.corrupt == {f"index:{FP_A}": "export did not finish (group not complete)"}
    export_snapshot(cache_dir, FP_A, url)  # an unfinished group is replaced
    store = ZarrStore(url)
    assert store.fingerprints() == sorted([FP_A, FP_B]) and store.verify().ok
    import fsspec

    fsspec.filesystem("memory").rm(f"/spcache-test-{os.getpid()}", recursive=True)


def _same_sample(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(
        got[k].dtype == want[k].dtype
        and got[k].shape == want[k].shape
        and torch.equal(got[k], want[k])
        for k in want
    )


def test_cached_dataset_on_the_snapshot_yields_what_lmdb_yields(exported) -> None:
    _, indexes, cache_dir, snap = exported
    for index in indexes:
        on_lmdb = CachedDataset(cache_dir, index.fingerprint)
        on_zarr = CachedDataset(str(snap), index.fingerprint)
        assert len(on_zarr) == len(on_lmdb) == len(index)
        assert on_zarr.recipe == on_lmdb.recipe
        for i in range(len(index)):
            assert on_zarr.sample_id(i) == on_lmdb.sample_id(i)
            assert _same_sample(on_zarr[i], on_lmdb[i])
        both = list(range(len(index)))[::-1]
        assert all(
            _same_sample(a, b)
            for a, b in zip(on_zarr.__getitems__(both), on_lmdb.__getitems__(both), strict=True)
        )
        on_lmdb.close()
        on_zarr.close()
    subset = CachedDataset(str(snap), "spc", fields=["octree", "scale"], level=5)
    assert subset.fingerprint == indexes[2].fingerprint
    reference = CachedDataset(cache_dir, "spc", fields=["octree", "scale"], level=5)
    assert _same_sample(subset[0], reference[0]) and set(subset[0]) == {"octree", "scale"}


def _forbid_cuda(worker_id: int) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"CUDA initialised in DataLoader worker {worker_id}")

    torch.cuda._lazy_init = refuse
    torch.cuda.init = refuse


def _tag_pid(sample: dict) -> dict:
    sample["pid"] = torch.tensor(os.getpid())
    return sample


@pytest.mark.parametrize("direct_reads", [True, False])
def test_forked_dataloader_workers_read_identical_samples(exported, direct_reads) -> None:
    _, _, cache_dir, snap = exported
    dataset = CachedDataset(
        str(snap), FP_A, transform=_tag_pid, store_options={"direct_reads": direct_reads}
    )
    dataset[0]  # the parent read first: its store and zarr's IO loop and thread are up
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=_forbid_cuda,
    )
    reference = CachedDataset(cache_dir, FP_A)
    got = list(loader)
    assert len(got) == len(IDS_A)
    pids = {int(sample.pop("pid")) for sample in got}
    assert len(pids) == 2 and os.getpid() not in pids
    assert all(_same_sample(sample, reference[i]) for i, sample in enumerate(got))
    assert "pid" in dataset[len(IDS_A) - 1]  # the parent's store still works


def test_batched_forked_workers_with_collate(exported) -> None:
    _, _, cache_dir, snap = exported
    loader_args = dict(
        batch_size=2,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=collate_spc,
        worker_init_fn=_forbid_cuda,
    )
    on_zarr = list(torch.utils.data.DataLoader(CachedDataset(str(snap), FP_A), **loader_args))
    on_lmdb = list(torch.utils.data.DataLoader(CachedDataset(cache_dir, FP_A), **loader_args))
    assert len(on_zarr) == len(on_lmdb) == 3
    for a, b in zip(on_zarr, on_lmdb, strict=True):
        assert set(a) == set(b)
        for name, value in b.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(a[name], value) and a[name].dtype == value.dtype
            else:
                assert a[name] == value


def test_cli_export_then_verify(tmp_path: Path, exported, capsys) -> None:
    from spcache.cli import main

    records, _, cache_dir, _ = exported
    dest = tmp_path / "cli.zarr"
    args = ["export", FP_A, "--cache", str(cache_dir), "--to", str(dest)]
    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["samples"] == len(IDS_A) and summary["skipped"] == {}
    assert main(args) == 1  # already exported: not exported again
    assert "already exported" in capsys.readouterr().err
    assert main(["export", "0" * 32, "--cache", str(cache_dir), "--to", str(dest)]) == 2
    assert "no dataset index" in capsys.readouterr().err  # no such fingerprint: usage
    assert main(["export", FP_A, "--cache", str(tmp_path / "nope"), "--to", str(dest)]) == 2
    assert ZarrStore(dest).verify().ok


def test_field_names_never_become_paths(tmp_path: Path) -> None:
    params = {"level": 3}
    fp = compute_fingerprint("custom", 1, params)
    meta = record_metadata(fp, "a") | {"recipe": "custom", "recipe_version": "1"}
    value = encode_record({"../../escaped": torch.zeros(3)}, meta)
    cache = fill_lmdb(
        tmp_path / "cache", {f"{fp}/a": value}, [DatasetIndex(fp, "custom", 1, params, ["a"])]
    )
    with pytest.raises(SpcacheError, match="escaped"):
        export_snapshot(cache, fp, tmp_path / "deep" / "s.zarr")
    assert not list(tmp_path.rglob("escaped*"))
    assert not (tmp_path / "deep" / "s.zarr" / fp).exists()
    cache.close()


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_a_record_rewritten_during_the_export_aborts_it(
    tmp_path: Path, exported, codec: str
) -> None:
    records, _, cache_dir, _ = exported
    source = LMDBStore(cache_dir)
    key, real_view = f"{FP_A}/tables/t1", source.read_view
    seen: list[str] = []
    rewritten = make_record(FP_A, "tables/t1", seed=5)

    @contextlib.contextmanager
    def read_view(k: str):  # the first pass checks in place; so does "none"'s second
        seen.append(k)
        if k == key and seen.count(k) > 1:
            yield rewritten
            return
        with real_view(k) as value:
            yield value

    def get(k: str) -> bytes:  # a compressed second pass copies: t1 recomputed by now
        assert k in seen, "the second pass read a record the first did not check"
        return rewritten if k == key else records[k]

    source.read_view, source.get = read_view, get
    with pytest.raises(SpcacheError, match="changed during the export"):
        export_snapshot(source, FP_A, tmp_path / "s.zarr", codec=codec)
    assert not (tmp_path / "s.zarr" / FP_A).exists() and not list(tmp_path.glob(".s.zarr*"))
    source.close()


@pytest.mark.slow
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    width=st.integers(1, 4),
    chunk_bytes=st.integers(1, 600),
)
def test_any_row_counts_and_chunk_sizes_round_trip(
    tmp_path_factory, rows, width, chunk_bytes
) -> None:
    root = tmp_path_factory.mktemp("prop")
    fp = compute_fingerprint("custom", 1, {"w": width})
    ids = [f"s{i}" for i in range(len(rows))]
    records = {}
    for i, (sid, r) in enumerate(zip(ids, rows, strict=True)):
        tensors = {
            "points": torch.arange(r * width, dtype=torch.float32).reshape(r, width) + i,
            "fixed": torch.full((3,), i, dtype=torch.int64),
        }
        meta = record_metadata(fp, sid) | {"recipe": "custom", "recipe_version": "1"}
        records[f"{fp}/{sid}"] = encode_record(tensors, meta)
    cache = fill_lmdb(root / "cache", records, [DatasetIndex(fp, "custom", 1, {"w": width}, ids)])
    export_snapshot(cache, fp, root / "s.zarr", chunk_bytes=chunk_bytes)
    cache.close()
    for direct in (True, False):
        store = ZarrStore(root / "s.zarr", direct_reads=direct)
        assert [store.get(k) for k in records] == list(records.values())


def test_shuffled_reads_decode_each_small_chunk_once(tmp_path: Path, monkeypatch) -> None:
    # 40 records, 64-byte chunks: a small field's chunk holds several records, and a
    # shuffled pass must not decompress it again for nearly every read.
    import numcodecs

    fp = compute_fingerprint("spc", 1, {"level": 3})
    ids = [f"s{i:03d}" for i in range(40)]
    records = {f"{fp}/{sid}": make_record(fp, sid, seed=i) for i, sid in enumerate(ids)}
    cache = fill_lmdb(
        tmp_path / "cache", records, [DatasetIndex(fp, "spc", 1, {"level": 3}, np.array(ids))]
    )
    export_snapshot(cache, fp, tmp_path / "s.zarr", chunk_bytes=64, codec="lz4")
    cache.close()
    decodes = []
    real = numcodecs.Blosc.decode
    monkeypatch.setattr(
        numcodecs.Blosc,
        "decode",
        lambda self, buf, out=None: decodes.append(1) or real(self, buf, out),
    )
    store = ZarrStore(tmp_path / "s.zarr")
    try:
        order = np.random.default_rng(0).permutation(len(ids))
        per_pass = []
        for _ in range(2):
            decodes.clear()
            for i in order:
                key = f"{fp}/{ids[i]}"
                assert torch.equal(
                    store.get_record(key, fields=["center", "scale"])["center"],
                    decode_record(records[key])["center"],
                )
            per_pass.append(len(decodes))
        assert per_pass[0] > 0 and per_pass[1] == 0  # the second pass decodes nothing
    finally:
        store.close()


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", ["int32", "uint8", "float64", "int16"])
def test_direct_chunk_writes_are_the_bytes_zarr_writes(
    tmp_path: Path, codec: str, dtype: str
) -> None:
    # the export's own chunk writer must write exactly what zarr's pipeline writes, so
    # any zarr client reads a snapshot; a partial last chunk included (padded with 0)
    from cache_store.snapshot.zarr.write import compressors_for
    from cache_store.snapshot.zarr.chunks import (
        ChunkWriterPool,
        LocalChunkWriter,
        RawChunkAppender,
    )

    data = (np.arange(37 * 3, dtype=np.int64) * 7919 % 251).astype(dtype).reshape(37, 3)
    files = {}
    for how in ("zarr", "direct"):
        group = zarr.create_group(zarr.storage.LocalStore(tmp_path / how))
        arr = group.create_array(
            "a",
            shape=data.shape,
            dtype=data.dtype,
            chunks=(8, 3),
            compressors=compressors_for(data.dtype, 3, codec),
            fill_value=0,
        )
        if how == "zarr":
            arr[:] = data
        elif codec == "none":
            appender = RawChunkAppender(str(tmp_path / how / "a"), arr)
            for lo, hi in ((0, 5), (5, 5), (5, 21), (21, 37)):  # across chunk boundaries
                appender.add(data[lo:hi])
            appender.flush(final=True)
        else:
            pool = ChunkWriterPool(threads=2)
            writer = LocalChunkWriter(str(tmp_path / how / "a"), arr, pool)
            writer.write(0, data[:16])
            writer.write(16, data[16:])
            pool.finish()
            pool.close()
        chunk_dir = tmp_path / how / "a" / "c"
        files[how] = {
            p.relative_to(chunk_dir): p.read_bytes()
            for p in sorted(chunk_dir.rglob("*"))
            if p.is_file()
        }
        assert np.array_equal(zarr.open_array(tmp_path / how / "a", mode="r")[:], data)
    assert len(files["direct"]) == 5
    assert files["direct"] == files["zarr"]


def test_direct_chunk_writer_refuses_a_write_off_a_chunk_boundary(tmp_path: Path) -> None:
    from cache_store.snapshot.zarr.write import compressors_for
    from cache_store.snapshot.zarr.chunks import ChunkWriterPool, LocalChunkWriter

    group = zarr.create_group(zarr.storage.LocalStore(tmp_path))
    arr = group.create_array(
        "a",
        shape=(20,),
        dtype="int32",
        chunks=(8,),
        compressors=compressors_for(np.dtype("int32"), 3, "lz4"),
        fill_value=0,
    )
    pool = ChunkWriterPool(threads=1)
    with pytest.raises(ValueError, match="not a chunk boundary"):
        LocalChunkWriter(str(tmp_path / "a"), arr, pool).write(3, np.zeros(4, np.int32))
    pool.close()


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_a_chunk_write_that_fails_aborts_the_export_and_leaves_nothing(
    tmp_path: Path, exported, monkeypatch, codec: str
) -> None:
    from cache_store.snapshot.zarr import chunks as zarr_chunks

    _, _, cache_dir, _ = exported
    writer, method = (
        (zarr_chunks.LocalChunkWriter, "_write_chunk")
        if codec != "none"
        else (zarr_chunks.RawChunkAppender, "add")
    )
    real, calls = getattr(writer, method), []

    def failing(self, *args):  # the disk fills up after a few chunks
        calls.append(args)
        if len(calls) > 3:
            raise OSError(28, "No space left on device")
        return real(self, *args)

    monkeypatch.setattr(writer, method, failing)
    with pytest.raises(OSError, match="No space left"):
        export_snapshot(cache_dir, FP_A, tmp_path / "s.zarr", codec=codec)
    assert len(calls) > 3
    assert not (tmp_path / "s.zarr" / FP_A).exists() and not list(tmp_path.glob(".s.zarr*"))


def test_threads_reading_uncompressed_chunks_while_files_are_dropped(tmp_path: Path) -> None:
    # one chunk file kept open per array and many chunks: every read drops a file
    # another thread may be reading; each must still get exactly its record
    import concurrent.futures as cf

    records, indexes = sample_content()
    cache = fill_lmdb(tmp_path / "cache", records, indexes)
    export_all(cache, tmp_path / "s.zarr", codec="none", chunk_bytes=32)
    cache.close()
    store = ZarrStore(tmp_path / "s.zarr")
    keys = list(records)
    for key in keys:
        store.get_record(key)
    for fp in store.fingerprints():
        for reader in store._snapshot(fp).local.values():
            reader.keep_files = 1
    want = {k: decode_record(v).tensors for k, v in records.items()}

    def read(i: int) -> None:
        key = keys[i % len(keys)]
        got = store.get_record(key).tensors
        assert all(torch.equal(got[n], want[key][n]) for n in want[key])

    with cf.ThreadPoolExecutor(8) as pool:
        list(pool.map(read, range(400)))


def _bool_record(fingerprint: str, sample_id: str, flags: list[bool]) -> bytes:
    return encode_record(
        {"flags": torch.tensor(flags), "points": torch.arange(6.0)},
        record_metadata(fingerprint, sample_id),
    )


def _with_bool_byte_two(value: bytes) -> bytes:
    """``value`` with its ``flags`` field's first byte set to 2, its field checksum and
    header checksum recomputed (as a bug or an attacker could): only the BOOL rule is left
    to catch it."""
    import xxhash

    header = read_header(value)
    info = header.tensors["flags"]
    out = bytearray(value)
    out[info.begin] = 2
    text = bytes(out[8 : header.data_start])
    old = header.field_checksums["flags"].encode()
    new = xxhash.xxh3_64_hexdigest(bytes(out[info.begin : info.end])).encode()
    assert text.count(old) == 1
    text = text.replace(old, new)
    at = text.index(b'"checksum":"') + len(b'"checksum":"')
    blank = text[:at] + b"0" * 32 + text[at + 32 :]
    text = text[:at] + xxhash.xxh3_128_hexdigest(blank).encode() + text[at + 32 :]
    out[8 : header.data_start] = text
    return bytes(out)


def test_a_bool_byte_of_two_is_refused_by_export_and_zarr_verify(tmp_path: Path) -> None:
    """The Zarr path (export, ``get``, ``verify``) refuses what the LMDB verify refuses: a
    BOOL byte other than 0 or 1, even with every checksum re-signed to match."""
    fp = compute_fingerprint("spc", 1, {"level": 4, "surface_samples": 100_000})
    ids = ["a", "b"]
    clean = {f"{fp}/{s}": _bool_record(fp, s, [False, True, False]) for s in ids}
    bad_key = f"{fp}/b"
    bad = _with_bool_byte_two(clean[bad_key])
    index = DatasetIndex(fp, "spc", 1, {"level": 4, "surface_samples": 100_000}, ids)
    cache = fill_lmdb(tmp_path / "cache", {**clean, bad_key: bad}, [index])
    assert list(cache.verify().corrupt) == [bad_key]  # the LMDB verify's answer
    with pytest.raises(SpcacheError, match="BOOL") as err:
        export_snapshot(cache, fp, tmp_path / "refused.zarr")
    assert bad_key in str(err.value)
    cache.close()

    # A snapshot whose stored bytes were edited the same way after a clean export.
    cache = fill_lmdb(tmp_path / "clean", clean, [index])
    dest = tmp_path / "s.zarr"
    export_snapshot(cache, fp, dest, codec="none")
    cache.close()
    group = zarr.open_group(str(dest / fp), mode="r")
    row = ids.index("b")
    (flags_chunk,) = _chunk_files(dest / fp, "data/flags")
    raw = bytearray(flags_chunk.read_bytes())
    raw[int(group["offsets/flags"][row])] = 2
    flags_chunk.write_bytes(bytes(raw))
    (headers_chunk,) = _chunk_files(dest / fp, "headers")
    raw = bytearray(headers_chunk.read_bytes())
    n = len(read_header(clean[bad_key]).metadata) and read_header(clean[bad_key]).data_start - 8
    old_text = clean[bad_key][8 : 8 + n]
    new_text = bad[8 : 8 + n]
    assert raw.count(old_text) == 1
    headers_chunk.write_bytes(bytes(raw).replace(old_text, new_text))
    store = ZarrStore(dest)
    with pytest.raises(CorruptRecord, match="BOOL"):
        store.get(bad_key)
    report = store.verify()
    assert bad_key in report.corrupt and "BOOL" in report.corrupt[bad_key]
    assert f"{fp}/a" not in report.corrupt
