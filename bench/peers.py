"""spcache's LMDB cache read every way a trainer reads it, and next to peer formats.

Builds ``--samples`` spc_query-shaped records with the pure-PyTorch SPC ops (the
workload of ``bench/zarr_snapshot.py``) and writes the same records into an spcache LMDB
cache and into each peer format of ``WRITERS``: LitData (``litdata``), MosaicML
Streaming's MDS (``streaming``), tensordict memory-maps (``tensordict``) and a Hugging
Face Arrow dataset (``datasets``); what each writes and reads is noted at its writer.
It checks that every format gives back exactly the same tensors (every sample, every
field: dtype, shape, values), then times, interleaved round by round so machine load
hits every format alike, and prints each rate and its ratio to spcache LMDB:

- one process, random ``ds[i]``;
- DataLoader, 0 workers, per sample (``batch_size=None``) and batch 8 (a list-keeping
  collate, so every format pays the same collate; spcache also with ``collate_spc``);
- DataLoader, each of ``--workers`` workers (fork; 2 and 4 by default), batch 8,
  list-keeping collate (spcache also with ``collate_spc``);
- ingest (write) time: the writer alone (records are built before), in a warm process
  (each writer first runs once untimed on one record, so library imports and first-call
  set-up are not counted); and the same until the data is on disk (``os.sync()`` after
  the writer: spcache's commits fsync, the peers' writers leave the flushing to the
  kernel, which does it later on the same disk).

Every format's ``ds[i]`` hands back a dict of CPU tensors whose bytes have been read into
the process, as spcache's decode does (see the note above the writers). Within spcache
the rows compare with each other: batch 8 with a list-keeping collate or ``collate_spc``
against per-sample reads (``batch_size=None``) in the same run. A format whose library
is missing or fails to import is left out and named (the peers are the ``bench`` extra,
installed with ``-c bench/constraints.txt``). Default run is short (two record sizes of
``SIZES``, few samples); ``--sizes``/``--samples``/``--unique``/``--rounds`` change that.

    python bench/peers.py [--sizes large small] [--samples 240] [--unique 8] [--rounds 3]
                          [--workers 2 4] [--peers lmdb litdata streaming tensordict datasets]
                          [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cache_store import CachedDataset, collate_spc
from cache_store.keys import compute_fingerprint
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.encode import encode_record
from cache_store.recipes.registry import get_recipe_spec
from cache_store.format.index import DatasetIndex

log = logging.getLogger("bench.peers")

#: name -> (level, surface points, queries): ~2.6 MB and ~0.13 MB records.
SIZES = {"large": (8, 60_000, 48_000), "small": (6, 4_000, 2_000)}


def build_records(
    samples: int, unique: int, level: int, points: int, queries: int
) -> list[dict[str, Any]]:
    """``unique`` distinct records computed, cycled to ``samples`` (computing is slow;
    each copy is still its own record in every format)."""
    from zarr_snapshot import make_fields  # bench/ heads sys.path when run as a script
    from workers.ops import get_backend

    ops = get_backend("torch")
    gen = torch.Generator().manual_seed(level)
    made = [make_fields(ops, level, points, queries, gen) for _ in range(min(unique, samples))]
    return [made[i % len(made)] for i in range(samples)]


def list_collate(batch: list[Any]) -> list[Any]:
    return batch


# --------------------------------------------------------------------------- writers
# ``write_<name>(root, records)`` writes every record under ``root / <name>`` and returns
# a Dataset factory. The factory is called once per timing, in the parent, before any
# DataLoader forks its workers: each reader opens its files (index, memory maps) there
# and reads nothing, and starts no thread, before the first ``ds[i]``, so forked workers
# use it safely. A peer imports its library inside its writer (``_peer``): a missing one
# raises ImportError and the format is left out.
#
# What ``ds[i]`` returns, alike for every format: a dict of CPU tensors, dtype and shape
# as written, whose bytes have been read into this process, as spcache's decode does (it
# copies each record out of LMDB). Where a library hands back views of a file mapping
# (LitData, tensordict) the view is copied out (``_owned``): a view costs nothing to make,
# so without the copy the timing would leave the reading to the trainer's first touch.


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into fresh memory with NumPy: one plain memcpy, as spcache's decode
    does. Not ``t.clone()``: torch copies a MB-sized tensor on its intra-op threads, which
    on a small machine shared with other work spin against it (measured on 2 loaded
    cores: 20-50x slower reads, erratic from one timing to the next)."""
    try:
        return torch.from_numpy(t.numpy().copy())
    except TypeError:  # a dtype NumPy lacks (bfloat16)
        return t.clone()


