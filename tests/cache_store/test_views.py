"""Views: records read as read-only tensors over the cache's own file, verified once.

What holds: a view equals a plain read; an in-place update raises and never reaches the
cache; a version is hashed once per process (and ``verify="always"`` hashes every read);
a view's bytes stay the verified ones across writers reusing pages, a fork, a store's
close and a compaction; a lease ends with its last view. Windows (the long-lived
read-only mappings the hop packs a batch from): a transient view is a slice of one, kept
across reads and the fork of workers, and keeps its bytes as a user's
view does; a window with a detached range is never sliced again; a compaction retires the
old file's windows, and the last store closed on a path its windows; a view handed to a
user never lies in a window. A sharded snapshot's parts are read through windows too,
and past ``FILES_MAX`` files the least recently read file's windows are retired.
"""

from __future__ import annotations

import gc
import itertools
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from cache_store import CachedDataset, collate_spc
from cache_store.errors import CorruptRecord
from cache_store.format.header import read_header
from cache_store.snapshot.sharded import ShardedSnapshot
from cache_store.stores.lmdb import LMDBStore, compact_environment, shared_envs
from cache_store.views import mapping
from cache_store.testing.records import contract_record, fingerprint_of, index_of
from cache_store.views.records import VERIFIED

FP = fingerprint_of("spc", level=8)
IDS = [f"s{i}" for i in range(6)]


def _record(sid: str, seed: int) -> bytes:
    return contract_record(FP, sid, seed, level=8, num_points=20000 + 1000 * seed)


def _cache(path: Path) -> dict[str, bytes]:
    records = {f"{FP}/{sid}": _record(sid, i) for i, sid in enumerate(IDS)}
    store = LMDBStore(path, readonly=False)
    store.put_many(records.items())
    store.put_index(index_of("spc", IDS, level=8))
    store.close()
    return records


def _snapshot(path: Path) -> None:
    snap = ShardedSnapshot(str(path), readonly=False)
    snap.put_many((f"{FP}/{sid}", _record(sid, i)) for i, sid in enumerate(IDS))
    snap.put_index(index_of("spc", IDS, level=8))
    snap.close()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


ORDER = [4, 1, 5, 0, 2, 3]


def _forked_loader(views: CachedDataset, collate_fn: Any = collate_spc) -> DataLoader:
    """Batches of 3 in ``ORDER`` from 2 forked workers."""
    return DataLoader(
        views,
        batch_size=3,
        sampler=ORDER,
        num_workers=2,
        collate_fn=collate_fn,
        multiprocessing_context="fork",
    )


def _epoch_equals_plain(loader: DataLoader, plain: CachedDataset) -> dict[str, Any]:
    """One epoch of ``_forked_loader``: every batch equals ``collate_spc`` of plain reads
    of its samples; the last batch."""
    for b, batch in enumerate(loader):
        want = collate_spc([plain[i] for i in ORDER[3 * b : 3 * b + 3]])
        assert batch.keys() == want.keys()
        for name in want:
            if isinstance(want[name], list):  # sample_ids
                assert batch[name] == want[name]
            else:
                assert torch.equal(batch[name], want[name]), name
    return batch


@pytest.mark.parametrize("kind", ["lmdb", "sharded"])
def test_views_equal_plain_reads_and_refuse_writes(tmp_path: Path, kind: str) -> None:
    where = tmp_path / ("cache" if kind == "lmdb" else "snap.zarr")
    _cache(where) if kind == "lmdb" else _snapshot(where)
    views = CachedDataset(where, FP, views=True)
    plain = CachedDataset(where, FP)
    assert views.read_path == "views"
    assert plain.read_path == "copies (views=False)"
    for i in range(len(views)):
        viewed = views[i]
        _same(viewed, plain[i])
        assert all(t.is_inference() for t in viewed.values())
    batch = views.__getitems__([3, 1])
    _same(batch[0], plain[3])
    _same(batch[1], plain[1])

    octree = views[2]["octree"]
    before = plain[2]["octree"].clone()
    with pytest.raises(RuntimeError, match="inference tensor"):
        octree.add_(1)
    with pytest.raises(RuntimeError, match="inference tensor"):
        octree[0] = 7
    # the cache is untouched: a plain read, and a view read anew, show the stored bytes
    assert torch.equal(plain[2]["octree"], before)
    assert torch.equal(views[2]["octree"], before)


