"""cache_store.sources_list: the one source discovery (patterns and limits here; the
directory and manifest rules are in tests/workers/test_cli.py, which predates the move)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_store.errors import SourceError
from cache_store.sources_list import SUPPORTED_EXTENSIONS, discover_sources


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("0 0 0\n")
    return path


def test_a_pattern_selects_supported_files_under_the_directory(tmp_path: Path) -> None:
    _touch(tmp_path / "chairs" / "a1.obj")
    _touch(tmp_path / "chairs" / "b2.ply")
    _touch(tmp_path / "chairs" / "notes.obj.txt")
    _touch(tmp_path / "tables" / "t.obj")
    _touch(tmp_path / ".cache" / "h.obj")
    assert discover_sources([tmp_path], pattern="chairs/*") == [
        ("chairs/a1", str(tmp_path / "chairs" / "a1.obj")),
        ("chairs/b2", str(tmp_path / "chairs" / "b2.ply"))]
    assert [i for i, _ in discover_sources([tmp_path], pattern="**/*.obj")] == [
        "chairs/a1", "tables/t"]
    # with no pattern: the same ids as the pattern that matches everything
    assert discover_sources([tmp_path]) == discover_sources([tmp_path], pattern="**/*")


@pytest.mark.parametrize("pattern", ["../*.obj", "/etc/*", ""])
def test_a_pattern_must_stay_inside(tmp_path: Path, pattern: str) -> None:
    with pytest.raises(SourceError, match="must stay inside"):
        discover_sources([tmp_path], pattern=pattern)


def test_a_limit_fails_the_whole_request(tmp_path: Path) -> None:
    for i in range(5):
        _touch(tmp_path / f"s{i}.xyz")
    assert len(discover_sources([tmp_path], limit=5)) == 5
    with pytest.raises(SourceError, match="more than 4 sources"):
        discover_sources([tmp_path], limit=4)


def test_the_workers_load_exactly_the_extensions_discovery_finds() -> None:
    from workers.sources import SUPPORTED_EXTENSIONS as LOADABLE

    assert LOADABLE is SUPPORTED_EXTENSIONS
