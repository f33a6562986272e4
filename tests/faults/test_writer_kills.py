"""Case 1: SIGKILL the writer in the middle of batches of thousands of records.

A real ``LMDBStore`` writer in its own process commits batches of ``SIZE`` records with
one ``put_many`` each. The test kills it with SIGKILL a random few milliseconds after it
announced a batch (so the kill lands while the batch is being checked or inside its write
transaction), ``KILLS`` times, and after every kill checks the store from outside:

* every batch is all or nothing (0 partial batches),
* every batch the writer had announced as committed is there in full (0 lost),
* every record written since the last check decodes with full checksum checks (0 corrupt).

Then one more run resumes (skipping stored batches) and completes, and ``verify`` reads
every record once more.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from cache_store.stores.lmdb import LMDBStore
from cache_store.format.decode import decode_arrays
from tests.helpers.fault_children import FAULT_FINGERPRINT, batch_key
from tests.helpers.faults import Child, env_int, report

KILLS = env_int("SPCACHE_FAULT_WRITER_KILLS", 20)
SIZE = env_int("SPCACHE_FAULT_WRITER_BATCH", 2000)


def _batch_counts(store: LMDBStore) -> dict[int, int]:
    counts: dict[int, int] = {}
    for key in store.keys(FAULT_FINGERPRINT + "/"):
        batch = int(key.split("/")[1][1:])
        counts[batch] = counts.get(batch, 0) + 1
    return counts


@pytest.mark.slow
def test_writer_sigkill_loses_nothing_and_resumes(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    rng = random.Random(1)
    batches = KILLS + 4  # about twice what the killed runs commit: the resume has work
    args = (
        "writer",
        str(cache),
        "--batches",
        str(batches),
        "--size",
        str(SIZE),
        "--record-bytes",
        "1024",
    )
    announced: set[int] = set()
    checked: set[int] = set()
    kills_inside = 0
    commit_s = 0.15  # the longest kill delay until a commit has been timed
    corrupt: dict[str, str] = {}
    partial: dict[int, int] = {}
    lost: set[int] = set()
    for run in range(KILLS):
        child = Child(*args)
        skip = int(rng.random() < 0.5)  # let 0 or 1 batch commit, then kill inside the next
        line = child.expect(("begin", "finished"))
        for _ in range(skip):
            began = time.monotonic()
            child.expect("committed")
            commit_s = min(commit_s, time.monotonic() - began)
            line = child.expect(("begin", "finished"))
        if line == "finished":  # everything is stored already: nothing left to interrupt
            child.kill()
            break
        # inside the batch: within the shortest commit seen so far (a machine that commits
        # a batch faster gets earlier kills, so they still land inside the transaction)
        time.sleep(rng.uniform(0.0, 0.8 * commit_s))
        child.kill()
        rest = child.drain()
        announced |= {int(x.split()[1]) for x in rest if x.startswith("committed")}
        target = int(line.split()[1])
        kills_inside += f"committed {target}" not in rest

        store = LMDBStore(cache, readonly=True)
        counts = _batch_counts(store)
        partial.update({b: n for b, n in counts.items() if n != SIZE})
        lost |= {b for b in announced if counts.get(b, 0) != SIZE}
        for b in sorted(set(counts) - checked):
            for i in range(SIZE):
                key = batch_key(b, i)
                try:
                    _, meta = decode_arrays(store.get(key), key=key)
                    assert meta["sample_id"] == key.split("/", 1)[1]
                except Exception as exc:  # noqa: BLE001 - counted, asserted below
                    corrupt[key] = repr(exc)
            checked.add(b)
        store.close()

    resumed = Child(*args)
    assert resumed.wait(300) == 0
    lines = resumed.drain()
    resumed_batches = sum(x.startswith("committed") for x in lines)
    assert "finished" in lines
    store = LMDBStore(cache, readonly=True)
    counts = _batch_counts(store)
    result = store.verify()
    store.close()
    figures = {
        "kills": KILLS,
        "batch_size": SIZE,
        "kills_inside_a_batch": kills_inside,
        "batches_committed_before_resume": len(checked),
        "batches_written_by_resume": resumed_batches,
        "records_verified": result.checked,
        "corrupt": len(corrupt) + len(result.corrupt),
        "partial_batches": len(partial),
        "lost_committed_batches": len(lost),
    }
    report("1 writer SIGKILL", figures)
    assert not corrupt and not partial and not lost, (list(corrupt.items())[:3], partial, lost)
    assert kills_inside >= KILLS // 2  # the kills really landed inside batches
    assert counts == dict.fromkeys(range(batches), SIZE)  # the resume completed every batch
    assert not (result.corrupt or result.missing or result.damaged), result.as_json()
    assert result.checked == batches * SIZE
    assert list(result.unindexed) == [FAULT_FINGERPRINT]  # the writer child indexes nothing
