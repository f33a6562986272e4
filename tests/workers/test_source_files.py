"""Opening sources in the worker: regular files only, inside the roots, within limits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cache_store.errors import SourceError
from cache_store.sources.hashing import hash_bytes
from cache_store.sources.files import (
    SourceLimits,
    hash_source_file,
    open_resolved,
    read_source_file,
    resolve_source,
)


@pytest.fixture()
def roots(tmp_path: Path) -> tuple[Path, Path]:
    inside, outside = tmp_path / "sources", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    (inside / "a.xyz").write_bytes(b"0 0 0\n1 1 1\n")
    (outside / "secret.xyz").write_bytes(b"9 9 9\n8 8 8\n")
    return inside, outside


def test_a_regular_file_inside_the_roots_reads_and_hashes_like_hash_bytes(roots) -> None:
    inside, _ = roots
    limits = SourceLimits.of([inside])
    assert read_source_file(inside / "a.xyz", limits) == b"0 0 0\n1 1 1\n"
    assert hash_source_file(inside / "a.xyz", limits) == hash_bytes(b"0 0 0\n1 1 1\n")


def test_a_link_that_stays_inside_the_roots_is_followed(roots) -> None:
    inside, _ = roots
    (inside / "alias.xyz").symlink_to(inside / "a.xyz")
    assert read_source_file(inside / "alias.xyz", SourceLimits.of([inside])) == b"0 0 0\n1 1 1\n"


def test_a_link_out_of_the_roots_is_refused_and_allowed_without_roots(roots) -> None:
    inside, outside = roots
    (inside / "leak.xyz").symlink_to(outside / "secret.xyz")
    with pytest.raises(SourceError, match="outside the allowed source roots") as info:
        read_source_file(inside / "leak.xyz", SourceLimits.of([inside]))
    assert info.value.path == str(inside / "leak.xyz")
    assert read_source_file(inside / "leak.xyz") == b"9 9 9\n8 8 8\n"  # no roots: any path


def test_a_final_component_swapped_for_a_link_after_resolving_is_refused(roots) -> None:
    inside, outside = roots
    path = inside / "a.xyz"
    limits = SourceLimits.of([inside])
    resolved = resolve_source(path, limits)  # the check passes: a regular file inside
    path.unlink()
    path.symlink_to(outside / "secret.xyz")  # the swap, between check and open
    with pytest.raises(SourceError, match="symbolic link after it was checked"):
        open_resolved(path, resolved, limits)
    # the same swap with a link that stays inside the roots is refused as well: O_NOFOLLOW
    path.unlink()
    (inside / "b.xyz").write_bytes(b"1 2 3\n")
    path.symlink_to(inside / "b.xyz")
    with pytest.raises(SourceError, match="symbolic link"):
        open_resolved(path, resolved, limits)


def test_a_parent_directory_swapped_after_resolving_is_caught_by_the_opened_path(roots) -> None:
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd (Linux) to see the opened file's path")
    inside, outside = roots
    (inside / "sub").mkdir()
    (inside / "sub" / "a.xyz").write_bytes(b"0 0 0\n")
    (outside / "a.xyz").write_bytes(b"7 7 7\n")
    limits = SourceLimits.of([inside])
    resolved = resolve_source(inside / "sub" / "a.xyz", limits)
    (inside / "sub" / "a.xyz").unlink()
    (inside / "sub").rmdir()
    (inside / "sub").symlink_to(outside)  # a directory on the path now leads out
    with pytest.raises(SourceError, match="outside the allowed source roots"):
        open_resolved(inside / "sub" / "a.xyz", resolved, limits)


@pytest.mark.parametrize(
    "make, kind",
    [
        (lambda p: os.mkfifo(p), "FIFO"),
        (lambda p: p.mkdir(), "directory"),
    ],
)
def test_special_files_are_refused_without_blocking(tmp_path: Path, make, kind: str) -> None:
    path = tmp_path / "shape.xyz"
    make(path)
    with pytest.raises(SourceError, match=f"not a regular file \\(it is a {kind}\\)"):
        read_source_file(path)


def test_a_device_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "null.xyz"
    link.symlink_to("/dev/zero")  # an endless read if it were allowed
    with pytest.raises(SourceError, match="character device"):
        read_source_file(link)


def test_a_file_over_the_byte_limit_is_refused(roots) -> None:
    inside, _ = roots
    limits = SourceLimits.of([inside], max_bytes=8)
    with pytest.raises(SourceError, match="over the per-source limit of 8 bytes"):
        read_source_file(inside / "a.xyz", limits)
    assert read_source_file(inside / "a.xyz", SourceLimits.of([inside], max_bytes=12))


def test_a_missing_file_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="cannot read file"):
        read_source_file(tmp_path / "gone.xyz")
