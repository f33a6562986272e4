"""Sample ids the user chooses: ``--id-template`` / ``--id-keep-ext`` in precompute and
``CachedDataset(sources=..., id_template=...)``, with collisions named, manifests as before."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import spcache
from cache_store import CachedDataset
from cache_store.errors import SourceError
from cache_store.sources.discover import KEEP_EXTENSION, discover_sources, sample_id_for
from tests.helpers.procs import run, run_spcache


@pytest.fixture
def shapenet(tmp_path: Path, corpus_meshes: list[Path]) -> Path:
    """ShapeNet's layout: SYNSET/MODEL/models/model_normalized.obj."""
    root = tmp_path / "ShapeNetCore"
    obj = next(p for p in corpus_meshes if p.name == "icosphere.obj")
    for synset, model in (("02691156", "1a2b3c"), ("02691156", "4d5e6f"), ("03001627", "1a2b3c")):
        folder = root / synset / model / "models"
        folder.mkdir(parents=True)
        shutil.copy(obj, folder / "model_normalized.obj")
    return root


@pytest.fixture
def twins(tmp_path: Path, corpus_meshes: list[Path]) -> Path:
    """link_0.stl beside link_0.obj, as robot description packages ship them."""
    root = tmp_path / "robot"
    root.mkdir()
    shutil.copy(next(p for p in corpus_meshes if p.suffix == ".obj"), root / "link_0.obj")
    shutil.copy(next(p for p in corpus_meshes if p.suffix == ".stl"), root / "link_0.stl")
    return root


def test_template_fields() -> None:
    rel = "02691156/1a2b3c/models/model_normalized.obj"
    assert sample_id_for(rel) == "02691156/1a2b3c/models/model_normalized"
    assert sample_id_for(rel, "{parts[0]}/{parts[1]}") == "02691156/1a2b3c"
    assert sample_id_for(rel, KEEP_EXTENSION) == rel
    assert (
        sample_id_for(rel, "{parent}|{stem}|{ext}|{name}")
        == "02691156/1a2b3c/models|model_normalized|obj|model_normalized.obj"
    )
    with pytest.raises(ValueError, match="parts"):
        sample_id_for("flat.obj", "{parts[1]}")
    with pytest.raises(ValueError, match="fields: path, id, parts"):
        sample_id_for("flat.obj", "{nope}")


def test_shapenet_ids_from_a_template(shapenet: Path) -> None:
    items = discover_sources(shapenet, id_template="{parts[0]}/{parts[1]}")
    assert [sid for sid, _ in items] == ["02691156/1a2b3c", "02691156/4d5e6f", "03001627/1a2b3c"]
    assert all(path.endswith("models/model_normalized.obj") for _, path in items)
    # the same rule over a .txt manifest; a .jsonl manifest keeps its own ids
    (shapenet / "list.txt").write_text("02691156/1a2b3c/models/model_normalized.obj\n")
    assert discover_sources(shapenet / "list.txt", id_template="{parts[0]}/{parts[1]}") == [
        ("02691156/1a2b3c", str(shapenet / "02691156/1a2b3c/models/model_normalized.obj"))
    ]
    (shapenet / "list.jsonl").write_text(
        json.dumps({"id": "plane", "path": "02691156/1a2b3c/models/model_normalized.obj"}) + "\n"
    )
    assert [sid for sid, _ in discover_sources(shapenet / "list.jsonl", id_template="{stem}")] == [
        "plane"
    ]
    with pytest.raises(SourceError, match="model_normalized.obj"):
        discover_sources(shapenet, id_template="{parts[9]}")


def test_dataset_names_both_paths_of_a_collision_and_keeps_ext_on_request(twins: Path) -> None:
    ds = CachedDataset(twins / "cache", "spc", sources=twins, on_miss="error", level=3)
    assert len(ds) == 2  # the clash is a sample that fails alone, not a refused dataset
    with pytest.raises(SourceError) as err:
        ds[1]
    assert err.value.path == str(twins / "link_0.stl") and str(twins / "link_0.obj") in str(
        err.value
    )
    assert "--id-keep-ext" in err.value.reason and "spcache.KEEP_EXTENSION" in err.value.reason
    ds = CachedDataset(
        twins / "cache", "spc", sources=twins, id_template=spcache.KEEP_EXTENSION, level=3
    )
    assert [ds.sample_id(i) for i in range(len(ds))] == ["link_0.obj", "link_0.stl"]
    assert spcache.KEEP_EXTENSION == KEEP_EXTENSION and "KEEP_EXTENSION" in spcache.__all__


BROKEN_FOLDER_SCRIPT = """
import json
import spcache
from torch.utils.data import DataLoader


def main():
    ds = spcache.CachedDataset(
        "cache", "spc", sources="broken", on_miss="error", on_error="skip",
        level=3, surface_samples=300,
    )
    n = len(ds)
    loader = DataLoader(ds, batch_size=2, num_workers=2, collate_fn=spcache.collate_spc)
    read = sum(len(batch["lengths"]) for batch in loader if batch)
    failed = {k: [v.sample_id, v.path, v.reason] for k, v in ds.failed.items()}
    print(json.dumps({"len": n, "read": read, "failed": failed}))


if __name__ == "__main__":
    main()
"""


