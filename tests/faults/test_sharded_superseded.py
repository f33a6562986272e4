"""Superseded parts are reclaimed, and nothing a reader reads goes with them.

Before issue 34, two ``spcache precompute`` runs into one sharded destination (runs into
a snapshot take no claims) left every sample both computed twice for good: 12 of 24 and
24 of 24 in the attack run. Readers read one copy of each; the other parts were never
deleted. Now ``spcache merge DEST --remove-superseded`` deletes a committed part once
none of its records is the copy readers read, and that has lasted longer than
``--orphan-age`` (:mod:`cache_store.snapshot.sharded.superseded`).

The first test does what users do, in a subprocess from a fresh directory, on a
directory and on moto's S3 server: run B is held (SIGSTOP) once it has admitted its
samples, run A computes and commits them, B goes on and commits them again; then the
documented reclaim. The others pin the rules with two writers of their own.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from cache_store.snapshot.sharded import ShardedSnapshot, superseded_parts
from cache_store.testing import contract_record
from tests.data import corpus
from tests.helpers.faults import report
from tests.helpers.local_cache import FP
from tests.helpers.procs import run_spcache, start_spcache, tree, wait_for
from tests.helpers.s3 import S3Server, moto_s3, snapshot_destination
from tests.helpers.sharded_writers import HeldWriter


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_s3() as server:
        yield server


@pytest.fixture(params=["local", "s3"])
def dest(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    return snapshot_destination(request, tmp_path)


def _listing(location: str, options: dict[str, Any]) -> dict[str, int]:
    """Every file under the snapshot (path below it -> bytes), as ``ls -R`` or a bucket
    listing shows it."""
    with ShardedSnapshot(location, storage_options=options) as snap:
        found = snap.fs.find(snap.root, detail=True)
        return {
            str(name)[len(snap.root) + 1 :]: int(info["size"])
            for name, info in found.items()
            if info.get("type") != "directory"
        }


def _copies(location: str, options: dict[str, Any], fingerprint: str) -> Counter[str]:
    """How many committed manifests list each sample id."""
    counts: Counter[str] = Counter()
    with ShardedSnapshot(location, storage_options=options) as snap:
        for part in snap.commit_names(fingerprint):
            raw = snap.fs.cat_file(snap.path(fingerprint, "commits", f"{part}.json"))
            counts.update(row[0] for row in json.loads(raw)["records"])
    return counts


def _records(location: str, options: dict[str, Any], fingerprint: str) -> dict[str, Any]:
    """Every sample's record as a reader reads it: ``{id: {field: tensor}}``."""
    with ShardedSnapshot(location, storage_options=options) as snap:
        ids = snap.get_index(fingerprint).sample_ids.tolist()
        return {sid: dict(snap.get_record(f"{fingerprint}/{sid}").tensors) for sid in ids}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        a[sid].keys() == b[sid].keys() and all(a[sid][f].equal(b[sid][f]) for f in a[sid])
        for sid in a
    )


def _merge(location: str, cwd: Path, *more: str) -> dict[str, Any]:
    done = run_spcache("merge", location, "--remove-superseded", *more, "--json", cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout))


