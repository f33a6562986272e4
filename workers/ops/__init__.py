"""SPC ops: Kaolin 0.18's ``kaolin.ops.spc`` functions behind one interface.

Two backends with the same names, signatures and bit-for-bit results:

- ``torch`` (:mod:`workers.ops.torch_spc`): pure PyTorch, any device;
- ``kaolin`` (:mod:`workers.ops.kaolin_spc`): delegates to Kaolin's CUDA kernels.

>>> ops = get_backend("torch")
>>> ops.name
'torch'
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from cache_store.errors import BackendUnavailable, UnknownName

from . import kaolin_spc, torch_spc

__all__ = [
    "BACKENDS",
    "OP_NAMES",
    "device_type",
    "get_backend",
    "select_backend",
    "kaolin_spc",
    "torch_spc",
]

logger = logging.getLogger(__name__)

BACKENDS: dict[str, ModuleType] = {"torch": torch_spc, "kaolin": kaolin_spc}
"""Backends by name; each module has the functions of :data:`OP_NAMES` and a ``name``."""

OP_NAMES = (
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
)


def device_type(device: torch.device | str | None) -> str:
    """``cuda`` or ``cpu`` for a device (``None`` or ``auto``: CUDA when it is available).

    Never initialises CUDA: ``torch.cuda.is_available()`` does not create a context."""
    if device is None or str(device) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def select_backend(
    name: str = "auto", device: torch.device | str | None = None
) -> tuple[ModuleType, str]:
    """The backend called ``name`` for ``device``, and why it is that one (for a log line).

    Same rules and errors as :func:`get_backend`; nothing is logged here.
    """
    if name not in (*BACKENDS, "auto"):
        raise UnknownName("SPC backend", name, [*BACKENDS, "auto"])
    any_device = device is None or str(device) == "auto"
    where = "cuda" if any_device else str(device)
    is_cuda = device_type(device) == "cuda"
    if name == "torch":
        return torch_spc, "asked for"
    if name == "kaolin":
        if not any_device and not is_cuda:
            raise BackendUnavailable(
                "kaolin",
                f"device {where} is not a CUDA device (Kaolin's "
                "SPC ops are CUDA-only); use --backend torch or "
                "auto there",
            )
        kaolin_spc.ensure_available()
        return kaolin_spc, f"asked for; kaolin {kaolin_spc.kaolin_version()} on {where}"
    if not any_device and not is_cuda:
        return torch_spc, f"device {where}: Kaolin's SPC ops are CUDA-only"
    problem = kaolin_spc.unavailable()  # what is true here (no CUDA device, no Kaolin...)
    if problem is not None:
        return torch_spc, problem[0]
    return kaolin_spc, f"kaolin {kaolin_spc.kaolin_version()} imports and {where} is CUDA"


def get_backend(name: str = "auto", device: torch.device | str | None = None) -> ModuleType:
    """The backend called ``name`` ("torch", "kaolin" or "auto").

    "auto" picks Kaolin when it imports and ``device`` is a CUDA device (``device=None``
    means CUDA when it is available), else the torch backend; falling back to torch on a
    CUDA device logs one WARNING line with the reason. Asking for "kaolin" with a device
    that is not CUDA, or where Kaolin or CUDA is missing, raises
    :class:`~cache_store.errors.BackendUnavailable` (before any sample is computed); an
    unknown name raises :class:`~cache_store.errors.UnknownName` listing the known ones.
    """
    backend, why = select_backend(name, device)
    if name == "auto" and backend is torch_spc and device_type(device) == "cuda":
        logger.warning("SPC ops on %s use the torch backend: %s", device or "cuda", why)
    return backend
