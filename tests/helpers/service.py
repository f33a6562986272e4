"""The service under test: a real LMDB cache with records, the app under a real uvicorn
(in-process or as a live `spcache serve`) and the test token."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import uvicorn

from cache_store.keys import compute_fingerprint, record_key
from cache_store.sources.files import hash_source_file
from cache_store.stores.lmdb import LMDBStore
from cache_store.recipes.registry import get_recipe_spec
from cache_store.format.encode import encode_record
from cache_store.format.index import DatasetIndex
from service.app import create_app
from service.settings import Settings
from tests.helpers.procs import Server, bound_socket, serve

TOKEN = "test-token-0123456789"


@dataclass
class Cache:
    root: Path  # cache directory
    sources: Path  # the allowed source root
    fingerprint: str
    params: dict
    ids: list[str]
    values: dict[str, bytes]  # sample id -> stored record bytes


def make_record(
    fingerprint: str, sample_id: str, source_hash: str, nbytes: int = 4096, seed: int = 0
) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    n = max(nbytes // 4, 1)
    return encode_record(
        {
            "octree": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen),
            "point_hierarchy": torch.randint(-5, 5, (n // 2, 3), dtype=torch.int16, generator=gen),
            "center": torch.zeros(3),
            "scale": torch.tensor(1.0),
        },
        {
            "recipe": "spc",
            "recipe_version": "1",
            "fingerprint": fingerprint,
            "sample_id": sample_id,
            "source_hash": source_hash,
            "backend": "torch",
            "device": "cpu",
        },
    )


def build_cache(tmp: Path, n: int = 5) -> Cache:
    sources = tmp / "sources"
    sources.mkdir(parents=True)
    spec = get_recipe_spec("spc")
    params = spec.resolve({"level": 4})
    fp = compute_fingerprint("spc", spec.version, params)
    ids, values = [], {}
    store = LMDBStore(tmp / "cache", readonly=False)
    for i in range(n):
        sid = f"shapes/s{i}"
        (sources / "shapes").mkdir(exist_ok=True)
        src = sources / "shapes" / f"s{i}.obj"
        src.write_text(f"v 0 0 {i}\nv 1 0 0\nv 0 1 0\nf 1 2 3\n")
        value = make_record(fp, sid, hash_source_file(src), seed=i)
        store.put_many([(record_key(fp, sid), value)])
        ids.append(sid)
        values[sid] = value
    store.put_index(DatasetIndex(fp, "spc", spec.version, params, np.array(ids)))
    store.close()
    return Cache(tmp / "cache", sources, fp, params, ids, values)


class InProcessServer:
    """The app under a real uvicorn on a loopback port, in a thread of the test process.

    (Starlette's TestClient is avoided: it is not a real server, and it warns with httpx.)
    """

    def __init__(self, settings: Settings | None, app: object = None) -> None:
        # bound here and handed to uvicorn: a port looked up free and bound later can be
        # taken in between (another test's client connection, on a busy machine)
        self.socket = bound_socket()
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(settings) if app is None else app
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_config=None,
            log_level="warning",
            lifespan="on",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + 60  # a loaded 2-core machine: seconds, not 10 ms
        while not self.server.started:
            if not self.thread.is_alive():
                self.socket.close()
                raise RuntimeError("in-process uvicorn ended before it started (see its log)")
            if time.monotonic() > deadline:
                raise RuntimeError("in-process uvicorn did not start within 60 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def start_server(
    cache: Path,
    sources: Path,
    *extra: str,
    env: dict[str, str | None] | None = None,
    token: str | None = TOKEN,
) -> Server:
    """``spcache serve`` over ``cache`` with the test token (``token=None``: none),
    ``sources`` as its source root, on a socket bound first (``tests.helpers.procs.serve``);
    ``--host H`` in ``extra`` binds that address."""
    args = list(extra)
    host = "127.0.0.1"
    if "--host" in args:
        at = args.index("--host")
        host = args[at + 1]
        del args[at : at + 2]
    return serve(
        "--cache",
        cache,
        "--source-root",
        sources,
        "--log-level",
        "warning",
        *args,
        host=host,
        env={"SPCACHE_TOKEN": token, **(env or {})},
    )


def stop_server(server: Server) -> None:
    """SIGTERM, as a user stops it; whatever is left after a generous wait is killed."""
    server.stop()
