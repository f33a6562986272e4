"""cache_store.sources.discover: the one source discovery (patterns and limits here; the
directory and manifest rules are in tests/workers/test_cli.py, which predates the move)."""

from __future__ import annotations

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
