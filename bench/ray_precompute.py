"""Benchmark: precompute on Ray (1 and 2 actors) against the local engine, same sources.

Runs the ``spc_query`` recipe over the shared meshes, each listed ``--copies`` times under
different sample ids (so every copy is its own sample with its own random draws), into a
fresh cache per run. One Ray instance is started for the whole benchmark
(``ray.init(num_cpus=--cpus)``); every Ray run starts its own actors, and the time they
take to start (``actor_start_s``: process start, imports, device and backend) is
reported apart from the work. Configurations, interleaved ``--repeat`` times:

- ``local``: :class:`workers.engine.Engine`, loading in its own process (``loaders=0``) with
  ``--threads`` torch threads (default 1, what a one-CPU Ray actor gets): the baseline,
  the same serial work one actor does;
- ``local-pipelined``: the local engine with ``--loaders`` loader processes (for reference);
- ``ray-1``, ``ray-2``: :class:`workers.ray_engine.RayEngine` with 1 and 2 CPU actors,
  each loading in its own process (``loaders=0``), every record sent to the driver, which
  writes them into one LMDB cache;
- ``ray-2-sharded``: 2 actors writing their own parts into a sharded snapshot in a local
  directory (the driver writes no record bytes);
- ``ray-2-s3``: the same into ``s3://`` on moto's S3 server on 127.0.0.1 (skipped, and
  said, where ``moto[server]`` and ``s3fs`` are not installed).

The driver's CPU time (this process's, all its threads) per record is printed for each
Ray run with its ratio to ``ray-2`` (the single writer), and the bytes each run wrote per
second of work.

With ``--device cuda`` every run uses the GPU (``ray-2`` only with two GPUs), and each
actor gets ``--loaders`` loader processes. The overhead line then compares ``ray-1`` with
the serial ``local`` run, so read it against ``local-pipelined`` instead.

Prints samples/s over the whole run (wall, actor start included) and over the work alone
(wall less actor start), each as a ratio to the local baseline of the same invocation,
and the overhead Ray adds per sample: ``(ray-1 work time - local wall) / samples``.
Nothing here asserts a speed.

    python bench/ray_precompute.py [--copies 2] [--level 8] [--queries 32768] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import ray  # noqa: E402
import torch  # noqa: E402

from cache_store.snapshot.sharded import ShardedSnapshot  # noqa: E402
from cache_store.stores.opener import open_store  # noqa: E402
from cache_store.sources.discover import discover_sources  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.ray_engine import RayEngine  # noqa: E402


def _moto() -> tuple[Any, str] | None:
    """moto's S3 server in a process of its own (its CPU is not the driver's) on a free
    loopback port, or None where it is not installed."""
    try:
        import boto3
        import moto.server  # noqa: F401 - run below as its own process
        import s3fs  # noqa: F401 - the snapshot's client
    except ImportError:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise SystemExit("moto's S3 server did not start") from None
            time.sleep(0.2)
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket="spcache-bench")
    return server, endpoint


def _target(config: dict, tmp: str, endpoint: str | None) -> Any:
    sink = config.get("sink")
    if sink == "local":
        return ShardedSnapshot(Path(tmp) / "snap.zarr", readonly=False)
    if sink == "s3":
        return ShardedSnapshot(
            f"s3://spcache-bench/{uuid.uuid4().hex}.zarr",
            readonly=False,
            storage_options={"endpoint_url": endpoint, "key": "testing", "secret": "testing"},
        )
    return open_store(Path(tmp) / "cache", readonly=False)


def run_once(
    items: list[tuple[str, str]],
    params: dict,
    config: dict,
    device: str,
    endpoint: str | None = None,
) -> dict:
    backend = "torch" if device == "cpu" else "auto"
    with tempfile.TemporaryDirectory(prefix="spcache-bench-") as tmp:
        store = _target(config, tmp, endpoint)
        try:
            if config["engine"] == "ray":
                engine = RayEngine(
                    store,
                    "spc_query",
                    params,
                    device=device,
                    backend=backend,
                    loaders=config["loaders"],
                    actors=config["actors"],
                )
            else:
                engine = Engine(
                    store,
                    "spc_query",
                    params,
                    device=device,
                    backend=backend,
                    loaders=config["loaders"],
                )
            # Open the store (and an S3 store's client: botocore loads its service models,
            # ~0.5 s of CPU once per process) before the clock starts: what is measured is
            # the driver's cost per record, not its start-up.
            store.has(f"{'0' * 32}/warm-up")
            start, cpu = time.perf_counter(), time.process_time()
            summary = engine.run(items)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            written = int(store.stats()["bytes"])
        finally:
            store.close()
    if summary.failed or summary.done != len(items):
        raise SystemExit(f"benchmark samples failed: {summary.errors}")
    actor_start = getattr(summary, "actor_start_s", 0.0)
    work = wall - actor_start
    per_actor = [a.samples_per_s for a in getattr(summary, "actors", [])]
    return {
        "samples": summary.done,
        "wall_s": wall,
        "actor_start_s": actor_start,
        "work_s": work,
        "samples_per_s": summary.done / wall,
        "work_samples_per_s": summary.done / work,
        "per_actor_samples_per_s": per_actor,
        "load_s": summary.load_s,
        "compute_s": summary.compute_s,
        "write_s": summary.write_s,
        "driver_cpu_s": cpu,
        "bytes": written,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", type=Path, default=REPO.parent / "shared" / "data" / "meshes")
    parser.add_argument("--copies", type=int, default=2, help="samples per mesh (distinct ids)")
    parser.add_argument("--level", type=int, default=8)
    parser.add_argument("--queries", type=int, default=32_768)
    parser.add_argument("--surface-samples", type=int, default=100_000)
    parser.add_argument("--loaders", type=int, default=2, help="loaders of the pipelined local run")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs given to the local Ray")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the local runs (a one-CPU actor gets 1)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: every run on the GPU(s), one actor per GPU, loaders ahead",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    meshes = discover_sources([args.meshes])
    items = [
        (f"{sample_id}-{copy}", path) for copy in range(args.copies) for sample_id, path in meshes
    ]
    params = {
        "level": args.level,
        "surface_samples": args.surface_samples,
        "uniform_queries": args.queries // 2,
        "surface_queries": args.queries - args.queries // 2,
    }
    # On the CPU each actor loads in its own process (the serial baseline's work); on
    # GPUs each actor has --loaders loaders ahead of its device, like the pipelined run.
    actor_loaders = 0 if args.device == "cpu" else args.loaders
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    configs = {
        "local": {"engine": "local", "loaders": 0},
        "local-pipelined": {"engine": "local", "loaders": args.loaders},
    }
    for actors in (1, 2):
        if args.device == "cpu" or actors <= gpus:
            configs[f"ray-{actors}"] = {"engine": "ray", "actors": actors, "loaders": actor_loaders}
    if args.device == "cpu" or gpus >= 2:
        configs["ray-2-sharded"] = {
            "engine": "ray",
            "actors": 2,
            "loaders": actor_loaders,
            "sink": "local",
        }
    moto = _moto()
    if moto is None:
        print("ray-2-s3 skipped: moto[server] and s3fs are not installed")
    elif "ray-2-sharded" in configs:
        configs["ray-2-s3"] = {"engine": "ray", "actors": 2, "loaders": actor_loaders, "sink": "s3"}
    endpoint = moto[1] if moto else None
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level=logging.WARNING)
    try:
        print(
            f"{len(items)} samples ({len(meshes)} meshes x {args.copies}) from {args.meshes} "
            f"on {args.device}{f' ({gpus} GPU(s))' if gpus else ''}; "
            f"spc_query {params}; {os.cpu_count()} CPUs (Ray: {args.cpus}), "
            f"torch {torch.__version__} ({args.threads} thread(s) in the local runs), "
            f"ray {ray.__version__}"
        )
        # warm-up: imports, the loader pool's first start, Ray's first worker processes
        for config in configs.values():
            run_once(items[:2], params, config, args.device, endpoint)
        trials: dict[str, list[dict]] = {name: [] for name in configs}
        for _ in range(args.repeat):
            for name, config in configs.items():
                trials[name].append(run_once(items, params, config, args.device, endpoint))
    finally:
        ray.shutdown()
        if moto is not None:
            moto[0].terminate()
            moto[0].wait(timeout=30)
    runs = {
        name: min(t, key=lambda r: r["work_s"])
        | {
            "median_wall_s": statistics.median(r["wall_s"] for r in t),
            "median_work_s": statistics.median(r["work_s"] for r in t),
        }
        for name, t in trials.items()
    }
    base = runs["local"]
    print(f"best of {args.repeat} by work time (medians in the last two columns)")
    print(
        f"{'run':<16}{'samples/s':>10}{'x local':>8}{'work/s':>8}{'x local':>8}"
        f"{'start s':>8}{'load s':>8}{'dev s':>7}{'write s':>8}{'wall s':>8}"
        f"{'med wall':>9}{'med work':>9}  per actor"
    )
    for name, r in runs.items():
        r["ratio_to_local"] = r["samples_per_s"] / base["samples_per_s"]
        r["work_ratio_to_local"] = r["work_samples_per_s"] / base["work_samples_per_s"]
        actors = ", ".join(f"{v:.2f}" for v in r["per_actor_samples_per_s"])
        print(
            f"{name:<16}{r['samples_per_s']:>10.2f}{r['ratio_to_local']:>8.2f}"
            f"{r['work_samples_per_s']:>8.2f}{r['work_ratio_to_local']:>8.2f}"
            f"{r['actor_start_s']:>8.2f}{r['load_s']:>8.2f}{r['compute_s']:>7.2f}"
            f"{r['write_s']:>8.2f}{r['wall_s']:>8.2f}{r['median_wall_s']:>9.2f}"
            f"{r['median_work_s']:>9.2f}  {actors}"
        )
    n = len(items)
    overhead = {
        "best_ms": 1000 * (runs["ray-1"]["work_s"] - base["wall_s"]) / n,
        "median_ms": 1000 * (runs["ray-1"]["median_work_s"] - base["median_wall_s"]) / n,
    }
    starts = ", ".join(
        f"{runs[name]['actor_start_s']:.2f} s ({name})" for name in runs if name.startswith("ray-")
    )
    print(
        f"Ray overhead per sample (ray-1 work time - local wall) / {n}: "
        f"{overhead['best_ms']:.1f} ms (best), {overhead['median_ms']:.1f} ms (median); "
        f"actor start per run: {starts}"
    )
    single = runs.get("ray-2")
    print(
        "driver CPU per record (this process, all threads), and bytes written per second of work:"
    )
    ray_runs = {name: r for name, r in runs.items() if name.startswith("ray-")}
    for r in ray_runs.values():
        r["driver_cpu_ms_per_record"] = 1000 * r["driver_cpu_s"] / r["samples"]
        r["write_mb_per_s"] = r["bytes"] / r["work_s"] / 1e6
    for name, r in ray_runs.items():
        ratio = (
            f"{r['driver_cpu_ms_per_record'] / single['driver_cpu_ms_per_record']:.2f}x ray-2"
            if single
            else ""
        )
        print(
            f"  {name:<16}{r['driver_cpu_ms_per_record']:>8.2f} ms  {ratio:>12}"
            f"{r['write_mb_per_s']:>9.2f} MB/s ({r['bytes'] / 1e6:.1f} MB)"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"params": params, "samples": n, "runs": runs, "overhead_per_sample_ms": overhead},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
