"""Writing: a thread that encodes records and commits them in batched transactions."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from cache_store.errors import FingerprintRemoved, StoreFull, REASON_MAX, one_line
from cache_store.format.encode import encode_record
from cache_store.keys import record_id
from cache_store.stores.base import Store
from workers.run_ledger import ItemResult, WorkItem

__all__ = ["PendingRecord", "RecordWriter"]

logger = logging.getLogger(__name__)


@dataclass
class PendingRecord:
    """A computed record (variant ``variant`` of a sample) waiting to be encoded and
    committed under ``key``."""

    item: WorkItem
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    variant: int = 0
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            self.key = self.item.key


class RecordWriter(threading.Thread):
    """Encodes records and commits them in batches (one ``store.put_many`` each).

    Every item's outcome (``done`` once committed, else ``failed`` with the reason) is
    put on ``committed`` as ``(ItemResult, perf_counter time)``; the engine reports it
    from its own thread. A failed write is ``transient`` (the sample itself is fine).

    Once a commit raises :class:`StoreFull` (the disk, or the LMDB map at its bound), it
    is kept in ``full`` and nothing more is written: the items still arriving fail at
    once with its reason, and the engine stops the run.

    ``stored`` holds the record id of every record committed, added by this thread before
    the result is queued: a SIGTERM lands only in the engine's thread, possibly between
    taking a result off the queue and counting it, and the index is written from
    ``stored`` too, so no committed record is left out of it.

    The engine's thread and this one share only :class:`queue.SimpleQueue` objects, whose
    ``put`` and ``get`` are each one C call. SIGTERM and Ctrl-C raise KeyboardInterrupt in
    the engine's thread at any bytecode, also inside the pure-Python ``queue.Queue`` and
    ``threading.Condition``: between waking this thread's waiter and taking it off the
    waiters' list (the next ``put``, :meth:`finish`'s stop, then wakes a stale waiter and
    this thread sleeps on), or holding the condition's lock. Either way :meth:`finish`
    waited for ever on a thread waiting for work. So the records come in one SimpleQueue
    and the bound on those waiting (two batches: memory) is a second one holding a token
    per free place; an interrupt costs at most a token, never a wake-up.
    """

    _STOP = object()

    def __init__(
        self, store: Store, batch: int, committed: queue.SimpleQueue[tuple[ItemResult, float]]
    ) -> None:
        super().__init__(name="spcache-writer", daemon=True)
        self.store = store
        self.batch = batch
        self.committed = committed
        # records (and the stop) from the engine's thread, and one token per record that
        # may wait here: the engine takes one before each put, this thread gives it back
        # when it takes the record (see the class doc for why two SimpleQueues)
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.room: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(2 * batch):
            self.room.put(None)
        self.busy_s = 0.0
        self.full: StoreFull | None = None
        self.stored: set[str] = set()

    def put(self, pending: PendingRecord) -> None:
        """Hand a computed record over; waits while two batches are waiting already."""
        self.room.get()
        self.inbox.put(pending)

    def finish(self) -> None:
        """Commit what was put, then stop the thread and wait for it."""
        self.inbox.put(self._STOP)  # takes no room: never waits
        self.join()

    def run(self) -> None:
        stopping = False
        while not stopping:
            batch: list[PendingRecord] = []
            item = self._take(block=True)
            while item is not None:
                if item is self._STOP:
                    stopping = True
                    break
                batch.append(item)
                if len(batch) >= self.batch:
                    break
                item = self._take(block=False)
            if batch:
                self._commit(batch)

    def _take(self, *, block: bool) -> Any:
        """The next record (or the stop) put; None when ``block`` is false and there is
        none. A record's room goes back to the engine as it is taken."""
        try:
            item = self.inbox.get(block)
        except queue.Empty:
            return None
        if item is not self._STOP:
            self.room.put(None)
        return item

    def _commit(self, batch: list[PendingRecord]) -> None:
        if self.full is not None:
            for pending in batch:
                self._report(
                    pending,
                    "failed",
                    f"not written: {one_line(self.full, limit=REASON_MAX)}",
                    transient=True,
                )
            return
        start = time.perf_counter()
        encoded: list[tuple[str, bytes]] = []
        ok: list[PendingRecord] = []
        for pending in batch:
            item = pending.item
            try:
                encoded.append((pending.key, encode_record(pending.tensors, pending.metadata)))
                ok.append(pending)
            except Exception as exc:  # this record fails alone
                logger.exception("encoding the record of %s failed", item.sample_id)
                self._report(
                    pending, "failed", f"cannot encode record: {one_line(exc, limit=REASON_MAX)}"
                )
        if encoded:
            try:
                self.store.put_many(encoded)
            except Exception as exc:  # the batch fails with its reason, the run goes on
                if isinstance(exc, FingerprintRemoved):
                    logger.info("not writing %d records: %s", len(encoded), exc)
                elif isinstance(exc, StoreFull):
                    self.full = exc
                    logger.error(
                        "writing %d records failed, the cache is full: %s", len(encoded), exc
                    )
                else:
                    logger.exception("writing %d records failed", len(encoded))
                # a removed fingerprint (spcache rm) is final: retrying would bring it back
                transient = not isinstance(exc, FingerprintRemoved)
                for pending in ok:
                    self._report(
                        pending,
                        "failed",
                        f"store write failed: {one_line(exc, limit=REASON_MAX)}",
                        transient=transient,
                    )
                ok = []
        self.busy_s += time.perf_counter() - start
        for pending in ok:
            self.stored.add(record_id(pending.item.sample_id, pending.variant))
            self._report(pending, "done", "")

    def _report(
        self, pending: PendingRecord, status: str, reason: str, transient: bool = False
    ) -> None:
        # The source hash goes with every result: the Ray driver matches a committed,
        # unreported record against it when a SIGTERM lands between commit and report.
        item = pending.item
        self.committed.put(
            (
                ItemResult(
                    item.sample_id,
                    item.path,
                    status,
                    key=pending.key if status == "done" else "",
                    reason=reason,
                    transient=transient,
                    source_hash=pending.metadata.get("source_hash", ""),
                    variant=pending.variant,
                ),
                time.perf_counter(),
            )
        )
