"""A directory of meshes with a few broken ones, as real datasets hold them: precompute
prints the failures, ``spcache stats`` and ``GET /v1/caches/{fp}`` (what the status page
shows in the cache row) list the same ones, and a read-through dataset with
``on_error="skip"`` trains two epochs at ``batch_size=8`` with forked loader workers and
a real ``spcache worker``, without an exception."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from torch.utils.data import DataLoader

from cache_store import CachedDataset, collate_spc
from service.settings import Settings
from tests.conftest import shared_data_present
from tests.helpers.procs import run_spcache
from tests.helpers.read_through import start_worker, stop_worker
from tests.helpers.service import InProcessServer

PARAMS = {"level": 5, "surface_samples": 2000, "uniform_queries": 256, "surface_queries": 256}
BROKEN = (
    "nan_vertices.obj",
    "empty.obj",
    "garbage.stl",
    "truncated_binary.ply",
    "faces_out_of_range.obj",
)


@pytest.fixture
def messy(tmp_path: Path, corpus_meshes: list[Path], corpus_bad_inputs: list[Path]) -> Path:
    root = tmp_path / "dataset"
    for folder, files in (
        ("good", corpus_meshes),
        ("broken", [p for p in corpus_bad_inputs if p.name in BROKEN]),
    ):
        (root / folder).mkdir(parents=True)
        for p in files:
            shutil.copy(p, root / folder / p.name)
    if shared_data_present():  # the real meshes and broken files beside the checkout
        from tests.conftest import SHARED_DATA

        for folder in ("meshes", "bad_inputs"):
            shutil.copytree(SHARED_DATA / folder, root / f"shared_{folder}")
    return root


def _precompute(sources: Path, cache: Path) -> tuple[int, str, dict[str, str]]:
    args = [arg for k, v in PARAMS.items() for arg in ("--param", f"{k}={v}")]
    out = run_spcache(
        "precompute",
        sources,
        "--recipe",
        "spc_query",
        *args,
        "--cache",
        cache,
        "--device",
        "cpu",
        "--backend",
        "torch",
        "--loaders",
        "0",
        "--id-keep-ext",
    )
    printed = dict(re.findall(r"^  failed (\S+) \((.+)\): ", out.stdout, re.M))
    fingerprint = re.search(r"^fingerprint (\w+)", out.stdout, re.M).group(1)
    return out.returncode, fingerprint, printed


@pytest.mark.slow
def test_messy_directory_precomputes_lists_failures_and_trains_with_skip(
    messy: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    code, fp, printed = _precompute(messy, cache)
    assert code == 1 and len(printed) >= len(BROKEN), printed
    assert all(sid.startswith(("broken/", "shared_bad_inputs/")) for sid in printed), printed

    stats = run_spcache("stats", "--cache", cache, "--json")
    assert stats.returncode == 0, stats.stderr
    listed = json.loads(stats.stdout)["fingerprints"][fp]["failed"]
    assert {f["id"]: f["path"] for f in listed["items"]} == printed
    assert listed["count"] == len(printed)
    text = run_spcache("stats", "--cache", cache).stdout
    assert all(f"{sid}  {path}" in text for sid, path in printed.items())

    with InProcessServer(
        Settings(cache=cache, source_roots=[messy], worker=False, token="t" * 32)
    ) as server:
        body = httpx.get(f"{server.url}/v1/caches/{fp}?limit=0", timeout=30).json()
        row = [
            c
            for c in httpx.get(f"{server.url}/v1/caches", timeout=30).json()["caches"]
            if c["fingerprint"] == fp
        ]
    assert {f["id"]: f["path"] for f in body["failed"]["items"]} == printed
    assert body["created"] and row[0]["created"] and row[0]["failed"] == len(printed)

    worker = start_worker(cache)
    try:
        ds = CachedDataset(
            cache,
            "spc_query",
            sources=messy,
            on_error="skip",
            id_template="{path}",
            miss_timeout=300,
            **PARAMS,
        )
        assert ds.fingerprint == fp
        loader = DataLoader(
            ds,
            batch_size=8,
            shuffle=True,
            num_workers=2,
            multiprocessing_context="fork",
            collate_fn=collate_spc,
        )
        for _ in range(2):
            seen = 0
            for batch in loader:
                if not batch:
                    continue
                seen += int(batch["lengths"].shape[0])
            assert seen == len(ds) - len(printed)
    finally:
        stop_worker(worker)
    assert set(ds.failed) == set(printed)
    assert all(ds.failed[sid].path == printed[sid] for sid in printed)
    # the worker's failures of the same samples land in the same log: still the same list
    again = json.loads(run_spcache("stats", "--cache", cache, "--json").stdout)
    assert {f["id"] for f in again["fingerprints"][fp]["failed"]["items"]} == set(printed)


def test_skip_failed_exits_0_when_every_failure_is_a_known_one(
    tmp_path: Path, corpus_meshes: list[Path], corpus_bad_inputs: list[Path]
) -> None:
    sources = tmp_path / "src"
    sources.mkdir()
    shutil.copy(corpus_meshes[0], sources)
    for p in corpus_bad_inputs:
        if p.name in ("nan_vertices.obj", "empty.obj"):  # fails after hashing / before it
            shutil.copy(p, sources)

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return run_spcache(
            "precompute",
            sources,
            "--recipe",
            "spc",
            "--param",
            "level=3",
            "--param",
            "surface_samples=300",
            "--cache",
            tmp_path / "cache",
            "--device",
            "cpu",
            "--backend",
            "torch",
            "--loaders",
            "0",
            "--json",
            *extra,
        )

    first = run()
    assert first.returncode == 1 and json.loads(first.stdout)["failed"] == 2
    known = run("--skip-failed")
    summary = json.loads(known.stdout)
    assert summary["failed"] == 2 and summary["skipped_failed"] == ["nan_vertices"]
    assert summary["failed_again"] == ["empty"]
    assert known.returncode == 0, known.stdout
    assert run().returncode == 1  # without --skip-failed a failure is still a failure
