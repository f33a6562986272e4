"""An spcache recipe package: :class:`~spcache_voxel_normals.recipe.VoxelNormals`."""

from spcache_voxel_normals.recipe import VoxelNormals

__all__ = ["VoxelNormals"]
