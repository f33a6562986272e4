"""``voxel_normals``: a mesh's structured point cloud (Kaolin SPC) with the mean face
normal of each occupied leaf voxel.

Written only against ``spcache.recipes``. The surface is sampled (area-weighted, from the
sample's seeded generator), each sample carries its face's unit normal, the samples are
quantised into an octree with the SPC ops spcache hands to ``compute`` (Kaolin's on CUDA,
spcache's pure-PyTorch ones elsewhere), and each leaf voxel gets the mean of its samples'
normals, renormalised. Leaves are in the octree's Morton order, so ``normals[i]`` belongs
to ``point_hierarchy[pyramid[1, level] + i]``.

torch and NumPy are imported inside the methods only: the spcache service, ``spcache
ls`` and ``spcache stats`` import this module to learn the schema and code digest, and
stay free of both (a command that only reads a cache's summaries starts in a fraction of
the time).
"""

from __future__ import annotations

from spcache.recipes import Field, Param, Recipe, SourceError

__all__ = ["VoxelNormals"]


class VoxelNormals(Recipe):
    """Sparse octree of a mesh with the mean face normal of each leaf voxel."""

    name = "voxel_normals"
    version = 1
    params = {
        "level": Param(int, 6, minimum=1, maximum=10, doc="octree depth"),
        "samples": Param(
            int,
            50_000,
            minimum=1,
            maximum=5_000_000,
            doc="surface points sampled (area-weighted) to find voxels and normals",
        ),
    }
    fields = {
        "octree": Field("uint8", "[num_bytes]", "Kaolin SPC octree of the normalised mesh"),
        "pyramid": Field("int32", "[2, level+2]", "points per level; first index of each level"),
        "exsum": Field("int32", "[num_bytes]", "inclusive running sum of set bits per byte"),
        "point_hierarchy": Field("int16", "[num_points, 3]", "voxel coordinates of all levels"),
        "normals": Field(
            "float32",
            "[num_leaves, 3]",
            "unit mean face normal of each leaf voxel, in Morton order",
            finite=True,
        ),
        "counts": Field("int32", "[num_leaves]", "surface samples that fell in each leaf"),
        "center": Field("float32", "[3]", "normalised = (source - center) / scale", finite=True),
        "scale": Field("float32", "[]", "normalisation scale", finite=True),
    }

    def prepare(self, source, params, generator):
        """Normalise the mesh into [-1, 1]^3 and draw the surface samples (CPU)."""
        import numpy as np
        import torch

        if source.faces is None or len(source.faces) == 0:
            raise SourceError(
                source.path,
                "voxel_normals needs a triangle mesh (this file "
                "has no faces: no normals to average)",
            )
        vertices = np.asarray(source.vertices, dtype=np.float64)
        faces = np.asarray(source.faces, dtype=np.int64)
        used = vertices[np.unique(faces)]
        lo, hi = used.min(axis=0), used.max(axis=0)
        center = ((lo + hi) / 2).astype(np.float32).astype(np.float64)
        scale = float(np.float32(max(float((hi - lo).max()) / 2, 1e-12) * 1.001))
        v = (vertices - center) / scale
        a, b, c = v[faces[:, 0]], v[faces[:, 1]], v[faces[:, 2]]
        cross = np.cross(b - a, c - a)
        area = np.linalg.norm(cross, axis=1)
        if not np.isfinite(area).all() or area.sum() <= 0:
            raise SourceError(source.path, "the mesh has no surface area")
        unit = cross / np.where(area > 0, area, 1.0)[:, None]
        count = int(params["samples"])
        face = torch.multinomial(
            torch.from_numpy(area), count, replacement=True, generator=generator
        ).numpy()
        uv = torch.rand(count, 2, dtype=torch.float64, generator=generator).numpy()
        flip = uv.sum(axis=1) > 1
        uv[flip] = 1 - uv[flip]
        points = a[face] + uv[:, :1] * (b[face] - a[face]) + uv[:, 1:] * (c[face] - a[face])
        return {
            "points": np.clip(points, -1, 1).astype(np.float32),
            "normals": unit[face].astype(np.float64),
            "center": center.astype(np.float32),
            "scale": np.array(scale, np.float32),
        }

    def compute(self, prepared, params, device, ops):
        """Octree with the SPC ops on ``device``; per-leaf means on the CPU (exact and
        in a fixed order, so every device gives the same record)."""
        import torch

        level = int(params["level"])
        points = torch.from_numpy(prepared["points"]).to(device)
        octree = ops.unbatched_points_to_octree(ops.quantize_points(points, level), level)
        lengths = torch.tensor([octree.numel()], dtype=torch.int32)
        _, pyramids, exsum = ops.scan_octrees(octree, lengths)
        hierarchy = ops.generate_points(octree, pyramids, exsum)
        pyramid = pyramids[0].to("cpu", torch.int32)
        first, leaves = int(pyramid[1, level]), int(pyramid[0, level])
        index = ops.unbatched_query(octree, exsum, points, level).to("cpu", torch.int64) - first
        sums = torch.zeros(leaves, 3, dtype=torch.float64)
        sums.index_add_(0, index, torch.from_numpy(prepared["normals"]))
        counts = torch.bincount(index, minlength=leaves)
        length = sums.norm(dim=1, keepdim=True)
        normals = torch.where(length > 1e-12, sums / length.clamp_min(1e-12), 0.0)
        return {
            "octree": octree.cpu(),
            "pyramid": pyramid,
            "exsum": exsum.to("cpu", torch.int32),
            "point_hierarchy": hierarchy.to("cpu", torch.int16),
            "normals": normals.to(torch.float32),
            "counts": counts.to(torch.int32),
            "center": torch.from_numpy(prepared["center"]),
            "scale": torch.from_numpy(prepared["scale"]),
        }
