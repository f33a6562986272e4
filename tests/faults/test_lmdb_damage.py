"""Byte flips in ``records/data.mdb`` never kill a caller.

A real cache of a few hundred records; seeded trials each flip bytes of the LMDB file in
place (half of them in a page header, where LMDB's structure lives and where damage
made ``mdb_cursor_next`` abort the process; half anywhere), then run: the isolated
library walks (``verify_cache``, ``stats_cache``), the CLI's ``verify`` and ``stats``
as subprocesses, and one request per read route of a live service (a subprocess, so an
abort would show as a dead server, which is counted and restarted). Then the bytes are
put back.

Every trial must be harmless, or reported: a record named as corrupt, or the cache
named as damaged. Zero callers killed by a signal, zero tracebacks, zero raw 500s.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from cache_store.errors import CacheDamaged
from cache_store.housekeeping.isolated import stats_cache, verify_cache
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.index import DatasetIndex
from tests.helpers.fault_children import FAULT_FINGERPRINT, SPEC, make_small_record
from tests.helpers.faults import env_int, report
from tests.helpers.procs import Server, run_spcache
from tests.helpers.service import AUTH, start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PAGE = 4096


def _build(root: Path, n: int) -> list[str]:
    store = LMDBStore(root, readonly=False)
    ids = [f"s{i:05d}" for i in range(n)]
    items = [
        (
            f"{FAULT_FINGERPRINT}/{sid}",
            make_small_record(f"{FAULT_FINGERPRINT}/{sid}", 600 + 37 * (i % 50), i),
        )
        for i, sid in enumerate(ids)
    ]
    store.put_many(items)
    store.put_index(
        DatasetIndex(
            FAULT_FINGERPRINT, "spc", SPEC.version, SPEC.resolve({"level": 3}), np.array(ids)
        )
    )
    store.close()
    return ids


def _flip(path: Path, rng: np.random.Generator, header: bool) -> list[tuple[int, int]]:
    """Flip bytes in place; returns (offset, original byte) to put back."""
    size = path.stat().st_size
    pages = size // PAGE
    spots = []
    for _ in range(4):
        if header:  # not the two meta pages: a page header's flags/bounds
            offset = int(rng.integers(2, pages)) * PAGE + int(rng.integers(8, 16))
        else:
            offset = int(rng.integers(0, size))
        spots.append(offset)
    saved = []
    with open(path, "r+b") as fh:
        for offset in spots:
            fh.seek(offset)
            old = fh.read(1)[0]
            fh.seek(offset)
            fh.write(bytes([old ^ int(rng.integers(1, 256))]))
            saved.append((offset, old))
    return saved


def _restore(path: Path, saved: list[tuple[int, int]]) -> None:
    with open(path, "r+b") as fh:
        for offset, old in reversed(saved):
            fh.seek(offset)
            fh.write(bytes([old]))


def test_byte_flips_in_data_mdb_never_kill_a_caller(tmp_path: Path) -> None:
    trials = env_int("SPCACHE_FAULT_DAMAGE_TRIALS", 30)
    root = tmp_path / "cache"
    sources = tmp_path / "sources"
    sources.mkdir()
    ids = _build(root, env_int("SPCACHE_FAULT_DAMAGE_RECORDS", 300))
    data = root / "records" / "data.mdb"
    cache = str(root)
    rng = np.random.default_rng(1515)
    env = {"SPCACHE_STATS_TTL_S": "0"}
    server: Server = start_server(root, sources, "--no-worker", env=env)
    outcomes = {"harmless": 0, "record_corrupt": 0, "cache_damaged": 0}
    aborts = server_deaths = 0
    failures: list[str] = []
    try:
        for trial in range(trials):
            saved = _flip(data, rng, header=trial % 2 == 0)
            seen: set[str] = set()
            try:
                # library, isolated
                verified = verify_cache(cache)
                if verified["damaged"]:
                    assert cache in verified["damaged"], verified
                    seen.add("damaged")
                elif verified["corrupt"] or verified["missing"]:
                    seen.add("corrupt")
                try:
                    stats_cache(cache)
                except CacheDamaged as exc:
                    assert cache in str(exc)
                    seen.add("damaged")
                # the CLI
                for command in ("verify", "stats"):
                    done = run_spcache(command, "--cache", cache, "--json")
                    if done.returncode < 0:
                        aborts += 1
                        failures.append(
                            f"trial {trial}: CLI {command} killed by signal {-done.returncode}"
                        )
                        continue
                    if "Traceback" in done.stderr or done.returncode not in (0, 1):
                        failures.append(
                            f"trial {trial}: CLI {command} exit "
                            f"{done.returncode}: {done.stderr[-400:]}"
                        )
                    if done.returncode == 1:
                        said = done.stdout + done.stderr
                        if "cache damaged" in said:
                            assert cache in said
                            seen.add("damaged")
                        else:
                            assert command == "verify" and not json.loads(done.stdout)["ok"]
                            seen.add("corrupt")
                # the service, one request per read route
                sid = ids[int(rng.integers(0, len(ids)))]
                requests = [
                    ("GET", "/readyz", None),
                    ("GET", "/v1/caches", None),
                    ("GET", f"/v1/caches/{FAULT_FINGERPRINT}", None),
                    ("GET", f"/v1/caches/{FAULT_FINGERPRINT}/records/{sid}", None),
                    ("POST", f"/v1/caches/{FAULT_FINGERPRINT}/batch", {"ids": [sid, ids[0]]}),
                ]
                for method, route, body in requests:
                    try:
                        answer = httpx.request(
                            method, server.url + route, json=body, headers=AUTH, timeout=120
                        )
                    except httpx.TransportError as exc:
                        failures.append(f"trial {trial}: {method} {route}: {exc}")
                        break
                    if answer.status_code == 503:
                        detail = json.dumps(answer.json())
                        assert "cache damaged" in detail and cache in detail, detail
                        seen.add("damaged")
                    elif answer.status_code >= 500 or answer.status_code == 404:
                        failures.append(
                            f"trial {trial}: {method} {route}: "
                            f"{answer.status_code} {answer.text[:300]}"
                        )
            finally:
                _restore(data, saved)
            if server.proc.poll() is not None:
                server_deaths += 1
                failures.append(f"trial {trial}: service died ({server.proc.returncode})")
                server = start_server(root, sources, "--no-worker", env=env)
            outcome = (
                "cache_damaged"
                if "damaged" in seen
                else "record_corrupt"
                if "corrupt" in seen
                else "harmless"
            )
            outcomes[outcome] += 1
        # put back, the cache verifies clean again, and the service says ready
        assert verify_cache(cache)["ok"]
        assert httpx.get(server.url + "/readyz", timeout=60).status_code == 200
    finally:
        stop_server(server)
    report(
        "lmdb_damage",
        {
            "trials": trials,
            "records": len(ids),
            **outcomes,
            "caller_aborts": aborts,
            "service_deaths": server_deaths,
            "failures": len(failures),
        },
    )
    assert not failures, "\n".join(failures)
    assert aborts == 0 and server_deaths == 0
