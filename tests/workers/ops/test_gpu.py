"""On a CUDA machine: the torch backend on CUDA equals itself on the CPU, and the Kaolin
backend equals the torch backend, bit for bit, on random inputs."""

from __future__ import annotations

import pytest
import torch

from cache_store.errors import BackendUnavailable
from tests.helpers.kaolin_data import two_octrees
from workers.ops import kaolin_spc, torch_spc

pytestmark = pytest.mark.gpu


def _random_case(seed: int, level: int, n: int = 20_000):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen)
    x = 0.95 * x / x.norm(dim=1, keepdim=True)  # a sphere: a sparse surface-like octree
    queries = torch.cat(
        [
            torch.rand(n, 3, generator=gen) * 2.2 - 1.1,
            x + 0.01 * torch.randn(n, 3, generator=gen),
            torch.tensor(
                [
                    [-1.0 - 2.0 ** -(level + 1)] * 3,
                    [1.0] * 3,
                    [-1.0] * 3,
                    [float("nan"), 0.0, 0.0],
                    [40.0, 0.0, 0.0],
                ]
            ),
        ]
    )
    return x, queries


def _everything(ops, x: torch.Tensor, queries: torch.Tensor, level: int) -> dict:
    out = {}
    points = ops.quantize_points(x, level)
    out["points"] = points
    out["morton"] = ops.points_to_morton(points)
    out["unmorton"] = ops.morton_to_points(out["morton"])
    out["octree"] = ops.unbatched_points_to_octree(points, level)
    lengths = torch.tensor([len(out["octree"])], dtype=torch.int32)
    out["max_level"], out["pyramids"], out["exsum"] = ops.scan_octrees(out["octree"], lengths)
    out["hierarchy"] = ops.generate_points(out["octree"], out["pyramids"], out["exsum"])
    out["corners"] = ops.points_to_corners(out["hierarchy"])
    out["leaves"] = ops.unbatched_get_level_points(out["hierarchy"], out["pyramids"][0], level)
    out["dual"], out["pyramid_dual"] = ops.unbatched_make_dual(out["hierarchy"], out["pyramids"][0])
    out["trinkets"], out["parents"] = ops.unbatched_make_trinkets(
        out["hierarchy"], out["pyramids"][0], out["dual"], out["pyramid_dual"]
    )
    for dtype in (torch.float16, torch.float32, torch.float64):
        q = queries.to(dtype)
        for lvl in sorted({0, level // 2, level}):
            out[f"q{dtype}{lvl}"] = ops.unbatched_query(out["octree"], out["exsum"], q, lvl)
            out[f"p{dtype}{lvl}"] = ops.unbatched_query(
                out["octree"], out["exsum"], q, lvl, with_parents=True
            )
    ints = ops.quantize_points(queries.nan_to_num().clamp(-1, 1), level)
    out["qint"] = ops.unbatched_query(out["octree"], out["exsum"], ints, level)
    out["pint"] = ops.unbatched_query(out["octree"], out["exsum"], ints, level, with_parents=True)
    out["empty_morton"] = ops.points_to_morton(points[:0])
    out["empty_points"] = ops.morton_to_points(out["morton"][:0])
    out["empty_corners"] = ops.points_to_corners(points[:0])
    out["empty_query"] = ops.unbatched_query(
        out["octree"], out["exsum"], queries[:0], level, with_parents=True
    )
    octrees, lengths = two_octrees()
    octrees = octrees.to(x.device)
    out["batch_max_level"], out["batch_pyramids"], out["batch_exsum"] = ops.scan_octrees(
        octrees, lengths
    )
    out["batch_points"] = ops.generate_points(octrees, out["batch_pyramids"], out["batch_exsum"])
    return out


def _assert_same(got: dict, expected: dict, device: str) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        other = got[key]
        if isinstance(value, torch.Tensor):
            assert other.dtype == value.dtype, key
            if key in ("pyramids", "batch_pyramids", "pyramid_dual"):
                assert other.device.type == "cpu", key  # Kaolin keeps pyramids on the CPU
            else:
                assert other.device.type == device, key
            assert torch.equal(other.cpu(), value.cpu()), key
        else:
            assert other == value, key


@pytest.mark.parametrize("level", [1, 4, 8, 10, 12])
def test_torch_backend_on_cuda_equals_cpu(level):
    x, queries = _random_case(level, level)
    on_cpu = _everything(torch_spc, x, queries, level)
    on_cuda = _everything(torch_spc, x.cuda(), queries.cuda(), level)
    _assert_same(on_cuda, on_cpu, "cuda")


@pytest.mark.parametrize("level", [1, 4, 8, 10, 12])
def test_kaolin_backend_equals_torch_backend(level):
    try:
        kaolin_spc.ensure_available()
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    x, queries = _random_case(100 + level, level)
    with_torch = _everything(torch_spc, x.cuda(), queries.cuda(), level)
    with_kaolin = _everything(kaolin_spc, x.cuda(), queries.cuda(), level)
    _assert_same(with_kaolin, with_torch, "cuda")


@pytest.mark.parametrize("level", [1, 4, 8, 10])
def test_kaolins_own_trinkets_equal_the_torch_ones(level):
    """The kaolin backend's unbatched_make_trinkets is the torch one (Kaolin's walks Python
    dictionaries); this holds it to Kaolin 0.18's own, which it replaces."""
    try:
        spc = kaolin_spc.ensure_available()
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    x, _ = _random_case(200 + level, level, n=5_000)
    points = torch_spc.quantize_points(x.cuda(), level)
    octree = torch_spc.unbatched_points_to_octree(points, level)
    lengths = torch.tensor([len(octree)], dtype=torch.int32)
    _, pyramids, exsum = torch_spc.scan_octrees(octree, lengths)
    hierarchy = torch_spc.generate_points(octree, pyramids, exsum)
    dual, pyramid_dual = torch_spc.unbatched_make_dual(hierarchy, pyramids[0])
    ours = torch_spc.unbatched_make_trinkets(hierarchy, pyramids[0], dual, pyramid_dual)
    theirs = spc.unbatched_make_trinkets(hierarchy, pyramids[0], dual, pyramid_dual)
    for mine, kaolins in zip(ours, theirs, strict=True):
        assert mine.dtype == kaolins.dtype == torch.int32
        assert torch.equal(mine.cpu(), kaolins.cpu())
