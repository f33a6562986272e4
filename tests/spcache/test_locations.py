"""Locations on the command line, as a user runs them: ``spcache`` in a subprocess from a
fresh directory, ``--cache s3://...`` against moto's real S3 server (both engines), and
``file://`` URLs in any case; then the README's next commands on the result, and the
result checked as the user would (the bucket listed with boto3, the records read back).

A location that went through ``Path`` would land in a local ``./s3:/...`` or
``./file:/...`` folder and the command would say it succeeded: every test here also looks
for such a folder anywhere under the directory the commands ran in.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cache_store import CachedDataset
from tests.helpers.s3 import S3Server, moto_s3
from tests.helpers.procs import run_spcache

#: small enough for a loaded 2-core machine; the README's command has level=8
SPC = ["--recipe", "spc", "--param", "level=5"]
CPU = ["--device", "cpu", "--backend", "torch", "--loaders", "0"]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_s3() as server:  # its address reaches the CLI through AWS_ENDPOINT_URL
        yield server


def spcache(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``spcache ARGS`` as typed in a shell in ``cwd`` (this test's environment: the S3
    server's address and credentials)."""
    return run_spcache(*args, cwd=cwd, timeout=timeout)


def _workdir(tmp_path: Path, meshes: list[Path]) -> Path:
    """A fresh directory holding ``shapes/`` with the given meshes."""
    cwd = tmp_path / "work"
    (cwd / "shapes").mkdir(parents=True)
    for mesh in meshes:
        shutil.copyfile(mesh, cwd / "shapes" / mesh.name)
    return cwd


def _stray_url_folders(root: Path) -> list[str]:
    """Paths under ``root`` with a component like ``s3:`` or ``FILE:``: a URL that a
    ``Path`` folded into a relative directory."""
    return [
        str(p.relative_to(root))
        for p in root.rglob("*")
        if any(re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*:", part) for part in p.parts)
    ]


def _bucket_keys(s3: S3Server, bucket: str) -> list[str]:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys += [obj["Key"] for obj in page.get("Contents", [])]
    return keys


def _fingerprint(stdout: str) -> str:
    return re.search(r"^fingerprint ([0-9a-f]{32})$", stdout, re.M).group(1)  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["local", "ray"])
def test_precompute_into_s3_then_merge_import_verify_and_read_back(
    s3: S3Server, tmp_path: Path, corpus_meshes: list[Path], engine: str
) -> None:
    """The README's scale-out commands, as written but smaller: the records land in the
    bucket, and merge, import, verify and ``CachedDataset`` follow on the result."""
    meshes = corpus_meshes[:3]
    cwd = _workdir(tmp_path, meshes)
    bucket = s3.new_bucket()
    dest = f"s3://{bucket}/l8.zarr"
    ray = ["--engine", "ray", "--actors", "2"] if engine == "ray" else []
    run = spcache(cwd, "precompute", "shapes", *SPC, "--cache", dest, *CPU, *ray)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "done 3, skipped 0, failed 0" in run.stdout
    fingerprint = _fingerprint(run.stdout)
    keys = _bucket_keys(s3, bucket)
    assert any(k.startswith(f"l8.zarr/{fingerprint}/parts/") for k in keys), keys
    assert any(k.startswith(f"l8.zarr/{fingerprint}/commits/") for k in keys), keys
    assert not _stray_url_folders(cwd)

    merged = spcache(cwd, "merge", dest)
    assert merged.returncode == 0, merged.stderr
    assert f"{fingerprint}: 3 record(s) indexed" in merged.stdout
    assert f"l8.zarr/{fingerprint}/index.json" in _bucket_keys(s3, bucket)

    imported = spcache(cwd, "import", dest, "--cache", "hot")
    assert imported.returncode == 0, imported.stderr
    assert f"{fingerprint}: 3 copied, 0 already in hot" in imported.stdout
    verified = spcache(cwd, "verify", "--cache", "hot")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "checked 3 records: cache verifies clean" in verified.stdout
    remote = spcache(cwd, "verify", "--cache", dest)
    assert remote.returncode == 0, remote.stdout + remote.stderr
    assert "checked 3 records" in remote.stdout
    if engine == "local":  # and back out: export --to a URL, then ls and verify it there
        exported = f"s3://{bucket}/exported.zarr"
        out = spcache(cwd, "export", fingerprint, "--cache", "hot", "--to", exported)
        assert out.returncode == 0, out.stderr
        assert any(k.startswith("exported.zarr/") for k in _bucket_keys(s3, bucket))
        listed = spcache(cwd, "ls", "--cache", exported, "--json")
        assert [r["fingerprint"] for r in json.loads(listed.stdout)] == [fingerprint]
        assert spcache(cwd, "verify", "--cache", exported).returncode == 0
    assert not _stray_url_folders(cwd)

    from_s3 = CachedDataset(dest, fingerprint)
    from_hot = CachedDataset(cwd / "hot", fingerprint)
    assert sorted(from_s3.sample_id(i) for i in range(len(from_s3))) == sorted(
        m.stem for m in meshes
    )
    hot = {from_hot.sample_id(i): from_hot[i] for i in range(len(from_hot))}
    for i in range(len(from_s3)):
        sample, twin = from_s3[i], hot[from_s3.sample_id(i)]
        assert sample["octree"].numel() > 0 and bool((sample["octree"] == twin["octree"]).all())


