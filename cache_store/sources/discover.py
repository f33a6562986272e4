"""Source discovery: which files a directory, a manifest or a path names, as ``(id, path)``.

One function, :func:`discover_sources`, shared by ``spcache precompute`` and
read-through datasets (``CachedDataset(..., sources=...)``), so both name the same samples.
(The service's warm-up glob is a different, bounded walk over untrusted patterns:
``service.warmup.expand_glob``.) CPU only: it
reads directory listings and manifests, never the files themselves (no trimesh, no torch).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from cache_store.errors import SourceError

__all__ = ["POINT_CLOUD_EXTENSIONS", "MESH_EXTENSIONS", "SUPPORTED_EXTENSIONS",
           "MANIFEST_EXTENSIONS", "discover_sources"]

#: file extensions a worker can load (``workers.sources`` loads them)
POINT_CLOUD_EXTENSIONS = frozenset({".npy", ".npz", ".xyz", ".pts"})
MESH_EXTENSIONS = frozenset({".obj", ".ply", ".stl", ".off", ".glb"})
SUPPORTED_EXTENSIONS = POINT_CLOUD_EXTENSIONS | MESH_EXTENSIONS
MANIFEST_EXTENSIONS = frozenset({".txt", ".jsonl"})


def discover_sources(sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *,
                     limit: int | None = None) -> list[tuple[str, str]]:
    """``(sample id, path)`` pairs from files, directories and manifests, in a stable order.

    ``sources`` is one source or an iterable of them:

    - a directory: every supported file under it (recursively, hidden entries skipped),
      sorted; the id is the path relative to the directory, without extension;
    - ``.txt``: a manifest, one path a line (``#`` comments), relative to the manifest's
      folder; the id is that relative path without extension, or for a path outside
      the folder its file name without extension;
    - ``.jsonl``: a manifest, one ``{"id": ..., "path": ...}`` object a line;
    - any other file: one sample whose id is the file name without extension.

    ``limit`` caps the number of pairs (a request that names more fails as a whole).

    Raises:
        SourceError: a source that does not exist or cannot be read, a malformed manifest,
            or more than ``limit`` pairs.
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    items: list[tuple[str, str]] = []
    for source in sources:
        path = Path(source)
        try:
            is_dir = path.is_dir()
        except OSError as exc:
            raise SourceError(path, f"cannot read: {exc.strerror or exc}") from exc
        if is_dir:
            items.extend(_walk(path))
        elif not path.exists():
            raise SourceError(path, "no such file or directory")
        elif path.suffix.lower() == ".txt":
            items.extend(_read_txt_manifest(path))
        elif path.suffix.lower() == ".jsonl":
            items.extend(_read_jsonl_manifest(path))
        else:
            items.append((path.stem, str(path)))
        if limit is not None and len(items) > limit:
            raise SourceError(path, f"names more than {limit} sources; split the request")
    return items


def _walk(root: Path) -> list[tuple[str, str]]:
    if not os.access(root, os.R_OK | os.X_OK):
        raise SourceError(root, "directory is not readable")
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for filename in sorted(filenames):
            if filename.startswith("."):
                continue
            file = Path(dirpath) / filename
            if file.suffix.lower() in SUPPORTED_EXTENSIONS:
                found.append((file.relative_to(root).with_suffix("").as_posix(), str(file)))
    found.sort()
    return found


def _manifest_lines(manifest: Path) -> list[tuple[int, str]]:
    try:
        text = manifest.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(manifest, f"cannot read manifest: {exc}") from exc
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), start=1)
            if line.strip() and not line.strip().startswith("#")]


def _read_txt_manifest(manifest: Path) -> list[tuple[str, str]]:
    items = []
    for _, line in _manifest_lines(manifest):
        path = manifest.parent / line  # an absolute line stays absolute
        items.append((_manifest_id(manifest.parent, Path(line)), str(path)))
    return items


def _manifest_id(base: Path, written: Path) -> str:
    """The path relative to the manifest's folder, without extension; a path outside that
    folder (absolute, or climbing out with ``..``) gets its file name without extension."""
    if written.is_absolute():
        try:
            written = written.relative_to(base.resolve())
        except ValueError:
            return written.stem
    inside = Path(os.path.normpath(written))
    if inside.parts and inside.parts[0] == "..":
        return written.stem
    return inside.with_suffix("").as_posix()


def _read_jsonl_manifest(manifest: Path) -> list[tuple[str, str]]:
    items = []
    for lineno, line in _manifest_lines(manifest):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SourceError(manifest, f"line {lineno}: not JSON ({exc.msg})") from exc
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) \
                or not isinstance(entry.get("id"), str):
            raise SourceError(manifest, f"line {lineno}: expected an object with string "
                                        f"'id' and 'path'")
        items.append((entry["id"], str(manifest.parent / entry["path"])))
    return items
