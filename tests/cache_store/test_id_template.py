"""Sample ids the user chooses: ``--id-template`` / ``--id-keep-ext`` in precompute and
``CachedDataset(sources=..., id_template=...)``, with collisions named, manifests as before."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from cache_store import CachedDataset
from cache_store.errors import SourceError
from cache_store.sources.discover import KEEP_EXTENSION, discover_sources, sample_id_for
from tests.helpers.procs import run_spcache


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
    with pytest.raises(SourceError) as err:
        len(CachedDataset(twins / "cache", "spc", sources=twins, level=3))
    assert "link_0.obj" in str(err.value) and "link_0.stl" in str(err.value)
    ds = CachedDataset(twins / "cache", "spc", sources=twins, id_template=KEEP_EXTENSION, level=3)
    assert [ds.sample_id(i) for i in range(len(ds))] == ["link_0.obj", "link_0.stl"]


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
