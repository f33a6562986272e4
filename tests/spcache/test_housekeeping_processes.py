"""rm and compact as real processes while forked DataLoader workers read the cache."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.utils.data

from cache_store.errors import FingerprintRemoved
from cache_store.readers.dataset import CachedDataset
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.housekeeping import add_fingerprint, record_counts
from tests.helpers.procs import Proc, run_spcache, start, start_spcache


def _loader(ds: CachedDataset) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        ds,
        batch_size=16,
        shuffle=True,
        num_workers=2,
        multiprocessing_context="fork",
        persistent_workers=True,
        collate_fn=lambda batch: batch,
    )


def _read_while(
    loader: torch.utils.data.DataLoader, proc: Proc, timeout: float = 240
) -> tuple[int, list[str]]:
    """Iterate epochs until ``proc`` exited and one more epoch ran. Returns (samples
    read, errors)."""
    read, errors = 0, []
    deadline = time.monotonic() + timeout
    finished_epochs_after = 0
    while finished_epochs_after < 1 and time.monotonic() < deadline:
        done = not proc.alive()
        try:
            for batch in loader:
                for sample in batch:
                    read += 1
                    if int(sample["octree"].numel()) <= 0:
                        errors.append("empty octree")
        except Exception as exc:  # noqa: BLE001 - counted: the test asserts there are none
            errors.append(f"{type(exc).__name__}: {exc}")
        if done:
            finished_epochs_after += 1
    return read, errors


def test_rm_and_compact_while_forked_workers_read_another_fingerprint(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    keep = add_fingerprint(cache, 3, n=400, nbytes=4096)
    gone = add_fingerprint(cache, 4, n=6000, nbytes=4096)
    other = add_fingerprint(cache, 5, n=300, nbytes=4096)
    counts = record_counts(cache)
    reader_of_gone = CachedDataset(str(cache), gone)
    assert len(reader_of_gone) == 6000 and reader_of_gone[0]["octree"].numel() > 0

    ds = CachedDataset(str(cache), keep)
    loader = _loader(ds)
    first = next(iter(loader))  # the workers are up and reading
    assert len(first) == 16
    rm = start_spcache("rm", gone, "--cache", str(cache), "--json")
    read, errors = _read_while(loader, rm)
    assert rm.wait(60) == 0, rm.stderr()
    (report,) = json.loads(rm.stdout())
    assert report["records"] == 6000 and report["fingerprint"] == gone
    assert errors == [] and read >= 400

    # the removed one: one clear error, for an open dataset and for a new one
    with pytest.raises(FingerprintRemoved, match=f"fingerprint {gone} was removed"):
        reader_of_gone[5]
    with pytest.raises(FingerprintRemoved, match="was removed"):
        len(CachedDataset(str(cache), gone))
    verify = run_spcache("verify", "--cache", str(cache))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "cache verifies clean" in verify.stdout
    assert record_counts(cache) == {keep: counts[keep], other: counts[other]}

    # compact while the workers keep reading the survivors
    size_before = (cache / "records" / "data.mdb").stat().st_size
    compact = start_spcache("compact", "--cache", str(cache), "--json")
    read, errors = _read_while(loader, compact)
    assert compact.wait(60) == 0, compact.stderr()
    sizes = json.loads(compact.stdout())
    size_after = (cache / "records" / "data.mdb").stat().st_size
    assert sizes == {"before": size_before, "after": size_after}
    # the removed bytes come back, less LMDB's page overhead (a page header per overflow
    # record, branch pages): at most one 4 KiB page per removed record
    assert size_before - size_after >= report["bytes"] - 6000 * 4096 // 4, (sizes, report)
    assert errors == [] and read >= 400
    del loader
    assert run_spcache("verify", "--cache", str(cache)).returncode == 0
    assert record_counts(cache) == {keep: counts[keep], other: counts[other]}
    store = LMDBStore(cache)
    assert store.get_record(f"{other}/s000007").metadata["sample_id"] == "s000007"
    store.close()


def test_compact_while_a_writer_process_writes_loses_no_commit(tmp_path: Path) -> None:
    """A writer that committed before, during and after the swap: every batch it said was
    committed is in the compacted file (none went to the swapped-out one)."""
    from tests.helpers.fault_children import FAULT_CHILD, FAULT_FINGERPRINT

    cache = tmp_path / "cache"
    keep = add_fingerprint(cache, 4, n=6000, nbytes=3000)
    gone = add_fingerprint(cache, 5, n=3000, nbytes=3000)
    assert run_spcache("rm", gone, "--cache", str(cache)).returncode == 0
    writer = start(
        [
            *FAULT_CHILD,
            "writer",
            str(cache),
            "--batches",
            "400",
            "--size",
            "50",
            "--record-bytes",
            "1000",
        ]
    )
    writer.wait_line("^committed 2$")  # start compacting once the writer is under way
    compact = run_spcache("compact", "--cache", str(cache), "--json")
    still_writing = writer.alive()  # so it also wrote after the swap
    assert writer.wait(300) == 0, writer.stderr()
    assert still_writing
    assert compact.returncode == 0, compact.stderr
    sizes = json.loads(compact.stdout)
    assert sizes["after"] < sizes["before"]
    assert "finished" in writer.stdout()
    counts = record_counts(cache)
    assert counts[FAULT_FINGERPRINT] == 400 * 50  # every committed batch survived the swap
    assert counts[keep] == 6000 and gone not in counts
    verified = json.loads(run_spcache("verify", "--cache", str(cache), "--json").stdout)
    assert not (verified["corrupt"] or verified["missing"] or verified["damaged"]), verified
    # the writer child stores records and never an index: verify names them, nothing else
    assert verified["unindexed"] == {FAULT_FINGERPRINT: 400 * 50}