def test_a_folder_with_two_files_of_one_id_skips_the_second_alone(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """The newcomer's folder: ``broken/empty.obj`` and ``broken/empty.ply`` beside a good
    mesh. Precompute fails both (one empty, one a duplicate id); a dataset over the folder
    with ``on_error="skip"`` reads the good one and lists both others in ``ds.failed``."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "empty.obj").write_bytes(b"")
    (broken / "empty.ply").write_bytes(b"")
    shutil.copy(next(p for p in corpus_meshes if p.suffix == ".obj"), broken / "good.obj")
    done = _precompute(broken, tmp_path / "cache")
    assert done.returncode == 1, done.stderr[-2000:]
    errors = {e["path"]: e["reason"] for e in json.loads(done.stdout)["errors"]}
    assert "duplicate sample id 'empty'" in errors[str(broken / "empty.ply")]
    (tmp_path / "train.py").write_text(BROKEN_FOLDER_SCRIPT)
    user = run([sys.executable, "train.py"], cwd=tmp_path, timeout=300)
    assert user.returncode == 0, user.stderr[-3000:]
    got = json.loads(user.stdout)
    assert got["len"] == 3 and got["read"] == 1
    clash_path = str(tmp_path.resolve() / "broken" / "empty.ply")
    assert set(got["failed"]) == {"empty", clash_path}, got["failed"]
    sample_id, path, reason = got["failed"][clash_path]
    assert sample_id == "empty" and path == clash_path
    assert reason.startswith("SourceError: ") and "broken/empty.obj" in reason
    assert "--id-keep-ext" in reason and "spcache.KEEP_EXTENSION" in reason
    assert got["failed"]["empty"][1].endswith("broken/empty.obj")
    assert got["failed"]["empty"][2].startswith("RecordNotFound")


def _precompute(source: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_spcache(
        "precompute",
        source,
        "--recipe",
        "spc",
        "--param",
        "level=3",
        "--param",
        "surface_samples=300",
        "--cache",
        cache,
        "--device",
        "cpu",
        "--backend",
        "torch",
        "--loaders",
        "0",
        "--json",
        *extra,
    )


def test_precompute_keep_ext_and_template(twins: Path, shapenet: Path, tmp_path: Path) -> None:
    default = _precompute(twins, tmp_path / "a")
    assert default.returncode == 1
    summary = json.loads(default.stdout)
    (error,) = summary["errors"]  # the collision names both paths
    assert (
        error["id"] == "link_0"
        and "link_0.obj" in error["reason"]
        and error["path"].endswith("link_0.stl")
    )
    kept = _precompute(twins, tmp_path / "b", "--id-keep-ext")
    assert kept.returncode == 0, kept.stderr[-2000:]
    assert json.loads(kept.stdout)["done"] == 2
    shaped = _precompute(shapenet, tmp_path / "c", "--id-template", "{parts[0]}/{parts[1]}")
    assert shaped.returncode == 0, shaped.stderr[-2000:]
    ds = CachedDataset(tmp_path / "c", "spc", level=3, surface_samples=300)
    assert sorted(ds.sample_id(i) for i in range(len(ds))) == [
        "02691156/1a2b3c",
        "02691156/4d5e6f",
        "03001627/1a2b3c",
    ]
    bad = _precompute(shapenet, tmp_path / "d", "--id-template", "{parts[7]}")
    assert bad.returncode == 2 and "id template" in bad.stderr and len(bad.stderr.splitlines()) == 1


@pytest.mark.slow
def test_read_through_never_queues_the_second_file_of_one_id(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """With a worker computing misses, the clash is skipped without being queued: its id
    is the first file's, so computing it would write the wrong file's record under it."""
    from cache_store.jobs.queue import JobQueue
    from tests.helpers.read_through import start_worker, stop_worker

    mesh = next(p for p in corpus_meshes if p.suffix == ".obj")
    folder = tmp_path / "meshes"
    folder.mkdir()
    shutil.copy(mesh, folder / "a.obj")
    shutil.copy(next(p for p in corpus_meshes if p.suffix == ".stl"), folder / "a.stl")
    shutil.copy(mesh, folder / "b.obj")
    worker = start_worker(tmp_path / "cache")
    try:
        ds = CachedDataset(
            tmp_path / "cache",
            "spc",
            sources=folder,
            on_error="skip",
            warm_ahead=4,
            level=3,
            surface_samples=300,
        )
        read = [ds[i] for i in range(len(ds))]
    finally:
        stop_worker(worker)
    assert [sample is None for sample in read] == [False, True, False]
    assert list(ds.failed) == [str(folder / "a.stl")]
    queue = JobQueue(tmp_path / "cache")
    try:
        paths = [item["path"] for job in queue.jobs() for item in queue.items(job.id)]
    finally:
        queue.close()
    assert sorted(paths) == [str(folder / "a.obj"), str(folder / "b.obj")]
