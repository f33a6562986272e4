"""Case 2: SIGKILL readers that hold read transactions, then keep writing.

A reader killed inside a read transaction leaves its slot in LMDB's reader table, and the
snapshot it pinned: no page freed after that snapshot can be reused, so a writer that
keeps overwriting records makes the file grow by everything it writes. The writer frees
such slots when it opens and then every ``READER_CHECK_INTERVAL_S`` seconds; once that
check has run, overwriting reuses pages and the file stops growing.

The test measures it: a long-lived writer (this process) overwrites the same records
round after round while killed readers pin an old snapshot, first with the periodic check
held off (the file grows: the hazard is real), then with it due (the file does not grow
any more). A fresh writer opening the cache also reports the dead readers it freed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import cache_store.stores.lmdb.environment as lmdb_environment
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.fault_children import batch_key, make_small_record
from tests.helpers.faults import Child, env_int, report

READERS = env_int("SPCACHE_FAULT_STALE_READERS", 8)
RECORDS = 100
ROUNDS = 5


def _overwrite(store: LMDBStore, round_: int) -> None:
    store.put_many(
        [
            (batch_key(0, i), make_small_record(batch_key(0, i), 16 * 1024, round_ * 1000 + i))
            for i in range(RECORDS)
        ]
    )


def _used(store: LMDBStore) -> int:
    return store.stats()["lmdb"]["used_bytes"]


def _file(cache: Path) -> int:
    return (cache / "records" / "data.mdb").stat().st_size


@pytest.mark.slow
def test_killed_readers_stop_pinning_pages_once_the_writer_checks(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    children: list[Child],
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setattr(lmdb_environment, "READER_CHECK_INTERVAL_S", 1e9)
    writer = LMDBStore(cache, readonly=False)
    _overwrite(writer, 0)
    for round_ in range(1, 3):  # steady state with no readers: freed pages are reused
        _overwrite(writer, round_)
    steady = _used(writer)

    for _ in range(READERS):
        child = Child("hold-readers", str(cache), "1")
        children.append(child)
        child.expect("holding")
    slots_held = writer.stats()["lmdb"]["readers_in_use"]
    for child in children:
        child.kill()

    for round_ in range(3, 3 + ROUNDS):  # the periodic check is not due yet
        _overwrite(writer, round_)
    pinned = _used(writer)

    monkeypatch.setattr(lmdb_environment, "READER_CHECK_INTERVAL_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="cache_store.stores.lmdb"):
        _overwrite(writer, 100)  # the check runs before this write
    freed = [r for r in caplog.records if "stale LMDB reader slot" in r.getMessage()]
    after_check = _used(writer)
    for round_ in range(101, 101 + 2 * ROUNDS):
        _overwrite(writer, round_)
    final = _used(writer)
    file_bytes = _file(cache)
    writer.close()

    report(
        "2 stale readers",
        {
            "readers_killed": READERS,
            "reader_slots_held_before_kill": slots_held,
            "used_bytes_steady": steady,
            "used_bytes_after_rounds_with_dead_readers": pinned,
            "used_bytes_after_check": after_check,
            "used_bytes_after_further_rounds": final,
            "rounds": ROUNDS,
            "record_bytes_per_round": RECORDS * 16 * 1024,
            "data_mdb_file_bytes": file_bytes,
        },
    )
    assert slots_held >= READERS
    assert pinned > steady + (ROUNDS - 1) * RECORDS * 16 * 1024  # the hazard is real
    assert freed and "freed" in freed[0].getMessage()
    # Once checked, twice as many rounds again grow the map by less than one round.
    assert final - after_check < RECORDS * 16 * 1024


def test_a_writer_opening_the_cache_frees_dead_readers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    with LMDBStore(cache, readonly=False) as writer:
        _overwrite(writer, 0)
    # A live process keeps the environment open (otherwise the next opener would find
    # the lock file unused and reset the whole reader table itself).
    keeper = Child("hold-readers", str(cache), "0")
    child = Child("hold-readers", str(cache), "2")
    children.extend([keeper, child])
    keeper.expect("holding")
    child.expect("holding")
    child.kill()
    with caplog.at_level(logging.WARNING, logger="cache_store.stores.lmdb"):
        with LMDBStore(cache, readonly=False) as writer:
            _overwrite(writer, 1)
    assert any("freed 2 stale" in r.getMessage() for r in caplog.records)
