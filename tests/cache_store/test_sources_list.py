"""cache_store.sources.discover: the one source discovery: directories, manifests,
patterns and limits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cache_store.errors import SourceError
from cache_store.sources.discover import SUPPORTED_EXTENSIONS, discover_sources


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
