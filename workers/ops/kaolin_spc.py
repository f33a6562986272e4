"""The SPC ops delegated to Kaolin 0.18's CUDA kernels (``kaolin.ops.spc``).

Importing this module never imports Kaolin: the first call (or :func:`ensure_available`)
does, and a missing Kaolin or CUDA raises :class:`~cache_store.errors.BackendUnavailable`.
Each function runs the same input checks as the torch backend first, so bad input fails
the same way on both, and Kaolin's kernels never see octrees they would read past.
Where Kaolin's result is undefined (NaN queries, voxels beyond int16) the answer is -1,
as in the torch backend. ``unbatched_make_trinkets`` is the torch backend's (on the same
device): Kaolin's is a Python dictionary walk, slow on large hierarchies, and the gpu
tests check that the two agree.

Two exsum layouts have shipped as Kaolin 0.18.0: the released wheels return and take the
legacy layout (a leading 0 per octree), later builds the inclusive one of
``docs/SPC_SEMANTICS.md`` (and a ``legacy_exsum`` flag). :func:`exsum_layout` tells them
apart by ``scan_octrees``' signature and the calls convert at the boundary, so records
hold the inclusive layout whichever Kaolin computed them.

Importing Kaolin runs a lot of code (warp, USD): any exception it raises, and any warning
it emits (an error under ``-W error``), makes the backend unavailable with the reason,
never an exception out of :func:`ensure_available`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from cache_store.errors import BackendUnavailable, InvalidTensor

from . import _checks, torch_dual, torch_spc
from ._checks import from_legacy_exsum, to_legacy_exsum

__all__ = [
    "name",
    "ensure_available",
    "SUPPORTED_VERSION",
    "TORCH_RANGE",
    "torch_version_note",
    "no_cuda_reason",
    "unavailable",
    "quantize_points",
    "points_to_morton",
    "morton_to_points",
    "unbatched_points_to_octree",
    "scan_octrees",
    "generate_points",
    "unbatched_query",
    "unbatched_get_level_points",
    "points_to_corners",
    "unbatched_make_dual",
    "unbatched_make_trinkets",
    "exsum_layout",
    "import_spc",
    "from_legacy_exsum",
    "to_legacy_exsum",
]

name = "kaolin"

logger = logging.getLogger(__name__)


SUPPORTED_VERSION = "0.18"
"""The Kaolin release whose results the torch backend matches bit for bit."""


TORCH_RANGE = ("2.3.0", "2.8.0")
"""The torch releases Kaolin 0.18.0 publishes wheels for (its setup.py refuses newer)."""


def _release(version: str) -> tuple[int, ...]:
    """``"2.5.1+cu121"`` -> ``(2, 5, 1)`` (enough to compare releases)."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def torch_version_note(version: str | None = None) -> str:
    """``""`` when ``version`` (default: this torch) is one Kaolin 0.18 ships wheels for,
    else a short note saying there is no Kaolin for it, and for which torch there is."""
    version = torch.__version__ if version is None else version
    low, high = TORCH_RANGE
    if _release(low) <= _release(version) <= _release(high):
        return ""
    return (
        f"there is no Kaolin {SUPPORTED_VERSION} for torch {version} "
        f"(its wheels are for torch {low} to {high})"
    )


def no_cuda_reason() -> str:
    """``""`` when CUDA is available to this process, else what this machine lacks (a
    CPU-only torch build, or a CUDA build that finds no device). Never initialises CUDA."""
    if torch.cuda.is_available():
        return ""
    build = torch.version.cuda
    if build is None:
        return f"no CUDA device here (torch {torch.__version__} is a CPU-only build)"
    return (
        f"no CUDA device here (torch {torch.__version__} is built for CUDA {build} but "
        f"finds no device: no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)"
    )


