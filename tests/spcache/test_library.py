"""``import spcache`` as training code uses it: the front door, ``spcache.precompute`` in
this process (twice), DataLoader workers forked right after it, and the same call inside a
Jupyter kernel."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import spcache
from spcache.cli import main
from tests.conftest import REPO_ROOT
from tests.helpers.notebook import run_notebook

PARAMS = {"level": 5, "surface_samples": 2000, "uniform_queries": 500, "surface_queries": 500}
SMALL = [arg for key, value in PARAMS.items() for arg in ("--param", f"{key}={value}")]


def _open_paths_under(folder: Path) -> list[str]:
    """Files under ``folder`` this process holds open (LMDB, SQLite, lock files...)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed while listing
        if target.startswith(str(folder)):
            held.append(target)
    return held


def test_import_spcache_is_light_and_lists_its_surface() -> None:
    code = (
        "import sys, spcache\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'workers', 'service', 'numpy', 'lmdb'})\n"
        "heavy += sorted(m for m in sys.modules if m.startswith('cache_store') and m not in "
        "{'cache_store', 'cache_store.errors', 'cache_store.lazy_names', 'cache_store.version'})\n"
        "before = list(heavy)\n"
        "spcache.precompute; spcache.PrecomputeResult; spcache.SpcacheError\n"
        "spcache.recipes.Recipe; spcache.ls\n"
        "after = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'workers'})\n"
        "print(before, after)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    # nothing at import but the error classes and the version (stdlib only: the one list
    # of errors is theirs); the precompute function and the errors still need no torch
    assert out.split() == ["[]", "[]"], out
    public = set(spcache.__all__) - {"__version__"}
    assert {
        "CachedDataset",
        "collate_spc",
        "precompute",
        "PrecomputeResult",
        "SpcacheError",
        "ls",
        "rm",
        "prune",
        "compact",
        "recipes",
        "ParameterError",
        "UsageError",
        "StoreFull",
        "SampleFailed",
    } <= public
    namespace: dict[str, object] = {}
    exec("from spcache import *", namespace)  # every listed name resolves
    assert public <= set(namespace)
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        spcache.Engine  # noqa: B018 - internal names are not reachable from the front door
    # every lazily loaded name of both front doors is listed (an unlisted one is internal)
    import cache_store

    for package in (spcache, cache_store):
        assert set(vars(package)["_LAZY"]) <= set(package.__all__), package.__name__
    from spcache.recipes import Recipe

    assert spcache.recipes.Recipe is Recipe  # the submodule itself, loaded on first use
    # the older import paths name the same objects
    from cache_store.errors import SpcacheError

    assert spcache.CachedDataset is cache_store.CachedDataset
    assert spcache.collate_spc is cache_store.collate_spc
    assert spcache.SpcacheError is SpcacheError
    assert issubclass(spcache.UsageError, SpcacheError) and issubclass(
        spcache.UsageError, ValueError
    )
    import cache_store.errors

    defined = {
        name
        for name, value in vars(cache_store.errors).items()
        if isinstance(value, type) and issubclass(value, SpcacheError)
    }
    assert defined <= public, defined - public  # every error class is on the front door


def test_dir_lists_the_public_names_only(tmp_path: Path) -> None:
    """``dir(spcache)`` in a fresh interpreter (as a user's tab completion sees it): the
    public names and the dunders, never the helpers the module imports for itself."""
    code = (
        "import json, spcache, cache_store\n"
        "spcache.CachedDataset; cache_store.CachedDataset\n"  # names loaded stay listed
        "print(json.dumps([dir(spcache), list(spcache.__all__), "
        "dir(cache_store), list(cache_store.__all__)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    listed, public, store_listed, store_public = json.loads(out)
    for names, exported in ((listed, public), (store_listed, store_public)):
        plain = {n for n in names if not (n.startswith("__") and n.endswith("__"))}
        assert plain == set(exported) - {"__version__"}, sorted(plain ^ set(exported))
        assert not {"Any", "TYPE_CHECKING", "annotations", "importlib"} & set(names)
        assert {"__version__", "__doc__", "__all__"} <= set(names)


@pytest.mark.slow
def test_precompute_twice_then_fork_dataloader_workers(
    tmp_path: Path,
    corpus_meshes: list[Path],
    corpus_points: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch
    from torch.utils.data import DataLoader

    folder = tmp_path / "sources"
    folder.mkdir()
    chosen = corpus_meshes[:3] + corpus_points[:2]
    for path in chosen:
        (folder / path.name).symlink_to(path)
    (folder / "broken.obj").write_text("v 0 0 0\nf 1 2 9\n")  # fails with a reason
    cache = tmp_path / "cache"
    sigterm_before = signal.getsignal(signal.SIGTERM)
    threads_before = set(threading.enumerate())

    first = spcache.precompute(
        folder, "spc_query", cache, device="cpu", backend="torch", loaders=1, **PARAMS
    )
    assert isinstance(first, spcache.PrecomputeResult)
    assert (first.done, first.skipped, first.failed) == (len(chosen), 0, 1), first.errors
    [error] = first.errors
    assert error.id == "broken" and error.path == str(folder / "broken.obj") and error.reason
    assert first.recipe == "spc_query" and dict(first.params)["level"] == 5
    assert first.device == "cpu" and first.backend == "torch" and first.engine == "local"
    assert first.timings.wall_s > 0 and first.timings.compute_s > 0
    assert not first.ok and first.total == len(chosen) + 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.done = 0  # type: ignore[misc]

    second = spcache.precompute(
        [folder],
        "spc_query",
        cache,
        device="cpu",
        backend="torch",
        loaders=1,
        progress=False,
        **PARAMS,
    )
    assert (second.done, second.skipped, second.failed) == (0, len(chosen), 1)
    assert second.fingerprint == first.fingerprint
    assert second.failed_again == ("broken",)

    # the CLI is the same run: its --json object is the result's as_json()
    capsys.readouterr()
    assert (
        main(
            [
                "precompute",
                str(folder),
                "--recipe",
                "spc_query",
                *SMALL,
                "--cache",
                str(cache),
                "--device",
                "cpu",
                "--backend",
                "torch",
                "--loaders",
                "0",
                "--json",
            ]
        )
        == 1
    )
    printed = json.loads(capsys.readouterr().out)
    third = spcache.PrecomputeResult.from_json(printed, cache=cache)
    assert printed == third.as_json()
    assert set(printed) == set(second.as_json())
    assert (third.skipped, third.failed, third.fingerprint) == (len(chosen), 1, first.fingerprint)
    [listed] = spcache.ls(cache)  # the lifecycle calls are on the front door too
    assert (listed["fingerprint"], listed["records"]) == (first.fingerprint, len(chosen))

    # nothing left open: no file of the cache, no loader process, no thread, no handler
    assert _open_paths_under(cache) == []
    assert multiprocessing.active_children() == []
    assert set(threading.enumerate()) <= threads_before
    assert signal.getsignal(signal.SIGTERM) is sigterm_before

    dataset = first.dataset()
    loader = DataLoader(
        dataset,
        batch_size=2,
        num_workers=2,
        collate_fn=spcache.collate_spc,
        multiprocessing_context="fork",
    )
    sizes, octrees = [], []
    for batch in loader:
        sizes.append(len(batch["lengths"]))
        octrees.append(batch["octree"])
    assert sum(sizes) == len(dataset) == len(chosen)
    read_here = [dataset[i]["octree"] for i in range(len(dataset))]  # after the fork
    assert torch.equal(torch.cat(octrees), torch.cat(read_here))


def test_precompute_reports_bad_calls_as_errors(tmp_path: Path, corpus_meshes: list[Path]) -> None:
    source = corpus_meshes[0]
    with pytest.raises(spcache.UnknownName):
        spcache.precompute(source, "no_such_recipe", tmp_path / "c", progress=False)
    with pytest.raises(spcache.ParameterError, match="level"):
        spcache.precompute(source, "spc_query", tmp_path / "c", level=99, progress=False)
    with pytest.raises(spcache.UsageError, match="device 'tpu'"):
        spcache.precompute(source, "spc_query", tmp_path / "c", device="tpu", progress=False)
    with pytest.raises(spcache.UsageError, match="engine 'spark'"):
        spcache.precompute(source, "spc_query", tmp_path / "c", engine="spark", progress=False)
    with pytest.raises(spcache.UsageError, match="no supported source files"):
        spcache.precompute(tmp_path, "spc_query", tmp_path / "c", progress=False)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(spcache.UsageError, match="afile"):
        spcache.precompute(source, "spc_query", afile, progress=False)
    assert not (tmp_path / "c").exists()


NOTEBOOK_CELLS = [
    "import sys\nsys.path.insert(0, {repo!r})\nimport signal, spcache",
    (
        "handler = signal.getsignal(signal.SIGTERM)\n"
        "first = spcache.precompute({sources!r}, 'spc_query', {cache!r}, device='cpu',\n"
        "                           backend='torch', loaders=1, **{params!r})\n"
        "first"
    ),
    (
        "second = spcache.precompute({sources!r}, 'spc_query', {cache!r}, device='cpu',\n"
        "                            backend='torch', loaders=1, **{params!r})"
    ),
    (
        "import json\n"
        "print(json.dumps({{'type': type(first).__name__, 'first': first.as_json(),\n"
        "                  'second': second.as_json(), 'handler_kept': signal.getsignal(signal.SIGTERM) is handler}}))"
    ),
]


@pytest.mark.slow
def test_precompute_in_a_jupyter_kernel(tmp_path: Path, corpus_meshes: list[Path]) -> None:
    sources = [str(p) for p in corpus_meshes[:2]]
    cache = str(tmp_path / "cache")
    values = {"repo": str(REPO_ROOT), "sources": sources, "cache": cache, "params": PARAMS}
    notebook = run_notebook(
        [cell.format(**values) for cell in NOTEBOOK_CELLS], tmp_path, timeout=240
    )

    shown = notebook.cells[1].outputs  # the result's repr as the cell's value
    assert any("PrecomputeResult(" in o.get("data", {}).get("text/plain", "") for o in shown)
    [printed] = [o for o in notebook.cells[3].outputs if o.get("name") == "stdout"]
    report = json.loads(printed["text"])
    assert report["type"] == "PrecomputeResult" and report["handler_kept"]
    first, second = report["first"], report["second"]
    assert (first["done"], first["skipped"], first["failed"]) == (2, 0, 0), first["errors"]
    assert (second["done"], second["skipped"], second["failed"]) == (0, 2, 0)
    assert first["fingerprint"] == second["fingerprint"]
    from cache_store.stores.opener import open_store

    with open_store(cache) as store:
        index = store.get_index(first["fingerprint"])
        assert sorted(index.sample_ids.tolist()) == sorted(Path(s).stem for s in sources)
