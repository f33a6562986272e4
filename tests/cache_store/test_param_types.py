"""Recipe parameters take their declared type only: an ``int`` parameter takes Python's
and NumPy's integers, never ``8.0``, ``True`` or ``"8"`` (README: "an `int` takes
integers"), from Python, from the command line and at the service alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import spcache
from cache_store.recipes.registry import get_recipe_spec
from tests.helpers.procs import run_spcache


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (8.0, "level: expected an integer, got 8.0 (float)"),
        (True, "level: expected an integer, got True (bool)"),
        ("8", "level: expected an integer, got '8' (str)"),
        (np.float64(8.0), "level: expected an integer, got np.float64(8.0) (float64)"),
        (np.bool_(True), "level: expected an integer, got np.True_ (bool)"),
        (None, "level: expected an integer, got None (NoneType)"),
    ],
)
def test_an_int_parameter_refuses_what_is_not_an_integer(value: object, says: str) -> None:
    spec = get_recipe_spec("spc")
    with pytest.raises(spcache.ParameterError) as caught:
        spec.resolve({"level": value})
    assert says in str(caught.value) and "recipe 'spc'" in str(caught.value)


def test_numpy_integers_are_integers() -> None:
    spec = get_recipe_spec("spc")
    for value in (np.int64(6), np.int32(6), np.uint8(6)):
        resolved = spec.resolve({"level": value})
        assert resolved == spec.resolve({"level": 6}) and type(resolved["level"]) is int
    # a float parameter takes integers and NumPy's numbers as the float they are
    query = get_recipe_spec("spc_query")
    assert query.resolve({"surface_sigma": np.float32(0.5)})["surface_sigma"] == 0.5
    assert query.resolve({"surface_sigma": 1})["surface_sigma"] == 1.0


def test_precompute_refuses_a_float_level_from_python_and_the_cli(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    mesh = next(p for p in corpus_meshes if p.suffix == ".obj")
    with pytest.raises(spcache.ParameterError, match=r"level: expected an integer, got 8\.0"):
        spcache.precompute(mesh, "spc", tmp_path / "py", level=8.0, progress=False)
    assert not (tmp_path / "py").exists()  # refused before the cache is made
    cli = run_spcache(
        "precompute", mesh, "--recipe", "spc", "--param", "level=8.0", "--cache", "cache",
        "--device", "cpu", cwd=tmp_path,
    )  # fmt: skip
    assert cli.returncode == 2, cli.stderr
    assert "level: expected an integer, got 8.0 (float)" in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1 and not (tmp_path / "cache").exists()