@pytest.mark.parametrize("kind", ["lmdb", "sharded"])
def test_a_batch_read_in_this_process_is_packed_once_and_collated_without_a_copy(
    tmp_path: Path, kind: str
) -> None:
    """A DataLoader with no workers over ``views=True`` reads a batch through
    ``__getitems__`` in the training process: its records are packed into one buffer at
    once (the hop's one copy, from the long-lived windows), so the samples hold plain
    writable tensors (not views of the cache) and ``collate_spc`` batches them as views
    of that buffer, without a second copy; every batch equals a plain read."""
    where = tmp_path / ("cache" if kind == "lmdb" else "snap.zarr")
    _cache(where) if kind == "lmdb" else _snapshot(where)
    views, plain = CachedDataset(where, FP, views=True), CachedDataset(where, FP)
    samples = views.__getitems__([3, 1, 4])
    storages = {t.untyped_storage().data_ptr() for s in samples for t in s.values() if t.numel()}
    assert len(storages) == 1, "the batch's fields lie in one buffer"
    assert not any(t.is_inference() for s in samples for t in s.values())
    samples[0]["octree"][0] = samples[0]["octree"][0]  # a plain tensor: writable
    batch = collate_spc(samples)
    assert batch["octree"].untyped_storage().data_ptr() in storages  # a view, no copy
    assert batch["sample_ids"] == ["s3", "s1", "s4"]
    order = [3, 1, 4, 0, 5, 2]
    loader = DataLoader(views, batch_size=3, sampler=order, collate_fn=collate_spc)
    for got, part in zip(loader, (order[:3], order[3:]), strict=True):
        want = collate_spc([plain[i] for i in part])
        for name, tensor in want.items():
            same = got[name] == tensor if isinstance(tensor, list) else None
            assert same or torch.equal(got[name], tensor), name
    assert torch.equal(plain[2]["octree"], views[2]["octree"])  # the cache is untouched


def test_the_reader_says_when_views_cannot_be_taken(tmp_path: Path) -> None:
    _cache(tmp_path / "cache")
    ds = CachedDataset(tmp_path / "cache", FP, views=True, store_options={"lock": False})
    assert ds.read_path.startswith("copies (opened without LMDB's lock file")
    _same(ds[0], CachedDataset(tmp_path / "cache", FP)[0])


