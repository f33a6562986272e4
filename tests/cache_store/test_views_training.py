"""Views as a training script uses them: forked DataLoader workers, a writer and a
compaction beside them.

The script runs in a subprocess from a fresh directory; it holds views of every sample
for the whole run (across each epoch's fork, the writer reusing pages and the
compaction's swap), reads epochs through 2 forked workers with ``collate_spc`` (the hop
without the bytes), and checks every batch against a plain read and every held view
against the bytes it showed when it was read and verified. A custom ``collate_fn``
batches the samples' tensors; many epochs hold no growing memory or reader slot.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from cache_store.stores.lmdb import LMDBStore
from cache_store.testing.records import contract_record, fingerprint_of, index_of
from tests.helpers.procs import run, run_spcache, start

FP = fingerprint_of("spc", level=8)
IDS = [f"shape{i:02d}" for i in range(10)]

TRAIN = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import torch
    from torch.utils.data import DataLoader
    import spcache

    cache, fp, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    views = spcache.CachedDataset(cache, fp, views=True)
    plain = spcache.CachedDataset(cache, fp)
    print("read path:", views.read_path, flush=True)
    held = [views[i] for i in range(len(views))]
    seen = [{k: t.clone() for k, t in s.items()} for s in held]
    for s, p in zip(held, (plain[i] for i in range(len(plain)))):
        assert all(torch.equal(s[k], p[k]) for k in p)
    try:  # (on a view of its own: a refused write still changed that view's private page)
        views[0]["octree"][0] = 0
    except RuntimeError as exc:
        print("a write to a view raises:", str(exc)[:60], flush=True)
    else:
        raise SystemExit("a write to a view did not raise")
    assert torch.equal(plain[0]["octree"], seen[0]["octree"])  # the cache is untouched
    assert torch.equal(views[0]["octree"], seen[0]["octree"])

    from cache_store.views.ring import ring
    slots, slotted, batches = ring(), 0, 0
    epoch = 0
    while epoch < 3 or not os.path.exists(stop):
        order = np.random.default_rng(epoch).permutation(len(views)).tolist()
        loader = DataLoader(views, batch_size=4, sampler=order, num_workers=2,
                            collate_fn=spcache.collate_spc, multiprocessing_context="fork")
        for b, batch in enumerate(loader):
            at = batch["octree"].untyped_storage().data_ptr()  # packed in a worker?
            slotted += slots.addr <= at < slots.addr + slots.slots * slots.capacity
            batches += 1
            want = spcache.collate_spc([plain[i] for i in order[4 * b : 4 * b + 4]])
            assert batch.keys() == want.keys(), (batch.keys(), want.keys())
            for name in want:
                if isinstance(want[name], list):  # sample_ids
                    assert batch[name] == want[name], (epoch, b, name)
                else:
                    assert torch.equal(batch[name], want[name]), (epoch, b, name)
        for s, kept in zip(held, seen):
            for name in kept:
                assert torch.equal(s[name], kept[name]), ("a held view changed", name)
        print(f"epoch {epoch} ok", flush=True)
        epoch += 1
    print("done", epoch, "epochs", flush=True)
    print("batches packed in workers:", slotted, "of", batches, flush=True)
    """
)

WRITER = textwrap.dedent(
    """
    import os, sys
    from cache_store.stores.lmdb import LMDBStore
    from cache_store.testing.records import contract_record, fingerprint_of

    cache, stop = sys.argv[1], sys.argv[2]
    other = fingerprint_of("spc", level=7)
    store = LMDBStore(cache, readonly=False)
    rounds = 0
    while not os.path.exists(stop):
        junk = [(f"{other}/j{j}", contract_record(other, f"j{j}", rounds + j, level=7,
                 num_points=30000)) for j in range(4)]
        store.put_many(junk)
        store.delete_records(other)
        rounds += 1
        print("round", rounds, flush=True)
    """
)