def _stand_in_torchvision() -> None:
    """``import streaming`` imports torchvision for its image datasets (``streaming.vision``:
    ``VisionDataset``, ``CIFAR10``, ``to_tensor``), which MDS writing and reading never
    use. PyPI's only torchvision for this torch is a CUDA build that cannot load next to
    the CPU torch (``operator torchvision::nms does not exist``), and the CPU build's
    index is out of reach here. When the real one fails to import, a stand-in module
    with those three names (raising if ever called) lets ``streaming`` import; what is
    timed is MDS's own writer and reader, unchanged."""
    import importlib.machinery
    import types

    try:
        import torchvision  # noqa: F401

        return
    except Exception as exc:  # noqa: BLE001 - any failure: the CUDA build raises RuntimeError
        reason = f"{type(exc).__name__}: {exc}"
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]

    def unavailable(*_: Any, **__: Any) -> Any:
        raise RuntimeError(f"torchvision stand-in (bench/peers.py): {reason}")

    root = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    datasets.VisionDataset = type("VisionDataset", (), {"__init__": unavailable})
    datasets.CIFAR10 = type("CIFAR10", (), {"__init__": unavailable})
    functional.to_tensor = unavailable
    root.datasets, root.transforms, transforms.functional = datasets, transforms, functional
    stand_ins = {
        "torchvision": root,
        "torchvision.datasets": datasets,
        "torchvision.transforms": transforms,
        "torchvision.transforms.functional": functional,
    }
    for name, module in stand_ins.items():  # find_spec() callers look for a spec
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules.update(stand_ins)
    log.info(
        "  torchvision does not load here (%s): streaming imported with a stand-in "
        "for its image datasets, which MDS does not use",
        reason,
    )


def _peer(module: str) -> Any:
    """Import a peer's library. Any failure is an ImportError (the format is left out);
    ``streaming`` gets :func:`_stand_in_torchvision` first."""
    if module.split(".")[0] == "streaming" and "streaming" not in sys.modules:
        _stand_in_torchvision()
    try:
        return importlib.import_module(module)
    except ImportError:
        raise
    except Exception as exc:
        raise ImportError(f"import {module} failed: {type(exc).__name__}: {exc}") from exc


def write_lmdb(root: Path, records: list[dict[str, torch.Tensor]]) -> Callable[[], Dataset]:
    spec = get_recipe_spec("spc_query")
    params = {"level": 0}
    fp = compute_fingerprint("spc_query", spec.version, params)
    store = LMDBStore(root / "lmdb", readonly=False)
    ids, batch = [], []
    for i, fields in enumerate(records):
        sid = f"s{i:06d}"
        meta = {
            "recipe": "spc_query",
            "recipe_version": str(spec.version),
            "fingerprint": fp,
            "sample_id": sid,
            "source_hash": "0" * 16,
            "backend": "torch",
            "device": "cpu",
        }
        batch.append((f"{fp}/{sid}", encode_record(fields, meta)))
        ids.append(sid)
        if len(batch) == 32:
            store.put_many(batch)
            batch = []
    if batch:
        store.put_many(batch)
    store.put_index(DatasetIndex(fp, "spc_query", spec.version, params, np.array(ids)))
    store.close()
    return lambda: CachedDataset(root / "lmdb", fp)


# LitData. Written with ``BinaryWriter`` in this process (``optimize`` is the same writer
# run in worker processes over a function's outputs): each record is one item, a dict
# of tensors, into uncompressed chunks of at most 64 MB. LitData picks each field's
# serializer from the first item, no pickle: ``tensor`` (dtype, rank and shape header,
# then the raw bytes) for 0-d and N-d tensors, ``no_header_tensor:<dtype>`` (raw bytes,
# dtype kept in the index) for 1-d ones. Read with ``StreamingDataset`` on the local
# directory, which memory-maps the chunks in place (nothing copied to a cache dir).


class _LitDataRecords(Dataset):
    """LitData's StreamingDataset is an IterableDataset (a DataLoader takes no sampler for
    it); this is its documented ``ds[i]`` as a map-style Dataset. Its tensors are views
    of a read-only mmap of the chunk (writing into one segfaults): copied out in the
    parent; in a DataLoader worker the trip to the trainer copies them into shared memory
    already, so they go as they are."""

    def __init__(self, path: Path) -> None:
        self.ds = _peer("litdata").StreamingDataset(str(path))

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self.ds[i]
        if get_worker_info() is not None:
            return item
        return {name: _owned(t) for name, t in item.items()}


