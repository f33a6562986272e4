"""``spcache.precompute`` with loader processes, from whatever ``__main__`` the user has:
``python -`` (stdin), a script with and without ``if __name__ == "__main__":``, and
``python -c``; each run as the user runs it, in a fresh directory, then checked as the
user would (the result, ``spcache stats``, the records read back). And when loader
processes cannot work at all, the run says so once and computes every sample anyway;
a file that kills its loader still fails alone. (The notebook: tests/spcache/test_library.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import trimesh

from tests.conftest import REPO_ROOT
from tests.helpers.procs import run, run_spcache

SHAPES = 4
LOADERS_DIED = "loader process died"


def _sources(folder: Path) -> Path:
    folder.mkdir()
    for i in range(SHAPES):
        trimesh.creation.icosphere(subdivisions=2, radius=0.5 + 0.1 * i).export(
            folder / f"ball{i}.obj"
        )
    return folder


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPCACHE_")}
    env.pop("PYTHONPATH", None)  # the installed spcache, as a user has it
    return {**env, **extra}


def _python(args: list[str], cwd: Path, *, stdin: str | None = None, **env: str):
    return run([sys.executable, *args], cwd=cwd, input=stdin, env=_env(**env), inherit_env=False)


def _result(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _remembered_failures(cwd: Path) -> int:
    """What ``spcache stats`` says the cache remembers as failed."""
    proc = run_spcache(
        "stats", "--cache", "cache", "--json", cwd=cwd, env=_env(), inherit_env=False
    )
    assert proc.returncode == 0, proc.stderr
    return int(json.loads(proc.stdout)["failed"])


def _read_back(cwd: Path, fingerprint: str) -> list[str]:
    from cache_store.readers.dataset import CachedDataset

    ds = CachedDataset(str(cwd / "cache"), fingerprint)
    return sorted(ds.sample_id(i) for i in range(len(ds)))


# The user's code: a line in ran.txt each time the module's body runs (a loader that
# imported the main module again would add one), then the run, its result on stdout.
BODY = textwrap.dedent(
    """
    import json
    import spcache

    with open("ran.txt", "a") as ran:
        print("body", file=ran)


    def main():
        result = spcache.precompute(
            "shapes", "spc", "cache", device="cpu", loaders=2, progress=False,
            level=4, surface_samples=2000,
        )
        print(json.dumps(result.as_json()))
    """
)

WAYS = {
    "stdin": lambda cwd: _python(["-"], cwd, stdin=BODY + "\nmain()\n"),
    "script-without-guard": lambda cwd: _run_file(cwd, BODY + "\nmain()\n"),
    "script-with-guard": lambda cwd: _run_file(
        cwd, BODY + '\nif __name__ == "__main__":\n    main()\n'
    ),
    "dash-c": lambda cwd: _python(["-c", BODY + "\nmain()\n"], cwd),
}


def _run_file(cwd: Path, code: str):
    (cwd / "train.py").write_text(code)
    return _python(["train.py"], cwd)


@pytest.mark.slow
@pytest.mark.parametrize("way", list(WAYS))
def test_precompute_with_loaders_from_any_main(tmp_path: Path, way: str) -> None:
    _sources(tmp_path / "shapes")
    proc = WAYS[way](tmp_path)
    result = _result(proc)
    assert (result["done"], result["skipped"], result["failed"]) == (SHAPES, 0, 0), proc.stderr
    assert LOADERS_DIED not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "loader processes cannot be used" not in proc.stderr, proc.stderr
    # the loaders never ran the user's module again
    assert (tmp_path / "ran.txt").read_text().splitlines() == ["body"]
    assert _remembered_failures(tmp_path) == 0
    assert _read_back(tmp_path, result["fingerprint"]) == [f"ball{i}" for i in range(SHAPES)]


# A recipe defined in the script itself and named by SPCACHE_RECIPES=__main__:Extent: the
# loaders (which never import the user's main module) cannot find it.
RECIPE_IN_MAIN = textwrap.dedent(
    """
    import json
    import numpy as np
    import spcache
    from spcache.recipes import Field, Param, Recipe


    class Extent(Recipe):
        name = "extent"
        version = 1
        params = {"scale": Param(float, 1.0, doc="a factor")}
        fields = {"extent": Field("float32", "[3]", "bounding-box size", finite=True)}

        def prepare(self, source, params, generator):
            v = source.vertices
            return {"extent": (v.max(axis=0) - v.min(axis=0)).astype(np.float32)}

        def compute(self, prepared, params, device, ops):
            import torch

            return {"extent": torch.from_numpy(prepared["extent"]) * params["scale"]}


    if __name__ == "__main__":
        result = spcache.precompute("shapes", "extent", "cache", device="cpu", loaders=2,
                                    progress=False)
        print(json.dumps(result.as_json()))
    """
)

# A recipe module that ends any process it is imported in but the first (as a native
# library that aborts where it was not initialised): every loader ends as it starts.
EXITS_IN_CHILDREN = textwrap.dedent(
    """
    import multiprocessing
    import os

    import numpy as np
    from spcache.recipes import Field, Recipe

    if multiprocessing.parent_process() is not None:
        os._exit(70)


    class Count(Recipe):
        name = "vertex_count"
        version = 1
        params = {}
        fields = {"count": Field("int64", "[1]", "vertices")}

        def prepare(self, source, params, generator):
            return {"count": np.array([len(source.vertices)], dtype=np.int64)}

        def compute(self, prepared, params, device, ops):
            import torch

            return {"count": torch.from_numpy(prepared["count"])}
    """
)

RUN = textwrap.dedent(
    """
    import json, multiprocessing, sys
    import spcache

    if sys.argv[2] == "no-python-to-start":  # an embedded interpreter's sys.executable
        multiprocessing.set_executable("/nonexistent/python3")
    result = spcache.precompute("shapes", sys.argv[1], "cache", device="cpu", loaders=2,
                                progress=False)
    print(json.dumps(result.as_json()))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["recipe-only-in-main", "loaders-end-as-they-start", "no-python-to-start"]
)
def test_loaders_that_cannot_work_say_so_once_and_every_sample_is_computed(
    tmp_path: Path, case: str
) -> None:
    _sources(tmp_path / "shapes")
    if case == "recipe-only-in-main":
        (tmp_path / "train.py").write_text(RECIPE_IN_MAIN)
        proc = _python(["train.py"], tmp_path, SPCACHE_RECIPES="__main__:Extent")
        why = "recipe 'extent' is not found in a loader process"
    elif case == "loaders-end-as-they-start":
        (tmp_path / "exits_in_children.py").write_text(EXITS_IN_CHILDREN)
        (tmp_path / "run.py").write_text(RUN)
        proc = _python(
            ["run.py", "vertex_count", case],
            tmp_path,
            SPCACHE_RECIPES="exits_in_children:Count",
            PYTHONPATH=str(tmp_path),
        )
        why = "loader processes end as they start"
    else:
        (tmp_path / "run.py").write_text(RUN)
        proc = _python(["run.py", "spc", case], tmp_path)
        why = "a loader process cannot be started by /nonexistent/python3"
    result = _result(proc)
    assert (result["done"], result["failed"]) == (SHAPES, 0), proc.stderr
    said = [line for line in proc.stderr.splitlines() if "loader processes cannot be used" in line]
    assert len(said) == 1, proc.stderr
    assert why in said[0] and "loading the samples in this process instead" in said[0]
    assert LOADERS_DIED not in proc.stderr, proc.stderr
    assert _remembered_failures(tmp_path) == 0
    assert len(_read_back(tmp_path, result["fingerprint"])) == SHAPES