def unavailable() -> tuple[str, str] | None:
    """None when the Kaolin backend can run here; else ``(what is true, what to do)``.

    The one place that says why Kaolin cannot run on this machine: no CUDA device
    (said first: without one no Kaolin helps), a torch no Kaolin 0.18 is built for, a
    Kaolin that does not import or is another release. The advice is what would help
    here: ``--backend torch`` where no Kaolin can run, an install only where one exists.
    """
    cuda, note = no_cuda_reason(), torch_version_note()
    use_torch = "use --backend torch (or auto): the same records from the PyTorch ops"
    if cuda:
        facts = (f"{cuda}: Kaolin's SPC ops are CUDA-only", note)
        return "; ".join(filter(None, facts)), use_torch
    spc, reason = import_spc()
    if spc is not None:
        return None
    if note:
        low, high = TORCH_RANGE
        return (
            reason,
            f"{use_torch}, or a torch from {low} to {high} with kaolin=={SUPPORTED_VERSION}.x",
        )
    return reason, (
        f"install kaolin=={SUPPORTED_VERSION}.x built for torch {torch.__version__} and "
        f"CUDA {torch.version.cuda} (README: Running on a GPU with Kaolin)"
    )


def _kaolin_version() -> str:
    version = getattr(importlib.import_module("kaolin"), "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version("kaolin")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
    return str(version)


def guarded_import(module: str) -> ModuleType:
    """``importlib.import_module(module)`` for a Kaolin module, with the import's warnings
    recorded instead of raised (``-W error`` must not turn a noisy import into a failure).

    Any exception of the import propagates; the warnings are logged at DEBUG."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        imported = importlib.import_module(module)
    if caught:
        logger.debug(
            "importing %s warned %d time(s); first: %s", module, len(caught), caught[0].message
        )
    return imported


@functools.cache
def import_spc() -> tuple[ModuleType | None, str]:
    """``(kaolin.ops.spc, "")``, or ``(None, why not)``; probed once per process
    (``import_spc.cache_clear()`` probes again)."""
    try:
        spc = guarded_import("kaolin.ops.spc")
        version = _kaolin_version()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a missing wheel, a broken CUDA build, anything
        text = " ".join(str(exc).split())[:200]
        reason = f"kaolin not importable ({type(exc).__name__}: {text})"
        note = torch_version_note()
        return None, f"{reason}; {note}" if note else reason
    if version.split(".")[:2] != SUPPORTED_VERSION.split("."):
        return None, (
            f"found kaolin {version}, but records must match Kaolin "
            f"{SUPPORTED_VERSION} bit for bit (earlier releases use another exsum layout)"
        )
    return spc, ""


def kaolin_version() -> str:
    """The importable Kaolin's version (call after :func:`ensure_available` succeeded)."""
    return _kaolin_version()


def ensure_available() -> ModuleType:
    """``kaolin.ops.spc``, or :class:`BackendUnavailable` saying why it cannot run here
    and what would help (:func:`unavailable`)."""
    problem = unavailable()
    if problem is not None:
        raise BackendUnavailable(name, "; ".join(problem))
    spc, _ = import_spc()
    assert spc is not None  # unavailable() said it imports
    return spc


def exsum_layout(spc: ModuleType) -> str:
    """Which exsum layout this ``kaolin.ops.spc`` speaks: ``"inclusive"`` (per-octree
    inclusive sums, ``num_bytes``; its ``scan_octrees`` takes ``legacy_exsum``) or
    ``"legacy"`` (a leading 0 per octree, ``num_bytes + batch_size``: the released 0.18.0
    wheels, whose version string is the same). Records always hold the inclusive layout;
    the calls convert at the boundary, so both give the torch backend's results."""
    try:
        parameters = inspect.signature(spc.scan_octrees).parameters
    except (TypeError, ValueError):  # a compiled function without a signature
        return "legacy"
    return "inclusive" if "legacy_exsum" in parameters else "legacy"


@contextmanager
def _on(arg: str, tensor: torch.Tensor) -> Iterator[ModuleType]:
    """Kaolin's spc module, with ``tensor``'s GPU current (some kernels allocate on it)."""
    spc = ensure_available()
    if tensor.device.type != "cuda":
        raise InvalidTensor(
            f"{arg}: the kaolin backend needs CUDA tensors, got one on "
            f"{tensor.device}; use the torch backend on the CPU"
        )
    with torch.cuda.device(tensor.device):
        yield spc


def quantize_points(x: torch.Tensor, level: int) -> torch.Tensor:
    """See :func:`workers.ops.torch_spc.quantize_points`."""
    x = _checks.check_float_coords(x)
    level = _checks.check_level(level)
    return ensure_available().quantize_points(x, level)


def points_to_morton(points: torch.Tensor) -> torch.Tensor:
    """See :func:`workers.ops.torch_spc.points_to_morton`."""
    shape = _checks.check_morton_points(points).shape
    _checks.check_points(points.reshape(-1, 3), allow_empty=True)
    with _on("points", points) as spc:
        if points.numel() == 0:  # Kaolin launches an empty grid, which CUDA refuses
            return torch.empty(shape[:-1], dtype=torch.int64, device=points.device)
        return spc.points_to_morton(points.contiguous())


def morton_to_points(morton: torch.Tensor) -> torch.Tensor:
    """See :func:`workers.ops.torch_spc.morton_to_points`."""
    morton = _checks.check_morton(morton)
    with _on("morton", morton) as spc:
        if morton.numel() == 0:  # Kaolin launches an empty grid, which CUDA refuses
            return torch.empty((*morton.shape, 3), dtype=torch.int16, device=morton.device)
        return spc.morton_to_points(morton.contiguous())


def unbatched_points_to_octree(
    points: torch.Tensor, level: int, sorted: bool = False
) -> torch.Tensor:  # `sorted` is Kaolin's name
    """See :func:`workers.ops.torch_spc.unbatched_points_to_octree`."""
    level = _checks.check_level(level, low=1)
    points = _checks.check_points(points, level)
    if sorted:  # refuse out-of-order points as the torch backend does (duplicates are harmless)
        torch_spc.sorted_unique_morton(points, level, True)
    with _on("points", points) as spc:
        return spc.unbatched_points_to_octree(points.contiguous(), level, sorted=bool(sorted))


def scan_octrees(
    octrees: torch.Tensor, lengths: torch.Tensor, legacy_exsum: bool = False
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """See :func:`workers.ops.torch_spc.scan_octrees`."""
    octrees = _checks.check_octree(octrees, "octrees")
    cpu_lengths = _checks.check_lengths(lengths, octrees.shape[0])
    with _on("octrees", octrees) as spc:
        # Kaolin loops forever on some malformed octrees: walk them on our side first.
        _checks.octree_structure(_checks.inclusive_exsum(octrees, cpu_lengths), cpu_lengths)
        if exsum_layout(spc) == "inclusive":
            return spc.scan_octrees(
                octrees.contiguous(), cpu_lengths.to(torch.int32), legacy_exsum=legacy_exsum
            )
        max_level, pyramids, legacy = spc.scan_octrees(
            octrees.contiguous(), cpu_lengths.to(torch.int32)
        )
        if legacy_exsum:
            warnings.warn(
                "scan_octrees(legacy_exsum=True) returns the deprecated exsum layout "
                "of size num_bytes + batch_size",
                DeprecationWarning,
                stacklevel=2,
            )
            return max_level, pyramids, legacy
        return max_level, pyramids, _checks.from_legacy_exsum(legacy, cpu_lengths)


def generate_points(
    octrees: torch.Tensor, pyramids: torch.Tensor, exsum: torch.Tensor
) -> torch.Tensor:
    """See :func:`workers.ops.torch_spc.generate_points`."""
    with _on("octrees", _checks.check_octree(octrees, "octrees")) as spc:
        _, lengths, exsum = torch_spc.checked_structure(octrees, pyramids, exsum, "generate_points")
        if exsum_layout(spc) == "legacy":
            exsum = _checks.to_legacy_exsum(exsum, lengths)
        return spc.generate_points(
            octrees.contiguous(), pyramids.cpu().contiguous(), exsum.contiguous()
        )


def unbatched_query(
    octree: torch.Tensor,
    exsum: torch.Tensor,
    query_coords: torch.Tensor,
    level: int,
    with_parents: bool = False,
) -> torch.Tensor:
    """See :func:`workers.ops.torch_spc.unbatched_query` (same -1 for undefined queries)."""
    with _on("octree", _checks.check_octree(octree)) as spc:
        exsum, query_coords, level = torch_spc.check_query(octree, exsum, query_coords, level)
        if query_coords.shape[0] == 0:  # Kaolin launches an empty grid, which CUDA refuses
            return torch_spc.unbatched_query(octree, exsum, query_coords, level, with_parents)
        if exsum_layout(spc) == "legacy":
            exsum = _checks.to_legacy_exsum(exsum, torch.tensor([octree.shape[0]]))
        result = spc.unbatched_query(
            octree.contiguous(),
            exsum.contiguous(),
            query_coords.contiguous(),
            level,
            with_parents=with_parents,
        )
        _, inside = torch_spc.query_voxels(query_coords, level, bool(with_parents))
        if with_parents:
            return result.masked_fill(~inside.unsqueeze(1), -1)
        return result.masked_fill(~inside, -1)


def unbatched_get_level_points(
    point_hierarchy: torch.Tensor, pyramid: torch.Tensor, level: int
) -> torch.Tensor:
    """See :func:`workers.ops.torch_spc.unbatched_get_level_points` (plain slicing in both)."""
    return torch_spc.unbatched_get_level_points(point_hierarchy, pyramid, level)


def points_to_corners(points: torch.Tensor) -> torch.Tensor:
    """See :func:`workers.ops.torch_spc.points_to_corners`."""
    points = _checks.check_tensor("points", points, (torch.int16,), "torch.int16")
    if points.dim() != 2 or points.shape[1] != 3:
        raise InvalidTensor(f"points: expected shape (num_points, 3), got {tuple(points.shape)}")
    with _on("points", points) as spc:
        if points.shape[0] == 0:  # Kaolin launches an empty grid, which CUDA refuses
            return torch.empty((0, 8, 3), dtype=torch.int16, device=points.device)
        return spc.points_to_corners(points.contiguous())


def unbatched_make_dual(
    point_hierarchy: torch.Tensor, pyramid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`workers.ops.torch_spc.unbatched_make_dual` (Kaolin's own, after our checks)."""
    point_hierarchy, pyramid, max_level = torch_dual.check_hierarchy(
        point_hierarchy, pyramid, ("point_hierarchy", "pyramid")
    )
    with _on("point_hierarchy", point_hierarchy) as spc:
        if max_level == _checks.MAX_LEVEL:  # refuse corners beyond int16, as the torch backend
            _refuse_far_corners(point_hierarchy, pyramid)
        dual, pyramid_dual = spc.unbatched_make_dual(point_hierarchy, pyramid)
        return dual, pyramid_dual.cpu()


def _refuse_far_corners(point_hierarchy: torch.Tensor, pyramid: torch.Tensor) -> None:
    leaves = point_hierarchy[torch_dual.level_slice(pyramid, pyramid.shape[1] - 2)]
    if bool((leaves == (1 << _checks.MAX_LEVEL) - 1).any()):
        raise InvalidTensor(
            "point_hierarchy: level-15 voxels on the far border have corners at 2**15, beyond int16"
        )


def unbatched_make_trinkets(
    point_hierarchy: torch.Tensor,
    pyramid: torch.Tensor,
    point_hierarchy_dual: torch.Tensor,
    pyramid_dual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`workers.ops.torch_spc.unbatched_make_trinkets`: that implementation, on the
    CUDA device.

    Kaolin 0.18's own walks the hierarchy level by level through Python dictionaries (slow
    on large hierarchies) and raises a ``KeyError`` for a missing corner or parent; the
    torch one gives the same trinkets and parents (the gpu tests compare them) and
    ``InvalidTensor`` for such input."""
    with _on("point_hierarchy", _checks.check_tensor("point_hierarchy", point_hierarchy)):
        return torch_spc.unbatched_make_trinkets(
            point_hierarchy, pyramid, point_hierarchy_dual, pyramid_dual
        )