def write_litdata(root: Path, records: list[dict[str, torch.Tensor]]) -> Callable[[], Dataset]:
    writer_mod = _peer("litdata.streaming.writer")
    path = root / "litdata"
    writer = writer_mod.BinaryWriter(str(path), chunk_bytes="64MB", compression=None)
    for i, fields in enumerate(records):
        writer.add_item(i, fields)
    writer.done()
    writer.merge()  # the one worker's index becomes the dataset's index.json
    return lambda: _LitDataRecords(path)


# MosaicML Streaming. ``MDSWriter`` into a local directory, no compression, shards of at
# most 64 MB (its default): each field a column of the ``ndarray:<dtype>`` encoding
# (dtype fixed per column, shape per sample in a few header bytes, then the raw bytes;
# no pickle), a 0-d field a ``<dtype>`` scalar column (``ndarray`` refuses 0-d arrays,
# and empty ones). Read with ``StreamingDataset(local=..., remote=None)``, whose ``ds[i]``
# (``get_item``) reads the sample's bytes from the shard file.


class _MDSRecords(Dataset):
    """MDS ``StreamingDataset`` by index (it is an IterableDataset too), NumPy to torch.
    The arrays are read-only (``np.frombuffer`` over the bytes read): wrapped without a
    copy, so the tensors are read-only too (nothing here writes into them); torch's
    warning about that is silenced."""

    def __init__(self, path: Path) -> None:
        self.ds = _peer("streaming").StreamingDataset(local=str(path), remote=None, shuffle=False)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = self.ds[i]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return {name: torch.from_numpy(np.asarray(v)) for name, v in sample.items()}


def write_streaming(root: Path, records: list[dict[str, torch.Tensor]]) -> Callable[[], Dataset]:
    mds = _peer("streaming")
    path = root / "streaming"
    columns = {
        name: (str(t.numpy().dtype) if t.dim() == 0 else f"ndarray:{t.numpy().dtype}")
        for name, t in records[0].items()
    }
    with mds.MDSWriter(out=str(path), columns=columns, compression=None) as out:
        for fields in records:
            out.write({name: t.numpy() for name, t in fields.items()})
    return lambda: _MDSRecords(path)


# tensordict. Samples differ in shape, so they cannot be one TensorDict with a batch
# dimension; tensordict's own answer for that is ``LazyStackedTensorDict``, a stack of
# per-sample TensorDicts indexed like one. ``memmap`` writes it as one directory per
# sample with a raw ``<field>.memmap`` file (no header, no pickle) and a ``meta.json``
# per sample; ``TensorDict.load_memmap`` opens it again as a lazy stack of
# MemoryMappedTensors. Chosen over one ``TensorDict.memmap`` directory loaded per
# ``ds[i]``: the stack is opened once in the factory (the maps are inherited by forked
# workers), where per-sample loading would parse a meta.json and open every file on each
# read.


class _TensorDictRecords(Dataset):
    """``td[i]`` of the lazy stack, copied out: MemoryMappedTensors are lazy views of the
    files, and cross to another process by file name (pickled as such), so without the
    copy neither ``ds[i]`` nor a worker would read any bytes."""

    def __init__(self, path: Path) -> None:
        self.td = _peer("tensordict").TensorDict.load_memmap(path)

    def __len__(self) -> int:
        return len(self.td)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {name: _owned(t) for name, t in self.td[i].items()}


def write_tensordict(root: Path, records: list[dict[str, torch.Tensor]]) -> Callable[[], Dataset]:
    td = _peer("tensordict")
    path = root / "tensordict"
    stack = td.LazyStackedTensorDict(
        *(td.TensorDict(fields, batch_size=[]) for fields in records), stack_dim=0
    )
    stack.memmap(path)
    return lambda: _TensorDictRecords(path)


# HF datasets. ``Dataset.from_generator`` yielding NumPy arrays into an uncompressed Arrow
# file in a local cache dir, which the Dataset memory-maps. Features given, from the
# first record: a 0-d field is ``Value(dtype)``, a 1-d one ``Sequence(Value(dtype))``, an
# N-d one ``ArrayND(shape=(None, *rest), dtype)`` (only the first dimension may vary
# between samples). An explicit ``fingerprint``: without one, from_generator hashes the
# generator and everything it reaches (every record) just to name its cache. Read with
# ``with_format("numpy", dtype=None)`` and ``torch.from_numpy``, not ``"torch"``: the
# formatters cast every integer to int64 and every float to float32 unless given a
# dtype, and ``dtype=None`` (handed to ``np.asarray``) keeps the stored one; the NumPy
# formatter's arrays are fresh and writable, where ``"torch"`` would copy them once more
# (``torch.tensor``). Batches use Dataset's own ``__getitems__`` (one Arrow gather, about
# twice the rate of row by row here); there a variable-length 1-d field comes back as a
# read-only view of the memory-mapped Arrow file, copied out like the other formats' views.


