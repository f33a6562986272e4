"""LMDBStore across processes: fork, stale readers, a writer racing readers."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from cache_store.errors import SpcacheError
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.decode import decode_record
from cache_store.testing import FP_A
from tests.helpers.synthetic import make_record
from tests.helpers.procs import start


def _fill(path: Path, n: int = 8) -> dict[str, bytes]:
    items = {f"{FP_A}/s{i}": make_record(FP_A, f"s{i}", i) for i in range(n)}
    store = LMDBStore(path, readonly=False)
    store.put_many(items.items())
    store.close()
    return items


def _read_all_in_child(path: str, keys: list[str], queue: mp.Queue) -> None:
    store = LMDBStore(path)
    queue.put([store.get(k) for k in keys])


def test_forked_child_reads_while_parent_holds_the_store_open(tmp_path: Path) -> None:
    items = _fill(tmp_path)
    parent = LMDBStore(tmp_path)
    assert parent.get(next(iter(items))) == items[next(iter(items))]  # parent has it open
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_all_in_child, args=(str(tmp_path), list(items), queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0
    assert got == list(items.values())
    # and the parent goes on reading (it re-opens lazily after the fork)
    assert [parent.get(k) for k in items] == list(items.values())
    parent.close()


def test_store_reused_in_child_after_fork_reopens(tmp_path: Path) -> None:
    items = _fill(tmp_path)
    store = LMDBStore(tmp_path)
    store.get(next(iter(items)))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: same object, different process
        try:
            ok = all(store.get(k) == v for k, v in items.items())
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    store.close()


def test_writer_frees_stale_reader_slots(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A reader killed inside a transaction leaves its slot; the next writer frees it.

    (Only while some other process keeps the environment open: the last one out lets the
    next opener reset the whole table.)
    """
    items = _fill(tmp_path)
    hold = (
        "import sys, time; from cache_store.stores.lmdb import LMDBStore\n"
        "s = LMDBStore(sys.argv[1]); s.fingerprints()\n"
        "if sys.argv[2] == 'txn': ctx = s._read(); ctx.__enter__()\n"
        "print('holding', flush=True); time.sleep(120)\n"
    )
    with (
        start([sys.executable, "-c", hold, tmp_path, "open"]) as keeper,
        start([sys.executable, "-c", hold, tmp_path, "txn"]) as reader,
    ):
        keeper.wait_line("^holding$")
        reader.wait_line("^holding$")
        reader.send_signal(signal.SIGKILL)
        reader.wait(30)
        with caplog.at_level(logging.WARNING, logger="cache_store.stores.lmdb"):
            writer = LMDBStore(tmp_path, readonly=False)
            writer.put_many([(f"{FP_A}/s0", items[f"{FP_A}/s0"])])
        assert "freed 1 stale LMDB reader slot" in caplog.text
        writer.close()


def test_full_reader_table_is_a_clear_error(tmp_path: Path) -> None:
    store = LMDBStore(tmp_path, readonly=False, max_readers=1)
    store.put_many([(f"{FP_A}/a", make_record(FP_A, "a", 1))])
    with store._read():  # holds the only slot
        with pytest.raises(SpcacheError, match="max_readers=1"):
            store.get(f"{FP_A}/a")
    store.close()


def _writer(path: str, stop: mp.Event, queue: mp.Queue) -> None:
    store = LMDBStore(path, readonly=False, map_size=1 << 16)  # small: grows while racing
    generation = 0
    try:
        while not stop.is_set():
            generation += 1
            # every generation rewrites every key with records of another size
            batch = [
                (
                    f"{FP_A}/k{i}",
                    make_record(
                        FP_A, f"k{i}", generation * 100 + i, num_points=50 + generation % 300
                    ),
                )
                for i in range(6)
            ]
            store.put_many(batch)
        queue.put(("writer", generation))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails
        queue.put(("writer-error", repr(exc)))


def _reader(path: str, stop: mp.Event, queue: mp.Queue) -> None:
    store = LMDBStore(path)
    reads = 0
    try:
        while not stop.is_set():
            for key in store.keys(f"{FP_A}/k"):
                record = store.get_record(key)  # full checksum verification
                assert record.metadata["sample_id"] == key.split("/", 1)[1]
                decode_record(store.get(key), key=key)
                reads += 1
        queue.put(("ok", reads))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails
        queue.put(("error", repr(exc)))


@pytest.mark.slow
def test_readers_in_other_processes_never_see_a_partial_record(tmp_path: Path) -> None:
    first = LMDBStore(tmp_path, readonly=False, map_size=1 << 16)
    first.put_many([(f"{FP_A}/k{i}", make_record(FP_A, f"k{i}", i)) for i in range(6)])
    first.close()
    ctx = mp.get_context("fork")
    stop, queue = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), stop, queue))]
    procs += [ctx.Process(target=_reader, args=(str(tmp_path), stop, queue)) for _ in range(2)]
    for proc in procs:
        proc.start()
    time.sleep(3.0)
    stop.set()
    results = [queue.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(60)
    assert all(status in ("ok", "writer") for status, _ in results), results
    assert all(count > 3 for _, count in results), results
    assert LMDBStore(tmp_path).stats()["lmdb"]["map_size"] > 1 << 16
