"""Every python snippet of README.md runs as pasted: the training one under every
multiprocessing start method, read-through next to a real worker, DDP under torchrun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cache_store.stores.opener import open_store
from tests.conftest import REPO_ROOT
from tests.helpers.notebook import run_notebook

# Runs the snippet as the main script (runpy puts it in sys.modules["__main__"], so spawn and
# forkserver workers re-import the snippet file itself, as they would `python train.py`),
# with the start method set first and the batches the parent receives counted.
RUNNER = """
import json, multiprocessing, runpy, sys
from torch.utils.data import dataloader

def main():
    method, snippet = sys.argv[1], sys.argv[2]
    multiprocessing.set_start_method(method)
    sizes = []
    original = dataloader._BaseDataLoaderIter.__next__

    def counting(self):
        batch = original(self)
        sizes.append(len(batch["lengths"]))
        return batch

    dataloader._BaseDataLoaderIter.__next__ = counting
    runpy.run_path(snippet, run_name="__main__")
    print(json.dumps({"method": multiprocessing.get_start_method(), "sizes": sizes}))

if __name__ == "__main__":
    main()
"""


def readme_training_snippet() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## Using the cache in training") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block under 'Using the cache in training'"
    return match.group(1)


@pytest.fixture(scope="module")
def demo_dir(
    tmp_path_factory: pytest.TempPathFactory, corpus_meshes: list[Path], corpus_points: list[Path]
) -> tuple[Path, int]:
    """A directory holding ``spcache-demo/cache`` as `spcache demo` leaves it (level 7)."""
    from workers.engine import Engine

    root = tmp_path_factory.mktemp("readme")
    sources = corpus_points + corpus_meshes[:3]
    folder = root / "spcache-demo" / "sources"  # the snippet's precompute finds them cached
    folder.mkdir(parents=True)
    for path in sources:
        (folder / path.name).symlink_to(path)
    with open_store(root / "spcache-demo" / "cache", readonly=False) as store:
        summary = Engine(
            store, "spc_query", {"level": 7}, device="cpu", backend="torch", loaders=0
        ).run([(p.stem, str(folder / p.name)) for p in sources])
    assert summary.done == len(sources) and summary.failed == 0, summary.errors
    return root, len(sources)


def test_the_snippet_has_what_spawn_needs() -> None:
    code = readme_training_snippet()
    compile(code, "README.md", "exec")
    assert 'if __name__ == "__main__":' in code
    assert "os.cpu_count()" in code  # num_workers fits the machine
    assert "spcache.precompute(" in code  # the Python way: precompute, then the DataLoader


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_the_readme_training_snippet_runs_as_pasted(
    demo_dir: tuple[Path, int], method: str
) -> None:
    root, count = demo_dir
    (root / "train.py").write_text(readme_training_snippet())
    (root / "run_snippet.py").write_text(RUNNER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "run_snippet.py", method, "train.py"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"0 computed, {count} cached, 0 failed" in out.stdout  # precompute found them all
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["method"] == method
    assert sum(result["sizes"]) == count  # every sample, once
    assert result["sizes"] == [8] * (count // 8) + ([count % 8] if count % 8 else [])


# -- every other python snippet of the README, each where it is meant to run --------------


def readme_python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)


def snippet_kind(code: str) -> str:
    """Which set-up a snippet needs; every snippet of the README must have one."""
    kinds = [
        kind
        for kind, marker in (
            ("training", 'spcache.precompute(SOURCES, "spc_query"'),
            # tests/spcache/test_variants_training.py runs it as a training script
            ("variants", "variants=4, rotation="),
            ("function_recipe", "@spcache.recipe("),
            ("read_through", 'sources="meshes/"'),
            ("plugin_reader", '"point_count", level=6)'),
            ("ddp", "# train_ddp.py"),
            ("resume", "# train_resume.py"),
            ("sdf", '"spc_sdf"'),
            # built, pip-installed and used by tests/test_readme_workflows.py
            ("recipe", "from spcache.recipes import Field, Param, Recipe"),
        )
        if marker in code
    ]
    assert len(kinds) == 1, f"a README snippet this test does not know how to run:\n{code}"
    return kinds[0]


def test_every_python_snippet_is_run_by_a_test() -> None:
    kinds = [snippet_kind(code) for code in readme_python_snippets()]
    assert sorted(kinds) == [
        "ddp",
        "function_recipe",
        "plugin_reader",
        "read_through",
        "recipe",
        "resume",
        "sdf",
        "training",
        "variants",
    ]
    for code in readme_python_snippets():
        compile(code, "README.md", "exec")


def _snippet(kind: str) -> str:
    return next(code for code in readme_python_snippets() if snippet_kind(code) == kind)


def _run(root: Path, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_function_recipe_snippet_runs_as_pasted(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """As pasted into ``python -`` (a notebook cell has no file either) in a fresh
    directory beside ``shapes/``: it computes and prints the first shape's extent."""
    (tmp_path / "shapes").mkdir()
    for mesh in sorted(corpus_meshes)[:2]:
        (tmp_path / "shapes" / mesh.name).write_bytes(mesh.read_bytes())
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        [sys.executable, "-"],
        input=_snippet("function_recipe"),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    printed = out.stdout.strip().splitlines()[-1]
    assert printed.startswith("tensor([") and "dtype" not in printed  # float32: no dtype shown
    with open_store(tmp_path / "cache") as store:
        (fingerprint,) = store.fingerprints()
        index = store.get_index(fingerprint)
        assert index.recipe == "extent" and dict(index.params) == {"margin": 0.1}
        assert len(index) == 2


