"""Benchmark: epochs of a remote snapshot read through a bounded local disk, against LitData.

One invocation, one S3 API: moto's server on 127.0.0.1 in a process of its own. The
same ``--samples`` records (``bench/peers.py``'s spc_query-shaped records, ``--size``)
are written three ways:

- an spcache sharded snapshot in the bucket (``--per-part`` records per part), read by
  ``CachedDataset(s3://..., local_cache=DIR, cache_limit=L)`` through ``Sampler`` (its
  block-local shuffle, read-ahead fetching the window's parts);
- LitData chunks (``BinaryWriter``, uncompressed, about the size of a part) uploaded to
  the bucket, read by ``StreamingDataset(s3://..., cache_dir=DIR, max_cache_size=L)``
  (shuffled), through ``StreamingDataLoader``;
- an spcache LMDB cache on the local disk (no network: the ceiling).

Each reader runs in fresh worker processes (``--workers``, fork, batch 8, a collate that
keeps the list, so both pay the same) over a fresh local directory: a first epoch (every
part or chunk fetched) and a warm one (the directory is as large as the data, so nothing
is fetched again). Readers are interleaved round by round (``--rounds``) so the load of
this shared machine hits each alike; medians are printed with the ratios spcache/LitData.
Then one bounded spcache epoch with ``cache_limit`` a third of the data: the directory's
bytes (as its evictions count them) are sampled during it and the peak is printed next
to the limit. Nothing here asserts a speed.

    .venv-bench/bin/python bench/remote_epochs.py [--samples 480] [--per-part 48]
                                                  [--size small] [--rounds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from cache_store.format.encode import encode_record  # noqa: E402
from cache_store.format.index import DatasetIndex  # noqa: E402
from cache_store.keys import compute_fingerprint  # noqa: E402
from cache_store.local_cache import LocalCache, LocalDisk  # noqa: E402
from cache_store.recipes.registry import get_recipe_spec  # noqa: E402
from cache_store.snapshot.sharded import ShardedSnapshot  # noqa: E402
from spcache import CachedDataset, Sampler  # noqa: E402

MOTO = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
server.start()
print("PORT", server.get_host_and_port()[1], flush=True)
sys.stdin.read()
"""


def keep_list(batch: list[Any]) -> list[Any]:
    return batch


def start_moto() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", MOTO],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    port = ""
    while not port:  # moto prints its own lines first
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("moto's server did not start")
        if line.startswith("PORT "):
            port = line.split()[1]
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    return proc, endpoint


def write_sharded(location: str, records: list[dict[str, Any]], per_part: int) -> str:
    spec = get_recipe_spec("spc_query")
    params = {"level": 0}
    fp = compute_fingerprint("spc_query", spec.version, params)
    writer = ShardedSnapshot(location, readonly=False)
    ids = [f"s{i:06d}" for i in range(len(records))]
    for start in range(0, len(records), per_part):  # one put_many: one part
        batch = []
        for i in range(start, min(start + per_part, len(records))):
            meta = {
                "recipe": "spc_query",
                "recipe_version": str(spec.version),
                "fingerprint": fp,
                "sample_id": ids[i],
                "source_hash": "0" * 16,
                "backend": "torch",
                "device": "cpu",
            }
            batch.append((f"{fp}/{ids[i]}", encode_record(records[i], meta)))
        writer.put_many(batch)
    writer.put_index(DatasetIndex(fp, "spc_query", spec.version, params, np.array(ids)))
    writer.close()
    return fp


def write_litdata(root: Path, bucket: str, records: list[dict[str, Any]], chunk: str) -> str:
    import boto3
    from litdata.streaming.writer import BinaryWriter

    path = root / "litdata"
    writer = BinaryWriter(str(path), chunk_bytes=chunk, compression=None)
    for i, fields in enumerate(records):
        writer.add_item(i, fields)
    writer.done()
    writer.merge()
    client = boto3.client("s3")
    for name in sorted(os.listdir(path)):
        client.upload_file(str(path / name), bucket, f"litdata/{name}")
    return f"s3://{bucket}/litdata"


def data_bytes(location: str, fp: str) -> int:
    with ShardedSnapshot(location) as store:
        listed = store.fs.ls(store.path(fp, "parts"), detail=True, refresh=True)
    return sum(int(i["size"]) for i in listed)


def epochs(loader: Any, count: int, on_epoch: Any = None) -> list[float]:
    """Seconds of each of ``count`` epochs of ``loader`` (every item touched)."""
    out = []
    for epoch in range(count):
        if on_epoch is not None:
            on_epoch(epoch)
        t0 = time.perf_counter()
        n = sum(len(batch) for batch in loader)
        out.append(time.perf_counter() - t0)
        assert n > 0
    return out


def spcache_epochs(
    location: str, fp: str, directory: Path, limit: int, workers: int, count: int
) -> list[float]:
    ds = CachedDataset(location, fp, local_cache=directory, cache_limit=limit)
    sampler = Sampler(ds, seed=1, num_replicas=1, rank=0, read_ahead=256)
    loader = DataLoader(
        ds,
        batch_size=8,
        sampler=sampler,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
        collate_fn=keep_list,
    )
    return epochs(loader, count, sampler.set_epoch)


