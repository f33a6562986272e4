"""Loading sources: read (bounded, through the source gate), hash, parse and validate
meshes and point clouds, with the decoded-size ("bomb") checks.

A *source* is one file holding one shape. :func:`load_source` reads the file's bytes
once, hashes exactly those bytes (so the hash always describes what was parsed), parses
geometry only (materials and textures are skipped), and validates it. Every way a file
can be unusable ends in :class:`~cache_store.errors.SourceError` naming the file and the
reason.

Supported files:

- point clouds: ``.npy`` (a numeric ``[N, 3]`` array), ``.npz`` (an array named
  ``points``, ``xyz`` or ``positions``, or the only array; with ``vertices`` and
  ``faces`` it is a mesh), ``.xyz`` / ``.pts`` text (three numbers a line, optional
  count header, ``#`` comments), and ``.ply`` files without faces;
- meshes: ``.obj``, ``.ply``, ``.stl``, ``.off``, ``.glb`` (through trimesh).

A file in a mesh format that holds vertices but no faces is a point cloud.

Normalisation and surface sampling are :mod:`workers.sampling`.
"""

from __future__ import annotations

import io
import logging
import re
import warnings
import zipfile
from dataclasses import dataclass
from typing import IO, Any
from pathlib import Path

import numpy as np

from cache_store.errors import SourceError
from cache_store.sources.hashing import hash_bytes
from cache_store.sources.discover import (
    MESH_EXTENSIONS,
    POINT_CLOUD_EXTENSIONS,
    SUPPORTED_EXTENSIONS,
)
from cache_store.sources.files import SourceLimits, read_source_file

__all__ = [
    "POINT_CLOUD_EXTENSIONS",
    "MESH_EXTENSIONS",
    "SUPPORTED_EXTENSIONS",
    "LoadedSource",
    "MAX_DECODED_BYTES",
    "hash_bytes",
    "read_source_bytes",
    "load_source",
]

logger = logging.getLogger(__name__)


_NPZ_POINT_NAMES = ("points", "xyz", "positions")


@dataclass(frozen=True)
class LoadedSource:
    """One validated shape, in its file's own coordinates.

    Attributes:
        path: the file it came from.
        source_hash: content hash of the file's bytes (:func:`hash_bytes`).
        vertices: float64 ``[N, 3]``, finite: mesh vertices or the cloud's points.
        faces: int64 ``[F, 3]`` with every index in ``[0, N)`` for a mesh, else None.
        variant: which version of the sample a recipe's ``prepare`` is making: 0, the
            unaugmented shape (no augmentation applied), or 1 .. K-1 of a run asking for
            ``variants=K`` (each with its own seeded generator).
    """

    path: str
    source_hash: str
    vertices: np.ndarray
    faces: np.ndarray | None
    variant: int = 0

    @property
    def kind(self) -> str:
        """``"mesh"`` or ``"points"``."""
        return "points" if self.faces is None else "mesh"

    def used_points(self) -> np.ndarray:
        """The points that define the shape: referenced vertices of a mesh, or all points."""
        if self.faces is None:
            return self.vertices
        return self.vertices[np.unique(self.faces)]


#: Largest array data one source may decode to (an ``.npy`` array, the sum of an
#: ``.npz`` archive's members), checked from headers before anything is allocated.
MAX_DECODED_BYTES = 1 << 30


def read_source_bytes(path: str | Path, limits: SourceLimits | None = None) -> bytes:
    """The bytes of a source file, after checking its extension is supported.

    Read through :func:`cache_store.sources.files.read_source_file`: a regular file only,
    inside ``limits.roots`` when given, within the size and time limits.

    Raises:
        SourceError: unsupported extension, not a regular file, outside the roots, over
            a limit, unreadable or empty file.
    """
    path = Path(path)
    if path.suffix.lower() not in SUPPORTED_EXTENSIONS:
        raise SourceError(
            path,
            f"unsupported file type {path.suffix or '(none)'!r}; "
            f"supported: {', '.join(sorted(SUPPORTED_EXTENSIONS))}",
        )
    data = read_source_file(path, limits)
    if not data:
        raise SourceError(path, "file is empty")
    return data


