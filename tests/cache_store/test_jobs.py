"""The SQLite job queue: real SQLite, real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sqlite3
from pathlib import Path

import pytest

from cache_store.errors import JobNotFound
from cache_store.jobs.queue import JOBS_FILENAME, JobQueue, NewItem


def _items(n: int, prefix: str = "s") -> list[NewItem]:
    return [NewItem(f"{prefix}{i:03d}", f"/data/{prefix}{i:03d}.obj") for i in range(n)]


class FakeClock:
    """The queue's clock, moved by the test: lease expiry without sleeping."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def queue(tmp_path: Path, clock: FakeClock) -> JobQueue:
    q = JobQueue(tmp_path, max_attempts=2, clock=clock)
    yield q
    q.close()


def test_constructor_opens_nothing(tmp_path: Path) -> None:
    JobQueue(tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_database_is_in_wal_mode(queue: JobQueue, tmp_path: Path) -> None:
    queue.counts()
    conn = sqlite3.connect(tmp_path / JOBS_FILENAME)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_submit_claim_complete(queue: JobQueue) -> None:
    job_id = queue.submit("spc", {"level": 4}, "f" * 16, _items(5), ready=_items(2, "r"))
    info = queue.job(job_id)
    assert info.status == "running" and info.counts["pending"] == 5 and info.already_ready == 2
    got = queue.claim("w1", limit=3)
    assert [c.sample_id for c in got] == ["s000", "s001", "s002"]
    assert all(c.params == {"level": 4} and c.attempts == 1 for c in got)
    assert queue.job(job_id).counts["running"] == 3
    for c in got:
        assert queue.complete("w1", c.item_id)
    assert not queue.complete("w1", got[0].item_id)  # done once, never twice
    rest = queue.claim("w1", limit=10)
    assert [c.sample_id for c in rest] == ["s003", "s004"]
    for c in rest:
        queue.complete("w1", c.item_id)
    info = queue.job(job_id)
    assert info.status == "done" and info.counts["done"] == 7
    assert queue.claim("w1") == []


def test_priority_then_age_orders_jobs(queue: JobQueue) -> None:
    low = queue.submit("spc", {}, "a" * 16, _items(2, "low"), priority=0)
    high = queue.submit("spc", {}, "b" * 16, _items(2, "high"), priority=5)
    first = queue.claim("w", limit=10)
    assert {c.job_id for c in first} == {high}  # one claim never mixes jobs
    second = queue.claim("w", limit=10)
    assert {c.job_id for c in second} == {low}


def test_expired_lease_is_claimed_again_then_fails_when_out_of_attempts(
    queue: JobQueue, clock: FakeClock
) -> None:
    job_id = queue.submit("spc", {}, "f" * 16, _items(1))
    first = queue.claim("dead", lease_s=0.05)
    assert queue.claim("other") == []  # lease still live
    clock.advance(0.1)
    second = queue.claim("other", lease_s=0.05)
    assert [c.item_id for c in second] == [first[0].item_id] and second[0].attempts == 2
    assert queue.renew("dead", [first[0].item_id]) == set()  # the dead worker lost it
    clock.advance(0.1)
    assert queue.claim("third") == []  # max_attempts=2 spent: failed, not handed out
    info = queue.job(job_id)
    assert info.status == "failed" and "lease expired" in info.errors[0].error


def test_the_leases_of_a_dead_worker_are_handed_back_at_once_attempt_counted(
    queue: JobQueue,
) -> None:
    job_id = queue.submit("spc", {}, "f" * 16, _items(2))
    host = socket.gethostname()
    first = queue.claim(f"{host}:4000001", lease_s=120)  # a worker's default id: host:pid
    assert queue.claim("someone-else", lease_s=120) == []
    assert queue.expire_leases_of(4000001, "the worker died holding it (SIGKILL)") == 2
    again = queue.claim(f"{host}:4000002", lease_s=120)  # at once, not 120 s later
    assert [c.item_id for c in again] == [c.item_id for c in first]
    assert [c.attempts for c in again] == [2, 2]  # the dead worker's attempt counted
    assert queue.expire_leases_of(4000001, "again") == 0  # it holds nothing now
    # the second worker dies too: out of attempts (2), failed with the reason
    assert queue.expire_leases_of(4000002, "the worker died holding it (SIGSEGV)") == 2
    assert queue.claim("third") == []
    info = queue.job(job_id)
    assert info.status == "failed"
    assert "SIGSEGV" in info.errors[0].error and "lease expired" in info.errors[0].error


def test_fail_retries_then_fails_with_its_error(queue: JobQueue) -> None:
    job_id = queue.submit("spc", {}, "f" * 16, _items(1))
    (c,) = queue.claim("w")
    assert queue.fail("w", c.item_id, "cuda hiccup") == "pending"
    (c,) = queue.claim("w")
    assert queue.fail("w", c.item_id, "cuda hiccup again") == "failed"
    info = queue.job(job_id)
    assert info.errors[0].error == "cuda hiccup again" and info.errors[0].attempts == 2


def test_permanent_failure_is_not_retried(queue: JobQueue) -> None:
    job_id = queue.submit("spc", {}, "f" * 16, _items(1))
    (c,) = queue.claim("w")
    assert queue.fail("w", c.item_id, "x.obj: no faces", permanent=True) == "failed"
    assert queue.job(job_id).counts["failed"] == 1


def test_fail_by_a_worker_that_lost_the_lease_changes_nothing(
    queue: JobQueue, clock: FakeClock
) -> None:
    queue.submit("spc", {}, "f" * 16, _items(1))
    (c,) = queue.claim("old", lease_s=0.01)
    clock.advance(0.05)
    queue.claim("new")
    assert queue.fail("old", c.item_id, "late") == "running"


def test_release_returns_items_without_spending_attempts(queue: JobQueue) -> None:
    job_id = queue.submit("spc", {}, "f" * 16, _items(3))
    got = queue.claim("w", limit=3)
    assert queue.release("w", [c.item_id for c in got]) == 3
    again = queue.claim("w", limit=3)
    assert all(c.attempts == 1 for c in again)
    assert queue.job(job_id).counts["running"] == 3


def test_cancel_stops_pending_items_running_ones_finish(queue: JobQueue) -> None:
    job_id = queue.submit("spc", {}, "f" * 16, _items(4))
    (c,) = queue.claim("w", limit=1)
    info = queue.cancel(job_id)
    assert info.counts["cancelled"] == 3 and info.counts["running"] == 1
    assert queue.claim("w") == []
    queue.complete("w", c.item_id)
    info = queue.job(job_id)
    assert info.status == "cancelled" and info.counts["done"] == 1
    assert info.percent == 25.0  # 3 of 4 items were dropped: not 100 %


def test_release_after_cancel_cancels(queue: JobQueue) -> None:
    job_id = queue.submit("spc", {}, "f" * 16, _items(1))
    (c,) = queue.claim("w")
    queue.cancel(job_id)
    queue.release("w", [c.item_id])
    assert queue.job(job_id).counts["cancelled"] == 1


def test_same_key_in_two_jobs_is_not_held_twice(queue: JobQueue) -> None:
    queue.submit("spc", {}, "f" * 16, _items(1))
    queue.submit("spc", {}, "f" * 16, _items(1))
    first = queue.claim("a")
    assert len(first) == 1
    assert queue.claim("b") == []  # same fingerprint + sample id is running under a live lease


def test_unknown_job(queue: JobQueue) -> None:
    with pytest.raises(JobNotFound):
        queue.job("nope")
    with pytest.raises(JobNotFound):
        queue.cancel("nope")


def test_errors_are_paged_and_jobs_listed_newest_first(queue: JobQueue, clock: FakeClock) -> None:
    job_id = queue.submit("spc", {}, "f" * 16, _items(5))
    for c in queue.claim("w", limit=5):
        queue.fail("w", c.item_id, f"bad {c.sample_id}", permanent=True)
    page = queue.job(job_id, errors_offset=2, errors_limit=2).errors
    assert [e.sample_id for e in page] == ["s002", "s003"]
    clock.advance(0.01)
    newer = queue.submit("spc", {}, "g" * 16, _items(1))
    assert [j.id for j in queue.jobs()] == [newer, job_id]
    assert queue.counts() == {"pending": 1, "running": 0, "done": 0, "failed": 5, "cancelled": 0}


def _claim_all(cache: str, worker: str, out: mp.Queue[list[str]]) -> None:
    q = JobQueue(cache)
    mine: list[str] = []
    while batch := q.claim(worker, limit=3):
        for c in batch:
            mine.append(c.sample_id)
            q.complete(worker, c.item_id)
    out.put(mine)
    q.close()


@pytest.mark.slow
def test_concurrent_workers_never_share_an_item(tmp_path: Path) -> None:
    q = JobQueue(tmp_path)
    job_id = q.submit("spc", {}, "f" * 16, _items(200))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claim_all, args=(str(tmp_path), f"w{i}", out)) for i in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    claimed = [s for r in results for s in r]
    assert sorted(claimed) == sorted(f"s{i:03d}" for i in range(200))  # each once, none lost
    assert q.job(job_id).counts["done"] == 200
    q.close()


