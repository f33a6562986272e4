"""The stat signature rule (``cache_store.sources.freshness``): what an equal signature
proves, what a record stored before the change time was part of it gets, and when a
signature is too fresh to store."""

from __future__ import annotations

import os
import time
from pathlib import Path

from cache_store.sources.freshness import (
    RACY_S,
    STAT_FIELD,
    HashBudget,
    compare_source,
    same_signature,
    trusted_signature,
)
from cache_store.sources.files import hash_source_file, source_signature


def _old_file(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    past = time.time() - 3600
    os.utime(path, (past, past))


def test_the_signature_holds_the_change_time_that_touch_cannot_put_back(tmp_path: Path) -> None:
    source = tmp_path / "a.bin"
    _old_file(source, b"x" * 64)
    before = source_signature(source)
    mtime = source.stat().st_mtime_ns
    source.write_bytes(b"y" * 64)  # same size
    os.utime(source, ns=(mtime, mtime))  # the mtime put back, as touch -r does
    after = source_signature(source)
    assert before.split(":")[:4] == after.split(":")[:4]  # what the old signature held
    assert not same_signature(before, after)


def test_a_record_signed_without_the_change_time_is_hashed_and_kept_when_equal(
    tmp_path: Path,
) -> None:
    source = tmp_path / "a.bin"
    _old_file(source, b"x" * 64)
    four_fields = ":".join(source_signature(source).split(":")[:4])
    meta = {STAT_FIELD: four_fields, "source_hash": hash_source_file(source)}
    budget = HashBudget(1 << 20)
    seen = compare_source(meta, source, budget=budget)
    assert seen.current is True and budget.hashed == 64  # hashed once, not recomputed
    meta["source_hash"] = "xxh3_128:" + "0" * 32
    assert compare_source(meta, source).current is False


def test_a_signature_is_trusted_only_once_mtime_and_ctime_are_old() -> None:
    now = time.time_ns()
    old, fresh = now - int(10 * RACY_S * 1e9), now - int(RACY_S * 1e9 / 4)
    assert trusted_signature(f"5:{old}:7:8:{old}", now) != ""
    assert trusted_signature(f"5:{old}:7:8:{fresh}", now) == ""  # touched just now
    assert trusted_signature(f"5:{fresh}:7:8:{old}", now) == ""
    assert trusted_signature(f"5:{old}:7:8", now) == ""  # the old form: hashed when checked
    assert not same_signature(None, f"5:{old}:7:8:{old}")
    assert not same_signature("", "")
