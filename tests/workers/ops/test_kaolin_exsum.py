"""The Kaolin backend speaks both exsum layouts Kaolin's ``kaolin.ops.spc`` has had under
the version string 0.18.0: the released wheels' legacy one (a leading 0 per octree) and
the current inclusive one. Records always hold the inclusive layout; the conversions at
the boundary are checked here on the CPU against the torch backend's own two layouts."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from workers.ops import kaolin_spc
from workers.ops import torch_spc as ops


def _batch(seed: int, count: int, level: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    octrees = []
    for _ in range(count):
        points = torch.randint(
            0,
            2**level,
            (int(torch.randint(1, 60, (1,), generator=gen)), 3),
            generator=gen,
            dtype=torch.int16,
        )
        octrees.append(ops.unbatched_points_to_octree(points, level))
    return torch.cat(octrees), torch.tensor([len(o) for o in octrees], dtype=torch.int32)


@pytest.mark.parametrize("seed, count, level", [(0, 1, 3), (1, 3, 5), (2, 5, 7)])
def test_the_conversions_are_the_torch_backends_two_layouts(
    seed: int, count: int, level: int
) -> None:
    octrees, lengths = _batch(seed, count, level)
    _, _, inclusive = ops.scan_octrees(octrees, lengths)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        _, _, legacy = ops.scan_octrees(octrees, lengths, legacy_exsum=True)
    assert legacy.shape[0] == inclusive.shape[0] + count
    assert torch.equal(kaolin_spc.to_legacy_exsum(inclusive, lengths), legacy)
    assert torch.equal(kaolin_spc.from_legacy_exsum(legacy, lengths), inclusive)
    single = inclusive[: int(lengths[0])]  # one octree, as unbatched_query takes it
    assert torch.equal(
        kaolin_spc.to_legacy_exsum(single, lengths[:1]), torch.cat([single.new_zeros(1), single])
    )


def test_the_layout_is_read_from_scan_octrees_signature() -> None:
    def released(octrees, lengths):  # kaolin 0.18.0 wheels
        raise AssertionError("not called")

    def current(octrees, lengths, legacy_exsum=False):  # kaolin after the exsum redo
        raise AssertionError("not called")

    assert kaolin_spc.exsum_layout(types.SimpleNamespace(scan_octrees=released)) == "legacy"
    assert kaolin_spc.exsum_layout(types.SimpleNamespace(scan_octrees=current)) == "inclusive"
    assert kaolin_spc.exsum_layout(types.SimpleNamespace(scan_octrees=len)) == "legacy"
