"""ZarrStore: a snapshot exported from an LMDB cache reads the same records, through the
store contract, ``open_store``, a plain zarr client, ``CachedDataset`` and forked
DataLoader workers; small chunks decoded once, files dropped under readers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from cache_store import CachedDataset, collate_spc
from cache_store.errors import (
    CacheNotFound,
    ReadOnlyStoreError,
    RecordNotFound,
)
from cache_store.snapshot.zarr.export import export_snapshot
from cache_store.keys import compute_fingerprint
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.decode import decode_record
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
from tests.helpers.zarr_snapshots import export_all, export_sample, fill_lmdb
from tests.helpers.synthetic import make_record


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(records, indexes, lmdb cache dir, snapshot dir), exported once for the module."""
    return export_sample(tmp_path_factory.mktemp("exported"))


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
