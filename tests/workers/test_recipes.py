"""Recipes: registry, seeding, the out-of-memory back-off and output checking (no ops needed)."""

from __future__ import annotations

import pytest
import torch

from cache_store.errors import SpcacheError, UnknownName
from cache_store.recipes.api import is_out_of_memory
from cache_store.recipes.registry import RECIPE_SPECS
from tests.helpers.recipes import BUILTINS, known_names
from workers.recipe_run import RECIPES, get_recipe, make_generator, sample_seed
from cache_store.recipes.api import ChunkBudget, check_outputs


def test_registry_computes_every_declared_recipe() -> None:
    assert set(RECIPES) == set(RECIPE_SPECS)
    for name, recipe in RECIPES.items():
        assert recipe.spec is RECIPE_SPECS[name] and recipe.name == name
    with pytest.raises(UnknownName, match="unknown recipe 'voxels'") as info:
        get_recipe("voxels")
    assert known_names(str(info.value)) >= BUILTINS


def test_public_parameter_and_field_names() -> None:
    spc, query = RECIPES["spc"].spec, RECIPES["spc_query"].spec
    augmentation = {"rotation", "scale_min", "scale_max", "jitter"}
    assert set(spc.params) == {"level", "surface_samples"} | augmentation
    assert (
        set(query.params)
        == {
            "level",
            "surface_samples",
            "uniform_queries",
            "surface_queries",
            "surface_sigma",
        }
        | augmentation
    )
    # the augmentation parameters are left out of the fingerprint at their defaults
    assert set(spc.resolve({})) == {"level", "surface_samples"}
    base = {"octree", "pyramid", "exsum", "point_hierarchy", "center", "scale"}
    assert set(spc.fields) == base | {"augmentation"}
    assert set(spc.fields_for(spc.resolve({}))) == base
    assert set(spc.fields_for(spc.resolve({"jitter": 0.01}))) == base | {"augmentation"}
    assert set(query.fields_for({})) == base | {"query_points", "query_pidx", "occupancy"}


def test_seed_depends_on_fingerprint_and_sample_id() -> None:
    seeds = {sample_seed(fp, sid) for fp in ("a" * 32, "b" * 32) for sid in ("x", "y")}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed("a" * 32, "x") == sample_seed("a" * 32, "x")
    # no ambiguity between ("ab", "c") and ("a", "bc")
    assert sample_seed("ab", "c") != sample_seed("a", "bc")
    g1, g2 = make_generator("f", "s"), make_generator("f", "s")
    assert torch.equal(torch.rand(5, generator=g1), torch.rand(5, generator=g2))
    assert g1.device.type == "cpu"


def test_chunk_budget_halves_on_oom_and_keeps_order() -> None:
    attempts: list[int] = []

    def hook(size: int) -> None:
        attempts.append(size)
        if len(attempts) <= 2:
            raise torch.cuda.OutOfMemoryError("injected")

    budget = ChunkBudget(64, minimum=4, before_query_chunk=hook)
    parts = budget.run(100, lambda a, b: torch.arange(a, b), torch.device("cpu"))
    assert torch.equal(torch.cat(parts), torch.arange(100))
    assert attempts[:3] == [64, 32, 16] and budget.size == 16 and budget.backoffs == 2
    # the reduced size carries over to the next sample
    assert [
        len(p) for p in budget.run(20, lambda a, b: torch.arange(a, b), torch.device("cpu"))
    ] == [16, 4]


# The message c10's CUDA caching allocator raises; from inside Kaolin's C++ (no exception
# translator in its bindings) it arrives as a plain RuntimeError, not OutOfMemoryError.
KAOLIN_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.11 GiB of which 1.06 GiB is free. Of the allocated memory 75.2 GiB is "
    "allocated by PyTorch, and 1.3 GiB is reserved by PyTorch but unallocated."
)


def test_chunk_budget_backs_off_on_kaolins_plain_runtime_error(monkeypatch) -> None:
    emptied: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    sizes: list[int] = []

    def step(a: int, b: int) -> torch.Tensor:
        sizes.append(b - a)
        if b - a > 16:
            raise RuntimeError(KAOLIN_OOM)
        return torch.arange(a, b)

    budget = ChunkBudget(64, minimum=4)
    # torch.device("cuda") is only a name: nothing here initialises CUDA
    parts = budget.run(40, step, torch.device("cuda"))
    assert torch.equal(torch.cat(parts), torch.arange(40))
    assert sizes[:3] == [40, 32, 16] and budget.size == 16
    assert budget.backoffs == 2 and len(emptied) == 2


def test_out_of_memory_is_recognised_by_type_or_by_cudas_message() -> None:
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("anything"))
    assert is_out_of_memory(RuntimeError(KAOLIN_OOM))
    assert is_out_of_memory(
        RuntimeError(
            "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"
        )
    )
    assert not is_out_of_memory(RuntimeError("CUDA error: an illegal memory access"))
    assert not is_out_of_memory(ValueError(KAOLIN_OOM))
    assert not is_out_of_memory(MemoryError())


def test_chunk_budget_gives_up_below_minimum() -> None:
    def hook(size: int) -> None:
        raise torch.cuda.OutOfMemoryError(f"injected at {size}")

    budget = ChunkBudget(16, minimum=4, before_query_chunk=hook)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="injected at 4"):
        budget.run(100, lambda a, b: torch.arange(a, b), torch.device("cpu"))
    assert budget.size == 4


def test_other_errors_are_not_retried() -> None:
    calls = []

    def step(a: int, b: int) -> torch.Tensor:
        calls.append(a)
        raise RuntimeError("not memory")

    with pytest.raises(RuntimeError, match="not memory"):
        ChunkBudget(8).run(100, step, torch.device("cpu"))
    assert calls == [0]


def _spc_like(level: int, m: int | None = None) -> dict[str, torch.Tensor]:
    out = {
        "octree": torch.zeros(5, dtype=torch.uint8),
        "pyramid": torch.zeros(2, level + 2, dtype=torch.int32),
        "exsum": torch.zeros(5, dtype=torch.int32),
        "point_hierarchy": torch.zeros(9, 3, dtype=torch.int16),
        "center": torch.zeros(3, dtype=torch.float32),
        "scale": torch.tensor(1.0),
    }
    if m is not None:
        out.update(
            query_points=torch.zeros(m, 3),
            occupancy=torch.zeros(m, dtype=torch.uint8),
            query_pidx=torch.zeros(m, level + 1, dtype=torch.int32),
        )
    return out


def test_check_outputs() -> None:
    spec = RECIPES["spc_query"].spec
    params = spec.resolve({"level": 3, "uniform_queries": 4, "surface_queries": 6})
    check_outputs(spec, _spc_like(3, 10), params)
    bad = _spc_like(3, 10)
    bad["exsum"] = torch.zeros(6, dtype=torch.int32)  # num_bytes disagrees with octree
    with pytest.raises(SpcacheError, match="exsum: shape"):
        check_outputs(spec, bad, params)
    with pytest.raises(SpcacheError, match="pyramid: shape"):
        check_outputs(spec, _spc_like(4, 10), params)
    with pytest.raises(SpcacheError, match="query_points: shape"):
        check_outputs(spec, _spc_like(3, 11), params)
    bad = _spc_like(3, 10)
    bad["occupancy"] = bad["occupancy"].bool()
    with pytest.raises(SpcacheError, match="occupancy: dtype"):
        check_outputs(spec, bad, params)
    with pytest.raises(SpcacheError, match="not declared"):
        check_outputs(RECIPES["spc"].spec, _spc_like(3, 10), params)
