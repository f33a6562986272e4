"""``spcache import`` adds to what a cache holds, and copies every good record.

Before issue 34 an import replaced the fingerprint's index with the snapshot's (a cache
of 24 samples showed 8 after importing an 8-sample snapshot, 16 records unreachable),
and one damaged record stopped the whole import (0 of 24 copied, every time). Now the
index is the cache's ids, then the snapshot's new ones, and a bad record is named and
left out (exit 1), as ``verify`` names it, while the others are copied and indexed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cache_store.format.index import DatasetIndex
from cache_store.recipes.registry import get_recipe_spec
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.faults import report
from tests.helpers.local_cache import FP, write_sharded
from tests.helpers.procs import run_spcache
from tests.helpers.synthetic import make_record


def _cache_with(cache: Path, ids: list[str]) -> None:
    spec = get_recipe_spec("spc")
    with LMDBStore(cache, readonly=False) as store:
        store.put_many(
            [(f"{FP}/{sid}", make_record(FP, sid, seed=1000 + n)) for n, sid in enumerate(ids)]
        )
        store.put_index(DatasetIndex(FP, "spc", spec.version, spec.resolve({}), np.array(ids)))


def _indexed(cache: Path) -> list[str]:
    with LMDBStore(cache) as store:
        return list(store.get_index(FP).sample_ids.tolist())


def _flip_one_record(snapshot: Path) -> str:
    """Flip the last byte of the first record of the first committed part; returns its id."""
    commit = sorted((snapshot / FP / "commits").glob("*.json"))[0]
    sample_id, offset, length, _, _ = json.loads(commit.read_text())["records"][0]
    part = snapshot / FP / "parts" / f"{commit.stem}.bin"
    data = bytearray(part.read_bytes())
    data[offset + length - 1] ^= 0xFF
    part.write_bytes(bytes(data))
    return str(sample_id)


def test_import_adds_a_snapshot_to_the_samples_a_cache_holds(tmp_path: Path) -> None:
    held = [f"c{i:04d}" for i in range(24)]
    _cache_with(tmp_path / "hot", held)
    snapshot_ids = write_sharded(str(tmp_path / "snap.zarr"), parts=2, per_part=4)
    imported = run_spcache("import", "snap.zarr", "--cache", "hot", cwd=tmp_path)
    indexed = _indexed(tmp_path / "hot")
    listed = run_spcache("ls", "--cache", "hot", "--json", cwd=tmp_path)
    verified = run_spcache("verify", "--cache", "hot", cwd=tmp_path)
    row = json.loads(listed.stdout)[0]
    figures = {
        "held_before": len(held),
        "snapshot_samples": len(snapshot_ids),
        "import_exit": imported.returncode,
        "indexed_after": len(indexed),
        "records_after": row["records"],
        "verify_exit": verified.returncode,
    }
    report("34.6 import into a cache holding the fingerprint", figures)
    assert imported.returncode == 0, imported.stderr
    assert f"{FP}: 8 copied, 0 already in hot" in imported.stdout
    assert indexed == held + snapshot_ids  # the cache's order first, then the new ids
    assert row["records"] == 32 and row["state"] == "complete"
    assert verified.returncode == 0, verified.stdout
    again = run_spcache("import", "snap.zarr", "--cache", "hot", cwd=tmp_path)
    assert again.returncode == 0 and f"{FP}: 0 copied, 8 already in hot" in again.stdout
    assert _indexed(tmp_path / "hot") == held + snapshot_ids


def test_import_copies_every_good_record_and_names_the_bad_one(tmp_path: Path) -> None:
    snapshot_ids = write_sharded(str(tmp_path / "snap.zarr"), parts=3, per_part=8)
    bad = _flip_one_record(tmp_path / "snap.zarr")
    imported = run_spcache("import", "snap.zarr", "--cache", "fresh", cwd=tmp_path)
    again = run_spcache("import", "snap.zarr", "--cache", "fresh", "--json", cwd=tmp_path)
    indexed = _indexed(tmp_path / "fresh")
    verified = run_spcache("verify", "--cache", "fresh", cwd=tmp_path)
    figures = {
        "snapshot_samples": len(snapshot_ids),
        "damaged": 1,
        "import_exit": imported.returncode,
        "said": [line for line in imported.stdout.splitlines() if bad in line],
        "indexed_after": len(indexed),
        "again": json.loads(again.stdout),
        "verify_exit": verified.returncode,
    }
    report("34.6 import of a snapshot with a damaged record", figures)
    assert imported.returncode == 1, imported.stdout + imported.stderr
    assert f"{FP}: 23 copied, 0 already in fresh, 1 bad" in imported.stdout
    assert figures["said"] and "checksum" in figures["said"][0]
    assert indexed == [sid for sid in snapshot_ids if sid != bad]
    assert again.returncode == 1
    assert figures["again"][FP]["present"] == 23 and list(figures["again"][FP]["bad"]) == [bad]
    assert verified.returncode == 0, verified.stdout
