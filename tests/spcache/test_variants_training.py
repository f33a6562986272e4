"""Variants as users run them: README's augmentation snippet as a training script with
real forked DataLoader workers (persistent), with its main guard and without, from a
fresh directory; and README's ``spcache precompute ... --variants 4`` line. Then read
back what was written: which variant each epoch got, that it is the same on every run,
that each variant was computed once."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import spcache
from cache_store.readers.variants import pick_variant
from cache_store.stores.lmdb.store import LMDBStore
from tests.conftest import REPO_ROOT
from tests.helpers.procs import run

README = REPO_ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent

# Runs the snippet as the main script under fork (runpy, as `python train.py`), noting
# each epoch the sampler starts and the augmentation matrices of every batch.
RUNNER = """
import json, multiprocessing, runpy, sys
from torch.utils.data import dataloader
from cache_store.readers.sampler import Sampler

def main():
    multiprocessing.set_start_method("fork")
    epochs = []
    original_next = dataloader._BaseDataLoaderIter.__next__
    original_set_epoch = Sampler.set_epoch

    def counting(self):
        batch = original_next(self)
        epochs[-1].extend(batch["augmentation"].tolist())
        return batch

    def set_epoch(self, epoch):
        epochs.append([])
        original_set_epoch(self, epoch)

    dataloader._BaseDataLoaderIter.__next__ = counting
    Sampler.set_epoch = set_epoch
    runpy.run_path(sys.argv[1], run_name="__main__")
    print(json.dumps(epochs))

if __name__ == "__main__":
    main()
"""


def readme_variants_snippet() -> str:
    text = README.read_text()
    section = text[text.index("### Augmentation that survives caching") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block under 'Augmentation that survives caching'"
    return match.group(1)


def readme_variants_line() -> str:
    (line,) = [
        x
        for x in README.read_text().splitlines()
        if x.startswith("spcache precompute") and "--variants 4" in x
    ]
    return line


@pytest.fixture
def fresh(tmp_path: Path, corpus_meshes: list[Path]) -> Path:
    """A fresh directory holding ``meshes/`` (four shapes), as the snippet expects."""
    (tmp_path / "meshes").mkdir()
    for mesh in sorted(corpus_meshes)[:4]:
        (tmp_path / "meshes" / mesh.name).write_bytes(mesh.read_bytes())
    return tmp_path


def _train(root: Path, script: str) -> list[list[Any]]:
    (root / "train.py").write_text(script)
    (root / "run_snippet.py").write_text(RUNNER)
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    out = run([sys.executable, "run_snippet.py", "train.py"], cwd=root, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _expected_epochs(cache: Path, epochs: int) -> list[list[bytes]]:
    """Per epoch, the sorted matrices of the variants pick_variant names (as bytes)."""
    with LMDBStore(cache) as store:
        (fingerprint,) = store.fingerprints()
        index = store.get_index(fingerprint)
        out = []
        for epoch in range(epochs):
            picked = []
            for sid, count in zip(
                index.sample_ids.tolist(), index.variant_counts().tolist(), strict=True
            ):
                k = pick_variant(0, epoch, sid, count)
                key = f"{fingerprint}/{sid}" + (f"#v{k}" if k else "")
                picked.append(store.get_record(key)["augmentation"].numpy().tobytes())
            out.append(sorted(picked))
    return out


def _as_bytes(matrices: list[Any]) -> list[bytes]:
    return sorted(np.array(m, dtype=np.float32).tobytes() for m in matrices)


@pytest.mark.slow
def test_the_readme_variants_snippet_trains_with_a_fresh_variant_each_epoch(fresh: Path) -> None:
    snippet = readme_variants_snippet()
    assert 'if __name__ == "__main__":' in snippet and "spcache.Sampler(" in snippet
    first = _train(fresh, snippet)
    cache = fresh / "cache"
    with LMDBStore(cache) as store:
        (fingerprint,) = store.fingerprints()
        keys = sorted(store.keys(fingerprint))
        created = {key: store.get_record(key).metadata["created"] for key in keys}
    assert len(keys) == 16  # 4 shapes x 4 variants, under one index
    expected = _expected_epochs(cache, 3)
    assert len(first) == 3
    for epoch, matrices in enumerate(first):
        assert len(matrices) == 4  # every shape once per epoch
        assert _as_bytes(matrices) == expected[epoch]  # the variant the pick names
    assert len({tuple(e) for e in expected}) > 1  # the epochs read other variants
    # without the main guard (fork needs none): the same epochs, in the same order, and
    # nothing computed again (the snippet's precompute found every variant stored)
    unguarded = snippet.replace('if __name__ == "__main__":\n    main()', "main()")
    assert unguarded != snippet
    assert _train(fresh, unguarded) == first
    with LMDBStore(cache) as store:
        assert sorted(store.keys(fingerprint)) == keys
        assert all(store.get_record(key).metadata["created"] == c for key, c in created.items())


@pytest.mark.slow
def test_the_readme_variants_line_then_more_variants_then_ls(fresh: Path) -> None:
    line = readme_variants_line()
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    argv = shlex.split(line) + ["--device", "cpu", "--param", "surface_samples=20000"]
    out = run(["bash", "-c", shlex.join(argv)], cwd=fresh, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done 16, skipped 0, failed 0 records (4 variants per sample)" in out.stdout
    more = [("6" if a == "4" and argv[i - 1] == "--variants" else a) for i, a in enumerate(argv)]
    out = run(["bash", "-c", shlex.join(more)], cwd=fresh, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done 8, skipped 16, failed 0 records (6 variants per sample)" in out.stdout
    listing = run(["bash", "-c", "spcache ls --cache cache"], cwd=fresh, env=env)
    assert "24 (4 x 6 variants)" in listing.stdout, listing.stdout
    result = spcache.precompute(
        fresh / "meshes",
        "spc",
        fresh / "cache",
        level=6,
        rotation="so3",
        surface_samples=20000,
        variants=6,
        device="cpu",
        progress=False,
    )  # the CLI and Python name one fingerprint: all stored
    assert (result.done, result.skipped) == (0, 24)
    ds = spcache.CachedDataset(fresh / "cache", result.fingerprint, variant=0)
    plain = spcache.precompute(
        fresh / "meshes",
        "spc",
        fresh / "plain",
        level=6,
        surface_samples=20000,
        device="cpu",
        progress=False,
    )
    base = spcache.CachedDataset(fresh / "plain", plain.fingerprint)
    assert all(
        np.array_equal(ds[i]["octree"].numpy(), base[i]["octree"].numpy()) for i in range(4)
    )  # variant 0 is the run without variants
    bad = run(
        ["bash", "-c", "spcache precompute meshes/ --recipe spc --variants 0 --cache c"],
        cwd=fresh,
        env=env,
    )
    assert bad.returncode == 2 and "variants: expected an integer from 1 to 1024" in bad.stderr
    # (--engine ray computes variants too: tests/workers/test_ray.py, on the module's Ray)


def test_the_readme_variants_snippet_and_line_are_what_the_tests_run() -> None:
    compile(readme_variants_snippet(), "README.md", "exec")
    assert "--variants 4" in readme_variants_line()
