"""Benchmark: GET of records over loopback, next to a bare Starlette floor.

Writes ``--records`` records of 1 MiB and of 16 KiB into a fresh LMDB cache, starts

- ``spcache``: the real service (``python -m spcache serve --no-worker``), and
- ``floor``: a bare Starlette route that returns the same bytes from memory,

each under uvicorn with the same options in its own process, then drives each with
``--clients`` concurrent client processes (keep-alive HTTP/1.1 over raw sockets, so the
client costs as little as possible) for ``--seconds``. Prints records/s and GB/s per
size and the service's ratio to the floor measured in the same run. Nothing here
asserts a speed; the goals (>= 60 % of the floor, >= 1.5 GB/s at 1 MiB) are read off.

Client and servers share the machine's cores: on a small machine the numbers say as
much about the client as the server, which is why the floor runs under the same load.

    python bench/http_serving.py [--records 64] [--clients 4] [--seconds 3] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SIZES = {"1MiB": 1 << 20, "16KiB": 16 << 10}

FLOOR_APP = r"""
import sys
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

bodies = {name: open(path, "rb").read() for name, path in
          (arg.split("=", 1) for arg in sys.argv[2:])}

async def record(request):
    return Response(bodies[request.path_params["size"]], media_type="application/octet-stream")

app = Starlette(routes=[Route("/r/{size}/{i}", record)])

import uvicorn
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            server_header=False, proxy_headers=False, log_config=None)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_cache(root: Path, records: int) -> tuple[str, dict[str, bytes]]:
    import numpy as np
    import torch

    from cache_store.keys import compute_fingerprint, record_key
    from cache_store.stores.lmdb import LMDBStore
    from cache_store.recipes.registry import get_recipe_spec
    from cache_store.format.encode import encode_record
    from cache_store.format.index import DatasetIndex

    spec = get_recipe_spec("spc")
    params = spec.resolve({})
    fp = compute_fingerprint("spc", spec.version, params)
    store = LMDBStore(root, readonly=False)
    samples: dict[str, bytes] = {}
    ids = []
    for size_name, size in SIZES.items():
        for i in range(records):
            sid = f"{size_name}/{i}"
            # Payload sized so the whole record (header included) is close to `size`.
            octree = torch.randint(0, 255, (size - 1024,), dtype=torch.uint8)
            value = encode_record(
                {"octree": octree},
                {
                    "recipe": "spc",
                    "recipe_version": "1",
                    "fingerprint": fp,
                    "sample_id": sid,
                    "source_hash": "xxh3_128:" + "0" * 32,
                    "backend": "torch",
                    "device": "cpu",
                },
            )
            store.put_many([(record_key(fp, sid), value)])
            ids.append(sid)
            samples.setdefault(size_name, value)
    store.put_index(DatasetIndex(fp, "spc", spec.version, params, np.array(ids)))
    store.close()
    return fp, samples


def wait_up(port: int, proc: subprocess.Popen, path: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(
                    f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
                )
                if s.recv(12).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server did not come up")


def _client(
    port: int, paths: list[str], seconds: float, start_at: float, out: mp.Queue[tuple[int, int]]
) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    while time.time() < start_at:
        time.sleep(0.001)
    deadline = time.time() + seconds
    n = nbytes = 0
    while time.time() < deadline:
        path = paths[n % len(paths)]
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        got = 0
        while True:  # read until the header ends
            got += sock.recv_into(view[got:], len(buf) - got)
            end = buf.find(b"\r\n\r\n", 0, got)
            if end >= 0:
                break
        head = bytes(buf[:end]).lower()
        if not head.startswith(b"http/1.1 200"):
            raise RuntimeError(f"{path}: {head[:80]!r}")
        length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        body = got - end - 4
        while body < length:
            body += sock.recv_into(view[end + 4 + body :], length - body)
        n += 1
        nbytes += length
    sock.close()
    out.put((n, nbytes))


def drive(port: int, paths: list[str], clients: int, seconds: float) -> dict[str, float]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start_at = time.time() + 0.5
    procs = [
        ctx.Process(target=_client, args=(port, paths[i::clients] or paths, seconds, start_at, out))
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join()
    n = sum(r[0] for r in results)
    nbytes = sum(r[1] for r in results)
    return {"records_per_s": n / seconds, "gb_per_s": nbytes / seconds / 1e9, "requests": n}


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=64, help="records per size")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved floor/spcache pairs")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="spcache-bench-http-") as tmp:
        tmp_path = Path(tmp)
        fp, samples = build_cache(tmp_path / "cache", args.records)
        for name, value in samples.items():
            (tmp_path / name).write_bytes(value)
        svc_port, floor_port = free_port(), free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        service = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spcache",
                "serve",
                "--cache",
                str(tmp_path / "cache"),
                "--port",
                str(svc_port),
                "--no-worker",
                "--log-level",
                "warning",
                "--source-root",
                tmp,
            ],
            cwd=REPO,
            env=env,
        )
        floor = subprocess.Popen(
            [
                sys.executable,
                "-c",
                FLOOR_APP,
                str(floor_port),
                *(f"{name}={tmp_path / name}" for name in samples),
            ],
            cwd=REPO,
            env=env,
        )
        try:
            wait_up(svc_port, service, "/healthz")
            wait_up(floor_port, floor, "/r/16KiB/0")
            results: dict[str, dict] = {}
            for size_name in SIZES:
                svc_paths = [
                    f"/v1/caches/{fp}/records/{size_name}/{i}" for i in range(args.records)
                ]
                floor_paths = [f"/r/{size_name}/{i}" for i in range(args.records)]
                drive(floor_port, floor_paths, args.clients, 1.0)  # warm both up
                drive(svc_port, svc_paths, args.clients, 1.0)
                floors, svcs = [], []
                for _ in range(args.repeats):  # interleaved: load swings hit both alike
                    floors.append(drive(floor_port, floor_paths, args.clients, args.seconds))
                    svcs.append(drive(svc_port, svc_paths, args.clients, args.seconds))
                ratios = [
                    s["records_per_s"] / f["records_per_s"]
                    for s, f in zip(svcs, floors, strict=True)
                ]
                results[size_name] = {
                    "floor": _median(floors),
                    "spcache": _median(svcs),
                    "ratio": {
                        "median": statistics.median(ratios),
                        "min": min(ratios),
                        "max": max(ratios),
                    },
                }
        finally:
            for proc in (service, floor):
                proc.terminate()
                proc.wait(30)
    conditions = {
        "cpus": os.cpu_count(),
        "clients": args.clients,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "records_per_size": args.records,
        "python": sys.version.split()[0],
        "load_average": os.getloadavg(),
    }
    if args.json:
        print(json.dumps({"conditions": conditions, "results": results}, indent=2))
        return
    print(f"conditions: {conditions}")
    print(
        "medians over the repeats; 'vs floor' is the median of the interleaved pairs' ratios "
        "(min-max)"
    )
    print(f"{'size':>6} {'server':>8} {'records/s':>10} {'GB/s':>7} {'vs floor':>16}")
    for size_name, r in results.items():
        for server in ("floor", "spcache"):
            q = r["ratio"]
            ratio = (
                f"{q['median']:.0%} ({q['min']:.0%}-{q['max']:.0%})"
                if server == "spcache"
                else "100%"
            )
            print(
                f"{size_name:>6} {server:>8} {r[server]['records_per_s']:>10.0f} "
                f"{r[server]['gb_per_s']:>7.2f} {ratio:>16}"
            )


if __name__ == "__main__":
    main()