def test_a_forked_child_opens_its_own_connection(tmp_path: Path) -> None:
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    q = JobQueue(tmp_path)
    job_id = q.submit("spc", {}, "f" * 16, _items(2))
    parent_conn = q.connection()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_claims, args=(q, out))
    child.start()
    child_result = out.get(timeout=30)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert child_result == (True, 1)  # a different connection object, and it worked
    assert q.connection() is parent_conn  # the parent's own connection is untouched and usable
    assert q.job(job_id).counts == {
        "pending": 1,
        "running": 0,
        "done": 1,
        "failed": 0,
        "cancelled": 0,
    }
    q.close()


def _child_claims(q: JobQueue, out: mp.Queue[tuple[bool, int]]) -> None:
    inherited = q._conns.process._value.all[0]  # the parent's connection, as the fork copied it
    got = q.claim("child", limit=1)
    for c in got:
        q.complete("child", c.item_id)
    out.put((q.connection() is not inherited, len(got)))


def test_ready_items_are_counted_done_not_queued(queue: JobQueue) -> None:
    job_id = queue.submit("spc", {}, "f" * 16, _items(2), ready=_items(3, "r"))
    info = queue.job(job_id)
    assert info.already_ready == 3 and info.counts["done"] == 3 and info.counts["pending"] == 2
    assert {c.sample_id for c in queue.claim("w", limit=10)} == {"s000", "s001"}


