"""One parser for cache locations: every opener reads a string the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_store.errors import UnknownName
from cache_store.location import cache_dir_problem, is_remote, local_path, parse_location
from cache_store.stores.opener import open_store
from cache_store.stores.lmdb import LMDBStore


@pytest.mark.parametrize("prefix", ["file://", "FILE://", "File://", "file://localhost"])
def test_a_file_url_in_any_case_is_the_local_path(tmp_path: Path, prefix: str) -> None:
    text = f"{prefix}{tmp_path}"
    parsed = parse_location(text)
    assert (parsed.kind, parsed.is_local, parsed.target) == ("lmdb", True, str(tmp_path))
    assert not is_remote(text)
    assert local_path(text) == str(tmp_path)
    store = open_store(text, readonly=False)
    assert isinstance(store, LMDBStore)
    # The cache lands at the path the URL names, never at a relative "FILE:" directory.
    assert Path(store.location) == tmp_path


def test_open_store_never_takes_a_file_url_for_a_relative_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "cache"
    store = open_store(f"FILE://{target}", readonly=False)
    store.put_many([])  # creates the environment
    store.close()
    assert (target / "records").is_dir()
    assert not (tmp_path / "FILE:").exists()


@pytest.mark.parametrize(
    "text, kind, local",
    [
        ("cache", "lmdb", True),
        ("/abs/cache", "lmdb", True),
        ("snap.zarr", "zarr", True),
        ("file:///data/snap.zarr/", "zarr", True),
        ("s3://bucket/prefix/snap.zarr", "zarr", False),
        ("S3://bucket/snap.ZARR", "zarr", False),
        ("http://127.0.0.1:8000", "http", False),
        ("HTTPS://host:8443", "http", False),
    ],
)
def test_kind_and_locality_agree_everywhere(text: str, kind: str, local: bool) -> None:
    parsed = parse_location(text)
    assert parsed.kind == kind
    assert parsed.is_local is local
    assert is_remote(text) is (not local)
    if not local:
        assert parsed.target.split("://")[0] == parsed.scheme  # scheme lower-cased once


@pytest.mark.parametrize("text", ["ftp://host/x", "s3://bucket/cache", "file://otherhost/x"])
def test_a_location_no_store_can_open_is_refused_by_name(text: str) -> None:
    with pytest.raises(UnknownName):
        parse_location(text)


def test_a_remote_location_is_not_a_cache_directory() -> None:
    assert (
        cache_dir_problem("http://127.0.0.1:8000", write=True)
        == "http://127.0.0.1:8000: not a local cache directory"
    )
    with pytest.raises(ValueError, match="not a local path"):
        local_path("s3://bucket/snap.zarr")


def test_a_parsed_location_passes_through_unparsed_and_a_url_never_becomes_a_path() -> None:
    parsed = parse_location("s3://Bucket/snap.zarr")
    assert parse_location(parsed) is parsed
    assert is_remote(parsed) and str(parsed) == "s3://Bucket/snap.zarr"
    assert (
        cache_dir_problem(parsed, write=True)
        == "s3://Bucket/snap.zarr: not a local cache directory"
    )
    with pytest.raises(ValueError, match="not a local path"):
        parsed.path()
    local = parse_location("FILE:///data/cache")
    assert local.path() == Path("/data/cache") and local_path(local) == "/data/cache"
