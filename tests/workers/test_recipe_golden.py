"""The built-in recipes, rewritten on the public recipe API, give the tensors the code
before the rewrite gave (kept in tests/data/recipes_golden, see its README). A field a
later recipe version added is listed in golden.json's ``added_since`` with its values,
and ``seeded_as`` names the fingerprint that seeded the golden draws."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cache_store.stores.lmdb import LMDBStore
import workers.loader
from workers.engine import Engine
from workers.recipe_run import make_generator

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "recipes_golden"
CASES = json.loads((GOLDEN / "golden.json").read_text())


@pytest.mark.parametrize("recipe", sorted(CASES))
def test_builtin_recipe_matches_the_records_made_before_the_api(
    recipe: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[recipe]
    if "seeded_as" in case:
        # a version bump changes the fingerprint, which seeds every sample's draws: seed
        # as the golden records were, so the old tensors must come back unchanged
        monkeypatch.setattr(
            workers.loader,
            "make_generator",
            lambda fingerprint, sample_id, variant=0: make_generator(
                case["seeded_as"], sample_id, variant
            ),
        )
    with LMDBStore(tmp_path / "cache", readonly=False, map_size=1 << 26) as store:
        engine = Engine(store, recipe, case["params"], device="cpu", backend="torch", loaders=0)
        assert engine.fingerprint == case["fingerprint"]
        summary = engine.run([(sid, str(GOLDEN / name)) for sid, name in case["samples"].items()])
        assert summary.failed == 0 and summary.done == len(case["samples"])
        for sid in case["samples"]:
            record = store.get_record(engine.key(sid))
            want = np.load(GOLDEN / f"{recipe}__{sid}.npz")
            # fields a later recipe version added: the golden tensors stay as they were
            added = case.get("added_since", {})
            assert sorted(record.tensors) == sorted([*want.files, *added])
            for name, since in added.items():
                got = record.tensors[name].numpy()
                np.testing.assert_array_equal(got, since["values"][sid], err_msg=f"{sid}: {name}")
            for name in want.files:
                got = record.tensors[name].numpy()
                assert got.dtype == want[name].dtype, (sid, name)
                np.testing.assert_array_equal(got, want[name], err_msg=f"{sid}: {name}")
            assert record.metadata["code_digest"] == engine.code_digest