def test_an_expired_lease_of_a_cancelled_job_is_not_claimed_again(
    queue: JobQueue, clock: FakeClock
) -> None:
    job_id = queue.submit("spc", {}, "f" * 16, _items(1))
    queue.claim("dead", lease_s=0.01)
    queue.cancel(job_id)
    clock.advance(0.05)
    assert queue.claim("other") == []
    assert queue.job(job_id).counts["cancelled"] == 1 and queue.job(job_id).status == "cancelled"


def test_progress_from_queue_timestamps(queue: JobQueue, clock: FakeClock) -> None:
    job_id = queue.submit("spc", {}, "f" * 16, _items(6), ready=_items(2, "r"))
    info = queue.job(job_id)
    assert (info.total, info.percent, info.samples_per_s, info.eta_s) == (8, 25.0, None, None)
    clock.advance(10.0)
    done = queue.claim("w", limit=3)
    for c in done[:2]:
        queue.complete("w", c.item_id)
    queue.fail("w", done[2].item_id, "bad", permanent=True)  # settled too
    info = queue.job(job_id)
    # 3 items settled by the worker in the 10 s since submission (ready ones not counted)
    assert info.percent == 62.5 and info.samples_per_s == 0.3
    assert info.eta_s == 10.0  # 3 left at 0.3/s
    listed = queue.jobs()[0].as_json()
    assert {k: listed[k] for k in ("total", "percent", "samples_per_s", "eta_s")} == {
        "total": 8,
        "percent": 62.5,
        "samples_per_s": 0.3,
        "eta_s": 10.0,
    }
    clock.advance(5.0)
    for c in queue.claim("w", limit=3):
        queue.complete("w", c.item_id)
    info = queue.job(job_id)
    assert (info.percent, info.samples_per_s, info.eta_s) == (100.0, 0.4, 0.0)


def test_job_states_tell_done_with_errors_from_failed(queue: JobQueue) -> None:
    mixed = queue.submit("spc", {}, "a" * 16, _items(3))
    claimed = queue.claim("w", limit=3)
    queue.complete("w", claimed[0].item_id)
    queue.complete("w", claimed[1].item_id)
    queue.fail("w", claimed[2].item_id, "bad mesh", permanent=True)
    all_bad = queue.submit("spc", {}, "b" * 16, _items(2))
    for c in queue.claim("w", limit=2):
        queue.fail("w", c.item_id, "bad mesh", permanent=True)
    clean = queue.submit("spc", {}, "c" * 16, _items(1))
    queue.complete("w", queue.claim("w")[0].item_id)
    assert queue.job(mixed).status == "done_with_errors"
    assert queue.job(all_bad).status == "failed"
    assert queue.job(clean).status == "done"
    # the list carries the errors of a job with failures, not an empty list
    listed = {j.id: j for j in queue.jobs(errors_limit=10)}
    assert [e.error for e in listed[mixed].errors] == ["bad mesh"]
    assert len(listed[all_bad].errors) == 2 and listed[clean].errors == []
    assert listed[mixed].as_json()["status"] == "done_with_errors"


def test_a_version_1_queue_is_migrated_and_its_jobs_claim_with_no_roots(tmp_path: Path) -> None:
    import sqlite3

    from cache_store.jobs.db import SCHEMA

    old = SCHEMA.replace(",\n    roots         TEXT NOT NULL DEFAULT '[]'", "").replace(
        ",\n    variants      INTEGER NOT NULL DEFAULT 1", ""
    )
    assert "roots" not in old and "variants" not in old
    conn = sqlite3.connect(tmp_path / "jobs.sqlite")
    conn.executescript(old)
    conn.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    conn.execute(
        "INSERT INTO jobs (id, recipe, params, fingerprint, priority, created) "
        "VALUES ('j1', 'spc', '{}', ?, 0, 1.0)",
        ("f" * 32,),
    )
    conn.execute(
        "INSERT INTO items (job_id, seq, fingerprint, sample_id, path, status, "
        "updated) VALUES ('j1', 0, ?, 's', '/x/s.obj', 'pending', 1.0)",
        ("f" * 32,),
    )
    conn.commit()
    conn.close()
    queue = JobQueue(tmp_path)
    [claimed] = queue.claim("w")
    assert claimed.job_id == "j1" and claimed.roots == ()
    new = queue.submit("spc", {}, "f" * 32, [("t", "/x/t.obj")], roots=[tmp_path])
    queue.complete("w", claimed.item_id)
    [later] = queue.claim("w")
    assert later.job_id == new and later.roots == (os.path.realpath(tmp_path),)
    assert claimed.variants == later.variants == 1  # a job from before variants asks for one
    queue.close()
