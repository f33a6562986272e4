"""Fixtures for the service: a real LMDB cache with records, the app, a live uvicorn.
(The helpers behind them live in ``tests/helpers/service.py``.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.settings import Settings
from tests.helpers.procs import Server
from tests.helpers.service import (
    TOKEN,
    Cache,
    InProcessServer,
    build_cache,
    start_server,
    stop_server,
)


@pytest.fixture
def cache(tmp_path: Path) -> Cache:
    return build_cache(tmp_path)


@pytest.fixture
def settings(cache: Cache) -> Settings:
    return Settings(
        cache=cache.root,
        source_roots=[cache.sources],
        token=TOKEN,
        worker=False,
        max_body_bytes=64 * 1024,
    )


@pytest.fixture
def client(settings: Settings) -> Iterator[httpx.Client]:
    with InProcessServer(settings) as server, httpx.Client(base_url=server.url) as c:
        yield c


@pytest.fixture
def live(cache: Cache) -> Iterator[Server]:
    server = start_server(cache.root, cache.sources, "--no-worker")
    try:
        yield server
    finally:
        stop_server(server)
