"""The hop's batch slots: DataLoader workers pack each batch into a slot of a ring the
training process made before forking them, and send the slot; the training process
views it (:mod:`cache_store.views.ring`).

Run as training scripts run, in a subprocess from a fresh directory with real forked
workers: every batch equal to a plain read, and where its memory lies (a slot of the
ring, or memory of the training process's own when the batch crossed as places). The
ring's rules are checked across real forks: a slot is written only by the worker that
claimed it, read only while opened, and a batch whose slot was claimed again is read
from the cache instead.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from cache_store.views.ring import BatchRing, ring_here
from tests.cache_store.test_views_training import FP, small_cache
from tests.helpers.procs import run

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="views are Linux's")

COMMON = textwrap.dedent(
    """
    import gc, sys
    import torch
    from torch.utils.data import DataLoader
    import spcache
    from cache_store.views import ring as rings

    cache, fp = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3:
        rings.SLOTS = int(sys.argv[3])
    views = spcache.CachedDataset(cache, fp, views=True)
    plain = spcache.CachedDataset(cache, fp)
    ring = rings.ring()

    def in_ring(batch):
        at = batch["octree"].untyped_storage().data_ptr()
        return ring.addr <= at < ring.addr + ring.slots * ring.capacity

    def loader(order, size=2):
        return DataLoader(views, batch_size=size, sampler=order, num_workers=2,
                          collate_fn=spcache.collate_spc, multiprocessing_context="fork")

    def same(batch, part):
        want = spcache.collate_spc([plain[i] for i in part])
        assert batch.keys() == want.keys()
        for name in want:
            if isinstance(want[name], list):
                assert batch[name] == want[name], name
            else:
                assert torch.equal(batch[name], want[name]), name

    def states():
        gc.collect()
        return [state for state, _, _ in ring.states()]
    """
)

EPOCHS = COMMON + textwrap.dedent(
    """
    order = list(range(len(plain)))[::-1]
    for epoch in range(3):
        slotted = 0
        for b, batch in enumerate(loader(order)):
            same(batch, order[2 * b : 2 * b + 2])
            slotted += in_ring(batch)
        print(f"epoch {epoch}: {slotted} of {b + 1} batches in slots", flush=True)
    del batch
    print("slots held after the epochs:", sum(s != 0 for s in states()), flush=True)
    for stop in range(40):  # an iterator dropped after one batch: its workers' batches
        batches = iter(loader(order))  # in flight never reach this process
        next(batches)
        del batches
    slotted = 0
    for b, batch in enumerate(loader(order)):
        same(batch, order[2 * b : 2 * b + 2])
        slotted += in_ring(batch)
    print(f"after 40 dropped iterators: {slotted} of {b + 1} batches in slots", flush=True)
    """
)

HELD = COMMON + textwrap.dedent(
    """
    order = list(range(len(plain)))
    kept = list(loader(order, 1))  # every batch held: more than the ring's slots
    for b, batch in enumerate(kept):
        same(batch, order[b : b + 1])
    print("held:", sum(map(in_ring, kept)), "of", len(kept), "in slots", flush=True)
    del kept, batch
    slotted = 0
    for b, batch in enumerate(loader(order, 1)):
        same(batch, order[b : b + 1])
        slotted += in_ring(batch)
    print("let go:", slotted, "of", b + 1, "in slots", flush=True)
    """
)


def _script(tmp_path: Path, text: str, *args: str) -> list[str]:
    cache = tmp_path / "cache"
    if not cache.exists():
        small_cache(cache, 10)
    work = tmp_path / "fresh"
    work.mkdir(exist_ok=True)
    (work / "train.py").write_text(text)
    done = run([sys.executable, "train.py", cache, FP, *args], cwd=work, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def test_workers_pack_each_batch_into_a_slot_and_dropped_iterators_leave_none_taken(
    tmp_path: Path,
) -> None:
    lines = _script(tmp_path, EPOCHS)
    assert lines[:3] == [f"epoch {e}: 5 of 5 batches in slots" for e in range(3)], lines
    # the last batch let go: every slot free again
    assert lines[3] == "slots held after the epochs: 0", lines
    # 40 iterators dropped with batches in flight left more claims than the ring has
    # slots (32): a slot claimed by a worker that is gone is claimed again
    assert lines[4] == "after 40 dropped iterators: 5 of 5 batches in slots", lines


def test_batches_held_past_the_ring_cross_as_places_and_equal_a_plain_read(
    tmp_path: Path,
) -> None:
    # 6 slots: the batches in flight (2 workers x prefetch_factor 2) and the one held
    lines = _script(tmp_path, HELD, "6")
    held = lines[0].split()
    assert held[0] == "held:" and held[2:] == ["of", "10", "in", "slots"], lines
    assert 1 <= int(held[1]) <= 6, lines  # the ring's slots, then places
    assert lines[1] == "let go: 10 of 10 in slots", lines


def _child(body: object) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            body()  # type: ignore[operator]
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return pid


def test_a_slot_is_read_only_while_it_holds_the_version_sent(tmp_path: Path) -> None:
    ring = BatchRing(slots=2, capacity=1 << 16)
    r, w = os.pipe()

    def pack(fill: int) -> None:
        got = ring.claim(4096)
        assert got is not None
        ring.writable(got[0], 4096)[:] = fill
        os.write(w, np.array(got, dtype=np.int64).tobytes())

    def sent() -> tuple[int, int]:
        slot, version = np.frombuffer(os.read(r, 16), dtype=np.int64).tolist()
        return slot, version

    _child(lambda: pack(7))
    slot, version = sent()
    memory = ring.open(slot, version, 4096)
    assert memory is not None and (memory.array() == 7).all()
    assert ring.open(slot, version, 4096) is None  # opened once
    assert ring.states()[slot][0] == 2
    _child(lambda: pack(9))  # the other slot: this one is in use
    other, version2 = sent()
    assert other != slot
    del memory
    assert ring.states()[slot][0] == 0  # free once nothing views it

    # claimed by a worker that is gone, never opened: claimed again by the next one
    # (lowest free first), and the first batch sent in it is read from the cache instead
    _child(lambda: pack(1))
    stale, old = sent()
    assert stale == slot
    _child(lambda: pack(2))
    again, new = sent()
    assert again == stale and new == old + 1
    assert ring.open(stale, old, 4096) is None
    memory = ring.open(again, new, 4096)
    assert memory is not None and (memory.array() == 2).all()
    # a child forked while this process holds the batch does not free its slot
    _child(lambda: None)
    assert ring.states()[again][0] == 2
    os.close(r)
    os.close(w)


def test_only_a_child_of_the_rings_maker_packs_into_it() -> None:
    made = ring_here()
    assert made is not None and ring_here() is made
    assert not made.usable_here()  # the training process itself: it reads, never packs
    assert made.claim(16) is None

    def grandchild() -> None:
        assert made.usable_here()
        _child(lambda: None if not made.usable_here() else os._exit(3))

    _child(grandchild)

    def launched() -> None:  # a training process its launcher forked makes its own
        own = ring_here()
        assert own is not None and own is not made and own.owner == os.getpid()

    _child(launched)


def test_a_lock_left_held_by_a_dead_process_gives_the_ring_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process killed while it held the ring's lock never releases it: the training
    process waits ``WAIT_S`` once, then gives the ring up (its batches cross as places
    from then on, without waiting again), and workers it forks after do not use it."""
    from cache_store.views import ring as rings

    monkeypatch.setattr(rings, "WAIT_S", 0.2)
    ring = BatchRing(slots=2, capacity=1 << 16)
    r, w = os.pipe()

    def pack() -> None:
        got = ring.claim(4096)
        assert got is not None
        os.write(w, np.array(got, dtype=np.int64).tobytes())
        ring.lock.acquire()  # and dies holding it

    _child(pack)
    slot, version = np.frombuffer(os.read(r, 16), dtype=np.int64).tolist()
    assert ring.open(slot, version, 4096) is None  # waited, then gave up
    assert ring.disabled
    monkeypatch.setattr(rings, "WAIT_S", 3600.0)  # no second wait: it would hang here
    assert ring.open(slot, version, 4096) is None
    _child(lambda: None if ring.claim(16) is None else os._exit(3))
    os.close(r)
    os.close(w)
