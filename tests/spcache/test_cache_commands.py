"""verify / stats / export / recipes: the CPU-side commands, as real processes."""

from __future__ import annotations

import json
from pathlib import Path

from cache_store.jobs.failures import FailureLog
from cache_store.jobs.queue import JobQueue, NewItem
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.index import DatasetIndex
from spcache.cli import resolve, subcommand_parser
from tests.helpers.procs import run_spcache
from tests.helpers.synthetic import fingerprint_of, make_record


def _cache_with_failures(root: Path) -> str:
    fp = fingerprint_of("spc", level=4)
    with LMDBStore(root, readonly=False) as store:
        store.put_many([(f"{fp}/s{i}", make_record(fp, f"s{i}", i)) for i in range(2)])
        store.put_index(
            DatasetIndex(fp, "spc", 1, {"level": 4, "surface_samples": 100000}, ["s0", "s1"])
        )
    queue = JobQueue(root, max_attempts=1)
    try:
        queue.submit(
            "spc",
            {"level": 4, "surface_samples": 100000},
            fp,
            [
                NewItem("bad1", "/data/bad1.obj"),
                NewItem("bad2", "/data/bad2.ply"),
                NewItem("good", "/data/good.obj"),
            ],
        )
        claimed = {c.sample_id: c for c in queue.claim("w", limit=3)}
        queue.fail("w", claimed["bad1"].item_id, "bad1.obj: file is empty", permanent=True)
        queue.fail("w", claimed["bad2"].item_id, "bad2.ply: no vertices", permanent=True)
        queue.complete("w", claimed["good"].item_id)
    finally:
        queue.close()
    return fp


def test_stats_lists_failed_samples_with_their_reasons(tmp_path: Path) -> None:
    fp = _cache_with_failures(tmp_path)
    # a precompute failure, remembered in the failure log (not the queue)
    FailureLog(tmp_path).record(fp, "bad3", "/data/bad3.stl", "h3", "bad3.stl: not a mesh")
    out = run_spcache("stats", "--cache", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    failed = data["fingerprints"][fp]["failed"]
    assert failed["count"] == 3 and data["failed"] == 3
    assert sorted((f["id"], f["path"], f["reason"]) for f in failed["items"]) == [
        ("bad1", "/data/bad1.obj", "bad1.obj: file is empty"),
        ("bad2", "/data/bad2.ply", "bad2.ply: no vertices"),
        ("bad3", "/data/bad3.stl", "bad3.stl: not a mesh"),
    ]
    assert all(f["when"].endswith("Z") for f in failed["items"])
    (job,) = data["fingerprints"][fp]["jobs"]
    assert job["status"] == "done_with_errors" and job["counts"] == {"done": 1, "failed": 2}
    text = run_spcache("stats", "--cache", str(tmp_path)).stdout
    # grouped per fingerprint: the block of fp holds its job and its failures
    block = text.split(f"fingerprint {fp}")[1]
    assert "done with errors" in block and "failed   3" in block
    assert "bad2  /data/bad2.ply" in block and "bad2.ply: no vertices" in block
    assert "- id:" not in text and "- job:" not in text


def test_stats_of_a_cache_without_a_queue_creates_none(tmp_path: Path) -> None:
    fp = fingerprint_of("spc", level=4)
    with LMDBStore(tmp_path, readonly=False) as store:
        store.put_many([(f"{fp}/s0", make_record(fp, "s0", 0))])
    out = run_spcache("stats", "--cache", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["failed"] == 0 and data["fingerprints"][fp]["failed"] == {"count": 0, "items": []}
    assert not (tmp_path / "jobs.sqlite").exists() and not (tmp_path / "failures.sqlite").exists()


def test_export_compression_level_is_clevel_and_level_stays_a_hidden_alias() -> None:
    parser = subcommand_parser("export", resolve("export"))
    base = ["0" * 32, "--cache", "c", "--to", "x.zarr"]
    assert parser.parse_args(base + ["--clevel", "5"]).clevel == 5
    assert parser.parse_args(base + ["--level", "7"]).clevel == 7
    assert parser.parse_args(base).clevel == 3
    helptext = parser.format_help()
    assert "--clevel" in helptext and "--level" not in helptext


def test_demo_level_is_the_octree_level() -> None:
    parser = subcommand_parser("demo", resolve("demo"))
    assert "octree level" in parser.format_help()
    assert "--clevel" not in parser.format_help()
