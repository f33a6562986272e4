"""cache_store.sources.discover: the one source discovery: directories, manifests,
patterns and limits."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import spcache
from cache_store.errors import SourceError
from cache_store.sources.discover import (
    SUPPORTED_EXTENSIONS,
    describe_left_out,
    discover,
    discover_sources,
)
from tests.helpers.procs import run_spcache


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("0 0 0\n")
    return path


def test_a_limit_fails_the_whole_request(tmp_path: Path) -> None:
    for i in range(5):
        _touch(tmp_path / f"s{i}.xyz")
    assert len(discover_sources([tmp_path], limit=5)) == 5
    with pytest.raises(SourceError, match="more than 4 sources"):
        discover_sources([tmp_path], limit=4)


def test_the_workers_load_exactly_the_extensions_discovery_finds() -> None:
    from workers.source_load import SUPPORTED_EXTENSIONS as LOADABLE

    assert LOADABLE is SUPPORTED_EXTENSIONS


def test_directory_discovery_is_recursive_sorted_and_ids_are_relative(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _touch(root / "b.xyz")
    _touch(root / "chairs" / "a1.OBJ")
    _touch(root / "chairs" / "deep" / "x.ply")
    _touch(root / "notes.md")
    _touch(root / ".hidden" / "y.obj")
    _touch(root / ".z.obj")
    items = discover_sources([root])
    assert items == [
        ("b", str(root / "b.xyz")),
        ("chairs/a1", str(root / "chairs" / "a1.OBJ")),
        ("chairs/deep/x", str(root / "chairs" / "deep" / "x.ply")),
    ]


def test_manifests_and_single_files(tmp_path: Path) -> None:
    a = _touch(tmp_path / "meshes" / "a.obj")
    elsewhere = _touch(tmp_path / "other" / "b.xyz")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "list.txt").write_text(f"# comment\n../meshes/a.obj\n\n{elsewhere}\n")
    assert discover_sources([tmp_path / "m" / "list.txt"]) == [
        ("a", str(tmp_path / "m" / "../meshes/a.obj")),
        ("b", str(elsewhere)),
    ]
    (tmp_path / "list.txt").write_text("# comment\nmeshes/a.obj\n\n" + str(a) + "\n")
    (tmp_path / "list.jsonl").write_text(json.dumps({"id": "first", "path": "meshes/a.obj"}) + "\n")
    assert discover_sources([tmp_path / "list.txt"]) == [
        ("meshes/a", str(tmp_path / "meshes/a.obj")),
        ("meshes/a", str(a)),
    ]
    assert discover_sources([tmp_path / "list.jsonl"]) == [
        ("first", str(tmp_path / "meshes/a.obj"))
    ]
    assert discover_sources([a]) == [("a", str(a))]


@pytest.mark.parametrize(
    "content,reason",
    [
        ("{not json\n", "line 1: not JSON"),
        ('{"id": "x"}\n', "line 1: expected an object"),
        ('["x", "y"]\n', "expected an object"),
    ],
)
def test_bad_jsonl_manifest(tmp_path: Path, content: str, reason: str) -> None:
    (tmp_path / "m.jsonl").write_text(content)
    with pytest.raises(SourceError, match=reason):
        discover_sources([tmp_path / "m.jsonl"])


def test_missing_source_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file"):
        discover_sources([tmp_path / "nope"])


ROBOT_FOLDER = {  # a robot description package: meshes spcache reads beside ones it does not
    "visual/base.dae": "collada",
    "visual/arm.dae": "collada",
    "visual/hand.dae": "collada",
    "visual/wheel.gltf": "{}",
    "visual/cam.gltf": "{}",
    "visual/wheel.bin": "bin",
    "visual/cam.bin": "bin",
    "collision/base.msh": "gmsh",
    "robot.URDF": "<robot/>",
    "LICENSE": "text",
    ".hidden.dae": "hidden entries are not files of the folder",
}


def _robot(root: Path, good: Path) -> Path:
    for name, text in ROBOT_FOLDER.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "collision" / "base.obj").write_bytes(good.read_bytes())
    return root


def test_discovery_counts_what_it_leaves_out_by_type(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    robot = _robot(tmp_path / "robot", next(p for p in corpus_meshes if p.suffix == ".obj"))
    found = discover(robot)
    assert [sid for sid, _ in found.items] == ["collision/base"]
    assert found.left_out == {".dae": 3, ".gltf": 2, ".bin": 2, ".msh": 1, ".urdf": 1, "": 1}
    assert describe_left_out(found.left_out) == (
        "left out 10 files of unsupported types: .dae 3, .bin 2, .gltf 2, "
        "(no extension) 1, .msh 1, .urdf 1"
    )
    assert describe_left_out({}) == "" and discover_sources(robot) == found.items


def _precompute(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_spcache(
        "precompute", *args, "--recipe", "spc", "--param", "level=3",
        "--param", "surface_samples=300", "--cache", "cache", "--device", "cpu",
        "--loaders", "0", cwd=cwd,
    )  # fmt: skip


def test_precompute_says_how_many_files_of_which_types_it_left_out(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    _robot(tmp_path / "robot", next(p for p in corpus_meshes if p.suffix == ".obj"))
    said = (
        "left out 10 files of unsupported types: .dae 3, .bin 2, .gltf 2, "
        "(no extension) 1, .msh 1, .urdf 1"
    )
    text = _precompute(tmp_path, "robot")
    assert text.returncode == 0, text.stderr[-2000:]
    assert f"  {said}\n" in text.stdout and "done 1, skipped 0, failed 0" in text.stdout
    as_json = _precompute(tmp_path, "robot", "--json")
    assert as_json.returncode == 0, as_json.stderr[-2000:]
    summary = json.loads(as_json.stdout)
    assert summary["skipped"] == 1 and summary["left_out"] == {
        ".dae": 3,
        ".gltf": 2,
        ".bin": 2,
        ".msh": 1,
        ".urdf": 1,
        "": 1,
    }
    result = spcache.precompute(
        tmp_path / "robot", "spc", tmp_path / "cache", level=3, surface_samples=300, progress=False
    )
    assert dict(result.left_out) == summary["left_out"] and result.skipped == 1
    assert result.as_json()["left_out"] == summary["left_out"]
    assert spcache.PrecomputeResult.from_json(summary).left_out == result.left_out
    # a folder of nothing spcache reads: the one line says what it held
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "a.dae").write_text("collada")
    none = _precompute(tmp_path, "only")
    assert none.returncode == 2
    assert (
        "no supported source files found in only (left out 1 file of unsupported types: .dae 1)"
        in (none.stderr)
    )