def load_source(
    path: str | Path, data: bytes | None = None, *, max_decoded_bytes: int = MAX_DECODED_BYTES
) -> LoadedSource:
    """Read (unless ``data`` is given: the file's bytes), hash, parse and validate a source.

    The file is read by :func:`read_source_bytes` (regular file, size limit);
    ``max_decoded_bytes`` bounds the array data an ``.npy``/``.npz`` declares (shape x
    item size from each header, and a zip's declared uncompressed sizes), checked before
    decoding, so a small file cannot expand into gigabytes.

    Raises:
        SourceError: unreadable file, unsupported extension, unparsable content,
            non-finite coordinates, face indices out of range, no points at all, or a
            file or decoded size over the limits.
            (A mesh whose faces have zero total area is caught by :func:`shape_points`.)
    """
    path = Path(path)
    if data is None:
        data = read_source_bytes(path)
    ext = path.suffix.lower()
    if ext == ".npy":
        _check_npy_header(path, io.BytesIO(data), max_decoded_bytes, len(data), "array")
    elif ext == ".npz":
        _check_npz_sizes(path, data, max_decoded_bytes)
    source_hash = hash_bytes(data)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        # Parsers warn about odd content; the checks below turn what matters into errors.
        warnings.simplefilter("ignore")
        if ext == ".npy":
            vertices, faces = _points_from_array(path, _load_npy(path, data)), None
        elif ext == ".npz":
            vertices, faces = _load_npz(path, data)
        elif ext in (".xyz", ".pts"):
            vertices, faces = _load_text_points(path, data), None
        elif ext in MESH_EXTENSIONS:
            vertices, faces = _load_with_trimesh(path, data, ext)
        else:
            raise SourceError(path, f"unsupported file type {path.suffix or '(none)'!r}")
    _validate(path, vertices, faces)
    return LoadedSource(str(path), source_hash, vertices, faces)


# --- parsing -----------------------------------------------------------------------------


# --- size checks (before any array is allocated) -----------------------------------------


def _check_npy_header(
    path: Path, fh: IO[bytes], limit: int, available: int | None, what: str
) -> int:
    """The data bytes an ``.npy`` header declares; SourceError when over ``limit``, or
    more than the ``available`` bytes that follow the header (a truncated file)."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = fmt.read_array_header_1_0(fh)
        else:
            shape, _, dtype = fmt.read_array_header_2_0(fh)
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise SourceError(path, f"not a valid .npy {what}: {exc}") from exc
    if dtype.hasobject:
        return 0  # refused when loaded: it needs pickle, which is never loaded
    declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if declared > limit:
        raise SourceError(
            path,
            f"{what} declares shape {tuple(shape)} of {dtype} = {declared} "
            f"bytes, over the decoded size limit of {limit} bytes",
        )
    if available is not None and declared > available - fh.tell():
        raise SourceError(
            path,
            f"truncated .npy {what}: header declares {declared} bytes of "
            f"data, the file holds {max(available - fh.tell(), 0)}",
        )
    return declared


def _check_npz_sizes(path: Path, data: bytes, limit: int) -> None:
    """Each member's header and the archive's declared uncompressed sizes within ``limit``."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
            declared = sum(m.file_size for m in members)
            if declared > limit:
                raise SourceError(
                    path,
                    f".npz members declare {declared} bytes uncompressed, "
                    f"over the decoded size limit of {limit} bytes",
                )
            for member in members:
                with archive.open(member) as fh:
                    _check_npy_header(
                        path, fh, limit, member.file_size, f"member {member.filename!r}"
                    )
    except SourceError:
        raise
    except zipfile.BadZipFile:
        return  # not a zip: the parser below says what it is
    except (OSError, EOFError, ValueError) as exc:
        raise SourceError(path, f"not a valid .npz archive: {exc}") from exc


def _load_npy(path: Path, data: bytes) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise SourceError(
                path,
                "array holds Python objects (needs pickle, which is "
                "never loaded); store a numeric [N, 3] array",
            ) from exc
        raise SourceError(path, f"not a valid .npy array: {exc}") from exc
    except (OSError, EOFError) as exc:
        raise SourceError(path, f"not a valid .npy array: {exc}") from exc


