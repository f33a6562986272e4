"""The generated test corpus: deterministic, complete, cached safely; and a bare clone passes."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, SHARED_SKIP
from tests.data import corpus


def _contents(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_two_builds_are_byte_identical(tmp_path: Path, corpus_data: Path) -> None:
    first, second = corpus.build(tmp_path / "a"), corpus.build(tmp_path / "b")
    assert _contents(first) == _contents(second) == _contents(corpus_data)
    assert len(_contents(first)) >= 40


def test_suffixes_agree_with_the_loader() -> None:
    from workers.source_load import SUPPORTED_EXTENSIONS

    assert corpus.SOURCE_SUFFIXES == SUPPORTED_EXTENSIONS


def test_every_format_and_variant_is_there(
    corpus_data: Path, corpus_meshes: list[Path], corpus_points: list[Path]
) -> None:
    assert len(corpus_meshes) + len(corpus_points) >= 20
    assert {p.suffix for p in corpus_meshes} == {".obj", ".ply", ".stl", ".off", ".glb", ".npz"}
    assert {p.suffix for p in corpus_points} == {".npy", ".npz", ".xyz", ".pts", ".ply"}
    heads = {p.name: p.read_bytes()[:80] for p in corpus_meshes}
    ply_formats = {h.split(b"\n")[1] for n, h in heads.items() if n.endswith(".ply")}
    assert {
        b"format ascii 1.0",
        b"format binary_little_endian 1.0",
        b"format binary_big_endian 1.0",
    } <= ply_formats
    stl = [h for n, h in heads.items() if n.endswith(".stl")]
    assert any(h.startswith(b"solid ") for h in stl) and any(
        not h.startswith(b"solid") for h in stl
    )
    obj_text = "".join(p.read_text() for p in corpus_meshes if p.suffix == ".obj")
    assert "mtllib " in obj_text and "usemtl " in obj_text
    assert any(len(line.split()) == 5 for line in obj_text.splitlines() if line.startswith("f "))
    assert (corpus_data / "meshes" / "torus_materials.mtl").is_file()
    for folder in ("meshes", "points", "bad_inputs"):  # a stem is a sample id
        stems = [
            p.stem for p in (corpus_data / folder).iterdir() if p.suffix in corpus.SOURCE_SUFFIXES
        ]
        assert len(stems) == len(set(stems)), folder


def test_every_hostile_file_has_a_documented_outcome(
    corpus_data: Path, corpus_bad_inputs: list[Path]
) -> None:
    expected = corpus.hostile_expectations()
    assert sorted(p.name for p in corpus_bad_inputs) == sorted(expected)
    documented = json.loads((corpus_data / "EXPECTED.json").read_text())
    assert set(documented) == set(expected)
    assert sum(v is None for v in expected.values()) >= 2
    assert sum(v is not None for v in expected.values()) >= 10
    # the object array really is one (a pickle inside): refusing it is the loader's job
    assert (
        b"'descr': '|O'"
        in (corpus_data / "bad_inputs" / "int_object_points.npy").read_bytes()[:128]
    )


def _ensure_into(root: str) -> str:
    return str(corpus.ensure(root))


def test_concurrent_builders_agree_and_leave_one_copy(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        results = pool.map(_ensure_into, [str(tmp_path)] * 3)
    assert len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [corpus.cache_key()]
    assert _contents(Path(results[0])) == _contents(corpus.build(tmp_path.parent / "direct"))


def test_a_changed_builder_builds_a_fresh_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = corpus.ensure(tmp_path)
    assert corpus.ensure(tmp_path) == first  # reused
    monkeypatch.setattr(corpus, "VERSION", corpus.VERSION + 1)
    monkeypatch.setattr(corpus, "cache_key", lambda: f"v{corpus.VERSION}-other")
    second = corpus.ensure(tmp_path)
    assert second != first and second.name == f"v{corpus.VERSION}-other"
    assert _contents(second) == _contents(first)


def test_command_line_builds_and_refuses_a_full_directory(tmp_path: Path) -> None:
    def run(dest: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tests.data.corpus", str(dest)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    done = run(tmp_path / "c")
    assert done.returncode == 0, done.stderr
    assert (
        '"bad_inputs": ' in done.stdout and (tmp_path / "c" / "meshes" / "icosphere.obj").is_file()
    )
    again = run(tmp_path / "c")
    assert again.returncode == 2 and "not empty" in again.stderr


# The data-needing files, cut to what runs in seconds; slow tests get the same fixtures.
BARE_SELECTION = [
    "tests/workers/test_sources.py",
    "tests/workers/ops/test_real_meshes.py",
    "tests/workers/test_engine.py",
    "-m",
    "not slow and not gpu",
    "-k",
    "not property",
]


@pytest.mark.slow
def test_a_bare_clone_passes_with_only_the_shared_corpus_skipped(tmp_path: Path) -> None:
    env = {**os.environ, "SPCACHE_SHARED_DATA": str(tmp_path / "empty")}
    (tmp_path / "empty").mkdir()
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *BARE_SELECTION]
    collected = subprocess.run(
        [
            *base[:-4],
            "-m",
            "shared_corpus and not slow and not gpu",
            "-k",
            "not property",
            "--collect-only",
            "-q",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    shared_ids = {line for line in collected.stdout.splitlines() if "::" in line}
    assert len(shared_ids) >= 4, collected.stdout
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [*base, f"--junitxml={report}"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:]
    assert f"shared real-mesh corpus: SKIPPED ({len(shared_ids)} tests)" in run.stdout
    passed, skipped = 0, {}
    for case in ET.parse(report).getroot().iter("testcase"):
        node = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
        assert case.find("failure") is None and case.find("error") is None, node
        skip = case.find("skipped")
        if skip is None:
            passed += 1
        else:
            skipped[node] = skip.get("message", "")
    assert passed >= 10
    assert set(skipped) == shared_ids
    assert all(SHARED_SKIP in message for message in skipped.values()), skipped


def test_hostile_files_end_as_documented_in_the_engine(
    tmp_path: Path, corpus_bad_inputs: list[Path]
) -> None:
    from cache_store.stores.opener import open_store
    from workers.engine import Engine

    expected = corpus.hostile_expectations()
    with open_store(tmp_path / "cache", readonly=False) as store:
        engine = Engine(
            store,
            "spc",
            {"level": 4, "surface_samples": 500},
            device="cpu",
            backend="torch",
            loaders=0,
        )
        summary = engine.run([(p.stem, str(p)) for p in corpus_bad_inputs])
        errors = {e.id: e for e in summary.errors}
        for path in corpus_bad_inputs:
            if expected[path.name] is None:
                assert path.stem not in errors, errors.get(path.stem)
                assert store.get_record(engine.key(path.stem)).metadata["sample_id"] == path.stem
            else:
                assert expected[path.name] in errors[path.stem].reason, errors[path.stem]
                assert errors[path.stem].path == str(path) and not store.has(engine.key(path.stem))
