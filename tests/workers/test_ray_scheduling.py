"""The Ray engine's parts that need no Ray: the shard buffer, option checks, the retry
policy for shards whose actor died, and the summary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cache_store.engine_options import EngineOptions
from cache_store.errors import RecordNotFound, SourceError, SpcacheError, UsageError
from cache_store.format.index import DatasetIndex
from tests.helpers.synthetic import fingerprint_of, make_record
from tests.helpers.ray_faults import CrashOnce
from workers.ray_common import RemoteError, local_error
from workers.ray_driver import RayRun, Shard
from workers.ray_engine import ActorStats, RayEngine, RaySummary, ShardBuffer
from workers.run_ledger import WorkItem

FP = fingerprint_of("spc")


def _engine(**options) -> RayEngine:
    return RayEngine(ShardBuffer(), "spc", {}, device="cpu", **options)


def _shard(ids: list[str], deaths: int = 0, avoid: set[int] | None = None) -> Shard:
    return Shard([WorkItem(i, f"/data/{i}.obj", f"{FP}/{i}") for i in ids], deaths, avoid or set())


# --- the shard buffer --------------------------------------------------------------------


def test_shard_buffer_hands_each_record_back_once() -> None:
    buffer = ShardBuffer()
    records = [(f"{FP}/s{i}", make_record(FP, f"s{i}", seed=i)) for i in range(3)]
    assert buffer.put_many(records) == 3
    assert buffer.has(f"{FP}/s1") and list(buffer.keys(FP)) == [k for k, _ in records]
    assert buffer.get(f"{FP}/s0") == records[0][1]
    assert buffer.pop(f"{FP}/s0") == records[0][1]
    assert not buffer.has(f"{FP}/s0")
    with pytest.raises(RecordNotFound):
        buffer.pop(f"{FP}/s0")
    with pytest.raises(RecordNotFound):
        buffer.get(f"{FP}/nope")
    buffer.close()
    assert list(buffer.keys()) == []


def test_shard_buffer_checks_keys_like_every_store() -> None:
    buffer = ShardBuffer()
    with pytest.raises(SpcacheError):  # the record names s1, the key says s2
        buffer.put_many([(f"{FP}/s2", make_record(FP, "s1", seed=1))])
    assert list(buffer.keys()) == []


def test_shard_buffer_drops_the_index_the_driver_writes_anyway() -> None:
    buffer = ShardBuffer()
    params = RayEngine(buffer, "spc", {}, device="cpu").params
    buffer.put_index(DatasetIndex(FP, "spc", 1, dict(params), np.array(["a", "b"])))
    with pytest.raises(SpcacheError):
        buffer.get_index(FP)
    assert buffer.fingerprints() == []


# --- options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"device": "cuda:1"}, "use auto, cpu or cuda"),
        ({"actors": 0}, "actors: 0"),
        ({"shard_size": 0}, "shard_size: 0"),
        ({"max_attempts": 0}, "max_attempts: 0"),
        ({"actor_restarts": -1}, "actor_restarts: -1"),
        ({"loaders": -1}, "loaders: -1"),
    ],
)
def test_bad_options_are_refused_before_ray_starts(options: dict, problem: str) -> None:
    options = {"device": "cpu", **options}
    with pytest.raises(UsageError, match=problem):
        RayEngine(ShardBuffer(), "spc", {}, **options)


def test_the_actor_engine_options_are_the_local_engine_options() -> None:
    engine = _engine(
        loaders=3,
        query_chunk=4096,
        min_query_chunk=64,
        prefetch=5,
        backend="torch",
        write_batch=7,
        time_limit_s=30.0,
    )
    assert engine.actor_options() == {
        "device": "cpu",
        "backend": "torch",
        "loaders": 3,
        "query_chunk": 4096,
        "min_query_chunk": 64,
        "write_batch": 7,
        "prefetch": 5,
        "source_roots": None,
        "max_source_bytes": 1 << 30,
        "skip_failed": False,  # the driver skips and remembers failures, not the actors
        "time_limit_s": 30.0,  # each actor's stages get the run's limit
    }
    # plain values that build the same options object on the actor
    assert EngineOptions.from_json(engine.actor_options()) == EngineOptions(
        device="cpu",
        backend="torch",
        loaders=3,
        query_chunk=4096,
        min_query_chunk=64,
        write_batch=7,
        prefetch=5,
        time_limit_s=30.0,
    )
    assert _engine().actor_options()["loaders"] is None  # each actor chooses


def test_the_driver_gets_a_frozen_copy_of_the_engine_options() -> None:
    engine = _engine(actors=2, shard_size=5, max_attempts=4, address="auto", loaders=1)
    options = engine.run_options()
    assert (options.actors, options.shard_size, options.max_attempts, options.address) == (
        2,
        5,
        4,
        "auto",
    )
    assert options.fingerprint == engine.fingerprint and options.recipe == "spc"
    assert options.actor_options == engine.actor_options()
    with pytest.raises(AttributeError):
        options.actors = 3  # type: ignore[misc]
    engine.shard_size = 9  # a later change to the engine does not reach a started run
    assert options.shard_size == 5


# --- the retry policy --------------------------------------------------------------------


def test_a_shard_whose_actor_died_once_is_retried_whole_and_first() -> None:
    run = RayRun(_engine().run_options(), [], None)
    run.shards.append(_shard(["z"]))
    run._requeue(_shard(["a", "b", "c", "d"], deaths=1, avoid={0}))
    first = run.shards[0]
    assert [i.sample_id for i in first.items] == ["a", "b", "c", "d"]
    assert first.avoid == {0} and run.summary.shard_retries == 1


def test_a_shard_that_killed_two_actors_is_halved() -> None:
    run = RayRun(_engine().run_options(), [], None)
    run._requeue(_shard(["a", "b", "c", "d", "e"], deaths=2, avoid={0, 1}))
    assert [[i.sample_id for i in s.items] for s in run.shards] == [["a", "b"], ["c", "d", "e"]]
    assert all(s.deaths == 1 and s.avoid == {0, 1} for s in run.shards)


def test_a_single_sample_fails_after_max_attempts_deaths() -> None:
    run = RayRun(_engine(max_attempts=3).run_options(), [], None)
    run._requeue(_shard(["poison"], deaths=2))
    assert len(run.shards) == 1 and run.summary.failed == 0
    run.shards.clear()
    run._requeue(_shard(["poison"], deaths=3))
    assert not run.shards and run.summary.failed == 1
    (error,) = run.summary.errors
    assert error.id == "poison" and "died 3 times" in error.reason


def test_samples_left_when_every_actor_is_gone_fail_without_being_remembered(
    tmp_path: Path,
) -> None:
    """The cluster's failure is reported, but the failure log keeps only a sample's own
    (so ``skip_failed`` never skips them, and ``spcache stats`` does not list them)."""
    from cache_store.jobs.failures import FailureLog

    log = FailureLog(tmp_path)
    run = RayRun(_engine(failure_log=log).run_options(), [], None)
    run.shards.append(_shard(["a", "b"]))
    run._requeue(_shard(["poison"], deaths=3))  # a sample that killed every actor it met
    run._schedule(ray=None)  # no actor left: nothing to wait for
    assert run.summary.failed == 3
    reasons = {e.id: e.reason for e in run.summary.errors}
    assert reasons["a"].startswith("no Ray actor left") and "died 3 times" in reasons["poison"]
    assert sorted(log.get_many(FP, ["a", "b", "poison"])) == ["poison"]
    log.close()


def test_bisection_isolates_a_poison_sample_in_a_bounded_number_of_deaths() -> None:
    """Simulate the policy: every shard holding the poison kills its actor."""
    run = RayRun(_engine(max_attempts=3).run_options(), [], None)
    ids = [f"s{i:02d}" for i in range(64)]
    run.shards.append(_shard(ids))
    deaths = computed = 0
    while run.shards:
        shard = run.shards.popleft()
        if any(i.sample_id == "s37" for i in shard.items):
            deaths += 1
            run._requeue(Shard(shard.items, shard.deaths + 1, shard.avoid))
        else:
            computed += len(shard.items)
    assert computed == 63 and run.summary.failed == 1
    assert run.summary.errors[0].id == "s37"
    assert deaths <= 2 + 6 + 2  # two tries whole, one per halving, then the single's tries


def test_next_shard_prefers_one_this_actor_did_not_kill() -> None:
    run = RayRun(_engine().run_options(), [], None)
    run.shards.extend([_shard(["a"], 1, {0}), _shard(["b"])])
    assert [i.sample_id for i in run._next_shard(0, {0, 1}).items] == ["b"]
    # the only shard left avoids actor 0, but actor 1 is alive to take it
    assert run._next_shard(0, {0, 1}) is None
    # every live actor is avoided: any of them is as good as another
    assert [i.sample_id for i in run._next_shard(0, {0}).items] == ["a"]


# --- fault injection and summary ---------------------------------------------------------


def test_crash_once_ignores_other_samples_and_fires_only_without_its_marker(tmp_path: Path) -> None:
    marker = tmp_path / "fired"
    fault = CrashOnce("victim", str(marker))
    fault("someone-else")  # returns: not the chosen sample
    marker.touch()
    fault("victim")  # returns: it fired before (the exit itself is tested on Ray)
    assert marker.exists()


def test_summary_json_and_lines_carry_each_actor() -> None:
    summary = RaySummary(
        "f" * 32,
        "spc",
        1,
        {"level": 8},
        device="cpu",
        backend="torch",
        done=5,
        actor_start_s=1.5,
        shard_retries=1,
    )
    summary.actors = [
        ActorStats(0, "10.0.0.1", "cuda:0", "kaolin", ["3"], 2, 3, 0, 1, 1.5),
        ActorStats(1, "10.0.0.2", "cuda:0", "kaolin", ["0"], 1, 2, 0, 0, 0.0),
    ]
    data = summary.as_json()
    assert data["engine"] == "ray" and data["shard_retries"] == 1
    assert data["timings"]["actor_start_s"] == 1.5 and data["done"] == 5
    assert data["actors"][0]["samples_per_s"] == 2.0 and data["actors"][1]["samples_per_s"] == 0.0
    lines = summary.detail_lines()
    assert "actor 0 (10.0.0.1 cuda:0 gpu 3): 3 done" in lines[0] and "died 1x" in lines[0]
    assert "1 shard(s) retried" in lines[-1]


def test_an_actors_spcache_error_comes_back_as_its_own_class() -> None:
    class TaskError(Exception):  # what Ray raises in the driver: the actor's error as .cause
        def __init__(self, cause: BaseException) -> None:
            super().__init__("task failed")
            self.cause = cause

    original = SourceError("/data/a.obj", "file is empty")
    carried = RemoteError.of(original)
    carried = RemoteError(*carried.args)  # how Ray's transport rebuilds it: from its args
    error = local_error(TaskError(carried))
    assert type(error) is SourceError and str(error) == str(original)
    assert error.path == "/data/a.obj" and error.reason == "file is empty"
    # only spcache's own classes are looked up; anything else stays an SpcacheError
    foreign = local_error(TaskError(RemoteError({"error": "system", "message": "no"})))
    assert type(foreign) is SpcacheError and str(foreign) == "system: no"
    plain = TaskError(ValueError("x"))
    assert local_error(plain) is plain
