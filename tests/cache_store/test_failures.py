"""The failure log: remembered per (fingerprint, sample id), counted while it repeats."""

from __future__ import annotations

import os
from pathlib import Path

from cache_store.jobs.failures import FAILURES_FILENAME, FailureLog

FP = "0" * 32


def test_nothing_is_created_until_a_failure_is_recorded(tmp_path: Path) -> None:
    log = FailureLog(tmp_path / "cache")
    assert log.get_many(FP, ["a"]) == {}
    log.forget(FP, ["a"])
    assert not (tmp_path / "cache").exists()


def test_a_repeat_counts_and_a_change_of_source_or_reason_starts_again(tmp_path: Path) -> None:
    log = FailureLog(tmp_path)
    first = log.record(FP, "a", "/src/a.obj", "xxh3_128:1", "bad faces")
    assert (first.times, first.reason, first.source_hash) == (1, "bad faces", "xxh3_128:1")
    assert log.record(FP, "a", "/src/a.obj", "xxh3_128:1", "bad faces").times == 2
    assert log.record(FP, "a", "/src/a.obj", "xxh3_128:2", "bad faces").times == 1
    changed = log.record(FP, "a", "/src/a.obj", "xxh3_128:2", "empty")
    assert changed.times == 1 and changed.reason == "empty"
    log.record("f" * 32, "a", "/src/a.obj", "xxh3_128:2", "other recipe")
    assert log.get_many(FP, ["a", "b"])["a"].reason == "empty"
    assert log.get_many("f" * 32, ["a"])["a"].reason == "other recipe"
    log.close()
    assert (tmp_path / FAILURES_FILENAME).is_file()


def test_forget_drops_only_the_given_ids_and_survives_a_reopen(tmp_path: Path) -> None:
    log = FailureLog(tmp_path)
    for i in range(700):  # more than one IN (...) batch
        log.record(FP, f"s{i}", f"/src/{i}.obj", "xxh3_128:0", "bad")
    log.forget(FP, [f"s{i}" for i in range(0, 700, 2)])
    log.close()
    reopened = FailureLog(tmp_path)
    left = reopened.get_many(FP, [f"s{i}" for i in range(700)])
    assert sorted(left) == sorted(f"s{i}" for i in range(1, 700, 2))


def test_a_forked_child_opens_its_own_connection(tmp_path: Path) -> None:
    log = FailureLog(tmp_path)
    log.record(FP, "parent", "/p", "xxh3_128:0", "bad")
    pid = os.fork()
    if pid == 0:  # the child must not use the parent's connection
        try:
            child = log.record(FP, "child", "/c", "xxh3_128:0", "bad")
            os._exit(0 if child.times == 1 and "parent" in log.get_many(FP, ["parent"]) else 1)
        except BaseException:  # noqa: BLE001 - a forked child must never return into pytest
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert set(log.get_many(FP, ["parent", "child"])) == {"parent", "child"}
