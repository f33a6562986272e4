"""Plugin recipes: how they are found, what is refused, and how a misbehaving one fails.

The recipes are in ``tests/workers/plugin_recipes.py``, written only against
``spcache.recipes``, and found through ``SPCACHE_RECIPES`` (entry points: a fake
distribution on ``sys.path`` in a child interpreter).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from cache_store.errors import UnknownName
from cache_store.recipes.registry import ENV_VAR, installed_recipes, load_registry
from cache_store.version import __version__
from cache_store.stores.lmdb import LMDBStore
from tests.conftest import REPO_ROOT
from tests.helpers.procs import run_spcache
from workers.engine import Engine

DATA = REPO_ROOT / "tests" / "data" / "recipes_golden"
MESH, CLOUD = DATA / "blob.obj", DATA / "cloud.xyz"
PLUGINS = "tests.workers.plugin_recipes"


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(ENV_VAR, f"{PLUGINS}:Probe")
    yield installed_recipes(reload=True).get("probe")
    monkeypatch.delenv(ENV_VAR)
    installed_recipes(reload=True)


def _run(tmp_path: Path, params: dict, **options):
    store = LMDBStore(tmp_path / "cache", readonly=False, map_size=1 << 24)
    engine = Engine(
        store,
        "probe",
        params,
        device="cpu",
        backend="torch",
        loaders=options.pop("loaders", 0),
        **options,
    )
    summary = engine.run([("mesh", str(MESH)), ("cloud", str(CLOUD))])
    return store, engine, summary


def test_a_plugin_recipe_is_listed_with_its_origin_and_computed(probe, tmp_path: Path) -> None:
    assert probe.origin == {
        "kind": ENV_VAR,
        "entry": f"{PLUGINS}:Probe",
        "package": None,
        "package_version": None,
    }
    assert probe.as_json()["fields"]["extent"]["finite"] is True
    store, engine, summary = _run(tmp_path, {"level": 4})
    with store:
        assert summary.done == 2 and summary.failed == 0
        record = store.get_record(engine.key("cloud"))
        assert record.tensors["voxels"].dtype.is_floating_point is False
        assert record.metadata["code_digest"] == probe.code_digest
        assert record.metadata["recipe"] == "probe"


def test_a_plugins_variable_size_field_has_one_batch_layout(probe, tmp_path: Path) -> None:
    """``voxels [N, 3]`` is concatenated with ``voxels_lengths`` in every batch: of one
    sample, of two equal-size samples and of unequal ones (the last batch of an epoch
    cannot change shape); ``extent [3]`` is stacked."""
    from torch.utils.data import DataLoader

    from spcache import CachedDataset, collate_spc

    store = LMDBStore(tmp_path / "cache", readonly=False, map_size=1 << 24)
    with store:
        engine = Engine(store, "probe", {"level": 4}, device="cpu", backend="torch", loaders=0)
        items = [("a", str(MESH)), ("b", str(MESH)), ("c", str(CLOUD))]
        assert engine.run(items).done == 3
    ds = CachedDataset(tmp_path / "cache", engine.fingerprint)
    at = {ds.sample_id(i): i for i in range(len(ds))}
    a, b, c = (ds[at[sid]] for sid in "abc")
    n_mesh, n_cloud = a["voxels"].shape[0], c["voxels"].shape[0]
    assert n_mesh != n_cloud and b["voxels"].shape[0] == n_mesh

    def layout(batch: dict) -> dict:  # the tensors' shapes; sample_ids is a list
        return {name: tuple(t.shape) for name, t in batch.items() if name != "sample_ids"}

    assert layout(collate_spc([a])) == {
        "voxels": (n_mesh, 3),
        "voxels_lengths": (1,),
        "extent": (1, 3),
    }
    assert layout(collate_spc([a, b])) == {
        "voxels": (2 * n_mesh, 3),
        "voxels_lengths": (2,),
        "extent": (2, 3),
    }
    assert collate_spc([a, c])["sample_ids"] == ["a", "c"]
    assert layout(collate_spc([a, c])) == {
        "voxels": (n_mesh + n_cloud, 3),
        "voxels_lengths": (2,),
        "extent": (2, 3),
    }
    # a transform returning a new dict keeps the declared layout of the fields it keeps
    renamed = CachedDataset(
        tmp_path / "cache", engine.fingerprint, transform=lambda s: {"voxels": s["voxels"]}
    )
    assert set(collate_spc([renamed[at["a"]]])) == {"voxels", "voxels_lengths", "sample_ids"}
    # forked DataLoader workers, batches of one: the same layout
    loader = DataLoader(ds, batch_size=1, num_workers=1, collate_fn=collate_spc)
    for batch in loader:
        assert batch["voxels"].dim() == 2 and batch["voxels_lengths"].shape == (1,)
        assert batch["extent"].shape == (1, 3)


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("dtype", "extent: dtype torch.float64, declared float32"),
        ("missing", "field(s) extent missing"),
        ("extra", "field(s) bonus not declared"),
        ("rank", "voxels: shape"),
        ("nan", "extent: holds NaN or infinite values, declared finite"),
        ("meta", "extent: left on meta, expected cpu"),
        ("compute", "compute() raised RuntimeError: probe's compute failed on purpose"),
        ("prepare", "prepare() raised RuntimeError: probe's prepare refuses meshes"),
        ("not_a_dict", "prepare() returned list, expected a dict of arrays"),
        (
            "oom",
            (
                "out of device memory (outside any chunked step: nothing to back off): CUDA "
                "out of memory (injected)"
            ),
        ),
    ],
)
def test_a_misbehaving_recipe_fails_that_sample_alone(
    probe, tmp_path: Path, mode: str, says: str
) -> None:
    store, engine, summary = _run(tmp_path, {"mode": mode})
    with store:
        assert (summary.done, summary.failed) == (1, 1), summary.errors
        [error] = summary.errors
        assert error.id == "mesh"
        assert "recipe 'probe'" in error.reason and says in error.reason, error.reason
        assert store.has(engine.key("cloud")) and not store.has(engine.key("mesh"))


def test_version_bump_is_a_new_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, f"{PLUGINS}:Probe")
    first = load_registry().get("probe").spec
    monkeypatch.setenv(ENV_VAR, f"{PLUGINS}:ProbeV2")
    bumped = load_registry().get("probe").spec
    from cache_store.keys import compute_fingerprint

    params = first.resolve({})
    assert bumped.version == 2
    assert compute_fingerprint("probe", first.version, params) != compute_fingerprint(
        "probe", bumped.version, bumped.resolve({})
    )


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"mode": 5}, "mode: expected a string, got 5"),
        ({"tag": None}, "tag: expected a string, got None"),
        ({"flip": "yes"}, "flip: expected a bool (true or false), got 'yes'"),
        ({"flip": 1}, "flip: expected a bool (true or false), got 1"),
        ({"flip": "true"}, "flip: expected a bool (true or false), got 'true'"),
    ],
)
def test_str_and_bool_parameters_are_type_checked(
    monkeypatch: pytest.MonkeyPatch, params: dict, says: str
) -> None:
    from cache_store.errors import ParameterError

    monkeypatch.setenv(ENV_VAR, f"{PLUGINS}:Tagged")
    spec = load_registry().get("tagged").spec
    with pytest.raises(ParameterError, match="recipe 'tagged'") as caught:
        spec.resolve(params)
    assert says in str(caught.value)
    assert spec.resolve({"tag": "123", "flip": True})["tag"] == "123"


def test_cli_params_are_read_as_their_declared_type(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--param tag=123`` is the string "123" of a str parameter, ``flip=true`` the bool:
    the CLI and Python (``tag="123", flip=True``) name one fingerprint."""
    from cache_store.keys import compute_fingerprint
    from spcache.cli import main
    from spcache.cli.precompute import parse_params

    monkeypatch.setenv(ENV_VAR, f"{PLUGINS}:Tagged")
    try:
        spec = installed_recipes(reload=True).get("tagged").spec
        assert parse_params(["tag=123", "flip=true", "level=4"], spec) == {
            "tag": "123",
            "flip": True,
            "level": 4,
        }
        assert parse_params(["flip=False"], spec) == {"flip": False}
        cache = tmp_path / "cache"
        argv = ["precompute", str(CLOUD), "--recipe", "tagged", "--cache", str(cache)]
        argv += ["--device", "cpu", "--backend", "torch", "--loaders", "0", "--json"]
        argv += ["--param", "tag=123", "--param", "flip=true"]
        capsys.readouterr()
        assert main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        python = spec.resolve({"tag": "123", "flip": True})
        assert out["params"] == python
        assert out["fingerprint"] == compute_fingerprint("tagged", 1, python)
        assert main([*argv[:-4], "--param", "flip=yes"]) == 2
        assert "flip: expected a bool (true or false), got 'yes'" in capsys.readouterr().err
    finally:
        monkeypatch.delenv(ENV_VAR)
        installed_recipes(reload=True)


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        (f"{PLUGINS}:Probe,{PLUGINS}:OtherProbe", "recipe name 'probe' is also claimed by"),
        (
            "no_such_module_anywhere:Thing",
            "failed to import: ModuleNotFoundError: No module named 'no_such_module_anywhere'",
        ),
        (f"{PLUGINS}:Missing", "failed to import: AttributeError"),
        (f"{PLUGINS}:NoCompute", "not a usable recipe: compute() is not implemented"),
        (f"{PLUGINS}:BadField", "dtype 'complex64' is not one of"),
        (f"{PLUGINS}:Shadow", "recipe name 'spc' is a built-in recipe; this one is not used"),
        (f"{PLUGINS}:EmptyFieldName", "field name '' is not a letter then letters"),
        (f"{PLUGINS}:PathFieldName", "field name 'a b/..' is not a letter then letters"),
        (
            f"{PLUGINS}:ReservedParam",
            "parameter name 'device' is reserved: spcache.precompute or CachedDataset",
        ),
        ("nonsense", "is not 'module:Class'"),
        (
            f"{PLUGINS}:PowerGrid",
            (
                "recipe 'power_grid', fields['occupancy']: shape '[2**grid, 2**grid, 2**grid]': "
                "'2**grid' is neither fixed nor a variable dimension"
            ),
        ),
        (
            f"{PLUGINS}:OffsetVariable",
            (
                "recipe 'offset_variable', fields['points']: shape '[N+1, 3]': 'N+1': 'N' is "
                "not a parameter, so it is a variable dimension, which takes no offset"
            ),
        ),
        (
            f"{PLUGINS}:FloatDimension",
            (
                "recipe 'float_dimension', fields['row']: shape '[spacing]': 'spacing': "
                "parameter 'spacing' is a float; only an int parameter sizes a dimension"
            ),
        ),
    ],
)
def test_an_unusable_recipe_is_named_with_its_reason_and_the_others_work(
    monkeypatch: pytest.MonkeyPatch, entries: str, says: str
) -> None:
    monkeypatch.setenv(ENV_VAR, entries)
    registry = load_registry()
    assert len(registry.problems) == 1 and says in registry.problems[0], registry.problems
    assert entries.split(",")[-1] in registry.problems[0]  # names the entry
    assert {"spc", "spc_query", "spc_sdf"} <= set(registry.recipes)
    assert "probe" not in registry.recipes or "OtherProbe" not in entries
    assert registry.recipes["spc"].cls.__module__ == "workers.builtin_recipes"
    with pytest.raises(UnknownName, match="known: .*spc"):
        registry.get("nothing")


