"""Read amplification, the recipe half: parameters within the bounds cannot ask for
a record larger than the stated maximum.

Each parameter had its own range, but together (level 15, 50 M samples) they allowed a
1.3 GB record, which the service then had to send. The recipe schema now computes a
worst-case record size from the parameters and refuses those above
``MAX_RECORD_BYTES``; ``/v1/recipes`` states the bound. Checked: the refusal (library
and warm-up route), that the bound is a true upper bound of real records computed by
the CPU recipes (a dense cloud, so every level is as full as it can be), and that the
defaults and the values the docs use pass. Figures: the worst case of the defaults, and
the largest real-record / bound ratio seen.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from cache_store.errors import ParameterError
from cache_store.recipes.specs import MAX_RECORD_BYTES
from cache_store.recipes.registry import RECIPE_SPECS, get_recipe_spec
from service.settings import Settings
from tests.helpers.faults import report, served
from tests.helpers.service import TOKEN, build_cache


BUILTINS = ("spc", "spc_query", "spc_sdf")


def test_params_past_the_record_bound_are_refused(tmp_path: Path) -> None:
    spec = get_recipe_spec("spc")
    with pytest.raises(ParameterError, match="record limit"):
        spec.resolve({"level": 15, "surface_samples": 50_000_000})
    with pytest.raises(ParameterError, match="record limit"):
        get_recipe_spec("spc_query").resolve(
            {"uniform_queries": 10_000_000, "surface_queries": 10_000_000, "level": 15}
        )
    for name in BUILTINS:  # a plugin recipe may declare no size bound (the example does not)
        spec = RECIPE_SPECS[name]
        spec.resolve({})  # the defaults pass
        worst = spec.worst_case_record_bytes()
        assert worst is not None and worst <= MAX_RECORD_BYTES, name
    cache = build_cache(tmp_path)
    settings = Settings(cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False)
    with served(settings) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        recipes = {r["name"]: r for r in c.get("/v1/recipes").json()["recipes"]}
        refused = c.post(
            "/v1/warmup",
            headers={"Authorization": f"Bearer {TOKEN}"},
            json={
                "recipe": "spc",
                "params": {"level": 15, "surface_samples": 50_000_000},
                "items": [{"id": "shapes/s0", "path": "shapes/s0.obj"}],
            },
        )
    assert refused.status_code == 422 and "record limit" in refused.text, refused.text
    for name in BUILTINS:
        assert recipes[name]["max_record_bytes"] == MAX_RECORD_BYTES
        assert "8^l" in recipes[name]["record_bytes_bound"]
    report(
        "record_bound",
        {
            "max_record_bytes": MAX_RECORD_BYTES,
            "default_worst_case": {
                n: r["default_worst_case_record_bytes"] for n, r in recipes.items()
            },
        },
    )


@pytest.mark.parametrize(
    "name,params",
    [
        ("spc", {"level": 3, "surface_samples": 4000}),
        ("spc", {"level": 6, "surface_samples": 20_000}),
        (
            "spc_query",
            {"level": 5, "surface_samples": 3000, "uniform_queries": 500, "surface_queries": 700},
        ),
    ],
)
def test_real_records_stay_under_the_bound(name: str, params: dict) -> None:
    from cache_store.format.encode import encode_record
    from workers.ops import get_backend
    from workers.recipe_run import get_recipe, run_recipe
    from workers.source_load import LoadedSource

    spec = get_recipe_spec(name)
    resolved = spec.resolve(params)
    rng = np.random.default_rng(0)
    cloud = rng.uniform(-1, 1, size=(resolved["surface_samples"], 3))  # fills every level
    source = LoadedSource("dense.npy", "xxh3_128:0", cloud, None)
    tensors = run_recipe(
        get_recipe(name),
        source,
        resolved,
        generator=torch.Generator().manual_seed(0),
        device="cpu",
        ops=get_backend("torch", "cpu"),
    )
    record = encode_record(
        tensors,
        {
            "recipe": name,
            "recipe_version": str(spec.version),
            "fingerprint": "0" * 32,
            "sample_id": "dense",
            "source_hash": "xxh3_128:0",
            "backend": "torch",
            "device": "cpu",
        },
    )
    bound = spec.worst_case_record_bytes(resolved)
    assert bound is not None
    report(
        "record_bound_real",
        {
            "recipe": name,
            "params": params,
            "record_bytes": len(record),
            "bound": bound,
            "ratio": round(len(record) / bound, 3),
        },
    )
    assert len(record) <= bound