def test_a_version_is_hashed_once_per_process_unless_always(tmp_path: Path) -> None:
    """Damage below the store (a byte flipped in data.mdb behind LMDB's back) after a
    version was hashed is what ``verify="once"`` trusts not to happen; ``"always"`` and
    a process that has not hashed that version yet catch it."""
    records = _cache(tmp_path / "cache")
    once = CachedDataset(tmp_path / "cache", FP, views=True)
    always = CachedDataset(tmp_path / "cache", FP, views=True, verify="always")
    first = once[0]["octree"].clone()
    key = f"{FP}/s0"
    header = read_header(records[key], key=key)
    data = (tmp_path / "cache" / "records" / "data.mdb").read_bytes()
    at = data.index(records[key]) + header.tensors["octree"].begin
    with open(tmp_path / "cache" / "records" / "data.mdb", "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    assert not torch.equal(once[0]["octree"], first)  # trusted: hashed already
    with pytest.raises(CorruptRecord, match="checksum mismatch in tensor 'octree'"):
        always[0]
    code = (
        "import sys\nfrom cache_store import CachedDataset\n"
        f"ds = CachedDataset({str(tmp_path / 'cache')!r}, {FP!r}, views=True)\n"
        "try:\n    ds[0]\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "CorruptRecord" in out.stdout and "octree" in out.stdout


def _churn(path: Path, rounds: int) -> None:
    """Write and delete other records, so LMDB frees pages and reuses them."""
    store = LMDBStore(path, readonly=False)
    other = fingerprint_of("spc", level=7)
    for r in range(rounds):
        junk = [
            (
                f"{other}/junk{j}",
                contract_record(other, f"junk{j}", r + j, level=7, num_points=30000),
            )
            for j in range(6)
        ]
        store.put_many(junk)
        store.delete_records(other)
    store.close()


def test_views_keep_their_bytes_across_reuse_fork_close_and_compaction(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    _cache(path)
    ds = CachedDataset(path, FP, views=True)
    held = [ds[i] for i in range(len(ds))]
    copies = [{k: v.clone() for k, v in sample.items()} for sample in held]

    _churn(path, 4)  # pages freed after the views were made: pinned, never reused
    for sample, copy in zip(held, copies, strict=True):
        _same(sample, copy)

    pid = os.fork()  # the at-fork hook closes the environment: live views are copied
    if pid == 0:  # NumPy: torch's thread pool is not usable in a forked child
        ok = all(
            s[k].numpy().tobytes() == c[k].numpy().tobytes()
            for s, c in zip(held, copies, strict=True)
            for k in s
        )
        os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0
    _churn(path, 4)  # the pins ended with the close: the views are private copies now
    for sample, copy in zip(held, copies, strict=True):
        _same(sample, copy)

    again = [ds[i] for i in range(len(ds))]
    compact_environment(path)
    _churn(path, 2)
    ds.close()  # the store closes: its views are copied before the lease ends
    _churn(path, 2)
    for sample, copy in zip(again, copies, strict=True):
        _same(sample, copy)
    _same(ds[0], copies[0])  # a read after the compaction: the new generation


def test_a_lease_ends_with_its_last_view(tmp_path: Path) -> None:
    _cache(tmp_path / "cache")
    ds = CachedDataset(tmp_path / "cache", FP, views=True)
    sample = ds[0]
    where = os.path.realpath(tmp_path / "cache" / "records")
    current = shared_envs[where].current
    assert current is not None
    leases = current.views
    assert leases is not None
    assert len(leases.live) == 1
    del sample
    gc.collect()
    assert not leases.live  # no read transaction left pinning the file
    VERIFIED.clear()


def _collate_in_worker(samples: list[object]) -> object:
    """collate_spc, asserting that the worker hands over where records lie."""
    from cache_store.readers.collate import collate_spc
    from cache_store.views.hop import LocatedBatch

    out = collate_spc(samples)  # type: ignore[arg-type]
    assert isinstance(out, LocatedBatch), type(out)
    assert len(pickle.dumps(out)) < 4096  # a few keys and places, not megabytes
    return out


def test_forked_workers_hand_over_places_not_bytes(tmp_path: Path) -> None:
    _cache(tmp_path / "cache")
    views = CachedDataset(tmp_path / "cache", FP, views=True)
    plain = CachedDataset(tmp_path / "cache", FP)
    batch = _epoch_equals_plain(_forked_loader(views, _collate_in_worker), plain)
    batch["octree"][0] = 0  # the packed batch is the training process's own copy
    single = DataLoader(
        views, batch_size=None, sampler=[2], num_workers=1, multiprocessing_context="fork"
    )
    [sample] = list(single)
    assert sample["octree"].is_inference()  # a sample crosses as places, opened as views
    _same(sample, plain[2])


def _data(path: Path) -> str:
    return os.path.join(os.path.realpath(path / "records"), "data.mdb")


def _transient(store: LMDBStore, sid: str) -> dict[str, torch.Tensor]:
    [record] = store.view_records([f"{FP}/{sid}"], None, "once", transient=True)
    return record.tensors


def test_transient_views_are_window_slices_that_keep_their_bytes(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    _cache(path)
    plain = CachedDataset(path, FP)
    store = LMDBStore(path)
    held = [_transient(store, sid) for sid in IDS]
    windows = mapping.windows_at(_data(path))
    [window] = windows.open.values()  # six records, one window
    for tensors, i in zip(held, range(len(IDS)), strict=True):
        _same(tensors, plain[i])
        base = tensors["octree"].untyped_storage().data_ptr()
        assert window.addr <= base < window.addr + window.size
    users = CachedDataset(path, FP, views=True)
    user = users[0]["octree"]  # handed out: its own pages
    assert not window.addr <= user.untyped_storage().data_ptr() < window.addr + window.size

    copies = [{k: v.clone() for k, v in t.items()} for t in held]
    _churn(path, 4)  # pages freed meanwhile are never reused while the views live
    for tensors, copy in zip(held, copies, strict=True):
        _same(tensors, copy)

    pid = os.fork()  # the hook detaches live views: the window is spoiled for new ones
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert window.spoiled
    _churn(path, 4)
    for tensors, copy in zip(held, copies, strict=True):
        _same(tensors, copy)
    again = _transient(store, IDS[0])
    _same(again, copies[0])
    assert mapping.windows_at(_data(path)).open[0] is not window  # a fresh window

    compact_environment(path)  # a new data.mdb: the old file's windows are retired
    _churn(path, 2)
    _same(_transient(store, IDS[1]), copies[1])
    assert windows.retired
    assert mapping.windows_at(_data(path)).identity != windows.identity
    _same(again, copies[0])
    store.close()
    plain.close()
    users.close()  # the last store on the path: its windows go with it
    assert mapping.windows_at(_data(path)) is None
    _same(again, copies[0])
    del held, again, window, windows
    gc.collect()
    VERIFIED.clear()


@pytest.fixture
def places_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No batch ring: every batch crosses as places and is packed in the training
    process, as one does when no slot is free (the training loop holds more batches than
    the ring has), with ``pin_memory``, or with workers started by ``spawn``."""
    from cache_store.views import ring

    monkeypatch.setattr(ring, "_ring", [None])
    monkeypatch.setattr(ring, "_unmade", ["not in this test"])


@pytest.mark.usefixtures("places_only")
def test_the_hop_packs_from_windows_kept_across_epochs(tmp_path: Path) -> None:
    """Each epoch forks its workers (the fork hook closes the environment): the training
    process's windows stay, so a later epoch maps, and faults in, nothing again."""
    path = tmp_path / "cache"
    _cache(path)
    views = CachedDataset(path, FP, views=True)
    plain = CachedDataset(path, FP)
    loader = _forked_loader(views)
    seen = []
    for _ in range(3):
        _epoch_equals_plain(loader, plain)
        windows = mapping.windows_at(_data(path))
        seen.append((windows, dict(windows.open)))
    assert seen[0][1]  # the training process packed from a window
    assert seen[1][0] is seen[0][0] and seen[2][0] is seen[0][0]
    assert seen[2][1] == seen[0][1]  # the same windows, mapped once
    VERIFIED.clear()


def test_a_snapshot_parts_transient_views_are_window_slices_kept_across_epochs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sharded snapshot's part never changes once committed: the hop's pack and a
    worker's check read it through this process's windows of the part file, kept across
    reads and epochs, as LMDB's ``data.mdb``; a view handed to a user has its own pages.
    Past ``FILES_MAX`` files the least recently read one's windows are retired, and what
    still views them keeps its bytes."""
    where = tmp_path / "snap.zarr"
    _snapshot(where)
    [part] = [str(p) for p in where.rglob("*.bin")]
    snap = ShardedSnapshot(str(where))
    plain = CachedDataset(where, FP)
    held = [
        snap.view_records([f"{FP}/{sid}"], None, "once", transient=True)[0].tensors for sid in IDS
    ]
    windows = mapping.windows_at(part)
    [window] = windows.open.values()  # six records in one part: one window
    for i, tensors in enumerate(held):
        _same(tensors, plain[i])
        assert (
            window.addr
            <= tensors["octree"].untyped_storage().data_ptr()
            < window.addr + window.size
        )
    user = CachedDataset(where, FP, views=True)[0]["octree"]
    assert not window.addr <= user.untyped_storage().data_ptr() < window.addr + window.size

    loader = _forked_loader(CachedDataset(where, FP, views=True))
    for _ in range(2):
        _epoch_equals_plain(loader, plain)
        assert mapping.windows_at(part) is windows and windows.open[0] is window

    copies = [{k: v.clone() for k, v in t.items()} for t in held]
    monkeypatch.setattr(mapping, "FILES_MAX", 1)
    _cache(tmp_path / "cache")
    store = LMDBStore(tmp_path / "cache")
    _transient(store, IDS[0])  # another file's windows: the part's are retired
    assert windows.retired and mapping.windows_at(part) is None
    for tensors, copy in zip(held, copies, strict=True):
        _same(tensors, copy)  # still mapped while viewed
    _same(snap.view_records([f"{FP}/{IDS[2]}"], None, "once", transient=True)[0].tensors, copies[2])
    assert mapping.windows_at(part) is not windows  # windows made anew
    store.close()
    snap.close()
    del held, window, windows
    gc.collect()
    VERIFIED.clear()


def _mapped_here(addr: int) -> bool:
    """Whether ``addr`` lies in a mapping of this process (``/proc/self/maps``)."""
    with open("/proc/self/maps", "rb") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split(None, 1)[0].split(b"-"))
            if start <= addr < end:
                return True
    return False


class _ForkProbe(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """In a forked worker: which of the training process's batch buffers are mapped
    there, what its pool holds, and the bytes of a batch the training process holds."""

    def __init__(self, idle: list[int], held: torch.Tensor) -> None:
        self.idle, self.held = idle, held

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> dict[str, object]:
        from cache_store.format.buffers import BATCH_BUFFERS

        return {
            "idle_mapped": [_mapped_here(addr) for addr in self.idle],
            "held_mapped": _mapped_here(self.held.data_ptr()),
            "held": self.held.clone(),
            "pool": [b.ctypes.data for b in BATCH_BUFFERS.buffers],
        }


@pytest.mark.usefixtures("places_only")
def test_batch_buffers_the_training_process_let_go_are_not_forked(tmp_path: Path) -> None:
    """The training process packs each batch into a pooled buffer; forking the next
    epoch's workers made every page of an idle one copy-on-write, so the parent's next
    batches in it faulted page by page. An idle buffer is now left out of the child
    (nothing there can reach it); one a batch still uses is inherited with its bytes,
    and the parent keeps packing correct batches into them all."""
    from cache_store.format.buffers import BATCH_BUFFERS

    path = tmp_path / "cache"
    _cache(path)
    views = CachedDataset(path, FP, views=True)
    plain = CachedDataset(path, FP)
    loader = _forked_loader(views)
    held = next(iter(loader))["octree"]  # a batch the training loop keeps
    kept = held.clone()
    for _ in loader:  # packed into the pool's other buffers, then let go
        pass
    del _
    gc.collect()
    held_addr = held.untyped_storage().data_ptr()
    buffers = [(b.ctypes.data, b.ctypes.data + b.size) for b in BATCH_BUFFERS.buffers]
    idle = [start for start, end in buffers if not start <= held_addr < end]
    assert idle and len(idle) < len(buffers)

    probe = DataLoader(
        _ForkProbe(idle, held),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
    )
    [seen] = list(probe)
    assert seen["idle_mapped"] == [False] * len(idle)  # not in the child at all
    assert seen["held_mapped"] and torch.equal(seen["held"], kept)  # inherited as it was
    assert len(seen["pool"]) == len(buffers) - len(idle)  # the child forgot the others
    assert all(_mapped_here(addr) for addr in idle)  # still the parent's

    for _ in range(2):  # the parent packs into them as before, through the next forks
        batch = _epoch_equals_plain(loader, plain)
    assert torch.equal(held, kept)  # a held batch is never written
    # a buffer handed out again is inherited by the next fork, whoever forks (one
    # idle at the last fork was marked not to be)
    in_use = batch["octree"].untyped_storage().data_ptr()
    [buffer] = [
        b for b in BATCH_BUFFERS.buffers if b.ctypes.data <= in_use < b.ctypes.data + b.size
    ]
    assert buffer.base.inherited
    VERIFIED.clear()


@pytest.mark.parametrize("spread", [False, True])
def test_the_pack_lays_every_dtype_end_to_end_in_one_buffer(spread: bool) -> None:
    """``packed`` copies each field from a NumPy view of its bytes (torch's for a dtype
    NumPy lacks, a copy for a strided tensor), or, with ``spread``, a large one by
    torch's threads, and hands back slices of one view of the buffer per dtype: every
    dtype a record may hold, empty fields included, small and large, comes back equal,
    in one buffer, each field's records end to end."""
    from cache_store.views.hop import SPREAD_BYTES, packed

    gen = torch.Generator().manual_seed(0)
    records = []
    for n in (5, 0, 3):
        big = SPREAD_BYTES // 4 + 7 * n  # float32 elements: over SPREAD_BYTES unless n == 0
        records.append(
            {
                "octree": torch.randint(0, 255, (n + 2,), dtype=torch.uint8, generator=gen),
                "point_hierarchy": torch.randint(-99, 99, (n, 3), generator=gen).to(torch.int16),
                "labels": torch.randint(0, 9, (n,), generator=gen).to(torch.int64),
                "weights": torch.rand(n, 2, generator=gen).to(torch.bfloat16),
                "mask": torch.rand(n, generator=gen) > 0.5,
                "strided": torch.rand(4, n + 1, generator=gen).t(),  # not contiguous
                "queries": torch.rand(big if n else 0, generator=gen),
                "big_strided": torch.rand(2 * big if n else 0, generator=gen)[::2],
                "big_bf16": torch.rand(2 * big if n else 0, generator=gen).to(torch.bfloat16),
            }
        )
    out = packed(records, spread=spread)
    base = out[0]["octree"].untyped_storage().data_ptr()
    for got, want in zip(out, records, strict=True):
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
            assert torch.equal(got[name], tensor), name
            assert got[name].untyped_storage().data_ptr() == base, name  # one buffer
    for name in records[0]:
        parts = [o[name] for o in out if o[name].numel()]  # (torch: an empty one's is 0)
        for a, b in itertools.pairwise(parts):  # each field's records end to end
            assert a.data_ptr() + a.nbytes == b.data_ptr(), name
    batch = collate_spc([dict(o) for o in (out[0], out[2])])
    assert batch["labels"].untyped_storage().data_ptr() == base  # a view, not a copy
    assert torch.equal(batch["labels"], torch.cat([records[0]["labels"], records[2]["labels"]]))


def test_a_batch_buffer_that_cannot_be_had_raises_memory_error(tmp_path: Path) -> None:
    """Pooled buffers are mapped by the pool, not NumPy: out of memory still says so
    the way an allocation does (``MemoryError``), which callers handle as before."""
    script = textwrap.dedent(
        """
        import resource
        import numpy  # loaded before the limit, as in a process already reading
        from cache_store.format.buffers import BATCH_BUFFERS

        with open("/proc/self/status") as status:
            [size] = [int(l.split()[1]) * 1024 for l in status if l.startswith("VmSize:")]
        resource.setrlimit(resource.RLIMIT_AS, (size + (16 << 20), size + (16 << 20)))
        try:
            BATCH_BUFFERS.take(48 << 20)
        except MemoryError as exc:
            print("MemoryError:", exc)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("MemoryError:") and "allocating" in proc.stdout, proc.stdout


class _EpochOrders:
    """A sampler dealing ``orders[epoch]`` in turn: each epoch's batches go to the other
    worker than the epoch before."""

    def __init__(self, orders: list[list[int]]) -> None:
        self.orders, self.epoch = orders, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        order = self.orders[self.epoch % len(self.orders)]
        self.epoch += 1
        return iter(order)

    def __len__(self) -> int:
        return len(self.orders[0])


def test_persistent_workers_hash_each_version_once_between_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What one process of a training run hashed (a worker, or the training process
    taking a worker's word), its forked siblings do not hash again: a persistent worker
    that is dealt, in the second epoch, the records its sibling read in the first finds
    them hashed. Every field of every record is hashed exactly once in the whole run,
    counted in every process; the batches equal plain reads."""
    from cache_store.views import records as records_module

    path = tmp_path / "cache"
    _cache(path)
    log = tmp_path / "hashed.log"
    real = records_module.verified_field

    def counted(view, header, name, key):  # type: ignore[no-untyped-def]
        with open(log, "a") as out:
            out.write(f"{os.getpid()} {key} {name}\n")
        return real(view, header, name, key)

    monkeypatch.setattr(records_module, "verified_field", counted)
    VERIFIED.clear()
    views, plain = CachedDataset(path, FP, views=True), CachedDataset(path, FP)
    orders = [[0, 1, 2, 3, 4, 5], [1, 0, 3, 2, 5, 4], [2, 5, 0, 4, 1, 3]]
    loader = DataLoader(
        views,
        batch_size=1,
        sampler=_EpochOrders(orders),
        num_workers=2,
        collate_fn=collate_spc,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    for order in orders:
        for i, batch in zip(order, loader, strict=True):
            assert torch.equal(batch["octree"], plain[i]["octree"]), i
    del loader
    lines = log.read_text().split("\n")[:-1]
    hashed = [tuple(line.split()[1:]) for line in lines]
    fields = len(plain[0])
    assert len({pid for pid, *_ in (line.split() for line in lines)}) == 2  # both workers
    assert len(set(hashed)) == len(IDS) * fields  # every field of every record
    assert len(hashed) == len(set(hashed)), sorted(h for h in hashed if hashed.count(h) > 1)
    VERIFIED.clear()


def test_a_snapshot_found_once_is_not_asked_of_lmdb_again_until_a_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a record lies in a snapshot (transaction id) of data.mdb is found once, by
    one process of the training run: the training process views what a worker looked
    up, and the second epoch's workers (forked again, their LMDB map new) and the
    training process view every record without a lookup, whose value py-lmdb would page
    in whole. A
    write makes a new snapshot: the records are looked up again, and a rewritten one is
    read at its new place, equal to a plain read of it."""
    from cache_store.stores.lmdb import store as store_module
    from cache_store.stores.lmdb.leases import KNOWN

    path = tmp_path / "cache"
    _cache(path)
    plain = CachedDataset(path, FP)
    want = [{k: v.clone() for k, v in plain[i].items()} for i in range(len(IDS))]
    log = tmp_path / "lookups.log"
    real = store_module.lookup_value

    def counted(txn, db, key):  # type: ignore[no-untyped-def]
        with open(log, "a") as out:
            out.write(f"{os.getpid()} {key}\n")
        return real(txn, db, key)

    monkeypatch.setattr(store_module, "lookup_value", counted)
    KNOWN.clear()
    views = CachedDataset(path, FP, views=True)
    loader = _forked_loader(views)

    def epoch(expected: list[dict[str, torch.Tensor]]) -> list[str]:
        log.write_text("")
        for b, batch in enumerate(loader):
            samples = [expected[i] for i in ORDER[3 * b : 3 * b + 3]]
            for name in ("octree", "point_hierarchy"):
                assert torch.equal(batch[name], torch.cat([s[name] for s in samples])), name
        keys = {f"{FP}/{sid}" for sid in IDS}  # (not a descriptor's, looked up once)
        return [line for line in log.read_text().split("\n")[:-1] if line.split()[1] in keys]

    first = epoch(want)
    # each record once, by the worker that read it: the training process and the other
    # worker find where it lies (in the table they share)
    assert sorted(line.split()[1] for line in first) == sorted(f"{FP}/{sid}" for sid in IDS)
    assert epoch(want) == [] and epoch(want) == []  # no process asked LMDB again
    log.write_text("")
    _same(views[1], want[1])
    assert f"{FP}/s1" not in log.read_text()

    writer = LMDBStore(path, readonly=False)  # s0 rewritten: a new snapshot
    writer.put_many([(f"{FP}/s0", _record("s0", 7))])
    writer.close()
    monkeypatch.setattr(store_module, "lookup_value", real)
    changed = [{k: v.clone() for k, v in CachedDataset(path, FP)[i].items()} for i in range(6)]
    assert not torch.equal(changed[0]["point_hierarchy"], want[0]["point_hierarchy"])
    monkeypatch.setattr(store_module, "lookup_value", counted)
    again = epoch(changed)
    assert f"{FP}/s0" in {line.split()[1] for line in again}
    _same(views[0], changed[0])
    VERIFIED.clear()


def test_a_shared_place_torn_or_of_another_key_or_snapshot_counts_as_unknown() -> None:
    """The table of places a training run's processes share is written without a lock:
    an entry read half-written, overwritten by another key (a full probe run), or of
    another snapshot is never taken for the record's place (it is looked up again)."""
    from cache_store.stores.lmdb.leases import KnownPlaces

    known = KnownPlaces(slots=4)  # every key probes the same four slots
    file_id = (1, 2)
    known.put(file_id, 7, "fp/a", 4096, 100)
    assert known.get(file_id, 7, "fp/a") == (4096, 100)
    assert known.get(file_id, 8, "fp/a") is None  # another snapshot
    assert known.get((1, 3), 7, "fp/a") is None  # another file
    [slot] = [s for s in range(0, 4 * known.WORDS, known.WORDS) if known.shared[s]]
    known.shared[slot + 3] = 8192  # a torn write: the offset of another write
    assert known.get(file_id, 7, "fp/a") is None
    for i in range(5):  # more keys than slots: one is overwritten, none misread
        known.put(file_id, 7, f"fp/k{i}", 4096 * i, 10 + i)
    found = {i: known.get(file_id, 7, f"fp/k{i}") for i in range(5)}
    assert all(place in (None, (4096 * i, 10 + i)) for i, place in found.items())
    assert sum(place is not None for place in found.values()) == 4


def _resident_kib(addr: int) -> int:
    """Rss of this process's mapping that starts at ``addr`` (its pages in the page
    table: faulted in or populated here)."""
    with open("/proc/self/smaps") as smaps:
        lines = iter(smaps)
        for line in lines:
            if line.split()[0].split("-")[0] == f"{addr:x}":
                for field in lines:
                    if field.startswith("Rss:"):
                        return int(field.split()[1])
    raise AssertionError(f"no mapping at {addr:#x}")


def test_a_batch_read_here_is_copied_from_the_pages_its_lookup_touched(tmp_path: Path) -> None:
    """With no workers the training process packs each batch itself. A record it asks
    LMDB for (py-lmdb then touches every page of it, in LMDB's map) is hashed and
    copied from those pages, so its window's pages are not faulted in as well; once its
    place is known (no lookup), the batch is copied from the window. Either way the
    batches equal plain reads."""
    from cache_store.stores.lmdb.leases import KNOWN

    path = tmp_path / "cache"
    records = _cache(path)
    KNOWN.clear()
    VERIFIED.clear()
    views, plain = CachedDataset(path, FP, views=True), CachedDataset(path, FP)
    loader = DataLoader(views, batch_size=3, sampler=ORDER, num_workers=0, collate_fn=collate_spc)
    for b, batch in enumerate(loader):
        want = collate_spc([plain[i] for i in ORDER[3 * b : 3 * b + 3]])
        for name in ("octree", "point_hierarchy", "exsum"):
            assert torch.equal(batch[name], want[name]), name
    [window] = mapping.windows_at(_data(path)).open.values()
    size_kib = sum(len(value) for value in records.values()) // 1024
    assert _resident_kib(window.addr) < size_kib // 8  # (a page-table walk's neighbours)
    for b, batch in enumerate(loader):  # places known: copied from the window
        want = collate_spc([plain[i] for i in ORDER[3 * b : 3 * b + 3]])
        for name in ("octree", "point_hierarchy", "exsum"):
            assert torch.equal(batch[name], want[name]), name
    assert _resident_kib(window.addr) > size_kib // 2
    VERIFIED.clear()


def test_places_are_known_per_incarnation_of_the_file_not_per_inode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compaction's new data.mdb starts LMDB's transaction ids again at 1 and may get
    the inode of a data.mdb removed before: (inode, id) alone could then send a read to
    where the record lay in another file. Places are kept under the file's change time
    too: here the same file, inode and snapshot, its change time moved (as a file made
    anew has another), is looked up again when it is opened anew; unchanged, it is not."""
    from cache_store.stores.lmdb import store as store_module
    from cache_store.stores.lmdb.leases import KNOWN

    path = tmp_path / "cache"
    _cache(path)
    asked: list[str] = []
    real = store_module.lookup_value

    def counted(txn, db, key):  # type: ignore[no-untyped-def]
        asked.append(key)
        return real(txn, db, key)

    monkeypatch.setattr(store_module, "lookup_value", counted)
    KNOWN.clear()
    key = f"{FP}/s2"

    def read_anew() -> dict[str, torch.Tensor]:  # a new store: the file opened anew
        ds = CachedDataset(path, FP, views=True)
        sample = {k: v.clone() for k, v in ds[2].items()}
        ds.close()
        return sample

    first = read_anew()
    assert asked.count(key) == 1
    _same(read_anew(), first)
    assert asked.count(key) == 1  # the same incarnation: known
    data = path / "records" / "data.mdb"
    inode = data.stat().st_ino
    os.utime(data)  # its change time moves; inode, bytes and transaction id stay
    _same(read_anew(), first)
    assert data.stat().st_ino == inode
    assert asked.count(key) == 2  # another incarnation: asked of LMDB again
    VERIFIED.clear()


def test_what_was_hashed_is_kept_once_for_the_run_not_in_each_process(tmp_path: Path) -> None:
    """Which versions were hashed lives in the table the run's processes share, and
    nowhere else: a dict of every version read, kept beside it in each process, grew
    by hundreds of bytes a record (hundreds of MB at a million, in the training process
    and again in each persistent worker). Reading 1,500 records allocates nothing in
    ``VerifiedOnce``; each record is still hashed once."""
    import inspect
    import tracemalloc

    from cache_store.views.records import VerifiedOnce

    ids = [f"t{i:04d}" for i in range(1500)]
    fp = fingerprint_of("spc", level=3)
    store = LMDBStore(tmp_path / "cache", readonly=False)
    store.put_many(
        (f"{fp}/{sid}", contract_record(fp, sid, i, level=3, num_points=50))
        for i, sid in enumerate(ids)
    )
    store.put_index(index_of("spc", ids, level=3))
    store.close()
    VERIFIED.clear()
    views = CachedDataset(tmp_path / "cache", fp, views=True)
    lines, first = inspect.getsourcelines(VerifiedOnce)
    code = inspect.getsourcefile(VerifiedOnce)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(len(views)):
            views[i]
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(
        stat.size_diff
        for stat in after.compare_to(before, "lineno")
        if stat.traceback[0].filename == code
        and first <= stat.traceback[0].lineno < first + len(lines)
    )
    assert grown < 4096, f"VerifiedOnce grew by {grown} bytes over 1,500 records"
    hashed = []
    from cache_store.views import records

    real = records.verified_field
    try:
        records.verified_field = lambda *a: hashed.append(a[3]) or real(*a)  # type: ignore[assignment]
        for i in range(len(views)):
            views[i]
    finally:
        records.verified_field = real  # type: ignore[assignment]
    assert hashed == []  # every version found in the shared table: none hashed again
    views.close()
    VERIFIED.clear()
