"""ls / rm / prune / compact on real LMDB caches (cache_store.housekeeping)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache_store import housekeeping as hk
from cache_store import usage
from cache_store.errors import FingerprintLookupError, FingerprintRemoved, RecordNotFound
from cache_store.jobs.failures import FailureLog
from cache_store.jobs.queue import JobQueue
from cache_store.recipes.registry import get_recipe_spec
from cache_store.format.index import DatasetIndex
from cache_store.stores.lmdb import LMDBStore
from spcache.cli import main
from tests.helpers.synthetic import fingerprint_of, make_record


def fill(cache: Path, level: int, n: int = 20, *, points: int = 400, index: bool = True) -> str:
    """``n`` records (and the index) of the ``spc`` recipe at ``level``; its fingerprint."""
    spec = get_recipe_spec("spc")
    params = spec.resolve({"level": level})
    fp = fingerprint_of("spc", level=level)
    ids = [f"s{i:03d}" for i in range(n)]
    store = LMDBStore(cache, readonly=False)
    try:
        store.put_many(
            [
                (f"{fp}/{sid}", make_record(fp, sid, seed=i, level=level, num_points=points))
                for i, sid in enumerate(ids)
            ]
        )
        if index:
            store.put_index(DatasetIndex(fp, "spc", spec.version, params, np.array(ids)))
    finally:
        store.close()
    return fp


def set_used(cache: Path, fp: str, when: float) -> None:
    usage.note_read(cache, fp)
    os.utime(cache / usage.USAGE_DIR / f"{fp}.read", (when, when))
    path = cache / usage.USAGE_DIR / f"{fp}.written"
    if path.exists():
        os.utime(path, (when, when))


@pytest.mark.parametrize(
    "text,expected",
    [
        ("123", 123),
        ("500M", 500 << 20),
        ("2G", 2 << 30),
        ("1.5T", int(1.5 * (1 << 40))),
        ("4KiB", 4096),
        ("10kb", 10240),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert hk.parse_size(text) == expected


@pytest.mark.parametrize(
    "size,shown",
    [(0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (235 << 10, "235.0 KiB"), (3 << 30, "3.0 GiB")],
)
def test_format_size_is_one_style_that_parse_size_reads_back(size: int, shown: str) -> None:
    assert hk.format_size(size) == shown
    assert hk.parse_size(shown) == size


@pytest.mark.parametrize("text", ["", "2X", "-1", "G", "1.2.3M"])
def test_parse_size_refuses_naming_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        hk.parse_size(text)


def test_parse_duration() -> None:
    assert hk.parse_duration("45s") == 45
    assert hk.parse_duration("12h") == 12 * 3600
    assert hk.parse_duration("30d") == 30 * 86400
    assert hk.parse_duration("2w") == 14 * 86400
    assert hk.parse_duration("12H") == 12 * 3600 and hk.parse_duration("30D") == 30 * 86400
    with pytest.raises(ValueError, match="duration '3 years'"):
        hk.parse_duration("3 years")


def test_ls_rows_exact_bytes_state_and_usage(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = fill(tmp_path, 3)
    b = fill(tmp_path, 4, index=False)
    store = LMDBStore(tmp_path)
    exact = sum(len(store.get(k)) for k in store.keys(a + "/"))
    store.close()
    FailureLog(tmp_path).record(a, "bad", "/x/bad.obj", "h", "broken mesh")
    rows = {r["fingerprint"]: r for r in hk.ls(tmp_path)}
    assert rows[a]["bytes"] == exact and isinstance(rows[a]["bytes"], int)
    assert rows[a]["records"] == 20 and rows[a]["state"] == "complete"
    assert rows[a]["failed"] == 1 and rows[a]["recipe"] == "spc"
    assert rows[a]["last_written"] is not None and rows[a]["last_read"] is None
    assert rows[a]["recipe_changed"] is False
    assert rows[b]["state"] == "unindexed" and rows[b]["recipe"] is None
    assert main(["ls", "--cache", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {r["fingerprint"] for r in listed} == {a, b}
    for row in listed:
        assert {"fingerprint", "recipe", "records", "bytes", "last_read", "last_written"} <= set(
            row
        )
    assert main(["ls", "--cache", str(tmp_path)]) == 0
    assert a in capsys.readouterr().out


def test_ls_partial_against_the_index(tmp_path: Path) -> None:
    a = fill(tmp_path, 3)
    store = LMDBStore(tmp_path, readonly=False)
    store._write(lambda txn, dbs: txn.delete(f"{a}/s005".encode(), db=dbs[b"records"]))
    store.close()
    (row,) = hk.ls(tmp_path)
    assert row["state"] == "partial" and row["indexed"] == 20 and row["records"] == 19


def test_dataset_open_records_last_read_once(tmp_path: Path) -> None:
    from cache_store.readers.dataset import CachedDataset

    a = fill(tmp_path, 3)
    assert usage.last_read(tmp_path, a) is None
    ds = CachedDataset(str(tmp_path), a)
    assert len(ds) == 20
    first = usage.last_read(tmp_path, a)
    assert first is not None
    os.utime(tmp_path / usage.USAGE_DIR / f"{a}.read", (1.0, 1.0))
    for i in range(20):  # reads record nothing: no write per record
        ds[i]
    assert usage.last_read(tmp_path, a) == 1.0


def test_rm_removes_one_and_readers_get_a_clear_error(tmp_path: Path) -> None:
    a, b, c = fill(tmp_path, 3), fill(tmp_path, 4), fill(tmp_path, 5)
    FailureLog(tmp_path).record(b, "bad", "/x/bad.obj", "h", "broken mesh")
    reader = LMDBStore(tmp_path)
    reader.get_record(f"{b}/s001")
    (report,) = hk.rm(tmp_path, [b[:8]])
    assert report["fingerprint"] == b and report["records"] == 20 and report["failures"] == 1
    with pytest.raises(FingerprintRemoved, match=f"fingerprint {b} was removed") as caught:
        reader.get_record(f"{b}/s001")
    assert isinstance(caught.value, RecordNotFound)  # code that handles a miss handles this
    with pytest.raises(FingerprintRemoved):
        reader.get_index(b)
    with pytest.raises(FingerprintRemoved):
        reader.get_records([f"{a}/s000", f"{b}/s000"])
    assert reader.get_record(f"{a}/s000").metadata["sample_id"] == "s000"
    assert list(reader.keys(b)) == [] and reader.fingerprints() == sorted([a, c])
    assert reader.verify().ok
    reader.close()
    assert FailureLog(tmp_path).get_many(b, ["bad"]) == {}
    assert {r["fingerprint"] for r in hk.ls(tmp_path)} == {a, c}


def test_rm_refuses_unknown_and_ambiguous_names_before_removing_anything(tmp_path: Path) -> None:
    a = fill(tmp_path, 3)
    with pytest.raises(FingerprintLookupError, match="no such fingerprint"):
        hk.rm(tmp_path, [a, "f" * 32])
    with pytest.raises(FingerprintLookupError, match="not a fingerprint"):
        hk.rm(tmp_path, ["abc"])
    assert [r["fingerprint"] for r in hk.ls(tmp_path)] == [a]  # nothing removed


def test_rm_cli_messages_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = fill(tmp_path, 3)
    assert main(["rm", "0" * 32, "--cache", str(tmp_path)]) == 2
    assert "no such fingerprint" in capsys.readouterr().err
    assert main(["rm", a, "--cache", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["rm", a, "--cache", str(tmp_path)]) == 0
    assert f"removed {a}: 20 records" in capsys.readouterr().out


def test_rm_cancels_queued_items_and_failed_forgets_failures(tmp_path: Path) -> None:
    a, b = fill(tmp_path, 3), fill(tmp_path, 4)
    queue = JobQueue(tmp_path)
    job_a = queue.submit("spc", {"level": 3}, a, [("n1", "/x/n1.obj"), ("n2", "/x/n2.obj")])
    job_b = queue.submit("spc", {"level": 4}, b, [("m1", "/x/m1.obj")])
    (claimed,) = queue.claim("w", limit=1)
    assert claimed.job_id == job_a
    queue.fail("w", claimed.item_id, "broken", permanent=True)
    FailureLog(tmp_path).record(a, claimed.sample_id, "/x/n1.obj", "h", "broken")
    (forgot,) = hk.rm(tmp_path, [a], failed=True)
    assert forgot["failures"] == 1 and forgot["records"] == 0
    assert queue.job(job_a).counts["failed"] == 0
    assert FailureLog(tmp_path).get_many(a, [claimed.sample_id]) == {}
    assert LMDBStore(tmp_path).has(f"{a}/s000")  # records untouched by --failed
    (removed,) = hk.rm(tmp_path, [b])
    assert removed["cancelled"] == 1
    assert queue.job(job_b).counts["cancelled"] == 1 and queue.job(job_b).counts["pending"] == 0
    queue.close()


def test_writes_of_a_removed_fingerprint_are_refused_until_asked_for_again(tmp_path: Path) -> None:
    a = fill(tmp_path, 3)
    asked_before = time.time() - 10
    hk.rm(tmp_path, [a])
    writer = LMDBStore(tmp_path, readonly=False)
    record = make_record(a, "late", seed=1, level=3)
    with pytest.raises(FingerprintRemoved):
        writer.put_many([(f"{a}/late", record)])
    assert not writer.revive(a, asked_before)  # work asked for before the removal stays refused
    with pytest.raises(FingerprintRemoved):
        writer.put_many([(f"{a}/late", record)])
    assert writer.revive(a, time.time())  # asked for again: computed again
    writer.put_many([(f"{a}/late", record)])
    assert writer.get_record(f"{a}/late").metadata["sample_id"] == "late"
    writer.close()


def test_prune_least_recently_used_first(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    fps = [fill(tmp_path, level) for level in (3, 4, 5, 6)]
    now = time.time()
    for age, fp in zip((400, 300, 200, 100), fps, strict=True):  # fps[0] least recently used
        set_used(tmp_path, fp, now - age * 3600)
    sizes = {r["fingerprint"]: r["bytes"] for r in hk.ls(tmp_path)}
    limit = sizes[fps[2]] + sizes[fps[3]]
    plan = hk.prune(tmp_path, max_size=limit, dry_run=True)
    assert [r["fingerprint"] for r in plan["removed"]] == fps[:2]
    assert len(hk.ls(tmp_path)) == 4  # a dry run removes nothing
    assert [
        r["fingerprint"] for r in hk.prune(tmp_path, unused_for="250h", dry_run=True)["removed"]
    ] == fps[:2]
    assert (
        hk.prune(tmp_path, unused_for="250h", keep=3, dry_run=True)["removed"][0]["fingerprint"]
        == fps[0]
    )
    assert main(["prune", "--cache", str(tmp_path), "--max-size", str(limit)]) == 0
    out = capsys.readouterr().out
    assert f"removed {fps[0]}" in out and f"removed {fps[1]}" in out
    assert [r["fingerprint"] for r in hk.ls(tmp_path)] == fps[2:]
    assert LMDBStore(tmp_path).verify().ok


def test_prune_never_removes_queued_work_and_refuses_a_limit_below_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    small, big = fill(tmp_path, 3), fill(tmp_path, 6)
    set_used(tmp_path, big, time.time() - 10 * 86400)  # the least recently used...
    queue = JobQueue(tmp_path)
    queue.submit("spc", {"level": 6}, big, [("more", "/x/more.obj")])  # ...but queued
    queue.close()
    sizes = {r["fingerprint"]: r["bytes"] for r in hk.ls(tmp_path)}
    result = hk.prune(tmp_path, max_size=sizes[big], dry_run=True)
    assert [r["fingerprint"] for r in result["removed"]] == [small]
    with pytest.raises(hk.LimitTooSmall, match=f"smaller than fingerprint {big}"):
        hk.prune(tmp_path, max_size=sizes[big] - 1)
    assert main(["prune", "--cache", str(tmp_path), "--max-size", "1K"]) == 2
    assert "must be kept" in capsys.readouterr().err
    assert len(hk.ls(tmp_path)) == 2
    assert main(["prune", "--cache", str(tmp_path)]) == 2
    assert "at least one of" in capsys.readouterr().err


def test_size_limit_refuses_at_start_and_evicts_lru_but_not_the_one_written(tmp_path: Path) -> None:
    a, b, c = fill(tmp_path, 3), fill(tmp_path, 4), fill(tmp_path, 5)
    sizes = {r["fingerprint"]: r["bytes"] for r in hk.ls(tmp_path)}
    with pytest.raises(hk.LimitTooSmall, match=f"fingerprint {c}"):
        hk.SizeLimit(tmp_path, sizes[c] - 1).check_start()
    now = time.time()
    set_used(tmp_path, c, now - 3000)  # c: least recently used, but being written
    set_used(tmp_path, a, now - 2000)
    set_used(tmp_path, b, now - 1000)
    limit = hk.SizeLimit(tmp_path, sizes[c] + sizes[b])
    limit.check_start()
    assert limit.after_batch(c) == [a]
    assert {r["fingerprint"] for r in hk.ls(tmp_path)} == {b, c}


def test_compact_shrinks_the_file_and_keeps_every_survivor(tmp_path: Path) -> None:
    a, b, c = (fill(tmp_path, level, n=30, points=3000) for level in (4, 5, 6))
    before = (tmp_path / "records" / "data.mdb").stat().st_size
    reader = LMDBStore(tmp_path)
    expected = {key: reader.get(key) for fp in (a, c) for key in reader.keys(fp + "/")}
    (removed,) = hk.rm(tmp_path, [b])
    assert (tmp_path / "records" / "data.mdb").stat().st_size >= before  # LMDB keeps its file
    before = (tmp_path / "records" / "data.mdb").stat().st_size
    sizes = hk.compact(tmp_path)
    after = (tmp_path / "records" / "data.mdb").stat().st_size
    assert sizes == {"before": before, "after": after}
    assert before - after >= removed["bytes"] - 64 * 4096, (before, after, removed)
    assert not (tmp_path / "records.compact").exists()
    time.sleep(1.1)  # the reader notices the swap within a second
    assert {key: reader.get(key) for key in expected} == expected
    with pytest.raises(FingerprintRemoved):  # the tombstone survives compaction
        reader.get(f"{b}/s000")
    reader.close()
    writer = LMDBStore(tmp_path, readonly=False)  # and writers write the new file
    writer.put_many([(f"{a}/new", make_record(a, "new", seed=9, level=4))])
    writer.close()
    fresh = LMDBStore(tmp_path)
    assert fresh.has(f"{a}/new") and fresh.verify().ok
    fresh.close()


def test_snapshots_are_listed_and_never_removed(tmp_path: Path) -> None:
    from cache_store.snapshot.zarr.export import export_snapshot

    a = fill(tmp_path / "cache", 3)
    snap = tmp_path / "a.zarr"
    export_snapshot(str(tmp_path / "cache"), a, str(snap))
    (row,) = hk.ls(snap)
    assert row["fingerprint"] == a and row["records"] == 20 and row["bytes"] > 0
    with pytest.raises(Exception, match="immutable"):
        hk.rm(snap, [a])


def test_worker_refuses_a_limit_below_a_stored_fingerprint(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPCACHE_PARENT_PID", raising=False)
    fp = fill(tmp_path, 4)
    assert main(["worker", "--cache", str(tmp_path), "--max-size", "1K", "--drain"]) == 2
    err = capsys.readouterr().err
    assert "--max-size 1024 bytes" in err and f"fingerprint {fp}" in err
    assert main(["worker", "--cache", str(tmp_path), "--max-size", "lots", "--drain"]) == 2
    assert "size 'lots'" in capsys.readouterr().err


def test_ls_while_a_fingerprint_is_removed_under_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = fill(tmp_path, 3), fill(tmp_path, 4)
    real_summaries = LMDBStore.summaries
    calls = []

    def summaries_then_remove(self: LMDBStore) -> object:
        calls.append(1)
        if len(calls) == 2:  # rm lands between ls's stats and its read of the summaries
            hk.rm(tmp_path, [b])
        return real_summaries(self)

    monkeypatch.setattr(LMDBStore, "summaries", summaries_then_remove)
    rows = {r["fingerprint"]: r for r in hk.ls(tmp_path)}
    assert len(calls) >= 2
    assert rows[a]["state"] == "complete"
    assert b not in rows or rows[b]["state"] == "removing"


def test_rm_failed_clears_a_fingerprint_whose_every_sample_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The run writes no index and no record when its only sample fails: the failure log
    is all that knows the fingerprint, and ``rm --failed`` must still find it."""
    from cache_store.stores.opener import open_store
    from workers.engine import Engine

    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((100, 4)))  # not [N, 3]: a SourceError
    cache = tmp_path / "cache"

    def run() -> Any:
        with open_store(cache, readonly=False) as store:
            return Engine(
                store,
                "spc",
                {"level": 4, "surface_samples": 200},
                device="cpu",
                backend="torch",
                loaders=0,
                skip_failed=True,
            ).run([("bad", str(bad))])

    first = run()
    fp = first.fingerprint
    assert first.failed == 1 and LMDBStore(cache).fingerprints() == []
    (row,) = hk.ls(cache)  # listed: no record, one failure
    assert row["fingerprint"] == fp and row["records"] == 0 and row["failed"] == 1
    assert row["state"] == "failed"
    assert run().errors[0].repeat == "skipped"  # remembered: not retried
    assert main(["rm", "--failed", fp[:8], "--cache", str(cache)]) == 0
    assert f"{fp}: forgot 1 failure(s)" in capsys.readouterr().out
    assert FailureLog(cache).get_many(fp, ["bad"]) == {}
    (error,) = run().errors
    assert error.repeat == ""  # forgotten: tried again
    # plain rm of a failure-only fingerprint forgets its failures, writes no tombstone
    (report,) = hk.rm(cache, [fp])
    assert report["failures"] == 1 and report["records"] == 0
    assert LMDBStore(cache).removals() == {} and hk.ls(cache) == []


