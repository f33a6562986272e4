"""README "Your own features", followed as written: the recipe module and pyproject.toml
from its blocks, installed as a package (pip, into a target directory), listed by
`spcache recipes`, precomputed by the CLI and read by a DataLoader."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT


def _blocks(kind: str) -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## Your own features") : text.index("## The CLI")]
    return re.findall(rf"```{kind}\n(.*?)```", section, re.S)


@pytest.mark.slow
def test_the_readme_recipe_from_an_empty_directory_to_a_dataloader(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    package = tmp_path / "my_recipes"
    (package / "my_recipes").mkdir(parents=True)
    (package / "my_recipes" / "__init__.py").write_text("")
    (package / "my_recipes" / "counts.py").write_text(_blocks("python")[0])
    (package / "pyproject.toml").write_text(_blocks("toml")[0])
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(package),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(site)])}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    listed = json.loads(run("-m", "spcache", "recipes", "--json").stdout)
    assert listed["point_count"]["origin"]["package"] == "my-recipes"
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    for mesh in corpus_meshes[:3]:
        (shapes / mesh.name).write_bytes(mesh.read_bytes())
    done = run(
        "-m",
        "spcache",
        "precompute",
        "shapes/",
        "--recipe",
        "point_count",
        "--param",
        "level=6",
        "--cache",
        "cache",
        "--device",
        "cpu",
        "--loaders",
        "0",
    )
    assert done.returncode == 0, done.stderr
    reader = _blocks("python")[1].split("# read-through")[0] + (
        "batch = next(iter(loader))\n"
        "print(len(ds), sorted(batch), int(batch['counts'].sum()) > 0)\n"
    )
    out = run("-c", reader)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "3" and "'voxels'" in out.stdout and "True" in out.stdout
