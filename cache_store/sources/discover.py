"""Source discovery: which files a directory, a manifest or a path names, as ``(id, path)``.

One rule, :func:`discover` (and :func:`discover_sources`, its pairs alone), shared by
``spcache precompute`` and read-through datasets (``CachedDataset(..., sources=...)``), so
both name the same samples and leave out the same files (counted by type, never silently).
(The service's warm-up glob is a different, bounded walk over untrusted patterns:
``service.warmup.expand_glob``.) CPU only: it
reads directory listings and manifests, never the files themselves (no trimesh, no torch).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from cache_store.errors import SourceError

__all__ = [
    "POINT_CLOUD_EXTENSIONS",
    "MESH_EXTENSIONS",
    "SUPPORTED_EXTENSIONS",
    "MANIFEST_EXTENSIONS",
    "KEEP_EXTENSION",
    "Discovery",
    "discover",
    "discover_sources",
    "describe_left_out",
    "sample_id_for",
    "id_clash_reason",
    "id_clashes",
]

#: the id template that keeps the extension (``link_0.stl`` and ``link_0.obj`` differ);
#: public as ``spcache.KEEP_EXTENSION``, and what ``spcache precompute --id-keep-ext`` uses
KEEP_EXTENSION = "{path}"

#: file extensions a worker can load (``workers.source_load`` loads them)
POINT_CLOUD_EXTENSIONS = frozenset({".npy", ".npz", ".xyz", ".pts"})
MESH_EXTENSIONS = frozenset({".obj", ".ply", ".stl", ".off", ".glb"})
SUPPORTED_EXTENSIONS = POINT_CLOUD_EXTENSIONS | MESH_EXTENSIONS
MANIFEST_EXTENSIONS = frozenset({".txt", ".jsonl"})


def sample_id_for(relative: str, template: str | None = None) -> str:
    """The sample id of a file at ``relative`` (a ``/``-separated path, with extension,
    relative to the directory or manifest folder it was found through).

    Without a template it is ``relative`` without its extension. A template is a
    :meth:`str.format` string over ``path`` (``relative`` itself), ``id`` (the default
    id), ``parts`` (the default id's components: ``{parts[0]}/{parts[1]}``), ``parent``,
    ``name`` (with extension), ``stem`` and ``ext`` (without the dot).

    Raises:
        ValueError: the template names an unknown field or a part the path lacks, or
            gives an empty id.
    """
    path = PurePosixPath(relative)
    default = path.with_suffix("").as_posix() if path.suffix else path.as_posix()
    if template is None:
        return default
    fields = {
        "path": path.as_posix(),
        "id": default,
        "parts": PurePosixPath(default).parts,
        "parent": path.parent.as_posix() if path.parent != PurePosixPath(".") else "",
        "name": path.name,
        "stem": path.stem,
        "ext": path.suffix.lstrip("."),
    }
    try:
        sample_id = template.format(**fields)
    except (KeyError, IndexError, AttributeError, ValueError) as exc:
        known = ", ".join(fields)
        raise ValueError(
            f"id template {template!r} does not fit {relative!r} "
            f"({type(exc).__name__}: {exc}; fields: {known})"
        ) from None
    if not sample_id.strip("/"):
        raise ValueError(f"id template {template!r} gives an empty id for {relative!r}")
    return sample_id


@dataclass(frozen=True)
class Discovery:
    """What :func:`discover` found: ``items``, the ``(sample id, path)`` pairs, and
    ``left_out``, how many files of each unsupported type (lowercase extension with its
    dot, ``""`` for none) the directory walks passed over."""

    items: list[tuple[str, str]]
    left_out: Mapping[str, int] = field(default_factory=dict)


def describe_left_out(left_out: Mapping[str, int]) -> str:
    """``"left out 7 files of unsupported types: .dae 3, .gltf 2, .bin 2"`` (most first),
    or ``""`` when nothing was left out."""
    total = sum(left_out.values())
    if not total:
        return ""
    kinds = sorted(left_out.items(), key=lambda kv: (-kv[1], kv[0]))
    listed = ", ".join(f"{ext or '(no extension)'} {n}" for ext, n in kinds)
    files = "file" if total == 1 else "files"
    return f"left out {total} {files} of unsupported types: {listed}"


def discover_sources(
    sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    limit: int | None = None,
    id_template: str | None = None,
) -> list[tuple[str, str]]:
    """``(sample id, path)`` pairs from files, directories and manifests, in a stable
    order: :func:`discover`'s ``items``."""
    return discover(sources, limit=limit, id_template=id_template).items


def discover(
    sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    limit: int | None = None,
    id_template: str | None = None,
) -> Discovery:
    """``(sample id, path)`` pairs from files, directories and manifests, in a stable
    order, and what the directory walks left out.

    ``sources`` is one source or an iterable of them:

    - a directory: every supported file under it (recursively, hidden entries skipped),
      sorted; the id is the path relative to the directory, without extension; every
      other file (``.dae``, ``.gltf``, ``.bin``, a ``README``) is counted by its
      extension in ``left_out`` (:func:`describe_left_out` says it in words);
    - ``.txt``: a manifest, one path a line (``#`` comments), relative to the manifest's
      folder; the id is that relative path without extension, or for a path outside
      the folder its file name without extension;
    - ``.jsonl``: a manifest, one ``{"id": ..., "path": ...}`` object a line;
    - any other file: one sample whose id is the file name without extension.

    ``id_template`` (see :func:`sample_id_for`; :data:`KEEP_EXTENSION` keeps the
    extension) makes the ids of directories, ``.txt`` manifests and files from their
    relative paths instead; a ``.jsonl`` manifest's ids are its own. Two files with one
    id are not caught here: the first keeps the id and every later one is a sample that
    fails alone (:func:`id_clashes`, :func:`id_clash_reason`), in ``precompute`` and in
    a dataset over sources alike.

    ``limit`` caps the number of pairs (a request that names more fails as a whole).

    Raises:
        SourceError: a source that does not exist or cannot be read, a malformed manifest,
            more than ``limit`` pairs, or an id template that does not fit a path.
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    items: list[tuple[str, str]] = []
    left_out: Counter[str] = Counter()
    for source in sources:
        path = Path(source)
        try:
            is_dir = path.is_dir()
        except OSError as exc:
            raise SourceError(path, f"cannot read: {exc.strerror or exc}") from exc
        if is_dir:
            items.extend(_walk(path, id_template, left_out))
        elif not path.exists():
            raise SourceError(path, "no such file or directory")
        elif path.suffix.lower() == ".txt":
            items.extend(_read_txt_manifest(path, id_template))
        elif path.suffix.lower() == ".jsonl":
            items.extend(_read_jsonl_manifest(path))
        else:
            items.append((_id(path, path.name, id_template), str(path)))
        if limit is not None and len(items) > limit:
            raise SourceError(path, f"names more than {limit} sources; split the request")
    return Discovery(items, dict(left_out))


def id_clash_reason(sample_id: str, first_path: str) -> str:
    """Why a file whose sample id an earlier file already has fails (the one wording
    of ``spcache precompute``, the worker and ``CachedDataset``)."""
    return (
        f"duplicate sample id {sample_id!r} (first given for {first_path}); give each file "
        f"its own id: spcache precompute --id-keep-ext, or "
        f"id_template=spcache.KEEP_EXTENSION in Python"
    )


def id_clashes(ids: Iterable[str]) -> dict[int, int]:
    """``{position: position of the first with that id}`` for every id already seen
    earlier in ``ids`` (empty when all differ)."""
    first: dict[str, int] = {}
    clashes: dict[int, int] = {}
    for position, sample_id in enumerate(ids):
        earlier = first.setdefault(sample_id, position)
        if earlier != position:
            clashes[position] = earlier
    return clashes


def _id(source: Path, relative: str, template: str | None) -> str:
    try:
        return sample_id_for(relative, template)
    except ValueError as exc:
        raise SourceError(source, str(exc)) from None


def _walk(
    root: Path, template: str | None = None, left_out: Counter[str] | None = None
) -> list[tuple[str, str]]:
    if not os.access(root, os.R_OK | os.X_OK):
        raise SourceError(root, "directory is not readable")
    found: list[tuple[str, str]] = []
    top = str(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        # strings, not Path objects: a directory of a million files is walked per file
        inside = os.path.relpath(dirpath, top).replace(os.sep, "/")
        prefix = "" if inside == "." else inside + "/"
        for filename in sorted(filenames):
            if filename.startswith("."):
                continue
            ext = os.path.splitext(filename)[1].lower()
            ext = "" if ext == "." else ext  # as Path.suffix has it
            if ext in SUPPORTED_EXTENSIONS:
                file = os.path.join(dirpath, filename)
                relative = prefix + filename
                if template is None:  # sample_id_for's default: the path less its extension
                    sample_id = relative[: -len(ext)]
                else:
                    sample_id = _id(Path(file), relative, template)
                found.append((sample_id, file))
            elif left_out is not None:
                left_out[ext] += 1
    found.sort()
    return found


def _manifest_lines(manifest: Path) -> list[tuple[int, str]]:
    try:
        text = manifest.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(manifest, f"cannot read manifest: {exc}") from exc
    return [
        (n, line.strip())
        for n, line in enumerate(text.splitlines(), start=1)
        if line.strip() and not line.strip().startswith("#")
    ]


def _read_txt_manifest(manifest: Path, template: str | None = None) -> list[tuple[str, str]]:
    items = []
    for lineno, line in _manifest_lines(manifest):
        path = manifest.parent / line  # an absolute line stays absolute
        relative = _manifest_relative(manifest.parent, Path(line))
        try:
            sample_id = sample_id_for(relative, template)
        except ValueError as exc:
            raise SourceError(manifest, f"line {lineno}: {exc}") from None
        items.append((sample_id, str(path)))
    return items


def _manifest_relative(base: Path, written: Path) -> str:
    """The path relative to the manifest's folder; a path outside that folder (absolute,
    or climbing out with ``..``) is its file name alone."""
    if written.is_absolute():
        try:
            written = written.relative_to(base.resolve())
        except ValueError:
            return written.name
    inside = Path(os.path.normpath(written))
    if inside.parts and inside.parts[0] == "..":
        return written.name
    return inside.as_posix()


def _read_jsonl_manifest(manifest: Path) -> list[tuple[str, str]]:
    items = []
    for lineno, line in _manifest_lines(manifest):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SourceError(manifest, f"line {lineno}: not JSON ({exc.msg})") from exc
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("path"), str)
            or not isinstance(entry.get("id"), str)
        ):
            raise SourceError(
                manifest, f"line {lineno}: expected an object with string 'id' and 'path'"
            )
        items.append((entry["id"], str(manifest.parent / entry["path"])))
    return items