class _HFRecords(Dataset):
    def __init__(self, ds: Any) -> None:
        self.ds = ds.with_format("numpy", dtype=None)

    def __len__(self) -> int:
        return len(self.ds)

    @staticmethod
    def _tensors(row: dict[str, Any]) -> dict[str, torch.Tensor]:
        out = {}
        for name, v in row.items():
            a = np.asarray(v)
            out[name] = torch.from_numpy(a if a.flags.writeable else a.copy())
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self._tensors(self.ds[i])

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self._tensors(row) for row in self.ds.__getitems__(list(indices))]


def _hf_feature(hf: Any, t: torch.Tensor) -> Any:
    dtype = str(t.numpy().dtype)
    if t.dim() == 0:
        return hf.Value(dtype)
    if t.dim() == 1:
        return hf.Sequence(hf.Value(dtype))
    array = {2: hf.Array2D, 3: hf.Array3D, 4: hf.Array4D, 5: hf.Array5D}[t.dim()]
    return array(shape=(None, *t.shape[1:]), dtype=dtype)


def write_datasets(root: Path, records: list[dict[str, torch.Tensor]]) -> Callable[[], Dataset]:
    hf = _peer("datasets")
    hf.disable_progress_bars()
    path = root / "datasets"
    features = hf.Features({name: _hf_feature(hf, t) for name, t in records[0].items()})

    def rows() -> Any:
        for fields in records:
            yield {name: t.numpy() for name, t in fields.items()}

    ds = hf.Dataset.from_generator(
        rows,
        features=features,
        cache_dir=str(path),
        fingerprint=hashlib.sha1(str(path).encode()).hexdigest(),
    )
    return lambda: _HFRecords(ds)


#: Formats timed: spcache's LMDB cache, then the peer formats. Each peer's library
#: is in the ``bench`` extra (pyproject.toml), installed with ``-c bench/constraints.txt``
#: so that its resolution keeps the project's torch; a peer whose import fails is left
#: out and named.
WRITERS: dict[str, Callable[[Path, list[dict[str, torch.Tensor]]], Callable[[], Dataset]]] = {
    "lmdb": write_lmdb,
    "litdata": write_litdata,
    "streaming": write_streaming,
    "tensordict": write_tensordict,
    "datasets": write_datasets,
}


# --------------------------------------------------------------------------- timing


def one_process(ds: Dataset, order: list[int]) -> float:
    ds[order[-1]]  # opened (files, maps, index) before timing, as for every format
    start = time.perf_counter()
    for i in order:
        ds[i]
    return len(order) / (time.perf_counter() - start)


def loader_rate(
    ds: Dataset,
    order: list[int],
    workers: int,
    batch: int | None,
    collate: Callable[[list[Any]], Any] | None,
) -> float:
    """Samples/s of one epoch; with workers, the second epoch of persistent workers (worker
    start-up is not what is compared)."""
    loader = DataLoader(
        ds,
        batch_size=batch,
        sampler=order,
        num_workers=workers,
        collate_fn=collate if batch else list_collate,
        multiprocessing_context="fork" if workers else None,
        persistent_workers=bool(workers),
        prefetch_factor=2 if workers else None,
    )
    if workers:
        for _ in loader:
            pass
    else:  # opened before timing (workers open theirs in the untimed first epoch)
        ds[order[-1]]
    start = time.perf_counter()
    for _ in loader:
        pass
    rate = len(order) / (time.perf_counter() - start)
    del loader  # persistent workers end here
    return rate


def same_tensors(name: str, ds: Dataset, records: list[dict[str, torch.Tensor]]) -> None:
    """Every sample, every field: ``ds[i]`` gives back what was written."""
    for i in range(len(records)):
        got = ds[i]
        if set(got) != set(records[i]):
            raise SystemExit(
                f"{name}: sample {i} has fields {sorted(got)}, not {sorted(records[i])}"
            )
        for field, want in records[i].items():
            have = got[field]
            if not (
                have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want)
            ):
                raise SystemExit(f"{name}: sample {i} field {field} differs from the source")


