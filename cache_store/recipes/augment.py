"""The standard augmentations: rotation, anisotropic scale and jitter of a shape's points.

An octree is not equivariant to augmentation: rotate a shape and its octree changes. So a
recipe augments the shape's points in ``prepare``, before the device work, and a run
asking for ``variants=K`` stores K versions of each sample, each prepared with its own
seeded generator (``source.variant`` says which: 0 is always the unaugmented shape).

The parameters (:data:`AUGMENTATION_PARAMS`, the built-in recipes take them; a plugin
adds them to its ``params``) and what :func:`augment_points` does with them, in order:

1. ``rotation``: ``"none"``; ``"z"``, a uniform angle about the z axis of the source's
   own coordinates (the up axis of z-up data such as ModelNet; y-up data such as
   ShapeNet turns about its vertical axis with ``so3`` only); ``"so3"``, a uniformly
   random rotation (a unit quaternion from four normal deviates).
2. ``scale_min`` .. ``scale_max``: each axis (x, y, z, after the rotation) scaled by its
   own uniform draw from the range: an anisotropic scale.
3. ``jitter``: Gaussian noise of this standard deviation added to every point, in
   normalised units (the ``[-1, 1]`` cube).
4. Fit: when a point then lies outside ``[-1, 1]^3`` (a rotated corner reaches
   ``sqrt(3)``, a scale over 1 grows the shape), all points are shrunk about the origin
   by one factor so that the farthest lies on the cube's surface; the octree covers the
   cube only.

Random draws, for a variant >= 1 and only for the steps whose parameters are not at their
defaults, in this order: the rotation (``z``: one float64 uniform; ``so3``: four float64
normal deviates), the scale (three float64 uniforms), the jitter (``N x 3`` float64 normal
deviates). Variant 0 draws nothing and changes nothing.

The matrix applied, ``augmentation`` (float32 ``[4, 4]``, homogeneous: ``fit * S @ R`` in
its upper 3 x 3, no translation), maps a point of the unaugmented normalised shape to the
stored one (jitter aside: noise is not a matrix): ``stored = augmentation @ [p, 1]``, so
``inverse(augmentation)`` undoes it and products compose it. Records of the built-in
recipes carry it as the field ``augmentation`` when any of these parameters is set
(identity in variant 0); a run with all of them at their defaults stores records exactly
as before they existed (the parameters are ``omit_default``, the field ``with_params``).

This module imports no torch at import time (the service reads the parameters).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple


from cache_store.recipes.specs import FieldSpec, ParamSpec

if TYPE_CHECKING:
    import numpy as np

if TYPE_CHECKING:  # pragma: no cover - for annotations only
    import torch

__all__ = [
    "AUGMENTATION_FIELD",
    "AUGMENTATION_PARAMS",
    "ROTATIONS",
    "Augmented",
    "AugmentationParts",
    "augment_points",
    "decompose_augmentation",
    "augmentation_set",
    "transform_points",
]

#: The choices of ``rotation``.
ROTATIONS = ("none", "z", "so3")

#: The standard augmentation parameters (defaults: no augmentation). Each is
#: ``omit_default``: a recipe that adds them keeps the fingerprints of its existing caches.
AUGMENTATION_PARAMS: Mapping[str, ParamSpec] = {
    "rotation": ParamSpec(
        str,
        "none",
        doc="variants >= 1 are rotated: none; z (a uniform angle about the source's z axis); "
        "so3 (a uniformly random rotation)",
        choices=ROTATIONS,
        omit_default=True,
        augmentation=True,
    ),
    "scale_min": ParamSpec(
        float,
        1.0,
        0.1,
        10.0,
        "variants >= 1: each axis scaled by its own uniform draw from scale_min..scale_max",
        omit_default=True,
        augmentation=True,
    ),
    "scale_max": ParamSpec(
        float,
        1.0,
        0.1,
        10.0,
        "see scale_min (at least scale_min)",
        omit_default=True,
        augmentation=True,
    ),
    "jitter": ParamSpec(
        float,
        0.0,
        0.0,
        0.1,
        "variants >= 1: std-dev of Gaussian noise added to each point, in normalised units",
        omit_default=True,
        augmentation=True,
    ),
}

#: The field that records the augmentation applied (see the module doc).
AUGMENTATION_FIELD = FieldSpec(
    "float32",
    "[4, 4]",
    "the augmentation applied to this variant: stored = augmentation @ [p, 1] for a point p "
    "of the unaugmented normalised shape (fit x scale x rotation; jitter is not in it); "
    "identity in variant 0",
    finite=True,
    with_params=tuple(AUGMENTATION_PARAMS),
)


def augmentation_set(params: Mapping[str, Any]) -> bool:
    """Whether any augmentation parameter among ``params`` is off its default (then
    records hold the field ``augmentation``)."""
    return any(
        name in params and params[name] != spec.default
        for name, spec in AUGMENTATION_PARAMS.items()
    )


class Augmented(NamedTuple):
    """What :func:`augment_points` made: ``points`` float64 ``[N, 3]`` in ``[-1, 1]``,
    and ``matrix`` float64 ``[4, 4]`` (store it as float32: the field ``augmentation``)."""

    points: np.ndarray
    matrix: np.ndarray


def augment_points(
    points: np.ndarray | torch.Tensor,
    params: Mapping[str, Any],
    generator: torch.Generator,
    variant: int,
) -> Augmented:
    """One variant's augmentation of a shape's normalised points (see the module doc).

    Args:
        points: float ``[N, 3]`` in ``[-1, 1]`` (NumPy or a CPU tensor).
        params: the recipe's parameters (``rotation``, ``scale_min``, ``scale_max``,
            ``jitter``; any missing one is at its default).
        generator: the variant's generator (``prepare``'s).
        variant: ``source.variant``; 0 returns the points unchanged, draws nothing.
    Returns:
        :class:`Augmented`: the points (float64 ``[N, 3]``) and the matrix.
    """
    import numpy as np
    import torch

    pts = torch.as_tensor(points).to(torch.float64)
    if variant == 0:
        return Augmented(pts.numpy(), np.eye(4))
    rotation = str(params.get("rotation", "none"))
    low = float(params.get("scale_min", 1.0))
    high = float(params.get("scale_max", 1.0))
    sigma = float(params.get("jitter", 0.0))
    linear = torch.eye(3, dtype=torch.float64)
    if rotation == "z":
        angle = float(torch.rand(1, dtype=torch.float64, generator=generator)) * 2.0 * math.pi
        c, s = math.cos(angle), math.sin(angle)
        linear = torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    elif rotation == "so3":
        linear = _quaternion_matrix(torch.randn(4, dtype=torch.float64, generator=generator))
    elif rotation != "none":
        raise ValueError(f"rotation: {rotation!r} is not one of {', '.join(ROTATIONS)}")
    if (low, high) != (1.0, 1.0):
        scale = low + torch.rand(3, dtype=torch.float64, generator=generator) * (high - low)
        linear = torch.diag(scale) @ linear
    out = pts @ linear.T
    if sigma > 0.0:
        out = out + torch.randn(out.shape, dtype=torch.float64, generator=generator) * sigma
    reach = float(out.abs().max()) if out.numel() else 0.0
    if reach > 1.0:
        fit = 1.0 / reach
        out = (out * fit).clamp_(-1.0, 1.0)  # the clamp only guards rounding
        linear = linear * fit
    matrix = np.eye(4)
    matrix[:3, :3] = linear.numpy()
    return Augmented(out.numpy(), matrix)


def transform_points(matrix: np.ndarray, points: np.ndarray) -> np.ndarray:
    """``points`` (float ``[N, 3]``) through a 4 x 4 augmentation: float64 ``[N, 3]``
    (for what goes with the points, a mesh's vertices: no jitter, no second fit)."""
    import numpy as np

    m = np.asarray(matrix, dtype=np.float64)
    return np.asarray(points, dtype=np.float64) @ m[:3, :3].T + m[:3, 3]


class AugmentationParts(NamedTuple):
    """An ``augmentation`` matrix taken apart (:func:`decompose_augmentation`)."""

    #: the rotation, float64 ``[3, 3]`` (identity when none)
    rotation: np.ndarray
    #: its angle in degrees, 0 .. 180
    angle_deg: float
    #: its unit axis, float64 ``[3]`` (zeros when the angle is 0)
    axis: np.ndarray
    #: the factor of each axis x, y, z after the rotation (the scale draw times the fit)
    scale: np.ndarray


def decompose_augmentation(matrix: Any) -> AugmentationParts:
    """The rotation and per-axis scale of an ``augmentation`` matrix (as
    :func:`augment_points` builds it: ``fit * S @ R`` in its upper 3 x 3, so row ``i`` is
    ``R``'s row ``i`` times axis ``i``'s factor). Raises ``ValueError`` for a matrix that
    is not 4 x 4 or whose upper 3 x 3 is not of that form."""
    import numpy as np

    m = np.asarray(matrix, dtype=np.float64)
    if m.shape != (4, 4) or not np.isfinite(m).all():
        raise ValueError(f"augmentation: expected a finite 4 x 4 matrix, got shape {m.shape}")
    linear = m[:3, :3]
    scale = np.linalg.norm(linear, axis=1)
    if (scale <= 0).any():
        raise ValueError("augmentation: a row of its upper 3 x 3 is zero")
    rotation = linear / scale[:, None]
    if not np.allclose(rotation @ rotation.T, np.eye(3), atol=1e-4):
        raise ValueError("augmentation: its upper 3 x 3 is not a scale times a rotation")
    cos = float(np.clip((np.trace(rotation) - 1.0) / 2.0, -1.0, 1.0))
    angle = math.degrees(math.acos(cos))
    skew = np.array(
        [
            rotation[2, 1] - rotation[1, 2],
            rotation[0, 2] - rotation[2, 0],
            rotation[1, 0] - rotation[0, 1],
        ]
    )
    if angle < 1e-6:
        axis = np.zeros(3)
    elif np.linalg.norm(skew) > 1e-6:
        axis = skew / np.linalg.norm(skew)
    else:  # a half turn: R = 2 a a^T - I, the axis from R's largest diagonal column
        outer = (rotation + np.eye(3)) / 2.0
        column = outer[:, int(np.argmax(np.diag(outer)))]
        axis = column / np.linalg.norm(column)
    return AugmentationParts(rotation, angle, axis, scale)


def _quaternion_matrix(q: torch.Tensor) -> torch.Tensor:
    """The rotation of a quaternion (normalised here): four normal deviates give a
    uniformly random one."""
    import torch

    norm = float(torch.linalg.vector_norm(q))
    w, x, y, z = (q / norm).tolist() if norm > 0 else (1.0, 0.0, 0.0, 0.0)
    return torch.tensor(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ],
        dtype=torch.float64,
    )
