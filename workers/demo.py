"""The demo's steps (``spcache demo``, :mod:`spcache.cli.demo`): the whole pipeline on a
fresh machine, with no GPU and no data.

1. Writes a few example shapes (meshes in four formats and a point cloud) that it makes
   itself, so nothing has to be downloaded.
2. Precomputes the ``spc_query`` recipe for them into a local LMDB cache with the same
   engine the ``precompute`` CLI uses.
3. Starts the service on 127.0.0.1 (``spcache serve``, which starts one worker process),
   sends one more shape as an HTTP warm-up request of the same recipe and parameters (so
   it joins the same dataset), and waits for the worker to finish it.
4. Reads a record back over HTTP and prints where to look next.

SIGTERM, SIGINT and SIGHUP stop the demo and the service (and so its worker) with it;
the service also ends by itself if the demo is killed outright (``SPCACHE_PARENT_PID``).
The command checks the directory and binds the port first; :func:`run_demo` runs the steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from cache_store.process_local import this_process_only
from cache_store.processes import child_env, stop_child

__all__ = ["RECIPE", "run_demo", "write_example_shapes"]

log = logging.getLogger(__name__)

#: the one recipe of the demo: precomputed first, then warmed up over HTTP
RECIPE = "spc_query"


def write_example_shapes(directory: Path) -> list[Path]:
    """Write six small example sources into ``directory`` and return their paths."""
    import trimesh

    directory.mkdir(parents=True, exist_ok=True)
    meshes = {
        "sphere.obj": trimesh.creation.icosphere(subdivisions=3),
        "torus.ply": trimesh.creation.torus(major_radius=1.0, minor_radius=0.3),
        "box.stl": trimesh.creation.box(extents=(2.0, 1.0, 0.5)),
        "capsule.off": trimesh.creation.capsule(height=1.5, radius=0.4),
        "cone.obj": trimesh.creation.cone(radius=0.8, height=1.6),
    }
    paths = []
    for name, mesh in meshes.items():
        path = directory / name
        mesh.export(path)
        paths.append(path)
    # A point cloud: a helix of points, the kind of thing a scanner would hand over.
    t = np.linspace(0.0, 8.0 * np.pi, 20_000)
    helix = np.stack([np.cos(t), np.sin(t), t / (4.0 * np.pi) - 1.0], axis=1).astype(np.float32)
    path = directory / "helix.npy"
    np.save(path, helix)
    paths.append(path)
    return paths


def _precompute(sources: list[Path], cache: Path, level: int) -> str:
    from cache_store.stores.opener import open_store
    from workers.engine import Engine

    on_terminal = sys.stderr.isatty()
    print(
        f"precomputing recipe {RECIPE} (level {level}) for {len(sources)} example shapes "
        f"into {cache} ...",
        flush=True,
    )
    store = open_store(cache, readonly=False)
    try:
        engine = Engine(
            store, RECIPE, {"level": level}, device="auto", backend="auto", progress=on_terminal
        )
        items = [(path.stem, str(path)) for path in sources]

        def report(result) -> None:  # without a terminal, one log line a sample
            log.info(
                "precompute: %s %s%s",
                result.sample_id,
                result.status,
                f" ({result.reason})" if getattr(result, "reason", None) else "",
            )

        summary = engine.run(items, on_result=None if on_terminal else report)
    finally:
        store.close()
    print(
        f"precomputed {summary.done} records ({summary.skipped} already cached, "
        f"{summary.failed} failed) into {cache}; fingerprint {summary.fingerprint}"
    )
    return summary.fingerprint


def _wait_healthy(client, base: str, service: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.poll() is not None:
            raise SystemExit(f"the service exited early with status {service.returncode}")
        import httpx

        with contextlib.suppress(httpx.TransportError):  # not listening yet
            if client.get(f"{base}/healthz").status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"the service did not answer {base}/healthz within {timeout:.0f}s")


def _warm_up_one(client, base: str, source: Path, level: int, timeout: float = 300.0) -> dict:
    body = {
        "recipe": RECIPE,
        "params": {"level": level},
        "items": [{"id": source.stem, "path": str(source)}],
    }
    response = client.post(f"{base}/v1/warmup", json=body)
    response.raise_for_status()
    job = response.json()
    print(
        f"warm-up job {job['job_id']} queued for {source.name} (recipe {RECIPE}, level {level})",
        flush=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get(f"{base}/v1/jobs/{job['job_id']}").json()
        if status["status"] in {"done", "failed", "cancelled"}:
            print(f"warm-up job {status['id']}: {status['status']} {json.dumps(status['counts'])}")
            return {**job, **status}
        time.sleep(0.3)
    raise SystemExit(f"warm-up job {job['job_id']} did not finish within {timeout:.0f}s")


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_demo(
    directory: Path, listener: socket.socket, *, level: int, exit_after: float | None = None
) -> int:
    """The demo's steps in ``directory`` (sources and cache), the service on
    ``listener`` (bound on 127.0.0.1 by the caller and handed to ``spcache serve --fd``,
    so nothing can take the port in between), octree level ``level``; serves until
    Ctrl-C or SIGTERM (or for ``exit_after`` seconds). Returns 0."""
    # SIGTERM (kill, docker stop; SIGHUP arrives as SIGTERM) ends the demo like Ctrl-C,
    # so the finally blocks below stop the service and its worker.
    signal.signal(signal.SIGTERM, this_process_only(_terminate))
    with listener:
        return _run(directory, listener, level, exit_after)


def _run(directory: Path, listener: socket.socket, level: int, exit_after: float | None) -> int:
    import httpx
    from safetensors.numpy import load as load_safetensors

    root: Path = directory.resolve()
    sources = write_example_shapes(root / "sources")
    cache = root / "cache"
    fingerprint = _precompute(sources, cache, level)

    extra = root / "sources" / "late_arrival.stl"
    import trimesh

    trimesh.creation.annulus(r_min=0.4, r_max=1.0, height=0.3).export(extra)

    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    command = [
        sys.executable,
        "-m",
        "spcache",
        "serve",
        "--cache",
        str(cache),
        "--fd",
        str(listener.fileno()),
        "--source-root",
        str(root),
        "--log-level",
        "warning",
    ]
    print(f"starting the service on {base} (with one worker) ...", flush=True)
    service = subprocess.Popen(
        command,
        start_new_session=True,
        env=child_env(),
        pass_fds=(listener.fileno(),),
    )
    try:
        with httpx.Client(timeout=10.0) as client:
            _wait_healthy(client, base, service)
            job = _warm_up_one(client, base, extra, level)
            record_url = f"{base}/v1/caches/{fingerprint}/records/{sources[0].stem}"
            response = client.get(record_url)
            response.raise_for_status()
            tensors = load_safetensors(response.content)
            shapes = ", ".join(
                f"{k} {tuple(v.shape)} {v.dtype}" for k, v in sorted(tensors.items())
            )
            print(f"\nread {len(response.content)} bytes over HTTP: {shapes}")
        print(
            f"""
spcache is serving {cache}
  status page:  {base}/
  health:       {base}/healthz
  caches:       {base}/v1/caches
  one record:   {record_url}
  warm-up job:  {base}/v1/jobs/{job["job_id"]}
  API docs:     {base}/docs
In Python (any number of forked DataLoader workers, no CUDA):
  import spcache
  ds = spcache.CachedDataset({str(cache)!r}, {RECIPE!r}, level={level})
  ds = spcache.CachedDataset({base!r}, {fingerprint!r})   # the same records over HTTP
""",
            flush=True,
        )
        _serve_until_stopped(service, exit_after)
    finally:
        stop_child(service, 30.0, group=True, what="the service")
    return 0


def _serve_until_stopped(service: subprocess.Popen, exit_after: float | None) -> None:
    try:
        if exit_after is None:
            print("Ctrl-C stops the service.", flush=True)
        service.wait(timeout=exit_after)
    except subprocess.TimeoutExpired:
        pass
    except KeyboardInterrupt:
        print("stopping the service", flush=True)