def litdata_epochs(
    uri: str, endpoint: str, directory: Path, limit: int, workers: int
) -> list[float]:
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming import downloader

    # LitData's chunk downloads (obstore) take no option for a plain-http endpoint such as
    # moto's: its client options gain allow_http, nothing else changes in how it reads
    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": True}

    ds = StreamingDataset(
        uri,
        cache_dir=str(directory),
        max_cache_size=limit,
        shuffle=True,
        seed=1,
        storage_options={
            "endpoint_url": endpoint,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
        },
    )
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=workers, collate_fn=keep_list)
    return epochs(loader, 2)


def lmdb_epoch(root: Path, fp: str, workers: int) -> float:
    ds = CachedDataset(root / "lmdb", fp)
    loader = DataLoader(
        ds,
        batch_size=8,
        sampler=Sampler(ds, seed=1, num_replicas=1, rank=0),
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
        collate_fn=keep_list,
    )
    return epochs(loader, 1)[0]


def bounded_peak(location: str, fp: str, directory: Path, limit: int, workers: int) -> int:
    """The peak of the directory's bytes during one spcache epoch under ``limit``."""
    disk = LocalDisk(LocalCache(str(directory), limit))
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            if directory.exists():
                peak[0] = max(peak[0], disk.usage())
            time.sleep(0.01)

    thread = threading.Thread(target=watch)
    thread.start()
    try:
        spcache_epochs(location, fp, directory, limit, workers, 1)
    finally:
        done.set()
        thread.join()
    return max(peak[0], disk.usage())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=480)
    parser.add_argument("--unique", type=int, default=8)
    parser.add_argument("--per-part", type=int, default=48)
    parser.add_argument("--size", choices=("small", "large"), default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)

    import boto3
    from peers import SIZES, build_records, write_lmdb

    torch.set_num_threads(1)
    moto, endpoint = start_moto()
    root = Path(tempfile.mkdtemp(prefix="spcache-remote-bench-"))
    try:
        records = build_records(args.samples, args.unique, *SIZES[args.size])
        bucket = "bench-remote"
        boto3.client("s3").create_bucket(Bucket=bucket)
        location = f"s3://{bucket}/snap.zarr"
        fp = write_sharded(location, records, args.per_part)
        total = data_bytes(location, fp)
        chunk = f"{max(1, total // max(1, args.samples // args.per_part) // 1_000_000)}MB"
        uri = write_litdata(root, bucket, records, chunk)
        write_lmdb(root, records)
        del records
        limit = 2 * total + (64 << 20)  # warm epochs: everything stays
        print(
            f"{args.samples} {args.size} records, {total / 1e6:.1f} MB in "
            f"{-(-args.samples // args.per_part)} parts (LitData chunks of {chunk}); "
            f"workers={args.workers}, moto at {endpoint}",
            flush=True,
        )
        times: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for name in ("spcache", "litdata", "lmdb"):
                directory = root / f"{name}-{r}"
                if name == "spcache":
                    got = spcache_epochs(location, fp, directory, limit, args.workers, 2)
                elif name == "litdata":
                    got = litdata_epochs(uri, endpoint, directory, limit, args.workers)
                else:
                    got = [lmdb_epoch_fp(root, args.workers)]
                for label, seconds in zip(("first", "warm"), got, strict=False):
                    times.setdefault(f"{name} {label}", []).append(seconds)
                shutil.rmtree(directory, ignore_errors=True)
            print(
                f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
                flush=True,
            )
        rate = {k: args.samples / statistics.median(v) for k, v in times.items()}
        for k, v in rate.items():
            print(f"{k:>16}: {v:8.0f} samples/s  ({statistics.median(times[k]):.2f} s/epoch)")
        print(
            f"first epoch, spcache / LitData: {rate['spcache first'] / rate['litdata first']:.2f}x"
        )
        print(f" warm epoch, spcache / LitData: {rate['spcache warm'] / rate['litdata warm']:.2f}x")
        print(
            f" warm epoch, spcache / local LMDB: {rate['spcache warm'] / rate['lmdb first']:.2f}x"
        )
        bound = total // 3
        peak = bounded_peak(location, fp, root / "bounded", bound, args.workers)
        print(
            f"bounded epoch: cache_limit {bound / 1e6:.1f} MB (a third of the data), "
            f"peak in use {peak / 1e6:.1f} MB ({'within' if peak <= bound else 'ABOVE'} the limit)"
        )
    finally:
        moto.kill()
        moto.wait()
        shutil.rmtree(root, ignore_errors=True)
    return 0


def lmdb_epoch_fp(root: Path, workers: int) -> float:
    spec = get_recipe_spec("spc_query")
    return lmdb_epoch(root, compute_fingerprint("spc_query", spec.version, {"level": 0}), workers)


if __name__ == "__main__":
    raise SystemExit(main())