def test_training_with_views_beside_a_writer_and_a_compaction(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    store = LMDBStore(cache, readonly=False)
    store.put_many(
        (f"{FP}/{sid}", contract_record(FP, sid, i, level=8, num_points=20000 + 2000 * i))
        for i, sid in enumerate(IDS)
    )
    store.put_index(index_of("spc", IDS, level=8))
    store.close()
    work = tmp_path / "fresh"
    work.mkdir()
    (work / "train.py").write_text(TRAIN)
    (work / "writer.py").write_text(WRITER)
    stop = tmp_path / "stop"

    writer = start([sys.executable, "writer.py", cache, stop], cwd=work)
    writer.wait_line("round 2", timeout=120)
    train = start([sys.executable, "train.py", cache, FP, stop], cwd=work)
    train.wait_line("read path: views", timeout=120)
    train.wait_line("a write to a view raises: Inplace update to inference tensor", timeout=120)
    train.wait_line("epoch 0 ok", timeout=300)
    compacted = run_spcache("compact", "--cache", cache, cwd=work, timeout=300)
    assert compacted.returncode == 0, compacted.stderr
    writer.wait_line("round", timeout=120, start=len(writer.lines))  # writes after the swap
    at = len(train.lines)
    train.wait_line(r"epoch \d+ ok", timeout=300, start=at)
    stop.write_text("")
    assert train.wait(timeout=600) == 0, train.describe()
    assert writer.wait(timeout=120) == 0, writer.describe()
    assert any(line.startswith("done") for line in train.lines), train.describe()
    # most batches were packed by the workers into the ring's slots (one whose records
    # changed under the worker's second look crosses as places): checked as the rest
    [packed] = [line.split() for line in train.lines if line.startswith("batches packed")]
    assert int(packed[4]) >= int(packed[6]) // 2, packed
    # the cache is whole afterwards, as a user checks it
    verified = run_spcache("verify", "--cache", cache, cwd=work, timeout=300)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def small_cache(path: Path, count: int) -> None:
    store = LMDBStore(path, readonly=False)
    ids = [f"shape{i:02d}" for i in range(count)]
    store.put_many(
        (f"{FP}/{sid}", contract_record(FP, sid, i, level=8, num_points=20000 + 2000 * i))
        for i, sid in enumerate(ids)
    )
    store.put_index(index_of("spc", ids, level=8))
    store.close()


CUSTOM = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils.data import DataLoader, default_collate
    import spcache

    cache, fp = sys.argv[1], sys.argv[2]
    views = spcache.CachedDataset(cache, fp, views=True)
    plain = spcache.CachedDataset(cache, fp)

    def mine(samples):  # indexes each sample, as a hand-written collate_fn does
        return {"octree": torch.cat([s["octree"] for s in samples]),
                "ids": [s.sample_id for s in samples]}

    order = [3, 0, 2, 1, 5, 4]
    loader = DataLoader(views, batch_size=3, sampler=order, num_workers=2,
                        collate_fn=mine, multiprocessing_context="fork")
    for b, batch in enumerate(loader):
        part = order[3 * b : 3 * b + 3]
        assert torch.equal(batch["octree"], torch.cat([plain[i]["octree"] for i in part]))
        assert batch["ids"] == [plain.sample_id(i) for i in part], batch["ids"]
    print("a hand-written collate_fn: ok", flush=True)

    fixed = spcache.CachedDataset(cache, fp, views=True, fields=["center", "scale", "pyramid"])
    loader = DataLoader(fixed, batch_size=3, sampler=order, num_workers=2,
                        collate_fn=default_collate, multiprocessing_context="fork")
    for b, batch in enumerate(loader):
        part = order[3 * b : 3 * b + 3]
        for name in ("center", "scale", "pyramid"):
            want = torch.stack([plain[i][name] for i in part])
            assert torch.equal(batch[name], want), name
    print("default_collate: ok", flush=True)

    loader = DataLoader(views, batch_size=2, sampler=order, num_workers=2,
                        collate_fn=lambda samples: samples, multiprocessing_context="fork")
    for b, samples in enumerate(loader):
        for s, i in zip(samples, order[2 * b : 2 * b + 2]):
            assert s.sample_id == plain.sample_id(i)
            assert all(torch.equal(s[k], plain[i][k]) for k in plain[i])
            assert s["octree"].is_inference()  # crossed as a place, opened as views here
    print("samples returned as they are: ok", flush=True)

    def extended(samples):  # changes collate_spc's batch in the worker
        batch = spcache.collate_spc(samples)
        batch["epoch"] = 0
        return batch

    loader = DataLoader(views, batch_size=2, num_workers=1, collate_fn=extended,
                        multiprocessing_context="fork")
    batches = iter(loader)
    try:
        next(batches)
    except TypeError as exc:
        print("refused:", " ".join(str(exc).split()), flush=True)
    del batches

    def fixed_up(samples):  # the fix the error names
        batch = spcache.collate_spc([s.sample() for s in samples])
        batch["epoch"] = 0
        return batch

    loader = DataLoader(views, batch_size=3, sampler=order, num_workers=2,
                        collate_fn=fixed_up, multiprocessing_context="fork")
    for b, batch in enumerate(loader):
        want = spcache.collate_spc([plain[i] for i in order[3 * b : 3 * b + 3]])
        assert torch.equal(batch["octree"], want["octree"]) and batch["epoch"] == 0
    print("collate_spc of the samples' tensors: ok", flush=True)
    """
)


def test_a_custom_collate_fn_gets_the_samples_tensors(tmp_path: Path) -> None:
    """A ``collate_fn`` other than ``collate_spc`` over ``views=True`` with forked
    workers: a hand-written one, ``default_collate`` and one returning the samples as they
    are all batch the records' tensors, equal to a plain read."""
    cache = tmp_path / "cache"
    small_cache(cache, 6)
    work = tmp_path / "fresh"
    work.mkdir()
    (work / "custom.py").write_text(CUSTOM)
    out = run([sys.executable, "custom.py", cache, FP], cwd=work, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    done = ("a hand-written collate_fn", "default_collate", "samples returned as they are")
    for line in (*done, "collate_spc of the samples' tensors"):
        assert f"{line}: ok" in out.stdout, out.stdout + out.stderr
    # changing collate_spc's batch in the worker: refused, naming the fixes
    assert "TypeError: collate_spc in a DataLoader worker of CachedDataset" in out.stdout
    assert "collate_spc([s.sample() for s in samples])" in out.stdout, out.stdout


LONG = textwrap.dedent(
    """
    import os, sys
    import torch
    from torch.utils.data import DataLoader
    import spcache
    from cache_store.stores.lmdb import LMDBStore

    cache, fp, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    views = spcache.CachedDataset(cache, fp, views=True)
    loader = DataLoader(views, batch_size=4, shuffle=True, num_workers=2,
                        collate_fn=spcache.collate_spc, multiprocessing_context="fork")
    probe = LMDBStore(cache)

    def memory():
        with open("/proc/self/smaps_rollup") as f:
            kb = {line.split(":")[0]: int(line.split()[1]) for line in f if "kB" in line}
        return kb["Pss"], kb["Private_Clean"] + kb["Private_Dirty"]

    def my_readers():  # reader slots of this process holding a transaction
        env, _ = probe.handle.environment()
        rows = [r.split() for r in env.readers().splitlines()[1:]]
        return sum(1 for r in rows if r and int(r[0]) == os.getpid() and r[2] != "-")

    first = None
    for epoch in range(epochs):
        count = 0
        for batch in loader:
            count += len(batch["lengths"])
            torch.sum(batch["octree"])  # the training step reads the batch
        del batch
        assert count == len(views), count
        pss, private = memory()
        print(f"epoch {epoch}: pss {pss} kB private {private} kB readers {my_readers()}",
              flush=True)
        if first is None:
            first = (pss, private)
        assert my_readers() == 0, "a read transaction outlived its views"
        assert pss < first[0] + 96 * 1024, ("Pss grew", pss, first)
        assert private < first[1] + 96 * 1024, ("private memory grew", private, first)
    print("bounded over", epochs, "epochs", flush=True)
    """
)


def test_a_long_run_holds_no_growing_memory_or_reader_slot(tmp_path: Path) -> None:
    """Many epochs with ``views=True`` and forked workers: after the first epoch the
    training process's Pss and private memory (``/proc/self/smaps_rollup``) stay within a
    generous bound, and no reader slot of it holds a transaction between epochs (each
    epoch maps and faults in ~25 MB: a map, window or buffer kept per epoch would pass
    the bound within the run)."""
    cache = tmp_path / "cache"
    small_cache(cache, 24)
    work = tmp_path / "fresh"
    work.mkdir()
    (work / "long.py").write_text(LONG)
    out = run([sys.executable, "long.py", cache, FP, "12"], cwd=work, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bounded over 12 epochs" in out.stdout, out.stdout + out.stderr
    # windows and views still alive at exit are unmapped quietly (no "Exception ignored
    # in Window.__del__" once the interpreter has cleared the module's globals)
    assert "Exception ignored" not in out.stderr, out.stderr[-3000:]


PINNED = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils.data import DataLoader
    import spcache

    cache, fp = sys.argv[1], sys.argv[2]
    views = spcache.CachedDataset(cache, fp, views=True, pin_memory=True)
    plain = spcache.CachedDataset(cache, fp)
    order = [3, 0, 2, 1, 5, 4]
    loader = DataLoader(views, batch_size=3, sampler=order, num_workers=2,
                        collate_fn=spcache.collate_spc, multiprocessing_context="fork")
    for b, batch in enumerate(loader):
        want = spcache.collate_spc([plain[i] for i in order[3 * b : 3 * b + 3]])
        for name in want:
            if isinstance(want[name], list):
                assert batch[name] == want[name], name
            else:
                assert torch.equal(batch[name], want[name]), name
        pinned = torch.cuda.is_available()  # an accelerator: packed into pinned memory
        assert batch["octree"].is_pinned() == pinned, batch["octree"].is_pinned()
    print("pinned" if pinned else "packed into ordinary memory", flush=True)
    """
)


def test_pin_memory_packs_a_batch_into_pinned_memory_or_says_why_not(tmp_path: Path) -> None:
    """``pin_memory=True``: batches as without it; pinned where an accelerator can pin
    memory, else (this machine) packed into ordinary memory and said once."""
    cache = tmp_path / "cache"
    small_cache(cache, 6)
    work = tmp_path / "fresh"
    work.mkdir()
    (work / "pinned.py").write_text(PINNED)
    out = run([sys.executable, "pinned.py", cache, FP], cwd=work, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    import torch

    if torch.cuda.is_available():
        assert "pinned" in out.stdout.splitlines(), out.stdout
    else:
        assert "packed into ordinary memory" in out.stdout, out.stdout + out.stderr
        said = [line for line in out.stderr.splitlines() if "no pinned memory here" in line]
        assert len(said) == 1, out.stderr