def test_a_shape_spcache_cannot_read_is_refused_at_registration_in_one_line(
    tmp_path: Path,
) -> None:
    """``[2**grid, 2**grid, 2**grid]`` was taken as a variable first dimension and batched
    as ``(B * 2**grid, 32, 32)`` plus lengths; now ``spcache recipes`` names the recipe,
    the field and the expression in one line, and the recipe is not offered."""
    env = {"PYTHONPATH": str(REPO_ROOT), ENV_VAR: f"{PLUGINS}:PowerGrid"}
    proc = run_spcache("recipes", "--json", cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr  # spcache recipes: some recipe is unusable
    lines = [x for x in proc.stderr.splitlines() if "power_grid" in x]
    assert lines and all("fields['occupancy']" in x and "'2**grid'" in x for x in lines)
    assert lines[-1].startswith("spcache recipes: recipe ")  # the one line the command says
    assert "power_grid" not in json.loads(proc.stdout) and "spc" in json.loads(proc.stdout)


def test_declared_dimensions_decide_stack_or_concatenate() -> None:
    """The one shape grammar: fixed dimensions (integers, int parameters, +- k) stack in
    a batch, a variable first dimension (a name that is not a parameter) concatenates."""
    from cache_store.recipes.specs import FieldSpec, ParamSpec, RecipeSpec, fixed_size

    spec = RecipeSpec(
        "grids",
        1,
        {"grid": ParamSpec(int, 4), "level": ParamSpec(int, 3)},
        {
            "dense": FieldSpec("uint8", "[grid, grid, grid]", ""),
            "pyramid": FieldSpec("int32", "[2, level + 2]", ""),
            "parents": FieldSpec("int32", "[level-1]", ""),
            "voxels": FieldSpec("int16", "[N, 3]", ""),
        },
    )
    params = spec.resolve({"grid": 32})
    assert spec.variable_length_fields(params) == {"voxels"}
    dims = ("grid", "level + 2", "level-1", "7", "N")
    assert [fixed_size(d, params) for d in dims] == [32, 5, 2, 7, None]
    with pytest.raises(ValueError, match="2\\*\\*grid"):
        fixed_size("2**grid", params)


def test_reserved_parameter_names_are_the_arguments_of_precompute_and_the_dataset() -> None:
    """Every keyword argument ``spcache.precompute`` or ``CachedDataset`` takes itself is
    reserved, so no recipe parameter is shadowed by one."""
    import inspect

    import spcache
    from spcache.recipes import RESERVED_PARAM_NAMES

    own: set[str] = set()
    for function in (spcache.precompute, spcache.CachedDataset.__init__):
        own |= {
            name
            for name, p in inspect.signature(function).parameters.items()
            if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
        }
    assert own == set(RESERVED_PARAM_NAMES)


def _fake_distribution(root: Path, name: str, entry_points: dict[str, str]) -> None:
    info = root / f"{name}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(
        "[spcache.recipes]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    )


def test_entry_points_at_cli_startup_one_line_each(tmp_path: Path) -> None:
    """Installed distributions (fake dist-info on the path) register recipes by entry
    point; a broken one and a duplicate are each one ERROR line when the CLI starts, and
    ``spcache recipes --json`` still lists the good ones with package and version. The
    built-ins are spcache's own entry points, found first: a distribution whose name
    sorts before ``spcache`` cannot take one of their names."""
    _fake_distribution(tmp_path, "good_recipes", {"probe": f"{PLUGINS}:Probe"})
    _fake_distribution(tmp_path, "broken_recipes", {"broken": "broken_recipes_mod:Thing"})
    _fake_distribution(tmp_path, "a_twin_recipes", {"spc": f"{PLUGINS}:Shadow"})
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(tmp_path)]), ENV_VAR: None}
    proc = run_spcache("recipes", "--json", env=env)
    listed = json.loads(proc.stdout)
    assert listed["probe"]["origin"] == {
        "kind": "entry point",
        "entry": f"probe = {PLUGINS}:Probe",
        "package": "good_recipes",
        "package_version": "1.2.3",
    }
    assert listed["spc"]["origin"] == {
        "kind": "builtin",
        "entry": "spc = workers.builtin_recipes:Spc",
        "package": "spcache",
        "package_version": __version__,
    }
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 2, proc.stderr
    assert "'spc = tests.workers.plugin_recipes:Shadow' (package a_twin_recipes 1.2.3)" in errors[0]
    assert "is a built-in recipe" in errors[0]
    assert (
        "recipe entry point 'broken = broken_recipes_mod:Thing' (package broken_recipes "
        "1.2.3): failed to import: ModuleNotFoundError"
    ) in errors[1]
    assert proc.returncode == 1  # `spcache recipes` says a plugin could not be used


