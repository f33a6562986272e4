"""A collated batch as Kaolin's ``kaolin.rep.Spc``, with the structures the records carry.

Each record stores its octree with the pyramid, the bit sums (``exsum``) and the point
hierarchy Kaolin would compute from it; ``collate_spc`` packs them as Kaolin packs
them. :func:`to_kaolin_spc` hands all of them to ``kaolin.rep.Spc``, so Kaolin finds its
``pyramids``, ``exsum`` and ``point_hierarchies`` already there and computes none of them
(it would, lazily, on first access, from ``octrees`` and ``lengths`` alone).

One layout difference is bridged here. The records keep the inclusive bit sum per byte,
restarting at each octree (``num_bytes`` entries in a batch). The released Kaolin 0.18.0
``Spc`` wants the older layout: each octree's sums preceded by a 0 (``num_bytes +
batch_size`` entries); Kaolin builds that carry ``kaolin.ops.spc.exsum_compat`` take the
per-byte one. :func:`spc_fields` makes either (``exsum_layout``); :func:`to_kaolin_spc`
picks the one the installed Kaolin takes.

:func:`spc_fields` needs only torch (tested on the CPU against the fields our ops compute
from the same octrees); :func:`to_kaolin_spc` imports Kaolin, which needs CUDA.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from typing import Any

import torch

from cache_store.errors import ParameterError

__all__ = ["EXSUM_LAYOUTS", "spc_fields", "to_kaolin_spc", "kaolin_exsum_layout"]

#: ``"current"``: inclusive sums, one per byte; ``"legacy"``: a 0 before each octree's
EXSUM_LAYOUTS = ("current", "legacy")


def _problem(message: str) -> ParameterError:
    return ParameterError([message], what="SPC batch for Kaolin")


def spc_fields(
    batch: Mapping[str, Any],
    *,
    device: str | torch.device | None = None,
    exsum_layout: str = "current",
) -> dict[str, Any]:
    """The keyword arguments of ``kaolin.rep.Spc`` for a :func:`collate_spc` batch:
    ``octrees`` (uint8 ``[num_bytes]``), ``lengths`` (int32 ``[B]``, CPU), ``max_level``
    (int), ``pyramids`` (int32 ``[B, 2, max_level + 2]``, CPU, as Kaolin keeps them),
    ``exsum`` (int32, ``exsum_layout``) and ``point_hierarchies`` (int16
    ``[num_points, 3]``), the last three on ``device`` with ``octrees`` (default: where
    the batch's octrees are).

    Raises:
        ParameterError: a batch without ``octree``/``lengths``/``pyramid``/``exsum``/
            ``point_hierarchy`` (e.g. read with ``fields=``), or one whose sizes disagree.
    """
    if exsum_layout not in EXSUM_LAYOUTS:
        raise _problem(f"exsum_layout: expected one of {EXSUM_LAYOUTS}, got {exsum_layout!r}")
    missing = [
        k for k in ("octree", "lengths", "pyramid", "exsum", "point_hierarchy") if k not in batch
    ]
    if missing:
        raise _problem(
            f"the batch lacks {missing} (read every SPC field, and batch with collate_spc)"
        )
    octrees, lengths = batch["octree"], batch["lengths"].to("cpu", torch.int32)
    pyramids = batch["pyramid"].to("cpu", torch.int32).contiguous()
    exsum, points = batch["exsum"], batch["point_hierarchy"]
    if pyramids.dim() != 3 or pyramids.shape[0] != lengths.shape[0] or pyramids.shape[1] != 2:
        raise _problem(
            f"pyramid: shape {tuple(pyramids.shape)} is not [{lengths.shape[0]}, 2, level + 2]"
        )
    num_bytes = int(lengths.sum())
    if octrees.shape != (num_bytes,) or exsum.shape != (num_bytes,):
        raise _problem(
            f"octree {tuple(octrees.shape)} and exsum {tuple(exsum.shape)} must "
            f"both hold the {num_bytes} bytes lengths add up to"
        )
    num_points = int(pyramids[:, 1, -1].sum())
    if points.shape != (num_points, 3):
        raise _problem(
            f"point_hierarchy: shape {tuple(points.shape)}, the pyramids give {num_points} points"
        )
    device = octrees.device if device is None else torch.device(device)
    octrees = octrees.to(device, torch.uint8).contiguous()
    exsum = exsum.to(device, torch.int32)
    if exsum_layout == "legacy":  # [0, sums of octree 0, 0, sums of octree 1, ...]
        legacy = exsum.new_zeros(num_bytes + lengths.shape[0])
        ends = torch.cumsum(lengths.to(torch.int64) + 1, 0)
        keep = torch.ones(legacy.shape[0], dtype=torch.bool)
        keep[ends - lengths.to(torch.int64) - 1] = False
        legacy[keep.to(device)] = exsum
        exsum = legacy
    return {
        "octrees": octrees,
        "lengths": lengths,
        "max_level": int(pyramids.shape[2] - 2),
        "pyramids": pyramids,
        "exsum": exsum.contiguous(),
        "point_hierarchies": points.to(device, torch.int16).contiguous(),
    }


def kaolin_exsum_layout() -> str:
    """The exsum layout the installed Kaolin's ``Spc`` takes (raises ImportError without
    Kaolin): ``"current"`` where ``kaolin.ops.spc.exsum_compat`` exists, else ``"legacy"``
    (the released 0.18.0)."""
    importlib.import_module("kaolin.ops.spc")  # raises ImportError without Kaolin
    if importlib.util.find_spec("kaolin.ops.spc.exsum_compat") is None:
        return "legacy"
    return "current"


def to_kaolin_spc(batch: Mapping[str, Any], device: str | torch.device = "cuda") -> Any:
    """``kaolin.rep.Spc`` of a :func:`collate_spc` batch on ``device``, with its pyramids,
    exsum and point hierarchies taken from the records (Kaolin recomputes none of them).

    Raises:
        ImportError: Kaolin is not installed (``pip install spcache[gpu]``: see the README).
        ParameterError: see :func:`spc_fields`.
    """
    spc_class = importlib.import_module("kaolin.rep").Spc
    return spc_class(**spc_fields(batch, device=device, exsum_layout=kaolin_exsum_layout()))
