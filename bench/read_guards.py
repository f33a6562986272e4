"""What the read-path guards cost per record GET, against baselines in the same run.

* ``HostGuard`` (Host check + trust test) around a bare ASGI app answering 16 KiB,
  against the bare app;
* ``record_length`` (the size peek before a copy) + ``LMDBStore.get``, against the get
  alone.

Usage: ``python bench/read_guards.py [--n 20000]``. Prints per-call microseconds and the
ratios; nothing is asserted (timings on a shared machine are noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path


def _asgi(n: int) -> tuple[float, float]:
    from service.hosts import HostGuard
    from service.settings import Settings

    body = b"x" * 16384

    async def inner(scope: dict, receive: object, send: object) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,  # type: ignore[operator]
                "headers": [(b"content-type", b"application/octet-stream")],
            }
        )
        await send({"type": "http.response.body", "body": body})  # type: ignore[operator]

    settings = Settings(
        cache=Path(tempfile.gettempdir()) / "bench-cache",
        source_roots=[tempfile.gettempdir()],
        worker=False,
    )
    guarded = HostGuard(inner, settings)
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/x",
        "client": ("127.0.0.1", 5555),
        "headers": [(b"host", b"127.0.0.1:8000"), (b"accept", b"*/*")],
    }

    async def send(message: dict) -> None:
        return None

    async def receive() -> dict:
        return {"type": "http.request"}

    async def run(app: object) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            await app(scope, receive, send)  # type: ignore[operator]
        return (time.perf_counter() - t0) / n * 1e6

    async def both() -> tuple[float, float]:
        await run(inner), await run(guarded)  # warm-up
        return await run(inner), await run(guarded)

    return asyncio.run(both())


def _lmdb(n: int) -> tuple[float, float]:
    import numpy as np

    from cache_store.stores.lmdb import LMDBStore
    from cache_store.format.encode import encode_record
    from service.budget import record_length

    with tempfile.TemporaryDirectory() as tmp:
        writer = LMDBStore(Path(tmp), readonly=False)
        fingerprint = "0" * 32
        key = f"{fingerprint}/bench"
        value = encode_record(
            {"octree": np.random.default_rng(0).integers(0, 255, 16384, dtype=np.uint8)},
            {
                "recipe": "spc",
                "recipe_version": "1",
                "fingerprint": fingerprint,
                "sample_id": "bench",
                "source_hash": "xxh3_128:0",
                "backend": "torch",
                "device": "cpu",
            },
        )
        writer.put_many([(key, value)])
        writer.close()
        store = LMDBStore(Path(tmp), readonly=True)
        for _ in range(1000):
            store.get(key)
        t0 = time.perf_counter()
        for _ in range(n):
            store.get(key)
        base = (time.perf_counter() - t0) / n * 1e6
        t0 = time.perf_counter()
        for _ in range(n):
            record_length(store, key)
            store.get(key)
        guarded = (time.perf_counter() - t0) / n * 1e6
        store.close()
    return base, guarded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    n = parser.parse_args().n
    bare, guarded = _asgi(n)
    print(
        f"ASGI 16 KiB answer: bare {bare:.2f} us, with HostGuard {guarded:.2f} us "
        f"(+{guarded - bare:.2f} us, ratio {guarded / bare:.2f})"
    )
    get, peeked = _lmdb(n)
    print(
        f"LMDB 16 KiB record: get {get:.2f} us, size peek + get {peeked:.2f} us "
        f"(+{peeked - get:.2f} us, ratio {peeked / get:.2f})"
    )


if __name__ == "__main__":
    main()
