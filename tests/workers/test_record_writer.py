"""The record writer's hand-over from the engine's thread, under interrupts.

SIGTERM (through ``spcache precompute``'s handler) and Ctrl-C raise KeyboardInterrupt in
the engine's thread between any two bytecodes. Wherever one lands in
:meth:`RecordWriter.put`, what follows on an interrupted run (:meth:`RecordWriter.finish`)
must end, with every record that was handed over committed. With a ``queue.Queue`` it
did not: an interrupt inside ``Condition.notify``, after waking the writer's waiter and
before taking it off the list, left a stale waiter that the stop's notify woke instead
of the writer, and ``finish()`` joined the sleeping writer for ever.

The interrupt is raised from a trace function at each bytecode of ``put`` in turn (a
signal's handler runs at a subset of those points), with the writer asleep waiting for
work, as it is while the engine computes.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from types import FrameType
from typing import Any

import torch

from cache_store.stores.memory import MemoryStore
from cache_store.testing.records import record_metadata
from tests.helpers.procs import EVENT_TIMEOUT, wait_for
from workers.record_writer import PendingRecord, RecordWriter
from workers.run_ledger import ItemResult, WorkItem

FINGERPRINT = "f" * 32


def _pending(sample_id: str) -> PendingRecord:
    return PendingRecord(
        WorkItem(sample_id, f"/{sample_id}.obj", key=f"{FINGERPRINT}/{sample_id}"),
        {"octree": torch.arange(8, dtype=torch.uint8)},
        record_metadata(FINGERPRINT, sample_id),
    )


class InterruptAt:
    """A trace function raising KeyboardInterrupt before the ``n``-th bytecode run in
    this thread (from when it is set), as a signal's handler would; ``fired`` says
    whether it did."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.fired = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return self.step

    def step(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode" and not self.fired:
            if self.left == 0:
                self.fired = True
                raise KeyboardInterrupt
            self.left -= 1
        return self.step


def _asleep(thread: threading.Thread) -> bool:
    """The thread is blocked (state S in /proc), as it is waiting for work."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # not Linux: trust the poll below
        return True
    return stat[stat.rfind(b")") + 2 :][:1] == b"S"


def _wait_until_waiting_for_work(writer: RecordWriter, committed: int, results: list) -> None:
    """Every record handed over so far is reported, and the writer sleeps (twice seen
    asleep, a poll apart: a thread only waiting for the GIL wakes in between)."""

    def idle() -> bool:
        while True:
            try:
                results.append(writer.committed.get_nowait()[0])
            except queue.Empty:
                break
        if len(results) < committed or not _asleep(writer):
            return False
        time.sleep(0.05)
        return _asleep(writer)

    wait_for(idle, what="the writer waiting for work")


def test_an_interrupt_anywhere_in_a_put_never_strands_the_stop(tmp_path: Any) -> None:
    for n in range(10_000):
        store = MemoryStore()
        writer = RecordWriter(store, 1, queue.SimpleQueue())
        writer.start()
        results: list[ItemResult] = []
        writer.put(_pending("before"))  # the writer has committed once and waits again
        _wait_until_waiting_for_work(writer, 1, results)

        pending, interrupt = _pending("interrupted"), InterruptAt(n)
        sys.settrace(interrupt)
        try:
            writer.put(pending)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)

        # what an interrupted run does next (the engine's clean-up): commit and stop
        stopper = threading.Thread(target=writer.finish, daemon=True)
        stopper.start()
        stopper.join(EVENT_TIMEOUT)
        assert not stopper.is_alive(), (
            f"finish() did not end after an interrupt at bytecode {n} of put(): the writer "
            f"sleeps with the stop in its inbox"
        )
        while not writer.committed.empty():
            results.append(writer.committed.get_nowait()[0])
        done = {r.sample_id for r in results if r.status == "done"}
        assert done == {key.split("/", 1)[1] for key in store.keys()} == writer.stored
        assert "before" in done
        if not interrupt.fired:  # past the end of put(): the record was handed over whole
            assert "interrupted" in done
            assert n > 0
            return
    raise AssertionError("put() never ran to its end without an interrupt")