def run_size(
    label: str,
    level: int,
    points: int,
    queries: int,
    samples: int,
    unique: int,
    rounds: int,
    workers: list[int],
    peers: list[str],
) -> dict[str, Any]:
    t0 = time.perf_counter()
    records = build_records(samples, unique, level, points, queries)
    mb = sum(t.nbytes for t in records[0].values()) / 1e6
    log.info(
        "%s: %d records of ~%.2f MB built in %.0fs", label, samples, mb, time.perf_counter() - t0
    )
    root = Path(tempfile.mkdtemp(prefix="spcache-peers-"))
    try:
        makers, ingest, durable = {}, {}, {}
        for name in peers:
            try:  # untimed, on one record: imports and first-call set-up out of ingest
                WRITERS[name](root / "warm-up", records[:1])
            except ImportError as exc:
                log.info("  %s not installed or not importable (%s): left out", name, exc)
                continue
            os.sync()  # nothing of the previous writer left to flush in this one's time
            start = time.perf_counter()
            makers[name] = WRITERS[name](root, records)
            ingest[name] = time.perf_counter() - start
            # spcache commits with fsync; the peers leave their files in the page cache
            # for the kernel to write later. Until on disk, with os.sync() for all:
            os.sync()
            durable[name] = time.perf_counter() - start
            same_tensors(name, makers[name](), records)
        shutil.rmtree(root / "warm-up", ignore_errors=True)
        if not makers:
            raise SystemExit("no format left to time")
        os.sync()
        order = np.random.default_rng(0).permutation(samples).tolist()
        rows = {
            "one process, random ds[i]": lambda ds: one_process(ds, order),
            "DataLoader 0 workers, per sample": lambda ds: loader_rate(ds, order, 0, None, None),
            "DataLoader 0 workers, batch 8": lambda ds: loader_rate(ds, order, 0, 8, list_collate),
        }
        rows |= {
            f"DataLoader {w} workers, batch 8": (
                lambda ds, w=w: loader_rate(ds, order, w, 8, list_collate)
            )
            for w in workers
        }
        spc_rows = {
            "DataLoader 0 workers, batch 8, collate_spc": lambda ds: loader_rate(
                ds, order, 0, 8, collate_spc
            )
        }
        spc_rows |= {
            f"DataLoader {w} workers, batch 8, collate_spc": (
                lambda ds, w=w: loader_rate(ds, order, w, 8, collate_spc)
            )
            for w in workers
        }
        rates: dict[str, dict[str, list[float]]] = {}
        for _ in range(rounds):
            for row, timer in rows.items():
                for name, make in makers.items():
                    rates.setdefault(row, {}).setdefault(name, []).append(timer(make()))
            if "lmdb" in makers:
                for row, timer in spc_rows.items():
                    rates.setdefault(row, {}).setdefault("lmdb", []).append(timer(makers["lmdb"]()))
        result: dict[str, Any] = {"record_mb": mb, "samples": samples, "rows": {}}
        base_name = "lmdb" if "lmdb" in makers else next(iter(makers))
        for row, per in rates.items():
            med = {name: statistics.median(v) for name, v in per.items()}
            base = med.get(base_name)
            result["rows"][row] = {
                name: {"per_s": r, "ratio": (r / base if base else None)} for name, r in med.items()
            }
            log.info(
                "  %-44s %s",
                row,
                "  ".join(
                    f"{n} {r:,.0f}/s" + (f" ({r / base:.2f})" if base and n != base_name else "")
                    for n, r in med.items()
                ),
            )
        result["ingest_s"], result["ingest_durable_s"] = ingest, durable
        for what, times in (
            ("ingest (write) seconds", ingest),
            ("ingest until on disk (+ os.sync) s", durable),
        ):
            log.info(
                "  %-44s %s",
                what,
                "  ".join(
                    f"{n} {s:.2f}s" + (f" ({s / times[base_name]:.2f})" if n != base_name else "")
                    for n, s in times.items()
                ),
            )
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--unique", type=int, default=8, help="distinct records computed")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats (median)")
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[2, 4],
        help="DataLoader worker counts timed (besides 0)",
    )
    parser.add_argument("--peers", nargs="+", default=list(WRITERS), choices=list(WRITERS))
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # libraries: warnings up
    log.setLevel(logging.INFO)
    log.info("machine: %d CPUs, load %s", os.cpu_count(), os.getloadavg())
    results = {
        label: run_size(
            label, *SIZES[label], args.samples, args.unique, args.rounds, args.workers, args.peers
        )
        for label in args.sizes
    }
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