@pytest.mark.parametrize("scheme", ["file://", "FILE://"])
def test_file_urls_open_the_path_they_name_in_every_command(
    tmp_path: Path, corpus_meshes: list[Path], scheme: str
) -> None:
    """``file:///abs`` (any case) is the directory ``/abs`` for precompute, verify, stats,
    ls, export (both sides), import, merge and rm; never a relative ``file:`` folder."""
    cwd = _workdir(tmp_path, corpus_meshes[:2])
    cache, snapshot = tmp_path / "elsewhere" / "cache", tmp_path / "elsewhere" / "snap.zarr"
    run = spcache(cwd, "precompute", "shapes", *SPC, "--cache", f"{scheme}{cache}", *CPU)
    assert run.returncode == 0, run.stderr[-3000:]
    fingerprint = _fingerprint(run.stdout)
    assert (cache / "records").is_dir()
    for command in ("verify", "stats", "ls"):
        done = spcache(cwd, command, "--cache", f"{scheme}{cache}", "--json")
        assert done.returncode == 0, (command, done.stderr)
    stats = json.loads(spcache(cwd, "stats", "--cache", f"{scheme}{cache}", "--json").stdout)
    assert stats["fingerprints"][fingerprint]["records"] == 2
    assert "failed" in stats  # the failure log beside a local cache was read
    exported = spcache(
        cwd,
        "export",
        fingerprint,
        "--cache",
        f"{scheme}{cache}",
        "--to",
        f"{scheme}{snapshot}",
        "--no-progress",
    )
    assert exported.returncode == 0, exported.stderr
    assert (snapshot / "zarr.json").is_file()
    imported = spcache(cwd, "import", f"{scheme}{snapshot}", "--cache", f"{scheme}{cache}2")
    assert imported.returncode == 0, imported.stderr
    assert "2 copied" in imported.stdout and (Path(f"{cache}2") / "records").is_dir()
    listed = spcache(cwd, "ls", "--cache", f"{scheme}{snapshot}", "--json")
    assert [row["fingerprint"] for row in json.loads(listed.stdout)] == [fingerprint]
    removed = spcache(cwd, "rm", fingerprint, "--cache", f"{scheme}{cache}2")
    assert removed.returncode == 0, removed.stderr
    assert not _stray_url_folders(cwd)


@pytest.mark.parametrize(
    "args",
    [
        ["worker", "--cache", "s3://bucket/cache.zarr", "--drain"],
        ["serve", "--cache", "s3://bucket/cache", "--no-worker"],
        ["rm", "0123456789abcdef0123456789abcdef", "--cache", "s3://bucket/c.zarr"],
        ["import", "snap.zarr", "--cache", "s3://bucket/c.zarr"],
        [
            "export",
            "0123456789abcdef0123456789abcdef",
            "--cache",
            "s3://b/c.zarr",
            "--to",
            "x.zarr",
        ],
    ],
    ids=lambda args: args[0],
)
def test_a_url_where_a_cache_directory_is_needed_is_refused_by_name(
    tmp_path: Path, args: list[str]
) -> None:
    """One line naming the location, exit 2, and nothing made in the working directory."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    done = spcache(cwd, *args, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "s3://b" in done.stderr and "Traceback" not in done.stderr
    assert not list(cwd.iterdir())
