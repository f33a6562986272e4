"""The engine end to end on CPU: real meshes, real LMDB, real loader processes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cache_store.engine_options import EngineOptions
from cache_store.format.decode import decode_record
from cache_store.format.header import read_header
from cache_store.stores.opener import open_store
from workers.engine import Engine, ItemResult
from workers.ops import get_backend
from workers.recipe_run import RECIPES, make_generator
from cache_store.recipes.api import check_outputs
from workers.source_load import load_source

# Small enough for a 2-core CI machine, big enough to exercise every stage.
PARAMS = {"level": 6, "surface_samples": 4000, "uniform_queries": 1000, "surface_queries": 1000}


def _items(paths: list[Path]) -> list[tuple[str, str]]:
    return [(p.stem, str(p)) for p in paths]


def _data_section(value: bytes) -> bytes:
    return bytes(value[read_header(value).data_start :])


@pytest.fixture(scope="module")
def mesh_cache(tmp_path_factory: pytest.TempPathFactory, meshes: list[Path]):
    cache = tmp_path_factory.mktemp("meshes") / "cache"
    store = open_store(cache, readonly=False)
    seen: list[ItemResult] = []
    committed_when_reported: list[bool] = []

    def on_result(result: ItemResult) -> None:
        seen.append(result)
        if result.status == "done":
            committed_when_reported.append(store.has(result.key))

    engine = Engine(
        store, "spc_query", PARAMS, device="cpu", backend="torch", loaders=2, write_batch=4
    )
    summary = engine.run(_items(meshes), on_result=on_result)
    yield store, engine, summary, seen, committed_when_reported
    store.close()


@pytest.mark.slow
def test_every_mesh_becomes_a_record(mesh_cache, meshes: list[Path]) -> None:
    store, engine, summary, seen, committed = mesh_cache
    assert summary.failed == 0, summary.errors
    assert summary.done == len(meshes) and summary.skipped == 0
    assert [r.sample_id for r in seen] == [p.stem for p in meshes]  # input order
    assert committed and all(committed)  # on_result only after the commit
    index = store.get_index(engine.fingerprint)
    assert index.sample_ids.tolist() == [p.stem for p in meshes]
    assert index.recipe == "spc_query" and index.params == engine.params
    assert store.verify().ok
    for path in meshes:
        record = store.get_record(engine.key(path.stem))
        check_outputs(RECIPES["spc_query"].spec, record.tensors, engine.params)
        meta = record.metadata
        assert meta["sample_id"] == path.stem and meta["fingerprint"] == engine.fingerprint
        assert meta["recipe"] == "spc_query" and meta["recipe_version"] == "1"
        assert meta["backend"] == "torch" and meta["device"] == "cpu"
        assert meta["source_hash"] == load_source(path).source_hash
        for name in ("created", "spcache_version", "schema"):
            assert meta[name]


@pytest.mark.slow
def test_records_agree_with_the_ops_called_directly(mesh_cache, meshes: list[Path]) -> None:
    store, engine, _, _, _ = mesh_cache
    ops = get_backend("torch", "cpu")
    level = PARAMS["level"]
    recipe = RECIPES["spc_query"]
    for path in meshes[::3]:
        record = store.get_record(engine.key(path.stem))
        t = record.tensors
        # redo the CPU half with the same seed, then every op by hand
        prepared = recipe.prepare(
            load_source(path), engine.params, make_generator(engine.fingerprint, path.stem)
        )
        points = torch.from_numpy(prepared["points"])
        octree = ops.unbatched_points_to_octree(ops.quantize_points(points, level), level)
        max_level, pyramids, exsum = ops.scan_octrees(
            octree, torch.tensor([len(octree)], dtype=torch.int32)
        )
        assert max_level == level
        assert torch.equal(t["octree"], octree)
        assert torch.equal(t["pyramid"], pyramids[0])
        assert torch.equal(t["exsum"], exsum)
        assert torch.equal(t["point_hierarchy"], ops.generate_points(octree, pyramids, exsum))
        queries = torch.from_numpy(prepared["queries"])
        assert torch.equal(t["query_points"], queries)
        pidx = ops.unbatched_query(octree, exsum, queries, level, with_parents=True)
        assert torch.equal(t["query_pidx"], pidx.to(torch.int32))
        assert torch.equal(t["occupancy"], (pidx[:, -1] >= 0).to(torch.uint8))
        # the normalisation reproduces the normalised shape from the source
        src = load_source(path)
        normalised = (src.used_points() - t["center"].double().numpy()) / float(t["scale"])
        assert np.abs(normalised).max() <= 1.0 and np.abs(normalised).max() > 0.999


@pytest.mark.slow
def test_leaf_voxels_are_exactly_where_the_surface_samples_are(
    mesh_cache, meshes: list[Path]
) -> None:
    store, engine, _, _, _ = mesh_cache
    level = PARAMS["level"]
    for path in meshes:
        t = store.get_record(engine.key(path.stem)).tensors
        start, end = t["pyramid"][1, level].item(), t["pyramid"][1, level + 1].item()
        leaves = t["point_hierarchy"][start:end].long()
        assert len(leaves) == t["pyramid"][0, level].item()
        # recompute the surface samples the record was built from (same seed, CPU only)
        prepared = RECIPES["spc"].prepare(
            load_source(path), engine.params, make_generator(engine.fingerprint, path.stem)
        )
        samples = torch.from_numpy(prepared["points"]).double()
        assert samples.abs().max() <= 1.0
        cells = torch.floor(((samples + 1) / 2 * 2**level).clamp(0, 2**level - 1)).long()
        as_set = lambda p: set(map(tuple, p.tolist()))  # noqa: E731
        assert as_set(leaves) == as_set(cells), path.name
        # and every query whose leaf exists lies inside a leaf voxel (with_parents maps a
        # coordinate to its voxel by truncation toward zero, as Kaolin does)
        occupied = t["occupancy"].bool()
        q = t["query_points"][occupied].double()
        qcells = torch.trunc((q * 0.5 + 0.5) * 2**level).long()
        assert as_set(qcells) <= as_set(leaves)


def test_determinism_across_runs_and_loader_modes(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    paths = corpus_meshes[:3]
    values = []
    for name, jobs in (("a", 0), ("b", 2)):
        with open_store(tmp_path / name, readonly=False) as store:
            engine = Engine(store, "spc_query", PARAMS, device="cpu", backend="torch", loaders=jobs)
            assert engine.run(_items(paths)).done == 3
            values.append({k: store.get(k) for k in store.keys()})
    assert values[0].keys() == values[1].keys() and len(values[0]) == 3
    for key in values[0]:
        assert _data_section(values[0][key]) == _data_section(values[1][key])
        a, b = decode_record(values[0][key]), decode_record(values[1][key])
        assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


def _kaolin_or_skip() -> None:
    """Skip unless Kaolin's backend runs here (not importorskip: on a broken install it
    warns, an error under filterwarnings = error)."""
    from cache_store.errors import BackendUnavailable
    from workers.ops import kaolin_spc

    try:
        kaolin_spc.ensure_available()
    except BackendUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_cpu_and_cuda_records_are_identical(
    tmp_path: Path, corpus_meshes: list[Path], backend: str
) -> None:
    """torch on CUDA (explicitly), and whatever auto picks there (Kaolin where it runs),
    against the CPU: the same record bytes."""
    paths = corpus_meshes[:4]
    values = []
    for device, name in (("cpu", "torch"), ("cuda", backend)):
        with open_store(tmp_path / device, readonly=False) as store:
            summary = Engine(
                store, "spc_query", PARAMS, device=device, backend=name, loaders=0
            ).run(_items(paths))
            assert summary.done == len(paths)
            if name == "torch":
                assert summary.backend == "torch"
            values.append({k: _data_section(store.get(k)) for k in store.keys()})
    assert values[0] == values[1]


@pytest.mark.gpu
def test_torch_and_kaolin_backends_agree_on_cuda(tmp_path: Path, corpus_meshes: list[Path]) -> None:
    _kaolin_or_skip()
    paths = corpus_meshes[:4]
    values = []
    for backend in ("torch", "kaolin"):
        with open_store(tmp_path / backend, readonly=False) as store:
            Engine(store, "spc_query", PARAMS, device="cuda", backend=backend, loaders=0).run(
                _items(paths)
            )
            values.append({k: _data_section(store.get(k)) for k in store.keys()})
    assert values[0] == values[1]


def test_oom_backoff_halves_the_chunk_and_gives_the_same_record(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    paths = corpus_meshes[:2]
    attempts: list[int] = []

    def inject(size: int) -> None:
        attempts.append(size)
        if len(attempts) <= 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    values = []
    for name, hook in (("plain", None), ("oom", inject)):
        with open_store(tmp_path / name, readonly=False) as store:
            engine = Engine(
                store,
                "spc_query",
                PARAMS,
                device="cpu",
                backend="torch",
                loaders=0,
                query_chunk=1024,
                min_query_chunk=64,
                before_query_chunk=hook,
            )
            summary = engine.run(_items(paths))
            assert summary.done == 2 and summary.failed == 0
            values.append({k: _data_section(store.get(k)) for k in store.keys()})
    assert attempts[:4] == [1024, 512, 256, 128]
    assert summary.oom_backoffs == 3
    assert values[0] == values[1]


@pytest.mark.parametrize(
    "error",
    [torch.cuda.OutOfMemoryError, RuntimeError],
    ids=["OutOfMemoryError", "kaolin-plain-RuntimeError"],
)
def test_oom_that_persists_fails_that_sample_alone(
    tmp_path: Path, corpus_meshes: list[Path], error: type[Exception]
) -> None:
    """Also when the out-of-memory error is the plain RuntimeError an allocation inside
    Kaolin's C++ raises: the sample fails as out of memory, not as a crash."""
    calls = []

    def inject(size: int) -> None:
        calls.append(size)
        if len(calls) == 1:
            raise error("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")

    with open_store(tmp_path / "c", readonly=False) as store:
        engine = Engine(
            store,
            "spc_query",
            PARAMS,
            device="cpu",
            backend="torch",
            loaders=0,
            query_chunk=2000,
            min_query_chunk=2000,
            before_query_chunk=inject,
        )
        summary = engine.run(_items(corpus_meshes[:3]))
        assert (summary.done, summary.failed) == (2, 1)
        assert summary.errors[0].id == corpus_meshes[0].stem
        assert "out of device memory" in summary.errors[0].reason
        assert store.get_index(engine.fingerprint).sample_ids.tolist() == [
            p.stem for p in corpus_meshes[1:3]
        ]