def test_code_changed_without_a_version_bump_is_reported(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Edit a recipe's module and forget to bump its version: the fingerprint stays, the
    records carry two code digests, and a run that skips old records, `stats` (text
    and JSON) and the item route say so."""
    from spcache.cli import main
    from service.settings import Settings
    from tests.helpers.service import InProcessServer

    module = tmp_path / "mods" / "edited_recipe.py"
    module.parent.mkdir()
    module.write_text(
        f"from {PLUGINS} import Probe\n\n\nclass Edited(Probe):\n    name = 'edited'\n"
    )
    monkeypatch.syspath_prepend(str(module.parent))
    monkeypatch.setenv(ENV_VAR, "edited_recipe:Edited")
    try:
        store = LMDBStore(tmp_path / "cache", readonly=False, map_size=1 << 24)
        with store:
            first = Engine(store, "edited", {}, device="cpu", backend="torch", loaders=0)
            assert first.run([("mesh", str(MESH))]).done == 1
            module.write_text(module.read_text() + "    # compute changed here\n")
            installed_recipes(reload=True)
            second = Engine(store, "edited", {}, device="cpu", backend="torch", loaders=0)
            assert second.fingerprint == first.fingerprint
            assert second.code_digest != first.code_digest
            assert second.run([("cloud", str(CLOUD))]).done == 1
            stats = store.stats()["fingerprints"][first.fingerprint]
            assert stats["code_digests"] == {first.code_digest: 1, second.code_digest: 1}
            assert "2 different versions of the recipe's code" in stats["mixed_code"]
            # the run again: the old record is skipped (kept), and the run says so
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="workers.run_ledger"):
                again = second.run([("mesh", str(MESH)), ("cloud", str(CLOUD))])
            assert (again.skipped, again.skipped_other_code) == (2, 1)
            assert again.as_json()["skipped_other_code"] == 1
            warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warned) == 1, warned
            assert f"recipe 'edited', fingerprint {first.fingerprint}: 1 skipped" in warned[0]
            assert "they were kept: bump the recipe's version" in warned[0]
        capsys.readouterr()
        assert main(["stats", "--cache", str(tmp_path / "cache")]) == 0
        text = capsys.readouterr().out
        assert (
            f"code     1 of 2 record(s) computed by other code than the installed recipe's "
            f"({second.code_digest})"
        ) in text, text
        assert f"1 by {first.code_digest}" in text and "bump the recipe's version" in text
        settings = Settings(cache=tmp_path / "cache", source_roots=[DATA], worker=False)
        with InProcessServer(settings) as server:
            import httpx

            old = httpx.get(f"{server.url}/v1/caches/{first.fingerprint}/items/mesh").json()
            new = httpx.get(f"{server.url}/v1/caches/{first.fingerprint}/items/cloud").json()
        assert old["code"] == {
            "record": first.code_digest,
            "installed": second.code_digest,
            "changed": True,
        }
        assert "computed by different recipe code" in old["reason"]
        assert new["code"]["changed"] is False and new["state"] == "ready"
    finally:
        monkeypatch.delenv(ENV_VAR)
        installed_recipes(reload=True)


def test_a_run_with_loader_processes_names_a_broken_recipe_once(tmp_path: Path) -> None:
    """`spcache precompute --loaders 2`: the plugin computes in the loader processes, and a
    broken entry beside it is one ERROR line (the loaders do not repeat it)."""
    env = {
        "PYTHONPATH": str(REPO_ROOT),
        ENV_VAR: f"{PLUGINS}:Probe,no_such_module_anywhere:Thing",
    }
    proc = run_spcache(
        "precompute",
        MESH,
        CLOUD,
        "--recipe",
        "probe",
        "--cache",
        tmp_path / "cache",
        "--device",
        "cpu",
        "--backend",
        "torch",
        "--loaders",
        "2",
        "--json",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["done"] == 2
    errors = [line for line in proc.stderr.splitlines() if "no_such_module_anywhere" in line]
    assert len(errors) == 1 and "failed to import: ModuleNotFoundError" in errors[0], proc.stderr