@pytest.mark.slow
def test_a_file_that_kills_its_loader_fails_alone(tmp_path: Path) -> None:
    """The recovery above never hides a culprit: a mesh whose parse ends its loader (the
    probe recipe's "crash" mode) fails with that reason, alone; point clouds are done."""
    sources = _sources(tmp_path / "shapes")
    rng = np.random.default_rng(0)
    for i in range(3):
        np.save(sources / f"cloud{i}.npy", rng.random((500, 3)).astype(np.float32))
    (tmp_path / "run.py").write_text(RUN)
    code = RUN.replace("progress=False)", 'progress=False, mode="crash")')
    (tmp_path / "run.py").write_text(code)
    proc = _python(
        ["run.py", "probe", "-"],
        tmp_path,
        SPCACHE_RECIPES="tests.workers.plugin_recipes:Probe",
        PYTHONPATH=str(REPO_ROOT),
    )
    result = _result(proc)
    assert (result["done"], result["failed"]) == (3, SHAPES), proc.stderr
    failed = {e["id"]: e["reason"] for e in result["errors"]}
    assert sorted(failed) == [f"ball{i}" for i in range(SHAPES)]
    assert all("the loader process died while reading this file" in r for r in failed.values())
    assert "loader processes cannot be used" not in proc.stderr, proc.stderr
    assert _remembered_failures(tmp_path) == SHAPES
