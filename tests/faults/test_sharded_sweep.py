"""The orphan sweep never takes a part a live writer is writing.

Before issue 34, ``spcache merge --remove-orphans --orphan-age 0`` during a write
deleted the writer's part between its bytes and its manifest: the manifest was then
committed over nothing and its samples failed to read (3 of 24 in the attack run). Now
a writer holds a claim on each part while it writes it (``<fp>/claims/<part>.json``,
rewritten while it writes: :mod:`cache_store.snapshot.sharded.claims`), and the sweep
leaves a claimed part alone while the claim is fresh; a dead writer's stale claim and
its part are swept.

The writer here is a real :class:`ShardedSnapshot` writing to a directory and to moto's
S3 server, held between its part and its manifest (the one moment the sweep could take
it) while ``spcache merge --remove-orphans --orphan-age 0`` runs as a subprocess.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_store.errors import SpcacheError
from cache_store.snapshot.sharded import ShardedSnapshot, claims, orphan_parts
from tests.helpers.faults import report
from tests.helpers.local_cache import FP
from tests.helpers.procs import run_spcache
from tests.helpers.s3 import S3Server, moto_s3, snapshot_destination
from tests.helpers.sharded_writers import HeldWriter
from tests.helpers.synthetic import make_record


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_s3() as server:
        yield server


@pytest.fixture(params=["local", "s3"])
def dest(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    return snapshot_destination(request, tmp_path)


def _listed(store: ShardedSnapshot, *parts: str) -> list[str]:
    try:
        return list(store.fs.ls(store.path(*parts), detail=False, refresh=True))
    except FileNotFoundError:
        return []


def _sweep(location: str) -> dict[str, Any]:
    done = run_spcache("merge", location, "--remove-orphans", "--orphan-age", "0", "--json")
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return dict(json.loads(done.stdout))


def test_a_part_being_written_is_never_an_orphan(
    dest: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    location, options = dest
    with ShardedSnapshot(location, readonly=False, storage_options=options) as first:
        first.put_many([(f"{FP}/old", make_record(FP, "old", seed=99))])  # the fingerprint
    ids = [f"s{i:02d}" for i in range(24)]
    writer = HeldWriter(location, options, ids)
    writer.start(monkeypatch)
    store = ShardedSnapshot(location, storage_options=options)
    parts_during = _listed(store, FP, "parts")
    claimed = _listed(store, FP, "claims")
    swept = _sweep(location)
    writer.release()
    assert writer.error is None, writer.error
    with ShardedSnapshot(location, storage_options=options) as reader:
        readable = 0
        for sid in ids:
            try:
                reader.get_record(f"{FP}/{sid}")
                readable += 1
            except (SpcacheError, OSError) as exc:  # what a reader of a swept part meets
                print(f"{sid}: {exc}")
        verified = reader.verify()
        claims_left = _listed(reader, FP, "claims")
    report(
        "34.10b the sweep during a write",
        {
            "where": "s3" if options else "local",
            "parts_while_held": len(parts_during),
            "claims_while_held": len(claimed),
            "orphans_swept": swept["orphans"],
            "readable_after": f"{readable}/{len(ids)}",
            "verify_ok": verified.ok,
        },
    )
    assert swept["orphans"] == []
    assert readable == len(ids)
    assert verified.ok and verified.checked == len(ids) + 1, verified.as_json()
    assert len(claimed) == 1  # the writer's claim on the part it is writing
    assert claims_left == []  # deleted once the part was committed
    store.close()


def test_a_dead_writers_claim_and_part_are_swept(
    dest: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that dies between its part and its manifest leaves a claim nobody
    refreshes: once stale, the part and the claim are orphans."""
    location, options = dest
    with ShardedSnapshot(location, readonly=False, storage_options=options) as first:
        first.put_many([(f"{FP}/old", make_record(FP, "old", seed=99))])
    writer = HeldWriter(location, options, ["a", "b"])
    writer.start(monkeypatch)
    store = ShardedSnapshot(location, storage_options=options)
    assert orphan_parts(location, storage_options=options, older_than_s=0) == []
    monkeypatch.setattr(claims, "CLAIM_FRESH_S", 0.0)  # as if its writer died long ago
    found = orphan_parts(location, storage_options=options, older_than_s=0, remove=True)
    names = sorted(path.rsplit("/", 2)[-2] for path in found)
    assert names == ["claims", "parts"], found
    writer.release(commit=False)  # it never commits
    assert isinstance(writer.error, RuntimeError)
    assert orphan_parts(location, storage_options=options, older_than_s=0) == []
    with ShardedSnapshot(location, storage_options=options) as reader:
        assert list(reader.keys()) == [f"{FP}/old"] and reader.verify().ok
    store.close()