def test_rm_cancels_a_fingerprint_known_only_to_the_queue(tmp_path: Path) -> None:
    a = fill(tmp_path, 3)
    queued = fingerprint_of("spc", level=6)
    queue = JobQueue(tmp_path)
    job = queue.submit("spc", {"level": 6}, queued, [("n1", "/x/n1.obj"), ("n2", "/x/n2.obj")])
    (report,) = hk.rm(tmp_path, [queued[:10]])
    assert report["fingerprint"] == queued and report["cancelled"] == 2
    assert queue.job(job).counts["pending"] == 0
    queue.close()
    store = LMDBStore(tmp_path)
    assert store.removals() == {} and store.fingerprints() == [a]  # store untouched
    store.close()


def test_a_fully_removed_fingerprint_is_no_longer_known(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    a, b = fill(tmp_path, 3), fill(tmp_path, 4)
    queue = JobQueue(tmp_path)
    queue.submit("spc", {"level": 3}, a, [("n1", "/x/n1.obj")])
    (running,) = queue.claim("w", limit=1)
    hk.rm(tmp_path, [a])
    # the item in flight: its write is refused by the removal, and it fails
    queue.fail("w", running.item_id, f"fingerprint {a} was removed", permanent=True)
    queue.close()
    assert [r["fingerprint"] for r in hk.ls(tmp_path)] == [b]  # not back as "failed"
    with pytest.raises(FingerprintLookupError, match=f"{a} was already removed") as caught:
        hk.rm(tmp_path, [a])
    assert a not in str(caught.value).split("fingerprints here:")[1]
    assert caught.value.candidates == [b]
    assert main(["rm", a, "--cache", str(tmp_path)]) == 2
    assert "already removed" in capsys.readouterr().err
    # a prefix shared with a removed fingerprint names the survivor alone
    twins = ["abcdef" + "0" * 26, "abcdef" + "1" * 26]
    store = LMDBStore(tmp_path, readonly=False)
    store.put_many([(f"{fp}/s0", make_record(fp, "s0", seed=1, level=3)) for fp in twins])
    store.close()
    hk.rm(tmp_path, [twins[0]])
    assert hk.rm(tmp_path, ["abcdef"])[0]["fingerprint"] == twins[1]
    # a killed rm (tombstone, records left) is still known, and finished by a re-run
    store = LMDBStore(tmp_path, readonly=False)
    store.mark_removed(b)
    store.close()
    (report,) = hk.rm(tmp_path, [b])
    assert report["records"] == 20


def test_prune_keep_alone_keeps_the_most_recently_used_and_removes_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    fps = [fill(tmp_path, level) for level in (3, 4, 5)]
    now = time.time()
    for age, fp in zip((300, 100, 200), fps, strict=True):  # fps[1] most recently used
        set_used(tmp_path, fp, now - age * 3600)
    assert main(["prune", "--cache", str(tmp_path), "--keep", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would remove {fps[0]}" in out and f"would remove {fps[2]}" in out
    assert fps[1] not in out and "2 fingerprint(s) would remove" in out
    assert len(hk.ls(tmp_path)) == 3
    assert main(["prune", "--cache", str(tmp_path), "--keep", "1"]) == 0
    out = capsys.readouterr().out
    assert out.index(f"removed {fps[0]}") < out.index(f"removed {fps[2]}")  # LRU first
    assert [r["fingerprint"] for r in hk.ls(tmp_path)] == [fps[1]]


def test_prune_refuses_a_max_size_the_kept_fingerprints_exceed_together(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Each of 3 fits the limit alone; the 2 that --keep keeps do not fit together: the
    prune used to remove the third and end over the limit with exit 0."""
    fps = [fill(tmp_path, level) for level in (3, 4, 5)]
    now = time.time()
    for age, fp in zip((300, 200, 100), fps, strict=True):
        set_used(tmp_path, fp, now - age * 3600)
    sizes = {r["fingerprint"]: r["bytes"] for r in hk.ls(tmp_path)}
    limit = int(1.45 * max(sizes.values()))
    assert sizes[fps[1]] + sizes[fps[2]] > limit
    with pytest.raises(hk.LimitTooSmall, match="2 fingerprints that must be kept"):
        hk.prune(tmp_path, max_size=limit, keep=2, dry_run=True)
    args = ["prune", "--cache", str(tmp_path), "--max-size", str(limit), "--keep", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert fps[1] in err and fps[2] in err and f"{sizes[fps[2]]} bytes" in err
    assert "smaller --keep" in err
    assert len(hk.ls(tmp_path)) == 3  # nothing removed


def test_ls_says_when_records_were_computed_by_other_recipe_code(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from cache_store.format.encode import encode_record
    from cache_store.recipes.registry import installed_code_digest
    from tests.helpers.synthetic import record_metadata, spc_fields

    installed = installed_code_digest("spc")
    assert installed is not None
    spec = get_recipe_spec("spc")
    fps = {}
    for level, digest in ((3, installed), (4, "0" * 16)):
        fp = fingerprint_of("spc", level=level)
        meta = {**record_metadata(fp, "s0"), "code_digest": digest}
        store = LMDBStore(tmp_path, readonly=False)
        store.put_many([(f"{fp}/s0", encode_record(spc_fields(1, level=level), meta))])
        store.put_index(
            DatasetIndex(fp, "spc", spec.version, spec.resolve({"level": level}), np.array(["s0"]))
        )
        store.close()
        fps[digest] = fp
    bare = fill(tmp_path, 5, n=2)  # records without a digest: cannot tell
    rows = {r["fingerprint"]: r for r in hk.ls(tmp_path)}
    assert rows[fps[installed]]["code_changed"] is False
    assert rows[fps["0" * 16]]["code_changed"] is True
    assert rows[bare]["code_changed"] is None
    assert all(r["recipe_changed"] is False for r in rows.values())  # same version
    assert main(["ls", "--cache", str(tmp_path)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "(code changed)" in lines[fps["0" * 16]]
    assert "changed" not in lines[fps[installed]] and "changed" not in lines[bare]


def test_fingerprint_removed_survives_forked_dataloader_workers(tmp_path: Path) -> None:
    """torch re-raises a worker's error in the main process as ``cls(message)``: the
    fingerprint and the message must come out whole, not the traceback in their place."""
    import pickle

    from torch.utils.data import DataLoader

    from cache_store import CachedDataset

    keep, gone = fill(tmp_path, 3, n=8), fill(tmp_path, 4, n=8)
    dataset = CachedDataset(str(tmp_path), gone)
    assert len(dataset) == 8  # its index read before the removal: the workers meet it
    hk.rm(tmp_path, [gone])
    loader = DataLoader(
        dataset, batch_size=2, num_workers=2, multiprocessing_context="fork", collate_fn=list
    )
    with pytest.raises(FingerprintRemoved) as caught:
        next(iter(loader))
    error = caught.value
    assert error.fingerprint == gone and error.key.startswith(f"{gone}/")
    assert isinstance(error, RecordNotFound)
    text = str(error)
    assert f"fingerprint {gone} was removed" in text
    assert "fingerprint Caught" not in text and text.count("was removed") == 1
    # pickled whole (a process pool), every field kept
    direct = FingerprintRemoved(gone, str(tmp_path), 1.0e9, key=f"{gone}/s001")
    again = pickle.loads(pickle.dumps(direct))
    assert (again.fingerprint, again.cache, again.removed_at, again.key) == (
        gone,
        str(tmp_path),
        1.0e9,
        f"{gone}/s001",
    )
    assert str(again) == str(direct)
    # the other fingerprint reads on through the same kind of loader
    survivors = DataLoader(
        CachedDataset(str(tmp_path), keep),
        batch_size=4,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=list,
    )
    assert sum(len(batch) for batch in survivors) == 8