def test_resume_skips_stored_and_recomputes_changed(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for p in corpus_meshes[:3]:
        shutil.copy(p, src / p.name)
    files = sorted(src.iterdir())
    with open_store(tmp_path / "cache", readonly=False) as store:
        engine = Engine(
            store, "spc", {"level": 5, "surface_samples": 2000}, device="cpu", loaders=0
        )
        first = engine.run(_items(files[:2]))
        assert first.done == 2
        before = {k: store.get(k) for k in store.keys()}
        second = engine.run(_items(files))  # adds the third, skips the rest
        assert (second.done, second.skipped, second.failed) == (1, 2, 0)
        for key, value in before.items():
            assert store.get(key) == value  # untouched, created time included
        assert store.get_index(engine.fingerprint).sample_ids.tolist() == [f.stem for f in files]
        # change a source: a fresh computation, never a stale hit
        other = next(
            p for p in corpus_meshes if p.suffix == files[0].suffix and p.name != files[0].name
        )
        shutil.copy(other, files[0])  # same format, other content
        third = engine.run(_items(files))
        assert (third.done, third.skipped) == (1, 2)
        meta = store.get_record(engine.key(files[0].stem)).metadata
        assert meta["source_hash"] == load_source(files[0]).source_hash
        # a changed parameter is another fingerprint: everything computed again
        other = Engine(store, "spc", {"level": 6, "surface_samples": 2000}, device="cpu", loaders=0)
        assert other.fingerprint != engine.fingerprint
        assert other.run(_items(files)).done == 3
        assert store.verify().ok


def test_a_full_cache_stops_the_run_and_keeps_what_was_committed(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """The LMDB map at its bound (what a full disk is to a writer): the run stops with
    StoreFull naming the cache instead of failing every later sample one by one; the
    records committed before stay readable; the same run on room to spare finishes."""
    from cache_store.errors import StoreFull
    from cache_store.stores.lmdb import LMDBStore

    cache = tmp_path / "cache"
    items = _items(corpus_meshes)
    params = {"level": 6, "surface_samples": 4000}
    seen: list[ItemResult] = []
    store = LMDBStore(cache, readonly=False, map_size=128 * 1024, max_map_size=512 * 1024)
    engine = Engine(store, "spc", params, device="cpu", loaders=0, write_batch=1, prefetch=1)
    with pytest.raises(StoreFull, match="no space left on .*max_map_size") as err:
        engine.run(items, on_result=seen.append)
    assert str(cache) in str(err.value)
    stored = [r.sample_id for r in seen if r.status == "done"]
    failed = [r for r in seen if r.status == "failed"]
    assert stored and failed and len(seen) < len(items)  # it stopped early
    assert all(r.transient and "no space left" in r.reason for r in failed)
    assert store.verify().ok
    assert sorted(k.split("/", 1)[1] for k in store.keys()) == sorted(stored)
    store.close()
    with open_store(cache, readonly=False) as roomy:
        again = Engine(roomy, "spc", params, device="cpu", loaders=0).run(items)
        assert (again.done, again.skipped, again.failed) == (
            len(items) - len(stored),
            len(stored),
            0,
        )
        assert roomy.get_index(again.fingerprint).sample_ids.tolist() == [i for i, _ in items]
        assert roomy.verify().ok


def test_bad_samples_fail_alone(
    tmp_path: Path, bad_inputs: list[Path], corpus_meshes: list[Path]
) -> None:
    items = _items(bad_inputs) + [
        ("good", str(corpus_meshes[0])),
        ("good", str(corpus_meshes[1])),
        ("../escape", str(corpus_meshes[1])),
        ("missing", str(tmp_path / "missing.obj")),
    ]
    with open_store(tmp_path / "cache", readonly=False) as store:
        engine = Engine(store, "spc_query", PARAMS, device="cpu", loaders=2)
        summary = engine.run(items)
        assert summary.total == len(items)
        errors = {e.id: e for e in summary.errors}
        assert "duplicate sample id" in errors["good"].reason
        assert "../escape" in errors and "missing" in errors
        assert "cannot read" in errors["missing"].reason
        for path in bad_inputs:
            if path.stem in errors:
                assert errors[path.stem].path == str(path) and errors[path.stem].reason
            else:
                check_outputs(
                    RECIPES["spc_query"].spec,
                    store.get_record(engine.key(path.stem)).tensors,
                    engine.params,
                )
        assert store.has(engine.key("good"))
        assert store.verify().ok


def test_engine_validates_options_without_touching_the_store(tmp_path: Path) -> None:
    from cache_store.errors import ParameterError, UnknownName, UsageError

    store = open_store(tmp_path / "never", readonly=False)
    with pytest.raises(UnknownName):
        Engine(store, "nope")
    with pytest.raises(ParameterError, match="surface_samples"):
        Engine(store, "spc", {"surface_samples": 0})
    with pytest.raises(UsageError, match="device 'tpu'"):
        Engine(store, "spc", device="tpu")
    with pytest.raises(UsageError, match="loaders: -1"):
        Engine(store, "spc", loaders=-1)
    with pytest.raises(UnknownName, match="SPC backend 'cuda'"):
        Engine(store, "spc", backend="cuda")
    assert not (tmp_path / "never").exists()


def test_open_engine_keeps_its_loader_pool_and_survives_a_dead_loader(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    import os
    import signal

    paths = corpus_meshes[:6]
    killed: list[int] = []
    with (
        open_store(tmp_path / "c", readonly=False) as store,
        Engine(
            store, "spc", {"level": 5, "surface_samples": 1000}, device="cpu", loaders=2, prefetch=4
        ) as engine,
    ):
        pool = engine._loader_pool.pool

        def kill_loaders(result: ItemResult) -> None:
            if not killed:  # loaders die while later items are still pending in them
                for pid in list(engine._loader_pool.pool._processes):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

        first = engine.run(_items(paths[:3]), on_result=kill_loaders)
        second = engine.run(_items(paths))
    assert killed
    assert (first.done, first.failed) == (3, 0), first.errors
    assert (second.done, second.skipped, second.failed) == (3, 3, 0), second.errors
    assert engine._loader_pool is None and pool is not None


def test_loaders_has_one_name(tmp_path: Path) -> None:
    with open_store(tmp_path / "c", readonly=False) as store:
        assert Engine(store, "spc", loaders=3).loaders == 3
        # the one default, EngineOptions': one per core but one, 1 to 8
        assert Engine(store, "spc").loaders == max(1, min(8, (os.cpu_count() or 2) - 1))
        assert Engine(store, "spc", options=EngineOptions(loaders=0)).loaders == 0
        with pytest.raises(TypeError, match="jobs"):
            Engine(store, "spc", jobs=3)  # type: ignore[call-arg]


def test_a_failed_write_is_not_remembered_as_the_sources_failure(tmp_path: Path) -> None:
    """skip_failed must never skip a sample because a write failed (a full disk) once."""
    from cache_store.jobs.failures import FailureLog
    from workers.run_ledger import RunLedger, Summary

    fp = "0" * 32
    log = FailureLog(tmp_path)
    with open_store(tmp_path / "cache", readonly=False) as store:
        ledger = RunLedger(store, Summary(fp, "spc", 1, {}), None, failures=log)
        ledger.admit([("written", "a.ply"), ("broken", "b.ply")])
        ledger.finish(
            ItemResult(
                "written",
                "a.ply",
                "failed",
                reason="store write failed: no space left",
                source_hash="1" * 16,
                transient=True,
            )
        )
        ledger.finish(
            ItemResult("broken", "b.ply", "failed", reason="not a mesh", source_hash="2" * 16)
        )
    remembered = log.get_many(fp, ["written", "broken"])
    assert set(remembered) == {"broken"}
    log.close()


def test_a_failure_is_remembered_repeated_skipped_on_request_and_forgotten_once_fixed(
    tmp_path: Path,
) -> None:
    from cache_store.jobs.failures import FailureLog

    sources = tmp_path / "src"
    sources.mkdir()
    np.save(sources / "good.npy", np.random.default_rng(0).uniform(-1, 1, (300, 3)))
    np.save(sources / "bad.npy", np.zeros((100, 4)))  # not [N, 3]: a SourceError
    items = [("good", str(sources / "good.npy")), ("bad", str(sources / "bad.npy"))]
    params = {"level": 4, "surface_samples": 200}
    cache = tmp_path / "cache"

    def run(**options):
        with open_store(cache, readonly=False) as store:
            return Engine(
                store, "spc", params, device="cpu", backend="torch", loaders=0, **options
            ).run(items)

    first = run()
    (error,) = first.errors
    assert error.id == "bad" and error.repeat == "" and "shape (100, 4)" in error.reason
    log = FailureLog(cache)
    (remembered,) = log.get_many(first.fingerprint, ["bad", "good"]).values()
    assert remembered.reason == error.reason and remembered.times == 1

    again = run()
    (error,) = again.errors
    assert (
        error.repeat == "again"
        and error.reason == "failed again, same reason: " + remembered.reason
    )
    assert again.as_json()["failed_again"] == ["bad"] and again.skipped == 1
    assert log.get_many(first.fingerprint, ["bad"])["bad"].times == 2

    reported: list[ItemResult] = []
    with open_store(cache, readonly=False) as store:
        skipping = Engine(
            store, "spc", params, device="cpu", backend="torch", loaders=0, skip_failed=True
        )
        skipped = skipping.run(items, on_result=reported.append)
    (error,) = skipped.errors
    assert error.repeat == "skipped" and remembered.reason in error.reason
    assert "not retried" in error.reason and skipped.as_json()["skipped_failed"] == ["bad"]
    assert [r.status for r in reported if r.sample_id == "bad"] == ["failed"]
    assert log.get_many(first.fingerprint, ["bad"])["bad"].times == 2  # not tried: not counted

    np.save(sources / "bad.npy", np.zeros((50, 5)))  # changed, still bad: retried
    changed = run(skip_failed=True)
    (error,) = changed.errors
    assert error.repeat == "" and "shape (50, 5)" in error.reason

    np.save(sources / "bad.npy", np.random.default_rng(1).uniform(-1, 1, (300, 3)))  # fixed
    fixed = run(skip_failed=True)
    assert fixed.failed == 0 and fixed.done == 1 and fixed.skipped == 1
    assert log.get_many(first.fingerprint, ["bad"]) == {}
    with open_store(cache) as store:  # readers never see the log: records only
        assert sorted(store.keys()) == sorted(f"{first.fingerprint}/{i}" for i in ("bad", "good"))
    log.close()


def test_skip_failed_needs_a_store_with_a_failure_log() -> None:
    from cache_store.errors import UsageError
    from workers.ray_engine import ShardBuffer

    with pytest.raises(UsageError, match="skip_failed"):
        Engine(ShardBuffer(), "spc", skip_failed=True)


def test_an_interrupt_between_a_commit_and_its_report_still_indexes_the_record(
    tmp_path: Path, corpus_meshes: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM reaches the engine's thread as KeyboardInterrupt (the CLI's handler), at any
    bytecode: here just after the second committed result is taken off the writer's
    queue, before it is counted. Its record is stored, so it must be in the index too."""
    from workers.run_ledger import RunLedger

    finish, done = RunLedger.finish, []

    def finish_or_interrupt(self: RunLedger, result: ItemResult) -> None:
        if result.status == "done":
            done.append(result.sample_id)
            if len(done) == 2:
                raise KeyboardInterrupt("signal 15")
        finish(self, result)

    monkeypatch.setattr(RunLedger, "finish", finish_or_interrupt)
    with open_store(tmp_path / "cache", readonly=False) as store:
        engine = Engine(
            store, "spc", {"level": 4}, device="cpu", backend="torch", loaders=0, write_batch=1
        )
        with pytest.raises(KeyboardInterrupt):
            engine.run(_items(corpus_meshes[:5]))
        stored = sorted(key.split("/", 1)[1] for key in store.keys())
        assert done[1] in stored
        assert sorted(store.get_index(engine.fingerprint).sample_ids.tolist()) == stored


def test_an_interrupt_during_the_runs_cleanup_still_writes_the_index(
    tmp_path: Path, corpus_meshes: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM that lands as the run ends, while the loader pool shuts down, still
    stops the run (KeyboardInterrupt), but only after the rest of the cleanup: every
    record computed is committed and indexed."""
    from workers.loader import LoaderPool

    close = LoaderPool.close

    def close_then_interrupt(self: LoaderPool) -> None:
        close(self)
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(LoaderPool, "close", close_then_interrupt)
    items = _items(corpus_meshes[:3])
    with open_store(tmp_path / "cache", readonly=False) as store:
        engine = Engine(store, "spc", {"level": 4}, device="cpu", backend="torch", loaders=0)
        with pytest.raises(KeyboardInterrupt):
            engine.run(items)
        assert sorted(store.get_index(engine.fingerprint).sample_ids.tolist()) == sorted(
            sample_id for sample_id, _ in items
        )
