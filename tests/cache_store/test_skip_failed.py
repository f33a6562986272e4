"""``CachedDataset(on_error="skip")``: a sample without a usable record is left out of its
batch, warned about once per id across forked loader workers, and listed by the dataset
in the parent process. Real LMDB, real forked DataLoader workers."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cache_store import CachedDataset, collate_spc
from cache_store.errors import ParameterError, RecordNotFound, SourceError
from cache_store.format.index import DatasetIndex
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.synthetic import fingerprint_of, make_record

FP = fingerprint_of("spc", level=4)
N = 40
# ids 8..15 (a whole batch of 8) have no record, and so have 3, 21 and 30
MISSING = {*range(8, 16), 3, 21, 30}


def _sid(i: int) -> str:
    return f"s{i:03d}"


@pytest.fixture(scope="module")
def holey_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain cache whose index lists samples that have no record."""
    path = tmp_path_factory.mktemp("holey")
    store = LMDBStore(path, readonly=False)
    ids = [_sid(i) for i in range(N)]
    store.put_many(
        (f"{FP}/{sid}", make_record(FP, sid, seed=i, level=4, num_points=20 + i))
        for i, sid in enumerate(ids)
        if i not in MISSING
    )
    store.put_index(
        DatasetIndex(FP, "spc", 1, {"level": 4, "surface_samples": 100_000}, np.array(ids))
    )
    store.close()
    return path


def test_skip_leaves_missing_samples_out_across_forked_workers(
    holey_cache: Path, tmp_path: Path
) -> None:
    log_file = tmp_path / "warnings.log"
    handler = logging.FileHandler(log_file)  # forked workers inherit it and append
    logger = logging.getLogger("cache_store.readers.dataset")
    logger.addHandler(handler)
    try:
        ds = CachedDataset(holey_cache, FP, on_error="skip")
        loader = DataLoader(
            ds, batch_size=8, num_workers=2, multiprocessing_context="fork", collate_fn=collate_spc
        )
        epochs = []
        for _ in range(2):
            seen, sizes, empty = [], [], 0
            for batch in loader:
                if not batch:
                    empty += 1
                    continue
                sizes.append(int(batch["lengths"].shape[0]))
                seen.extend(int(x) for x in batch["pyramid"][:, 1, -1])
            epochs.append((sizes, empty))
    finally:
        logger.removeHandler(handler)
        handler.close()
    good = N - len(MISSING)
    for sizes, empty in epochs:
        assert sum(sizes) == good and empty == 1  # the batch of ids 8..15 failed whole
        assert sorted(sizes) == sorted([7, 8, 7, 7])  # short batches, none dropped
    # the parent lists what the forked workers skipped, with a reason naming the key
    failed = ds.failed
    assert sorted(failed) == sorted(_sid(i) for i in MISSING)
    assert "RecordNotFound" in failed[_sid(3)].reason and failed[_sid(3)].when > 0
    # one warning per id over two epochs and two worker processes
    lines = [line for line in log_file.read_text().splitlines() if "skipping sample" in line]
    assert len(lines) == len(MISSING)
    assert sorted(
        line.split("skipping sample ")[1].split()[0].strip("'") for line in lines
    ) == sorted(_sid(i) for i in MISSING)


def test_raise_stays_the_default(holey_cache: Path) -> None:
    ds = CachedDataset(holey_cache, FP)
    with pytest.raises(RecordNotFound):
        ds[3]
    with pytest.raises(RecordNotFound):
        ds.__getitems__([0, 1, 2, 3])
    assert ds.failed == {}


def test_skip_in_the_main_process(holey_cache: Path) -> None:
    ds = CachedDataset(holey_cache, FP, on_error="skip")
    assert ds[3] is None and ds[4] is not None
    batch = ds.__getitems__([0, 1, 2, 3])
    assert [b is None for b in batch] == [False, False, False, True]
    assert list(ds.failed) == [_sid(3)]
    collated = collate_spc(batch)
    assert collated["lengths"].shape == (3,)
    assert torch.equal(collated["octree"], torch.cat([b["octree"] for b in batch[:3]]))


def test_collate_drops_none_and_an_all_failed_batch_is_empty() -> None:
    assert collate_spc([None, None]) == {}
    with pytest.raises(ParameterError, match="empty batch"):
        collate_spc([])


def test_on_error_is_checked(holey_cache: Path) -> None:
    with pytest.raises(ParameterError, match="on_error"):
        CachedDataset(holey_cache, FP, on_error="ignore")


def test_skip_leaves_out_a_source_deleted_between_epochs(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    import shutil

    from spcache import precompute

    sources = tmp_path / "meshes"
    sources.mkdir()
    for path in corpus_meshes[:4]:
        shutil.copy(path, sources / path.name)
    params = {"level": 4, "surface_samples": 2000}
    result = precompute(sources, "spc", tmp_path / "cache", loaders=0, progress=False, **params)
    assert result.done == 4
    ds = CachedDataset(
        tmp_path / "cache", "spc", sources=sources, on_miss="error", on_error="skip", **params
    )
    loader = DataLoader(
        ds, batch_size=2, num_workers=2, multiprocessing_context="fork", collate_fn=collate_spc
    )
    assert sum(int(b["lengths"].shape[0]) for b in loader) == 4
    strict = CachedDataset(tmp_path / "cache", "spc", sources=sources, on_miss="error", **params)
    gone = sorted(sources.iterdir())[1]
    position = next(i for i in range(len(strict)) if strict.sample_id(i) == gone.stem)
    gone.unlink()  # between epochs: the stored record can no longer be checked
    assert sum(int(b["lengths"].shape[0]) for b in loader if b) == 3
    failed = ds.failed
    assert list(failed) == [gone.stem] and str(gone) in failed[gone.stem].path
    with pytest.raises(SourceError, match=gone.name):  # the default policy still raises
        strict[position]
