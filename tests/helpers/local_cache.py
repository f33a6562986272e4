"""Helpers for the tests of ``local_cache``: snapshots to read, units to fetch, and a
watch on the directory's size at every fetch and eviction, in every process."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cache_store.errors import CorruptRecord
from cache_store.format.index import DatasetIndex
from cache_store.local_cache import LocalCache, LocalDisk, directory_bytes
from cache_store.recipes.registry import get_recipe_spec
from cache_store.snapshot.sharded import ShardedSnapshot
from cache_store.snapshot.zarr.export import export_snapshot
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.synthetic import fingerprint_of, make_record

FP = fingerprint_of("spc")

__all__ = [
    "FP",
    "BytesUnit",
    "SizeWatch",
    "as_list",
    "limit_for",
    "peak_bytes",
    "same",
    "write_exported",
    "write_sharded",
]


def write_sharded(location: str, parts: int, per_part: int, points: int = 400) -> list[str]:
    """A sharded snapshot of ``parts`` parts of ``per_part`` spc records each, indexed;
    returns the sample ids in index order."""
    spec = get_recipe_spec("spc")
    writer = ShardedSnapshot(location, readonly=False)
    ids = [f"s{i:04d}" for i in range(parts * per_part)]
    for p in range(parts):
        chunk = ids[p * per_part : (p + 1) * per_part]
        writer.put_many(
            [
                (f"{FP}/{sid}", make_record(FP, sid, seed=p * per_part + n, num_points=points))
                for n, sid in enumerate(chunk)
            ]
        )
    writer.put_index(DatasetIndex(FP, "spc", spec.version, spec.resolve({}), np.array(ids)))
    writer.close()
    return ids


def write_exported(
    location: str,
    lmdb_dir: Path,
    samples: int,
    chunk_bytes: int,
    points: int = 400,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """An exported Zarr snapshot at ``location`` of ``samples`` spc records (written
    into an LMDB cache at ``lmdb_dir`` first, as ``spcache export`` reads one), its data
    in chunks of about ``chunk_bytes``; returns the sample ids in index order."""
    spec = get_recipe_spec("spc")
    ids = [f"s{i:04d}" for i in range(samples)]
    cache = LMDBStore(lmdb_dir, readonly=False, map_size=1 << 26)
    cache.put_many(
        [
            (f"{FP}/{sid}", make_record(FP, sid, seed=n, num_points=points))
            for n, sid in enumerate(ids)
        ]
    )
    cache.put_index(DatasetIndex(FP, "spc", spec.version, spec.resolve({}), np.array(ids)))
    export_snapshot(cache, FP, location, chunk_bytes=chunk_bytes, storage_options=storage_options)
    cache.close()
    return ids


def limit_for(directory: Path, units: int, unit_bytes: int) -> int:
    """A limit holding ``units`` units of ``unit_bytes`` with the directory's own files."""
    disk = LocalDisk(LocalCache(str(directory), 1 << 40)).open()
    return disk.cost(unit_bytes) * units + directory_bytes(str(directory))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def as_list(batch: list[Any]) -> list[Any]:
    return batch


@contextlib.contextmanager
def peak_bytes(directory: Path) -> Iterator[list[int]]:
    """The most bytes ``directory`` held, sampled from outside too, between the events
    (``[peak]``, final when the block ends). Each sample is
    :meth:`LocalDisk.bytes_on_disk`: under the directory's lock, as every count, eviction
    and publish is, and through the descriptors a forked loader worker closes (a lock
    file this thread opened itself would stay locked in a worker forked while it held
    it, and that worker, and then this thread, would wait on it for ever)."""
    peak = [0]
    done = threading.Event()
    disk = LocalDisk(LocalCache(str(directory), 1 << 40))

    def sample() -> None:
        while not done.is_set():
            if os.path.exists(directory / "lock"):
                peak[0] = max(peak[0], disk.bytes_on_disk())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join(timeout=120)
        assert not sampler.is_alive(), f"the size sampler of {directory} did not stop in 120 s"


class BytesUnit:
    """A unit whose bytes are given; each fetch appends a line to ``fetches`` (a file,
    so fetches in other processes count), after ``delay`` seconds."""

    def __init__(self, name: str, data: bytes, fetches: Path, delay: float = 0.0) -> None:
        self.name = name
        self.data = data
        self.fetches = fetches
        self.delay = delay

    def size(self) -> int:
        return len(self.data)

    def fetch(self, path: str) -> None:
        with open(self.fetches, "a") as f:
            f.write(f"{os.getpid()} {self.name}\n")
        time.sleep(self.delay)
        with open(path, "wb") as f:
            f.write(self.data)

    def check(self, path: str) -> None:
        with open(path, "rb") as f:
            if f.read() != self.data:
                raise CorruptRecord(self.name, "fetched bytes differ")

    def fetch_count(self) -> int:
        if not self.fetches.exists():
            return 0
        return sum(line.split()[1] == self.name for line in self.fetches.read_text().splitlines())


class SizeWatch(logging.Handler):
    """Appends ``<pid> <bytes on disk>`` to ``out`` at every fetch, eviction and removal
    the local directory logs (under its lock, so each is a settled state), in this
    process and in the processes forked from it while it is installed."""

    def __init__(self, directory: str, out: Path) -> None:
        super().__init__(logging.DEBUG)
        self.directory = directory
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if any(word in text for word in (": fetched ", ": evicted ", ": removed ")):
            with open(self.out, "a") as f:
                f.write(f"{os.getpid()} {directory_bytes(self.directory)} {text}\n")

    def sizes(self) -> list[int]:
        if not self.out.exists():
            return []
        return [int(line.split()[1]) for line in self.out.read_text().splitlines()]

    def events(self, word: str) -> list[str]:
        if not self.out.exists():
            return []
        return [line for line in self.out.read_text().splitlines() if f": {word} " in line]

    @classmethod
    @contextlib.contextmanager
    def installed(cls, directory: str, out: Path) -> Iterator[SizeWatch]:
        logger = logging.getLogger("cache_store.local_cache.disk")
        watch = cls(directory, out)
        level = logger.level
        logger.addHandler(watch)
        logger.setLevel(logging.DEBUG)
        try:
            yield watch
        finally:
            logger.removeHandler(watch)
            logger.setLevel(level)
