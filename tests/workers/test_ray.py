"""``--engine ray``: Ray's local mode on this machine, two CPU actors, one Ray start.

Every test here that runs actors shares one Ray instance (module fixture); the runs are
small so the file stays well under a minute and a half on two cores.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import ray

from cache_store.errors import BackendUnavailable, SpcacheError
from cache_store.format.header import read_header
from cache_store.stores.opener import open_store
from tests.conftest import REPO_ROOT
from tests.helpers.procs import start_spcache, wait_for
from spcache.cli import main
from workers.engine import Engine, ItemResult
from tests.helpers.ray_faults import CrashOnce, HoldOnce, register_with_ray
from workers.ray_engine import RayEngine, RaySummary

PARAMS = {"level": 5, "surface_samples": 2000, "uniform_queries": 500, "surface_queries": 500}
SMALL = [arg for key, value in PARAMS.items() for arg in ("--param", f"{key}={value}")]
RAY_OPTIONS = dict(device="cpu", backend="torch", loaders=0, actors=2)


def _items(paths: list[Path]) -> list[tuple[str, str]]:
    return [(p.stem, str(p)) for p in paths]


def _split(value: bytes) -> tuple[dict[str, str], bytes]:
    header = read_header(value)
    return dict(header.metadata), bytes(value[header.data_start :])


def _all_records(cache: Path) -> dict[str, bytes]:
    with open_store(cache) as store:
        return {key: store.get(key) for key in store.keys()}


def _ray_processes(parent: int) -> list[psutil.Process]:
    """The Ray daemons started by process ``parent`` (not those of other Ray users on
    this machine, e.g. another test run at the same time)."""
    names = ("raylet", "gcs_server")
    return [
        p
        for p in psutil.process_iter(["name", "ppid"])
        if p.info["name"] in names and p.info["ppid"] == parent
    ]


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance with two CPUs for the module; stopped after it."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(
        num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False
    )
    register_with_ray()  # actors unpickle CrashOnce without importing tests/
    started = _ray_processes(os.getpid())
    assert started, "ray.init started no raylet/gcs_server of its own"
    yield ray
    ray.shutdown()
    for sig, handler in handlers.items():  # ray.init replaced them for this process
        signal.signal(sig, handler)
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"Ray processes left running: {alive}"


@pytest.fixture(scope="module")
def sources(corpus_meshes: list[Path], corpus_bad_inputs: list[Path]) -> list[Path]:
    """Six generated meshes and every hostile file."""
    return corpus_meshes[:6] + corpus_bad_inputs


@pytest.fixture(scope="module")
def local_cache(tmp_path_factory: pytest.TempPathFactory, sources: list[Path]):
    cache = tmp_path_factory.mktemp("local") / "cache"
    with open_store(cache, readonly=False) as store:
        summary = Engine(store, "spc_query", PARAMS, device="cpu", backend="torch", loaders=0).run(
            _items(sources)
        )
    return cache, summary


@pytest.fixture(scope="module")
def ray_cache(ray_local, tmp_path_factory: pytest.TempPathFactory, sources: list[Path]):
    cache = tmp_path_factory.mktemp("ray") / "cache"
    reported: list[ItemResult] = []
    with open_store(cache, readonly=False) as store:
        engine = RayEngine(store, "spc_query", PARAMS, shard_size=4, write_batch=2, **RAY_OPTIONS)
        summary = engine.run(_items(sources), on_result=reported.append)
    return cache, summary, reported


# --- the same records as the local engine ----------------------------------------------


@pytest.mark.slow
def test_records_are_byte_identical_to_the_local_engine(local_cache, ray_cache) -> None:
    local, ray_ = _all_records(local_cache[0]), _all_records(ray_cache[0])
    assert local.keys() == ray_.keys() and len(local) >= 6
    for key in local:
        local_meta, local_data = _split(local[key])
        ray_meta, ray_data = _split(ray_[key])
        assert ray_data == local_data, key
        # `created` is the commit time, and `checksum` covers every metadata value, so
        # those two differ; the field checksums and everything else must not.
        for meta in (local_meta, ray_meta):
            del meta["created"], meta["checksum"]
        assert ray_meta == local_meta, key
    with open_store(local_cache[0]) as a, open_store(ray_cache[0]) as b:
        fingerprint = local_cache[1].fingerprint
        assert (
            b.get_index(fingerprint).sample_ids.tolist()
            == a.get_index(fingerprint).sample_ids.tolist()
        )
        assert b.verify().ok


@pytest.mark.slow
def test_an_installed_recipe_package_runs_on_ray_as_locally(
    ray_local, example_recipe, tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """The example recipe package (an entry point, not spcache's code) on the actors: found
    there as in the driver, records identical to the local engine's."""
    params = {"level": 4, "samples": 2000}
    items = _items(corpus_meshes[:3])
    # An installed package is found by every actor; the session's fallback copy (a
    # developer's older venv) travels in the actors' runtime env instead.
    runtime_env = {"env_vars": {"PYTHONPATH": example_recipe}} if example_recipe else None
    with open_store(tmp_path / "local", readonly=False) as store:
        assert (
            Engine(store, "voxel_normals", params, device="cpu", backend="torch", loaders=0)
            .run(items)
            .done
            == 3
        )
    with open_store(tmp_path / "ray", readonly=False) as store:
        summary = RayEngine(
            store, "voxel_normals", params, actor_runtime_env=runtime_env, **RAY_OPTIONS
        ).run(items)
        assert summary.done == 3, summary.errors
    local, ray_ = _all_records(tmp_path / "local"), _all_records(tmp_path / "ray")
    assert local.keys() == ray_.keys()
    with open_store(tmp_path / "local") as a, open_store(tmp_path / "ray") as b:
        for key in local:
            assert _split(ray_[key])[1] == _split(local[key])[1], key
            # in the descriptor both records name (the same one: same code, backend, device)
            assert _split(ray_[key])[0]["descriptor"] == _split(local[key])[0]["descriptor"]
            assert b.record_metadata(key)["code_digest"] == a.record_metadata(key)["code_digest"]


@pytest.mark.slow
def test_bad_inputs_fail_as_in_the_local_engine(local_cache, ray_cache, corpus_bad_inputs) -> None:
    local, ray_summary = local_cache[1], ray_cache[1]
    assert isinstance(ray_summary, RaySummary)
    assert (ray_summary.done, ray_summary.skipped, ray_summary.failed) == (
        local.done,
        local.skipped,
        local.failed,
    )
    assert ray_summary.failed >= 10
    by_id = lambda errors: {(e.id, e.path, e.reason) for e in errors}  # noqa: E731
    assert by_id(ray_summary.errors) == by_id(local.errors)
    assert {e.id for e in ray_summary.errors} <= {p.stem for p in corpus_bad_inputs}


@pytest.mark.slow
def test_a_rerun_says_failed_again_and_skip_failed_sends_nothing_to_ray(ray_cache, sources) -> None:
    cache, first, _ = ray_cache
    failed = {e.id for e in first.errors}
    with open_store(cache, readonly=False) as store:
        again = RayEngine(store, "spc_query", PARAMS, **RAY_OPTIONS).run(_items(sources))
        skipping = RayEngine(store, "spc_query", PARAMS, skip_failed=True, **RAY_OPTIONS)
        skipped = skipping.run(_items(sources))
    # failures read from the file (an unreadable one has no hash) are remembered
    remembered = {e.id for e in again.errors if e.repeat == "again"}
    assert remembered and remembered <= failed and again.skipped == first.done
    assert all(
        e.reason.startswith("failed again, same reason: ")
        for e in again.errors
        if e.id in remembered
    )
    # a failure found before its file could be hashed (unreadable, empty) is remembered
    # and reported "again", but without a hash it can never be skipped as unchanged
    not_retried = set(skipped.as_json()["skipped_failed"])
    assert not_retried and not_retried <= remembered
    assert skipped.skipped == first.done and skipped.failed == first.failed
    retried = {e.id for e in skipped.errors if e.repeat != "skipped"}
    assert retried == failed - not_retried


@pytest.mark.slow
def test_a_rerun_on_ray_reports_records_made_by_other_recipe_code(
    ray_cache, sources, caplog: pytest.LogCaptureFixture
) -> None:
    """The Ray driver skips stored records as the local engine does, and says, once,
    how many of them other code than the installed recipe's computed."""
    cache, first, _ = ray_cache
    with open_store(cache, readonly=False) as store:
        engine = RayEngine(store, "spc_query", PARAMS, skip_failed=True, **RAY_OPTIONS)
        engine.code_digest = "0" * 16  # as if the recipe's code had changed since
        with caplog.at_level(logging.WARNING, logger="workers.run_ledger"):
            again = engine.run(_items(sources))
    assert again.skipped == first.done and again.skipped_other_code == first.done
    warned = [r.getMessage() for r in caplog.records if "computed by other code" in r.getMessage()]
    assert len(warned) == 1 and f"{first.done} skipped record(s)" in warned[0], warned


@pytest.mark.slow
def test_summary_reports_every_item_once_and_each_actor(ray_cache, sources) -> None:
    _, summary, reported = ray_cache
    counts = Counter(r.sample_id for r in reported)
    assert set(counts) == {p.stem for p in sources} and set(counts.values()) == {1}
    assert summary.total == len(sources)
    assert len(summary.actors) == 2
    assert all(a.shards >= 1 and a.busy_s > 0 for a in summary.actors)
    assert sum(a.done for a in summary.actors) == summary.done
    assert sum(a.failed for a in summary.actors) == summary.failed
    assert summary.device == "cpu" and summary.backend == "torch"
    assert summary.compute_s > 0 and summary.load_s > 0 and summary.write_s > 0
    data = summary.as_json()
    json.dumps(data)
    assert data["engine"] == "ray" and len(data["actors"]) == 2
    assert all(a["samples_per_s"] >= 0 for a in data["actors"])


# --- resume, through the command line ------------------------------------------------------


@pytest.mark.slow
def test_spcache_precompute_runs_on_ray(
    ray_local, tmp_path: Path, local_cache, corpus_meshes: list[Path]
) -> None:
    """The library call with engine="ray": the same records, a Ray result object."""
    import spcache

    sources = corpus_meshes[:3]
    result = spcache.precompute(
        sources,
        "spc_query",
        tmp_path / "cache",
        engine="ray",
        progress=False,
        **RAY_OPTIONS,
        **PARAMS,
    )
    assert result.engine == "ray" and (result.done, result.failed) == (3, 0), result.errors
    assert result.fingerprint == local_cache[1].fingerprint
    assert len(result.extra["actors"]) == 2 and result.timings.actor_start_s is not None
    assert result.as_json()["engine"] == "ray"
    local, ray_made = _all_records(local_cache[0]), _all_records(tmp_path / "cache")
    for path in sources:
        key = f"{result.fingerprint}/{path.stem}"
        assert _split(ray_made[key])[1] == _split(local[key])[1]


@pytest.mark.slow
def test_cli_resumes_a_local_run_and_recomputes_only_what_changed(
    ray_local,
    tmp_path: Path,
    local_cache,
    corpus_meshes: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(local_cache[0], cache)
    src = tmp_path / "src"
    src.mkdir()
    for path in corpus_meshes[:8]:
        shutil.copyfile(path, src / path.name)
    # the first six are stored (same bytes as the corpus meshes); change one of them
    changed = src / corpus_meshes[0].name  # annulus.off: text, so a trailing newline keeps it valid
    changed.write_bytes(changed.read_bytes() + b"\n")
    before = _all_records(cache)
    args = [
        "precompute",
        str(src),
        "--recipe",
        "spc_query",
        *SMALL,
        "--cache",
        str(cache),
        "--engine",
        "ray",
        "--actors",
        "2",
        "--device",
        "cpu",
        "--backend",
        "torch",
    ]
    # the module's Ray is running in this process: the CLI uses it rather than start one
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "done 3, skipped 5, failed 0" in out
    assert out.count("samples/s") == 2  # one line per actor
    after = _all_records(cache)
    key = f"{local_cache[1].fingerprint}/{changed.stem}"
    assert _split(after[key])[0]["source_hash"] != _split(before[key])[0]["source_hash"]
    assert all(after[k] == v for k, v in before.items() if k != key)
    # everything stored now: nothing is sent to Ray at all
    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["skipped"], summary["done"], summary["actors"]) == (8, 0, [])


# --- variants -----------------------------------------------------------------------------

VARIANT_PARAMS = {
    "level": 5,
    "surface_samples": 2000,
    "rotation": "so3",
    "scale_min": 0.8,
    "scale_max": 1.2,
    "jitter": 0.002,
}


@pytest.fixture(scope="module")
def local_variants(tmp_path_factory: pytest.TempPathFactory, corpus_meshes: list[Path]):
    """4 variants of three meshes by the local engine: what Ray must store too."""
    cache = tmp_path_factory.mktemp("local-variants") / "cache"
    with open_store(cache, readonly=False) as store:
        summary = Engine(
            store, "spc", VARIANT_PARAMS, device="cpu", backend="torch", loaders=0
        ).run(_items(corpus_meshes[:3]), variants=4)
    assert summary.done == 12, summary.errors
    return cache, summary


def _same_records(made: dict[str, bytes], local: dict[str, bytes]) -> None:
    assert made.keys() == local.keys()
    for key, value in made.items():
        made_meta, made_data = _split(value)
        local_meta, local_data = _split(local[key])
        assert made_data == local_data, key
        for meta in (made_meta, local_meta):  # the commit time; a copy's own stat
            del meta["created"], meta["checksum"]
            meta.pop("source_stat", None)
        assert made_meta == local_meta, key


@pytest.mark.slow
def test_cli_variants_on_ray_are_the_local_engines_and_more_compute_only_the_new_ones(
    ray_local,
    tmp_path: Path,
    local_variants,
    corpus_meshes: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for path in corpus_meshes[:3]:
        shutil.copyfile(path, src / path.name)
    cache = tmp_path / "cache"
    params = [a for k, v in VARIANT_PARAMS.items() for a in ("--param", f"{k}={v}")]
    args = ["precompute", str(src), "--recipe", "spc", *params, "--cache", str(cache)]
    args += ["--engine", "ray", "--actors", "2", "--device", "cpu", "--backend", "torch"]
    # the module's Ray is running in this process: the CLI uses it rather than start one
    assert main([*args, "--variants", "2"]) == 0
    assert "done 6, skipped 0, failed 0 records (2 variants per sample)" in capsys.readouterr().out
    first = _all_records(cache)
    assert main([*args, "--variants", "4"]) == 0  # the 2 new ones of each shape only
    assert "done 6, skipped 6, failed 0 records (4 variants per sample)" in capsys.readouterr().out
    made = _all_records(cache)
    assert all(made[key] == value for key, value in first.items())  # not written again
    _same_records(made, _all_records(local_variants[0]))
    fingerprint = local_variants[1].fingerprint
    with open_store(cache) as store:
        index = store.get_index(fingerprint)
        assert index.sample_ids.tolist() == [p.stem for p in corpus_meshes[:3]]
        assert index.variant_counts().tolist() == [4, 4, 4]
    assert main([*args, "--variants", "4", "--json"]) == 0  # all stored: nothing sent to Ray
    summary = json.loads(capsys.readouterr().out)
    assert (summary["skipped"], summary["done"], summary["actors"]) == (12, 0, [])


@pytest.mark.slow
def test_an_actor_crashing_among_a_samples_variants_loses_and_repeats_nothing(
    ray_local, tmp_path: Path, local_variants, corpus_meshes: list[Path]
) -> None:
    paths = corpus_meshes[:3]
    reported: list[ItemResult] = []
    with open_store(tmp_path / "cache", readonly=False) as store:
        engine = RayEngine(
            store,
            "spc",
            VARIANT_PARAMS,
            shard_size=2,
            write_batch=1,
            # the actor dies reporting the sample's third record, its first two reported
            actor_fault=CrashOnce(paths[1].stem, str(tmp_path / "crashed"), after=2),
            **RAY_OPTIONS,
        )
        summary = engine.run(_items(paths), on_result=reported.append, variants=4)
    assert (tmp_path / "crashed").exists()  # the fault fired
    assert summary.failed == 0 and summary.done == 12, summary.errors
    assert sum(a.deaths for a in summary.actors) == 1 and summary.shard_retries == 1
    # each record reported once, as done
    assert Counter((r.sample_id, r.variant, r.status) for r in reported) == Counter(
        {(p.stem, v, "done"): 1 for p in paths for v in range(4)}
    )
    _same_records(_all_records(tmp_path / "cache"), _all_records(local_variants[0]))


# --- actors that die ----------------------------------------------------------------------


@pytest.mark.slow
def test_an_actor_crashing_mid_shard_loses_nothing(
    ray_local, tmp_path: Path, local_cache, corpus_meshes: list[Path]
) -> None:
    paths = corpus_meshes[:6]
    reported: list[ItemResult] = []
    with open_store(tmp_path / "cache", readonly=False) as store:
        engine = RayEngine(
            store,
            "spc_query",
            PARAMS,
            shard_size=3,
            write_batch=1,
            actor_fault=CrashOnce(paths[1].stem, str(tmp_path / "crashed")),
            **RAY_OPTIONS,
        )
        summary = engine.run(_items(paths), on_result=reported.append)
        keys = list(store.keys())
    assert (tmp_path / "crashed").exists()  # the fault fired
    assert summary.failed == 0 and summary.done == len(paths), summary.errors
    assert Counter(r.sample_id for r in reported) == Counter(p.stem for p in paths)
    assert len(keys) == len(paths)
    assert sum(a.deaths for a in summary.actors) == 1 and summary.shard_retries == 1
    local = _all_records(local_cache[0])
    for key, value in _all_records(tmp_path / "cache").items():
        assert _split(value)[1] == _split(local[key])[1]


@pytest.mark.slow
def test_an_actor_killed_for_good_mid_run_loses_nothing(
    ray_local, tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    # The actor computing paths[1] stalls with it unsent and is killed there, so the
    # kill lands mid-shard however the two actors' timings fall on a loaded machine
    paths = corpus_meshes[:8]
    marker = tmp_path / "holding"
    killed: list[str] = []

    def kill_the_holder() -> None:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        name = marker.read_text()
        ray.kill(
            ray.get_actor(name)
        )  # no restart: the actor is gone for the run  # no restart: the actor is gone for the run
        killed.append(name)

    killer = threading.Thread(target=kill_the_holder, daemon=True)
    killer.start()
    reported: list[ItemResult] = []
    with open_store(tmp_path / "cache", readonly=False) as store:
        engine = RayEngine(
            store,
            "spc_query",
            PARAMS,
            shard_size=3,
            write_batch=1,
            actor_fault=HoldOnce(paths[1].stem, str(marker)),
            **RAY_OPTIONS,
        )
        summary = engine.run(_items(paths), on_result=reported.append)
        keys = list(store.keys())
        index = store.get_index(summary.fingerprint).sample_ids.tolist()
    killer.join(timeout=5)
    assert killed and killed[0].startswith("spcache-shard")
    assert summary.failed == 0 and summary.done == len(paths), summary.errors
    assert Counter(r.sample_id for r in reported) == Counter(p.stem for p in paths)
    assert len(keys) == len(paths) and index == [p.stem for p in paths]
    assert sum(a.deaths for a in summary.actors) == 1 and summary.shard_retries == 1


@pytest.mark.slow
def test_a_sample_that_kills_every_actor_fails_alone(
    ray_local, tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    # (how a shard is halved down to the poison is tested without Ray, in test_ray_scheduling)
    paths = corpus_meshes[:3]
    poison = paths[1].stem
    with open_store(tmp_path / "cache", readonly=False) as store:
        engine = RayEngine(
            store,
            "spc_query",
            PARAMS,
            shard_size=1,
            write_batch=1,
            max_attempts=2,
            actor_fault=CrashOnce(poison, str(tmp_path / "marker"), always=True),
            **RAY_OPTIONS,
        )
        summary = engine.run(_items(paths))
        stored = {key.rsplit("/", 1)[1] for key in store.keys()}
    assert summary.done == 2 and summary.failed == 1
    assert sum(a.deaths for a in summary.actors) == 2
    (error,) = summary.errors
    assert error.id == poison and "died 2 times" in error.reason
    assert stored == {p.stem for p in paths} - {poison}


# --- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--actors", "2"], "need the ray engine"),
        (["--engine", "ray", "--actors", "0"], "actors 0: must be 1 or more"),
        (["--engine", "ray", "--device", "cuda:1"], "use auto, cpu or cuda"),
    ],
)
def test_cli_ray_usage_errors(
    tmp_path: Path,
    corpus_meshes: list[Path],
    extra: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        [
            "precompute",
            str(corpus_meshes[0]),
            "--recipe",
            "spc",
            "--cache",
            str(tmp_path / "cache"),
            *extra,
        ]
    )
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_an_interrupt_between_a_commit_and_its_report_still_indexes_the_record(
    ray_local, tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """SIGTERM reaches the driver as KeyboardInterrupt (the CLI's handler) at any bytecode:
    here right after the second batch is committed, before its results are reported. The
    record is stored, so it must be in the index too (a CI run once caught it left out)."""
    with open_store(tmp_path / "cache", readonly=False) as store:
        commit = store.put_many
        commits = []

        def commit_then_interrupt(items, descriptors=()):
            stored = commit(items, descriptors)
            commits.append(stored)
            if len(commits) == 2:
                raise KeyboardInterrupt("signal 15")
            return stored

        store.put_many = commit_then_interrupt  # type: ignore[method-assign]
        engine = RayEngine(
            store, "spc_query", PARAMS, **{**RAY_OPTIONS, "actors": 1, "write_batch": 1}
        )
        with pytest.raises(KeyboardInterrupt):
            engine.run(_items(corpus_meshes[:4]))
        stored = sorted(key.split("/", 1)[1] for key in store.keys())
        assert len(stored) == 2
        assert sorted(store.get_index(engine.fingerprint).sample_ids.tolist()) == stored


@pytest.mark.slow
def test_cli_sigterm_stops_its_own_ray_keeps_the_records_and_resumes(
    ray_local, tmp_path: Path, corpus_meshes: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that starts its own local Ray, stopped by SIGTERM (``docker stop``) after
    its first records: exit 130, records and index kept, no Ray process left; the same
    command then finishes the rest and recomputes nothing."""
    cache = tmp_path / "cache"
    args = [
        "precompute",
        *map(str, corpus_meshes),
        "--recipe",
        "spc_query",
        *SMALL,
        "--cache",
        str(cache),
        "--engine",
        "ray",
        "--actors",
        "1",
        "--device",
        "cpu",
        "--backend",
        "torch",
        "--loaders",
        "0",
        "--write-batch",
        "1",
        "--json",
    ]
    with start_spcache(*args) as proc:
        wait_for(lambda: len(_stored_keys(cache)) >= 2, 180, "two stored records", proc=proc)
        started = _ray_processes(proc.pid)  # records arrived, so its Ray is up
        assert started, "the run started no Ray of its own"
        assert proc.stop(signal.SIGTERM) == 130, proc.stderr()[-3000:]
    err = proc.stderr()
    assert proc.stdout() == ""  # no summary for an interrupted run, and nothing of Ray's
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"Ray processes left running: {alive}"
    stored = _stored_keys(cache)
    assert 2 <= len(stored) < len(corpus_meshes)
    fingerprint = stored[0].split("/", 1)[0]
    with open_store(cache) as store:
        assert sorted(store.get_index(fingerprint).sample_ids.tolist()) == sorted(
            k.split("/", 1)[1] for k in stored
        ), err
    # resume in this process (its Ray is the module's): only the rest is computed
    capsys.readouterr()
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["skipped"] == len(stored)
    assert summary["done"] == len(corpus_meshes) - len(stored)
    with open_store(cache) as store:
        assert len(store.get_index(fingerprint)) == len(corpus_meshes)
        assert store.verify().ok


def _stored_keys(cache: Path) -> list[str]:
    try:
        with open_store(cache) as store:
            return list(store.keys())
    except (SpcacheError, OSError):
        return []


def test_the_local_path_never_imports_ray() -> None:
    code = (
        "import sys, spcache.cli, workers.engine, workers.ray_engine; "
        "from spcache.cli import main; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_an_error_that_is_not_one_samples_stops_the_run_with_its_own_type(
    ray_local, tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    options = {**RAY_OPTIONS, "backend": "kaolin"}  # Kaolin needs CUDA: no actor can run it
    with open_store(tmp_path / "cache", readonly=False) as store:
        engine = RayEngine(store, "spc", {"level": 4}, **options)
        with pytest.raises(BackendUnavailable, match="kaolin"):
            engine.run(_items(corpus_meshes[:2]))
        assert list(store.keys()) == []
    assert not [n for n in ray.util.list_named_actors() if n.startswith("spcache-shard")]
