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

__all__ = ["BACKENDS", "OP_NAMES", "get_backend", "kaolin_spc", "torch_spc"]

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


def get_backend(name: str = "auto", device: torch.device | str | None = None) -> ModuleType:
    """The backend called ``name`` ("torch", "kaolin" or "auto").

    "auto" picks Kaolin when it imports and ``device`` is a CUDA device (``device=None``
    means CUDA when it is available), else the torch backend. Asking for "kaolin" where
    Kaolin or CUDA is missing raises :class:`~cache_store.errors.BackendUnavailable`; an
    unknown name raises :class:`~cache_store.errors.UnknownName` listing the known ones.
    """
    if name == "auto":
        is_cuda = (torch.device(device).type == "cuda" if device is not None
                   else torch.cuda.is_available())
        if is_cuda:
            try:
                kaolin_spc.ensure_available()
            except BackendUnavailable as exc:
                logger.info("SPC ops on %s use the torch backend: %s", device or "cuda", exc)
                return torch_spc
            return kaolin_spc
        return torch_spc
    if name not in BACKENDS:
        raise UnknownName("SPC backend", name, [*BACKENDS, "auto"])
    backend = BACKENDS[name]
    if backend is kaolin_spc:
        kaolin_spc.ensure_available()
    return backend
