"""Summaries kept by the writers: ``stats``, ``ls`` and the service's cache view answer
from them, with the numbers a walk over every record gives; a cache some older writer
touched is walked until the next writer counts it again.

Precompute, rm, compact and the readers run as users run them (the CLI in a subprocess
from a fresh directory, the service over HTTP); what they wrote is read back with LMDB
itself, walking every record, as the check.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import lmdb
import numpy as np

from cache_store.sources.freshness import RACY_S
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.procs import run, run_spcache, serve, wait_for

TINY = ["--recipe", "spc", "--param", "level=3", "--device", "cpu", "--loaders", "0"]


def point_clouds(folder: Path, count: int, *, start: int = 0) -> Path:
    """``count`` 64-point clouds as ``.npy`` files whose records will carry a stat
    signature: their mtimes a minute old, and returned only once their change time
    (which no call sets back) is :data:`RACY_S` in the past, as a signature must be to be
    stored. (Without that wait, a precompute started at once on a quiet machine reads
    them too soon, stores no signature, and its re-run hashes every source.)"""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(start)
    old = time.time() - 60
    for i in range(start, start + count):
        path = folder / f"p{i:04d}.npy"
        np.save(path, rng.normal(size=(64, 3)).astype(np.float32))
        os.utime(path, (old, old))
    changed = max(os.stat(p).st_ctime_ns for p in folder.glob("p*.npy"))
    while time.time_ns() - changed < RACY_S * 1e9 + 50_000_000:
        time.sleep(0.05)
    return folder


def spcache(workdir: Path, *args: str | os.PathLike[str]) -> Any:
    """``spcache ARGS --json`` from ``workdir`` (made fresh), its JSON answer."""
    workdir.mkdir(parents=True, exist_ok=True)
    done = run_spcache(*args, "--json", cwd=workdir)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def walked(cache: Path) -> dict[str, tuple[int, int]]:
    """Per fingerprint ``(records, bytes)``, walking every record with LMDB itself."""
    env = lmdb.open(str(cache / "records"), max_dbs=8, readonly=True, lock=False)
    out: dict[str, tuple[int, int]] = {}
    try:
        with env.begin() as txn:
            for key, value in txn.cursor(db=env.open_db(b"records", txn=txn)):
                fp = bytes(key[:32]).decode()
                count, size = out.get(fp, (0, 0))
                out[fp] = (count + 1, size + len(value))
    finally:
        env.close()
    return out


def older_writer_adds(cache: Path, key: str, value: bytes) -> None:
    """A record written as an spcache that knows no summaries writes it."""
    env = lmdb.open(str(cache / "records"), max_dbs=4)
    try:
        with env.begin(write=True) as txn:
            txn.put(key.encode(), value, db=env.open_db(b"records", txn=txn))
    finally:
        env.close()


def test_stats_ls_and_the_cache_view_answer_what_a_walk_finds(tmp_path: Path) -> None:
    sources = point_clouds(tmp_path / "sources", 6)
    cache = tmp_path / "cache"
    run = spcache(tmp_path / "a", "precompute", sources, "--cache", cache, *TINY)
    fp = run["fingerprint"]
    assert run["done"] == 6
    more = spcache(
        tmp_path / "b",
        "precompute",
        sources,
        "--cache",
        cache,
        *TINY[:2],
        "--param",
        "level=4",
        *TINY[4:],
    )
    other = more["fingerprint"]
    truth = walked(cache)
    assert set(truth) == {fp, other} and truth[fp][0] == 6

    with LMDBStore(cache) as store:  # what the writers kept, without a walk
        kept = store.summaries()
    assert kept is not None
    assert {f: (e["records"], e["bytes"]) for f, e in kept.items()} == truth
    assert kept[fp]["present"] == 6 and kept[fp]["index"]["samples"] == 6

    stats = spcache(tmp_path / "c", "stats", "--cache", cache)
    for f, (count, size) in truth.items():
        entry = stats["fingerprints"][f]
        assert (entry["records"], entry["bytes"], entry["samples"]) == (count, size, 6)
        assert entry["recipe"] == "spc" and len(entry["code_digests"]) == 1
    assert stats["records"] == 12 and stats["bytes"] == sum(s for _, s in truth.values())
    listed = {r["fingerprint"]: r for r in spcache(tmp_path / "d", "ls", "--cache", cache)}
    assert {f: (r["records"], r["bytes"]) for f, r in listed.items()} == truth
    assert {r["state"] for r in listed.values()} == {"complete"}

    with serve("--cache", cache, "--no-worker", cwd=tmp_path / "d") as server:
        view = httpx.get(f"{server.url}/v1/caches/{fp}", timeout=60).json()
        assert view["counts"]["records"] == 6 and view["counts"]["indexed"] == 6
        assert view["bytes"] == truth[fp][1]
        listing = httpx.get(f"{server.url}/v1/caches", timeout=60).json()["caches"]
        assert {c["fingerprint"]: c["samples"] for c in listing} == {fp: 6, other: 6}

    # removed: its summary goes with its records; the other one's is untouched
    spcache(tmp_path / "e", "rm", "--cache", cache, fp)
    stats = spcache(tmp_path / "f", "stats", "--cache", cache)
    assert fp not in stats["fingerprints"]
    assert stats["fingerprints"][other]["records"] == 6 and stats["records"] == 6
    with LMDBStore(cache) as store:
        assert set(store.summaries() or {}) == {other}


def test_records_an_older_writer_added_are_walked_until_the_next_write_counts_them(
    tmp_path: Path,
) -> None:
    sources = point_clouds(tmp_path / "sources", 4)
    cache = tmp_path / "cache"
    fp = spcache(tmp_path / "a", "precompute", sources, "--cache", cache, *TINY)["fingerprint"]
    with LMDBStore(cache) as store:
        value = store.get(f"{fp}/p0000")
    older_writer_adds(cache, f"{fp}/copy", value.replace(b"p0000", b"copy\x20"))
    with LMDBStore(cache) as store:
        assert store.summaries() is None  # they do not add up: not trusted
    truth = walked(cache)
    assert truth[fp][0] == 5
    stats = spcache(tmp_path / "b", "stats", "--cache", cache)
    assert (stats["fingerprints"][fp]["records"], stats["fingerprints"][fp]["bytes"]) == truth[fp]
    listed = spcache(tmp_path / "c", "ls", "--cache", cache)
    assert [(r["records"], r["bytes"]) for r in listed] == [truth[fp]]

    point_clouds(sources, 1, start=4)  # the next run writes: the summaries are built again
    assert spcache(tmp_path / "d", "precompute", sources, "--cache", cache, *TINY)["done"] == 1
    truth = walked(cache)
    with LMDBStore(cache) as store:
        kept = store.summaries()
    assert kept is not None and (kept[fp]["records"], kept[fp]["bytes"]) == truth[fp] == (
        6,
        truth[fp][1],
    )


def test_compaction_keeps_the_summaries_and_a_rewrite_counts_them_again(tmp_path: Path) -> None:
    sources = point_clouds(tmp_path / "sources", 5)
    cache = tmp_path / "cache"
    fp = spcache(tmp_path / "a", "precompute", sources, "--cache", cache, *TINY)["fingerprint"]
    for option in ([], ["--rewrite-records"]):
        spcache(tmp_path / "b", "compact", "--cache", cache, *option)
        truth = walked(cache)
        with LMDBStore(cache) as store:
            kept = store.summaries()
        assert kept is not None and (kept[fp]["records"], kept[fp]["bytes"]) == truth[fp]
        assert kept[fp]["present"] == 5
        listed = spcache(tmp_path / "c", "ls", "--cache", cache)
        assert [(r["records"], r["bytes"], r["state"]) for r in listed] == [
            (*truth[fp], "complete")
        ]


#: what ``ls`` and ``stats`` of an LMDB cache must not load: they read a few summary
#: values, so the tensor, snapshot, object-store and web stacks stay out of them
HEAVY = ("numpy", "torch", "zarr", "s3fs", "fsspec", "fastapi", "starlette", "uvicorn")

#: ``spcache ARGS`` exactly as ``python -m spcache`` runs it, noting which module first
#: imported each of ``HEAVY`` (the importer's ``__name__``) into the file ``$IMPORTS``
_SPY = """
import builtins, json, os, sys
heavy, first, real = set(sys.argv[1].split(",")), {}, builtins.__import__
def spy(name, globals=None, locals=None, fromlist=(), level=0):
    top = name.split(".")[0]
    if not level and top in heavy and top not in sys.modules and top not in first:
        first[top] = (globals or {}).get("__name__", "?")
    return real(name, globals, locals, fromlist, level)