@pytest.mark.slow
def test_two_runs_into_one_destination_then_merge_reclaims_the_duplicates(
    dest: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    location, options = dest
    sources = tmp_path / "shapes"
    shutil.copytree(corpus.ensure() / "meshes", sources)
    work = tmp_path / "fresh"
    work.mkdir()
    run = (
        "precompute",
        str(sources),
        "--recipe",
        "spc_query",
        "--param",
        "level=6",
        "--cache",
        location,
        "--json",
    )
    # B admits every sample (none committed yet), then is held; A commits them; B goes on
    with start_spcache(*run, cwd=work) as b:
        wait_for(lambda: len(tree(b.pid)) > 1, 120, "run B's loaders (it has admitted)", proc=b)
        held = tree(b.pid)
        for p in held:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGSTOP)
        try:
            a = run_spcache(*run, cwd=work)
        finally:
            for p in held:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(signal.SIGCONT)
        assert b.wait(300) == 0, b.output()[-3000:]
    assert a.returncode == 0, a.stderr[-3000:]
    summary_a, summary_b = json.loads(a.stdout), json.loads(b.stdout())
    fingerprint = summary_a["fingerprint"]
    samples = summary_a["done"] + summary_a["skipped"]
    copies = _copies(location, options, fingerprint)
    twice = sorted(sid for sid, n in copies.items() if n > 1)
    before = _listing(location, options)
    parts_before = {p: n for p, n in before.items() if "/parts/" in p}
    records_before = _records(location, options, fingerprint)

    young = _merge(location, work)  # the default age: superseded a moment ago, kept
    assert young["superseded_removed"] == {}
    assert _stored(_listing(location, options)) == _stored(before)

    reclaimed = _merge(location, work, "--orphan-age", "0")
    after = _listing(location, options)
    parts_after = {p: n for p, n in after.items() if "/parts/" in p}
    records_after = _records(location, options, fingerprint)
    verified = run_spcache("verify", "--cache", location, "--json", cwd=work)
    report(
        "34.10c two runs into one destination, then merge --remove-superseded",
        {
            "where": "s3" if options else "local",
            "samples": samples,
            "done_by_a_and_b": [summary_a["done"], summary_b["done"]],
            "committed_twice": len(twice),
            "parts_before": len(parts_before),
            "part_bytes_before": sum(parts_before.values()),
            "parts_after": len(parts_after),
            "part_bytes_after": sum(parts_after.values()),
            "bytes_reclaimed": reclaimed["superseded_bytes"],
            "verify_rc": verified.returncode,
        },
    )
    assert len(twice) >= 1, copies  # B committed again what A had committed
    # B's parts go: a part holds one record or more, as B's writer batched them (several
    # under load), so they are fewer than the samples; then every sample is committed once
    assert len(reclaimed["superseded_removed"]) >= 1
    assert set(_copies(location, options, fingerprint).values()) == {1}  # duplicates gone
    assert len(parts_after) == len(parts_before) - len(reclaimed["superseded_removed"])
    assert sum(parts_before.values()) - sum(parts_after.values()) == reclaimed["superseded_bytes"]
    assert reclaimed["superseded_bytes"] > 0
    assert not any("/commits/" in p and p not in before for p in after)
    assert len(records_after) == samples and _same(records_before, records_after)
    assert verified.returncode == 0, verified.stdout + verified.stderr[-2000:]
    assert json.loads(verified.stdout)["checked"] == samples
    assert _merge(location, work, "--orphan-age", "0")["superseded_removed"] == {}  # idempotent


def _stored(listing: dict[str, int]) -> dict[str, int]:
    """Parts and manifests (``index.json`` is written again by every merge)."""
    return {p: n for p, n in listing.items() if not p.endswith("/index.json")}


def _write(location: str, options: dict[str, Any], *parts: list[tuple[str, int, str]]) -> list[str]:
    """Commit each of ``parts`` (``(sample id, seed, source hash)`` records) as one part,
    in that order; returns the part names."""
    with ShardedSnapshot(location, readonly=False, storage_options=options) as writer:
        for records in parts:
            writer.put_many(
                [
                    (f"{FP}/{sid}", contract_record(FP, sid, seed, source_hash=source))
                    for sid, seed, source in records
                ]
            )
        names = [n for n in writer.commit_names(FP) if n.startswith(f"{writer.writer}-")]
        writer.merge_index(FP)
    return names


def _reads(location: str, options: dict[str, Any]) -> dict[str, Any]:
    with ShardedSnapshot(location, storage_options=options) as snap:
        return {k: dict(snap.get_record(k).tensors) for k in snap.keys(f"{FP}/")}


H1, H2 = "1" * 16, "2" * 16