def _load_npz(path: Path, data: bytes) -> tuple[np.ndarray, np.ndarray | None]:
    try:
        archive = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise SourceError(path, f"not a valid .npz archive: {exc}") from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise SourceError(path, "not a .npz archive (looks like a single .npy array)")
    with archive:
        names = list(archive.files)
        try:
            if "vertices" in names and "faces" in names:
                vertices = _points_from_array(path, archive["vertices"], what="vertices")
                return vertices, _faces_from_array(path, archive["faces"])
            chosen = next((n for n in _NPZ_POINT_NAMES if n in names), None)
            if chosen is None and len(names) == 1:
                chosen = names[0]
            if chosen is None:
                raise SourceError(
                    path,
                    f"no point array found; expected one named "
                    f"{', '.join(_NPZ_POINT_NAMES)} (or vertices + faces), "
                    f"found: {', '.join(names) or '(none)'}",
                )
            return _points_from_array(path, archive[chosen], what=f"array {chosen!r}"), None
        except ValueError as exc:
            if isinstance(exc, SourceError):
                raise
            raise SourceError(path, f"cannot read array from .npz: {exc}") from exc


def _points_from_array(path: Path, array: np.ndarray, what: str = "array") -> np.ndarray:
    if array.dtype.kind not in "fiu":
        raise SourceError(path, f"{what} has dtype {array.dtype}; expected a real number type")
    if array.ndim != 2 or array.shape[1] != 3:
        raise SourceError(path, f"{what} has shape {tuple(array.shape)}; expected (N, 3)")
    return np.ascontiguousarray(array, dtype=np.float64)


def _faces_from_array(path: Path, array: np.ndarray) -> np.ndarray:
    if array.dtype.kind not in "iu":
        raise SourceError(path, f"faces have dtype {array.dtype}; expected integers")
    if array.ndim != 2 or array.shape[1] != 3:
        raise SourceError(path, f"faces have shape {tuple(array.shape)}; expected (F, 3)")
    if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise SourceError(path, "face indices out of range")
    return np.ascontiguousarray(array, dtype=np.int64)


_NUMBER_SPLIT = re.compile(r"[\s,;]+")