builtins.__import__ = spy
sys.argv = ["spcache", *sys.argv[2:]]
from spcache.cli import main
status = main()
loaded = sorted({m.split(".")[0] for m in sys.modules} & heavy)
with open(os.environ["IMPORTS"], "w") as out:
    json.dump({"loaded": loaded, "importers": first}, out)
sys.exit(status)
"""


def test_ls_and_stats_of_an_lmdb_cache_load_no_tensor_or_web_stack(tmp_path: Path) -> None:
    """``spcache ls`` and ``spcache stats`` answer from the summaries, so they import only
    what reads them: none of NumPy, torch, Zarr, s3fs or the web stack (their import was
    most of the commands' time). A recipe plugin that imports one of them at its top is
    its own cost (the registry imports every installed plugin to learn its schema and
    code digest), so NumPy is allowed only where the importer is such a plugin; the
    example plugin imports it inside its methods."""
    sources = point_clouds(tmp_path / "sources", 3)
    cache = tmp_path / "cache"
    fp = spcache(tmp_path / "a", "precompute", sources, "--cache", cache, *TINY)["fingerprint"]
    # the example plugin is a plugin like any other here: a venv may hold an older build
    ours = ("cache_store", "spcache.", "workers", "service")
    for command in ("ls", "stats"):
        workdir = tmp_path / command
        workdir.mkdir()
        imports = workdir / "imports.json"
        done = run(
            [sys.executable, "-c", _SPY, ",".join(HEAVY), command, "--cache", cache, "--json"],
            cwd=workdir,
            env={"IMPORTS": str(imports)},
        )
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        records = answer[0]["records"] if command == "ls" else answer["fingerprints"][fp]["records"]
        assert records == 3
        seen = json.loads(imports.read_text())
        importers = seen["importers"]
        for module in seen["loaded"]:
            by = importers.get(module, "?")
            assert module == "numpy" and not (by == "spcache" or by.startswith(ours)), (
                f"spcache {command} loaded {module} (first imported by {by})"
            )


def test_the_cache_view_pages_the_index_and_follows_each_run(tmp_path: Path) -> None:
    """``GET /v1/caches/{fp}`` answers counts and bytes from the summaries and its page of
    ids from the stored index (one page decoded, not every id): any page, the last one
    included, is the index's slice, before and after a run adds samples while the
    service is up."""
    sources = point_clouds(tmp_path / "sources", 5)
    cache = tmp_path / "cache"
    fp = spcache(tmp_path / "a", "precompute", sources, "--cache", cache, *TINY)["fingerprint"]

    def view(server: Any, offset: int, limit: int) -> Any:
        answer = httpx.get(
            f"{server.url}/v1/caches/{fp}", params={"offset": offset, "limit": limit}, timeout=60
        )
        assert answer.status_code == 200, answer.text
        return answer.json()

    def indexed() -> list[str]:
        with LMDBStore(cache) as store:
            return store.get_index(fp).sample_ids.tolist()

    (tmp_path / "s").mkdir()
    with serve("--cache", cache, "--no-worker", cwd=tmp_path / "s") as server:
        ids = indexed()
        first = view(server, 3, 10)
        assert first["index"] == {"offset": 3, "limit": 10, "total": 5, "sample_ids": ids[3:]}
        assert first["counts"]["indexed"] == 5 and first["recipe"] == "spc"

        point_clouds(sources, 3, start=5)
        assert spcache(tmp_path / "b", "precompute", sources, "--cache", cache, *TINY)["done"] == 3
        ids = indexed()
        assert len(ids) == 8
        pages = [view(server, offset, 3)["index"] for offset in (0, 3, 6, 9)]
        assert [p["total"] for p in pages] == [8] * 4
        assert [sid for p in pages for sid in p["sample_ids"]] == ids
        assert pages[-1]["sample_ids"] == []
        truth = walked(cache)[fp]
        wait_for(  # counts and bytes: the service's summary, read again once a write landed
            lambda: (lambda v: (v["counts"]["records"], v["bytes"]))(view(server, 0, 0)) == truth,
            what="the view's counts after the second run",
        )