def test_a_part_with_one_record_still_read_is_kept(dest: tuple[str, dict[str, Any]]) -> None:
    location, options = dest
    first, again, mixed = _write(
        location,
        options,
        [("a", 1, H1), ("b", 2, H1)],
        [("a", 1, H1)],  # a again: superseded by the first commit
        [("b", 2, H1), ("c", 3, H1)],  # b superseded, c read from here only
    )
    before = _reads(location, options)
    assert superseded_parts(location, storage_options=options) == {}  # all younger than 1 h
    taken = superseded_parts(location, storage_options=options, older_than_s=0, remove=True)
    assert [path.rsplit("/", 1)[-1] for path in taken] == [f"{again}.bin"]
    with ShardedSnapshot(location, storage_options=options) as snap:
        assert snap.commit_names(FP) == sorted([first, mixed])
        assert snap.verify().ok
    assert _same(before, _reads(location, options))


def test_a_changed_sources_old_copy_is_reclaimed_and_no_read_ever_moves(
    dest: tuple[str, dict[str, Any]],
) -> None:
    """A source changed and recomputed is read from its later commit, so the earlier
    part goes. And a part whose removal would make readers read another copy stays:
    ``s`` committed from sources H1, H2, H1 is read from the third commit; without the
    second, the first would be read instead (same source hash, committed first)."""
    location, options = dest
    old, new = _write(location, options, [("x", 1, H1)], [("x", 4, H2)])
    taken = superseded_parts(location, storage_options=options, older_than_s=0, remove=True)
    assert [path.rsplit("/", 1)[-1] for path in taken] == [f"{old}.bin"]
    first, second, third = _write(
        location,
        options,
        [("s", 1, H1), ("t", 2, H1)],  # t keeps this part
        [("s", 5, H2)],
        [("s", 6, H1)],
    )
    before = _reads(location, options)
    assert superseded_parts(location, storage_options=options, older_than_s=0, remove=True) == {}
    with ShardedSnapshot(location, storage_options=options) as snap:
        assert snap.commit_names(FP) == sorted([new, first, second, third])
        assert snap.entry_of(f"{FP}/s").part == third  # type: ignore[union-attr]
    assert _same(before, _reads(location, options))


def test_a_part_not_merged_into_the_index_yet_is_kept(dest: tuple[str, dict[str, Any]]) -> None:
    """A reader of ``index.json`` reads the manifests committed after it in commit order:
    taking one of those could change what it reads, so only merged parts go."""
    location, options = dest
    _write(location, options, [("a", 1, H1)])
    with ShardedSnapshot(location, readonly=False, storage_options=options) as writer:
        writer.put_many([(f"{FP}/a", contract_record(FP, "a", 1, source_hash=H1))])  # unmerged
    assert superseded_parts(location, storage_options=options, older_than_s=0) == {}
    with ShardedSnapshot(location, readonly=False, storage_options=options) as writer:
        writer.merge_index(FP)
    assert len(superseded_parts(location, storage_options=options, older_than_s=0)) == 1


def test_a_writer_between_its_part_and_its_manifest_loses_nothing(
    dest: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reclaim runs while a writer has written its part (a again, and c) and not yet
    its manifest: the superseded part goes, the writer's part and claim stay, and once
    it commits every sample reads."""
    location, options = dest
    zero = "0" * 16  # the source hash the held writer's records carry
    _, again = _write(location, options, [("a", 0, zero), ("b", 1, zero)], [("a", 0, zero)])
    writer = HeldWriter(location, options, ["a", "c"])
    writer.start(monkeypatch)
    with ShardedSnapshot(location, storage_options=options) as snap:
        held = sorted(snap.fs.ls(snap.path(FP, "parts"), detail=False, refresh=True))
    taken = superseded_parts(location, storage_options=options, older_than_s=0, remove=True)
    assert [path.rsplit("/", 1)[-1] for path in taken] == [f"{again}.bin"]
    with ShardedSnapshot(location, storage_options=options) as snap:
        left = sorted(snap.fs.ls(snap.path(FP, "parts"), detail=False, refresh=True))
        assert len(left) == len(held) - 1
        assert len(snap.fs.ls(snap.path(FP, "claims"), detail=False, refresh=True)) == 1
    writer.release()
    assert writer.error is None, writer.error
    with ShardedSnapshot(location, storage_options=options) as snap:
        assert sorted(snap.keys()) == [f"{FP}/{sid}" for sid in "abc"]
        assert snap.verify().ok
    assert superseded_parts(location, storage_options=options, older_than_s=0) == {}
