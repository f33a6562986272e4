"""Hostile warm-up globs must not disable the service.

A 56-character pattern of repeated ``**/`` made ``Path.glob`` walk a 120-file tree for
about a minute per request, in the thread pool; 45 of them took every pool thread, so
every pooled route hung while ``/healthz`` still said 200, and SIGTERM did not stop the
process. Against a real ``spcache serve`` subprocess:

* ``HOSTILE`` such requests at once are each refused (422), then every route (pooled and
  not) answers, and SIGTERM stops the server (each waited for up to ``BOUND_S``, a bound
  for a loaded machine; how long they took is reported, not asserted);
* a one-``**`` pattern over a tree larger than the entry bound is refused (422) naming
  the bound; a glob through a symlinked directory leading outside the source root
  neither matches nor names anything there;
* the liveness check: with every pool thread held (the glob expansion replaced by one
  that blocks), ``/healthz`` answers 503 (it does not wait for the pool), and 200 once
  released.

Figures: answers by status, the slowest route answer after the flood, the stop time.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from cache_store.errors import ParameterError
from service.settings import Settings
from tests.helpers.faults import env_int, report, served
from tests.helpers.service import TOKEN, build_cache, start_server

AUTH = {"Authorization": f"Bearer {TOKEN}"}
HOSTILE = env_int("SPCACHE_FAULT_HOSTILE_GLOBS", 45)
BOUND_S = 120.0
BOMB = "**/" * 17 + "*.obj"


def _tree(root: Path, depth: int, fanout: int = 3) -> int:
    if depth == 0:
        return 0
    n = 0
    for i in range(fanout):
        sub = root / f"d{i}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / "x.obj").write_text("v 0 0 0\n")
        n += 1 + _tree(sub, depth - 1, fanout)
    return n


def _warm(url: str, glob: str, root: str = "tree", timeout: float = BOUND_S) -> int | str:
    try:
        r = httpx.post(
            url + "/v1/warmup",
            headers=AUTH,
            timeout=timeout,
            json={"recipe": "spc", "root": root, "glob": glob},
        )
    except httpx.TimeoutException:
        return "timeout"
    return r.status_code


def test_glob_flood_leaves_every_route_answering_and_sigterm_stops(tmp_path: Path) -> None:
    cache = build_cache(tmp_path)
    files = _tree(cache.sources / "tree", 4)
    server = start_server(
        cache.root, cache.sources, "--no-worker", env={"SPCACHE_GLOB_MAX_ENTRIES": "100000"}
    )
    try:
        with cf.ThreadPoolExecutor(16) as pool:
            answers = Counter(pool.map(lambda _: _warm(server.url, BOMB), range(HOSTILE)))
        slowest = 0.0
        statuses = {}
        for path in (
            "/healthz",
            "/readyz",
            "/v1/recipes",
            "/v1/caches",
            "/v1/jobs",
            f"/v1/caches/{cache.fingerprint}",
            f"/v1/caches/{cache.fingerprint}/items/{cache.ids[0]}",
        ):
            t0 = time.monotonic()
            try:
                statuses[path] = httpx.get(server.url + path, timeout=BOUND_S).status_code
            except httpx.TimeoutException:
                statuses[path] = "timeout"
            slowest = max(slowest, time.monotonic() - t0)
        # a good glob still works after the flood
        good = _warm(server.url, "d0/*.obj")
    finally:
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(BOUND_S)
            stopped = time.monotonic() - t0
        except Exception:  # noqa: BLE001 - reported as a failure below, after the kill
            server.proc.kill()
            server.proc.wait()
            stopped = None
    report(
        "glob_bomb",
        {
            "hostile": HOSTILE,
            "tree_files": files,
            "answers": dict(answers),
            "route_statuses": statuses,
            "slowest_route_s": round(slowest, 3),
            "stop_s": stopped,
        },
    )
    assert answers == Counter({422: HOSTILE}), answers
    assert all(s == 200 for s in statuses.values()), statuses
    assert good == 202
    assert stopped is not None, f"SIGTERM did not stop the server in {BOUND_S} s"


def test_glob_bounds_and_symlinks_outside_the_root(tmp_path: Path) -> None:
    cache = build_cache(tmp_path)
    _tree(cache.sources / "tree", 5)  # 363 files + 363 directories
    outside = tmp_path / "secret-outside"
    outside.mkdir()
    (outside / "private-name.obj").write_text("v 0 0 0\n")
    (cache.sources / "linked").mkdir()
    (cache.sources / "linked" / "out").symlink_to(outside, target_is_directory=True)
    (cache.sources / "linked" / "loop").symlink_to(
        cache.sources / "linked", target_is_directory=True
    )
    settings = Settings(
        cache=cache.root,
        source_roots=[cache.sources],
        token=TOKEN,
        worker=False,
        glob_max_entries=500,
    )
    with (
        served(settings) as server,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c,
    ):
        big = c.post("/v1/warmup", json={"recipe": "spc", "root": "tree", "glob": "**/*.obj"})
        two = c.post("/v1/warmup", json={"recipe": "spc", "root": "tree", "glob": "**/d0/**/*"})
        glued = c.post("/v1/warmup", json={"recipe": "spc", "root": "tree", "glob": "d**/*.obj"})
        linked = c.post("/v1/warmup", json={"recipe": "spc", "root": "linked", "glob": "**/*.obj"})
        direct = c.post("/v1/warmup", json={"recipe": "spc", "root": "linked", "glob": "out/*.obj"})
        small = c.post(
            "/v1/warmup", json={"recipe": "spc", "root": "tree/d0/d0/d0", "glob": "**/*.obj"}
        )
    assert big.status_code == 422 and "more than 500 entries" in big.text, big.text
    assert two.status_code == 422 and "at most one '**'" in two.text, two.text
    assert glued.status_code == 422, glued.text
    for r in (linked, direct):
        assert r.status_code == 422, r.text
        assert "private-name" not in r.text and "secret-outside" not in r.text, r.text
    assert small.status_code == 202, small.text
    assert small.json()["queued"] == 1 + 3 + 9  # its own x.obj and two levels below


def test_healthz_reports_a_starved_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import service.routes_jobs as routes_jobs

    release = threading.Event()
    entered = threading.Semaphore(0)

    def blocking_glob(*args: object, **kwargs: object) -> list[tuple[str, str]]:
        entered.release()
        release.wait(60)
        raise ParameterError(["released by the test"], what="warm-up request")

    monkeypatch.setattr(routes_jobs, "expand_glob", blocking_glob)
    cache = build_cache(tmp_path)
    settings = Settings(
        cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False, pool_check_s=1.0
    )
    with served(settings) as server, cf.ThreadPoolExecutor(HOSTILE) as pool:
        healthy = httpx.get(server.url + "/healthz", timeout=10).status_code
        futures = [pool.submit(_warm, server.url, "*.obj", "tree", 60) for _ in range(HOSTILE)]
        for _ in range(40):  # anyio's default pool: 40 threads
            assert entered.acquire(timeout=30)
        t0 = time.monotonic()
        starved = httpx.get(server.url + "/healthz", timeout=BOUND_S)
        took = time.monotonic() - t0
        release.set()
        cf.wait(futures, timeout=60)
        recovered = httpx.get(server.url + "/healthz", timeout=10).status_code
    report(
        "starved_pool_healthz",
        {
            "before": healthy,
            "starved": starved.status_code,
            "starved_answer_s": round(took, 3),
            "after": recovered,
        },
    )
    assert healthy == 200
    assert starved.status_code == 503 and "starved" in starved.text, starved.text
    assert recovered == 200