def _load_text_points(path: Path, data: bytes) -> np.ndarray:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(path, f"not a text point file (byte {exc.start} is not UTF-8)") from exc
    rows: list[list[str]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        tokens = _NUMBER_SPLIT.split(line)
        if len(tokens) < 3:
            if not rows and len(tokens) == 1 and tokens[0].isdigit():
                continue  # a count header, as some .pts files have
            raise SourceError(path, f"line {lineno}: expected at least 3 numbers, got {line!r:.60}")
        rows.append(tokens[:3])
    if not rows:
        raise SourceError(path, "no points in file")
    try:
        return np.array(rows, dtype=np.float64)
    except ValueError as exc:
        raise SourceError(path, f"not a number: {exc}") from exc


def _load_with_trimesh(path: Path, data: bytes, ext: str) -> tuple[np.ndarray, np.ndarray | None]:
    import trimesh  # imported here: a second or so, and only mesh formats need it

    if ext == ".ply":
        declared = _ply_declared_counts(path, data)
    kwargs: dict[str, Any] = {"skip_materials": True} if ext in (".obj", ".ply", ".glb") else {}
    try:
        loaded = trimesh.load(io.BytesIO(data), file_type=ext[1:], process=False, **kwargs)
    except (MemoryError, RecursionError):
        raise
    except Exception as exc:  # trimesh raises anything; each becomes a SourceError
        raise SourceError(
            path, f"cannot parse as {ext[1:].upper()}: {type(exc).__name__}: {exc}"
        ) from exc
    vertices, faces = _geometry_of(path, loaded, trimesh)
    if ext == ".ply":
        _check_ply_counts(path, declared, vertices, faces)
    return vertices, faces


def _geometry_of(path: Path, loaded: object, trimesh) -> tuple[np.ndarray, np.ndarray | None]:
    """Vertices and faces of whatever trimesh returned; a scene is flattened with its transforms.

    Only positions and faces are read (never ``copy()`` or ``dump()``, which would touch
    textures and need an image library).
    """
    parts: list[tuple[np.ndarray, np.ndarray | None]]
    if isinstance(loaded, trimesh.Trimesh):
        parts = [(np.asarray(loaded.vertices), np.asarray(loaded.faces))]
    elif isinstance(loaded, trimesh.PointCloud):
        parts = [(np.asarray(loaded.vertices), None)]
    elif isinstance(loaded, trimesh.Scene):
        parts = []
        for node in loaded.graph.nodes_geometry:
            transform, name = loaded.graph[node]
            geometry = loaded.geometry.get(name)
            if not isinstance(geometry, trimesh.Trimesh | trimesh.PointCloud):
                continue
            vertices = np.asarray(geometry.vertices, dtype=np.float64)
            vertices = vertices @ transform[:3, :3].T + transform[:3, 3]
            faces = np.asarray(geometry.faces) if isinstance(geometry, trimesh.Trimesh) else None
            parts.append((vertices, faces))
    else:
        raise SourceError(path, f"unsupported content ({type(loaded).__name__})")
    parts = [(v, f) for v, f in parts if len(v)]
    if not parts:
        raise SourceError(path, "no geometry in file (no vertices)")
    with_faces = [(v, f) for v, f in parts if f is not None and len(f)]
    if not with_faces:
        return np.concatenate([np.asarray(v, np.float64).reshape(-1, 3) for v, _ in parts]), None
    vertex_parts: list[np.ndarray] = []
    face_parts: list[np.ndarray] = []
    offset = 0
    for v, f in with_faces:  # a mesh's loose points (if any) do not belong to its surface
        vertex_parts.append(np.asarray(v, np.float64).reshape(-1, 3))
        face_parts.append(np.asarray(f, np.int64).reshape(-1, 3) + offset)
        offset += len(vertex_parts[-1])
    return np.concatenate(vertex_parts), np.concatenate(face_parts)


_PLY_ELEMENT = re.compile(rb"^element\s+(\w+)\s+(\d+)\s*$")


def _ply_declared_counts(path: Path, data: bytes) -> dict[str, int]:
    """Element counts a PLY header declares (trimesh may quietly read fewer from a cut file)."""
    if not data.startswith(b"ply"):
        raise SourceError(path, "not a PLY file (does not start with 'ply')")
    end = data.find(b"end_header")
    if end < 0:
        raise SourceError(path, "PLY header has no end_header")
    counts: dict[str, int] = {}
    for line in data[:end].splitlines():
        match = _PLY_ELEMENT.match(line.strip())
        if match:
            counts[match.group(1).decode("ascii", "replace")] = int(match.group(2))
    return counts


def _check_ply_counts(
    path: Path, declared: dict[str, int], vertices: np.ndarray, faces: np.ndarray | None
) -> None:
    want_v = declared.get("vertex")
    if want_v is not None and want_v != len(vertices):
        raise SourceError(
            path,
            f"truncated or malformed PLY: header declares {want_v} "
            f"vertices, {len(vertices)} were read",
        )
    want_f = declared.get("face", 0)
    got_f = 0 if faces is None else len(faces)
    # trimesh triangulates polygons, so a face count can only grow; fewer means data is missing.
    if got_f < want_f:
        raise SourceError(
            path, f"truncated or malformed PLY: header declares {want_f} faces, {got_f} were read"
        )


# --- validation and normalisation ------------------------------------------------------------


def _validate(path: Path, vertices: np.ndarray, faces: np.ndarray | None) -> None:
    if len(vertices) == 0:
        raise SourceError(path, "no points" if faces is None else "mesh has no vertices")
    finite = np.isfinite(vertices).all(axis=1)
    if not finite.all():
        bad = int((~finite).sum())
        raise SourceError(
            path,
            f"{bad} of {len(vertices)} points have non-finite coordinates "
            f"(NaN or inf), first at index {int(np.argmin(finite))}",
        )
    if faces is None:
        return
    if len(faces) == 0:
        raise SourceError(path, "mesh has no faces")
    low, high = int(faces.min()), int(faces.max())
    if low < 0 or high >= len(vertices):
        raise SourceError(
            path,
            f"face indices out of range: found [{low}, {high}], mesh has {len(vertices)} vertices",
        )