@pytest.mark.slow
def test_the_function_recipe_snippet_runs_in_a_jupyter_kernel(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    """The snippet as one notebook cell of a real Jupyter kernel (ipykernel, driven by
    nbclient) whose working directory holds ``shapes/``: the function defined in the cell
    is the recipe, its source found through the kernel's cell cache; the cell prints the
    first shape's extent, and the cache holds the recipe's index."""
    (tmp_path / "shapes").mkdir()
    for mesh in sorted(corpus_meshes)[:2]:
        (tmp_path / "shapes" / mesh.name).write_bytes(mesh.read_bytes())
    cells = [f"import sys\nsys.path.insert(0, {str(REPO_ROOT)!r})", _snippet("function_recipe")]
    notebook = run_notebook(cells, tmp_path)
    printed = "".join(
        o.get("text", "") for o in notebook.cells[1].outputs if o.get("name") == "stdout"
    )
    assert printed.strip().splitlines()[-1].startswith("tensor(["), notebook.cells[1].outputs
    with open_store(tmp_path / "cache") as store:
        (fingerprint,) = store.fingerprints()
        index = store.get_index(fingerprint)
        assert index.recipe == "extent" and dict(index.params) == {"margin": 0.1}
        assert len(index) == 2


@pytest.mark.slow
def test_the_read_through_snippet_runs_as_pasted(
    tmp_path: Path, corpus_meshes: list[Path], corpus_bad_inputs: list[Path]
) -> None:
    from tests.helpers.read_through import start_worker, stop_worker

    meshes = tmp_path / "meshes"
    meshes.mkdir()
    for path in corpus_meshes[:2] + [p for p in corpus_bad_inputs if p.name == "nan_vertices.obj"]:
        (meshes / path.name).symlink_to(path)
    (tmp_path / "train.py").write_text(_snippet("read_through"))
    worker = start_worker(tmp_path / "cache")
    try:
        out = _run(tmp_path, [sys.executable, "train.py"])
    finally:
        stop_worker(worker)
    assert out.returncode == 0, out.stderr[-4000:]
    # relative "meshes/" in the snippet: the worker, elsewhere, still finds the files
    (line,) = out.stdout.splitlines()
    assert line.startswith(f"skipped nan_vertices ({meshes / 'nan_vertices.obj'}): SampleFailed")


def test_the_plugin_reader_snippet_runs_as_pasted(tmp_path: Path) -> None:
    # it builds the datasets and the loader only (each opens nothing before its first read)
    (tmp_path / "read.py").write_text(_snippet("plugin_reader"))
    out = _run(tmp_path, [sys.executable, "read.py"], timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.mark.slow
def test_the_ddp_snippet_runs_under_torchrun(demo_dir: tuple[Path, int]) -> None:
    root, _ = demo_dir
    (root / "train_ddp.py").write_text(_snippet("ddp"))
    out = _run(
        root,
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "train_ddp.py",
        ],
    )
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.mark.slow
def test_the_resume_snippet_is_killed_under_torchrun_and_goes_on_alone(
    demo_dir: tuple[Path, int],
) -> None:
    """As its comment says: started under torchrun with 2 ranks, SIGKILLed (every process
    of the job) once it printed a checkpoint, started again as a single process, it
    resumes from that checkpoint and finishes; started once more, nothing is left."""
    from tests.helpers.procs import kill_tree, start, tree, wait_gone

    root, count = demo_dir
    (root / "train_resume.py").write_text(_snippet("resume"))
    checkpoint = root / "checkpoint.pt"
    checkpoint.unlink(missing_ok=True)
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    with start([*argv, "--nproc_per_node", "2", "train_resume.py"], cwd=root, env=env) as job:
        # killed once it printed a checkpoint (or, finished by then, after it ends)
        job.wait_line(r"^(checkpoint: |done$)", stream="stdout")
        procs = tree(job.pid)
        kill_tree(procs)
        assert wait_gone(procs) == []
    assert any(line.startswith("checkpoint: ") for line in job.out_lines), job.describe()
    try:
        alone = _run(root, [sys.executable, "train_resume.py"])
        assert alone.returncode == 0, alone.stderr[-4000:]
        lines = alone.stdout.splitlines()
        assert lines[0].startswith("resuming epoch ") and lines[-1] == "done", alone.stdout
        again = _run(root, [sys.executable, "train_resume.py"])
        assert again.returncode == 0, again.stderr[-4000:]
        assert again.stdout.splitlines()[0] == f"resuming epoch 2 after {count} samples"
    finally:
        checkpoint.unlink(missing_ok=True)


@pytest.mark.slow
def test_the_sdf_snippet_runs_as_pasted(tmp_path: Path, corpus_meshes: list[Path]) -> None:
    from workers.engine import Engine

    closed = [p for p in corpus_meshes if p.name in ("icosphere.obj", "box_quads.obj")]
    with open_store(tmp_path / "cache", readonly=False) as store:
        summary = Engine(
            store, "spc_sdf", {"level": 7}, device="cpu", backend="torch", loaders=0
        ).run([(p.stem, str(p)) for p in closed])
    assert summary.done == 2, summary.errors
    (tmp_path / "sdf.py").write_text(_snippet("sdf"))
    out = _run(tmp_path, [sys.executable, "sdf.py"])
    assert out.returncode == 0, out.stderr[-4000:]
