"""The README's workflows, each run as written from a fresh directory and checked as a
user would check it: the housekeeping block, your own recipe from an empty directory,
serving over TLS, and the Ray block into a bucket. The table of
:mod:`tests.helpers.readme_commands` names these tests for their lines."""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT
from tests.helpers.procs import run, run_spcache, wait_http
from tests.helpers.readme_commands import (
    readme_python,
    README,
    RUN,
    SERVE,
    OUTPUT,
    S3_TEST,
    COMMANDS,
    shell_blocks,
    sh,
    sh_start,
    ctrl_c,
    line_of,
)


# -- Housekeeping


def _housekeeping_cache(root: Path, corpus_meshes: list[Path], bad: Path) -> Path:
    """``runs/cache`` as the README's `ls` shows it: ``spc`` level 3 (fingerprint
    4e2c9ec4...) with one failed sample, and level 4 beside it, both made by precompute."""
    shapes = root / "shapes"
    shapes.mkdir(parents=True)
    for mesh in corpus_meshes[:6]:
        shutil.copy(mesh, shapes / mesh.name)
    shutil.copy(bad, shapes / bad.name)
    for level in (3, 4):
        out = run_spcache(
            "precompute", shapes, "--recipe", "spc", "--param", f"level={level}",
            "--cache", root / "runs" / "cache", "--device", "cpu", "--loaders", "0",
        )  # fmt: skip
        assert out.returncode == 1, out.stderr[-3000:]  # the bad one failed alone
    return root / "runs" / "cache"


def _ls(cwd: Path) -> dict[str, dict]:
    out = run_spcache("ls", "--cache", "runs/cache", "--json", cwd=cwd)
    assert out.returncode == 0, out.stderr
    return {row["fingerprint"]: row for row in json.loads(out.stdout)}


@pytest.mark.slow
def test_the_housekeeping_block(
    tmp_path: Path, corpus_meshes: list[Path], corpus_bad_inputs: list[Path]
) -> None:
    bad = next(p for p in corpus_bad_inputs if p.name == "nan_vertices.obj")
    template = _housekeeping_cache(tmp_path / "template", corpus_meshes, bad)
    fp = "4e2c9ec4d244890b73411cf9b684a3c3"
    original = _ls(tmp_path / "template")
    assert original[fp]["failed"] == 1 and original[fp]["records"] == 6
    (other,) = set(original) - {fp}
    block = next(b for b in shell_blocks(README.read_text()) if b[0].startswith("spcache ls"))

    def fresh() -> Path:  # each line on the cache as `ls` shows it
        cwd = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        shutil.copytree(template, cwd / "runs" / "cache")
        return cwd

    for line in block:
        how = COMMANDS[line]
        if how.kind == OUTPUT:
            continue
        cwd = fresh()
        if "--unused-for 30d" in line:  # the level-4 fingerprint last used 40 days ago
            for kind in ("read", "written"):
                usage = cwd / "runs" / "cache" / "usage" / f"{other}.{kind}"
                usage.touch()
                days_40 = usage.stat().st_mtime - 40 * 86400
                os.utime(usage, (days_40, days_40))
        out = sh(line, cwd)
        assert out.returncode == 0, f"{line}: {out.stderr[-3000:]}"
        after = _ls(cwd)
        if line.startswith("spcache ls"):
            header, row = block[1].split(), block[2].split()
            printed = out.stdout.splitlines()
            assert printed[0].split() == header, printed[0]
            mine = next(p.split() for p in printed if p.startswith(fp))
            # fingerprint, recipe, the size's unit and state as the README shows them
            # (the size is two words: "235.0 KiB"); its one failure
            assert mine[:3] == row[:3] and mine[5:7] == row[5:7] and mine[7] == "1", mine
            assert after == original
        elif line.startswith("spcache rm --failed"):
            assert after[fp]["failed"] == 0 and after[fp]["records"] == 6
        elif line.startswith("spcache rm"):
            assert set(after) == {other}
        elif "--dry-run" in line:
            assert after == original  # 50G and keep 3: nothing would go, nothing went
        elif "--unused-for" in line:
            assert set(after) == {fp}, out.stdout
        elif line.startswith("spcache compact"):
            assert after == original
            assert json.loads(sh("spcache verify --cache runs/cache --json", cwd).stdout)["ok"]
        else:
            raise AssertionError(f"a housekeeping line this test does not check: {line}")


# -- Your own features


@pytest.fixture
def uninstalls_my_recipes() -> Iterator[None]:
    """The README installs its plugin into the environment spcache runs in: the test
    venv. It goes again after the test, whatever happened."""
    yield
    run([sys.executable, "-m", "pip", "uninstall", "--yes", "my-recipes"])


@pytest.mark.slow
def test_your_own_recipe_from_an_empty_directory(
    tmp_path: Path, corpus_meshes: list[Path], uninstalls_my_recipes: None
) -> None:
    text = README.read_text()
    section = text[text.index("## Your own features") : text.index("## The CLI")]
    (mkdir,) = line_of(RUN, "test_your_own_recipe_from_an_empty_directory")[:1]
    out = sh(mkdir, tmp_path)
    assert out.returncode == 0, out.stderr
    project = tmp_path / "my_recipes"  # where `cd my_recipes` left the user
    assert (project / "my_recipes").is_dir()
    (project / "my_recipes" / "__init__.py").write_text("")
    (project / "my_recipes" / "counts.py").write_text(
        re.findall(r"```python\n(.*?)```", section, re.S)[0]
    )
    (project / "pyproject.toml").write_text(re.findall(r"```toml\n(.*?)```", section, re.S)[0])
    shapes = project / "shapes"
    shapes.mkdir()
    for mesh in corpus_meshes[:3]:
        shutil.copy(mesh, shapes / mesh.name)

    block = next(b for b in shell_blocks(section) if b and b[0] == "pip install -e .")
    install, recipes, precompute, serve = block
    out = sh(install, project)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]

    out = sh(recipes, project)
    assert out.returncode == 0, out.stderr
    assert "point_count (version 1)" in out.stdout, out.stdout
    listed = json.loads(run_spcache("recipes", "--json", cwd=project).stdout)
    assert listed["point_count"]["origin"]["package"] == "my-recipes"

    out = sh(precompute, project)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done 3, skipped 0, failed 0" in out.stdout, out.stdout
    reader = readme_python('"point_count", level=6)').split("# read-through")[0] + (
        "batch = next(iter(loader))\n"
        "print(len(ds), sorted(batch), int(batch['counts'].sum()) > 0)\n"
    )
    (project / "read.py").write_text(reader)
    out = sh("python read.py", project)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "3" and "'voxels'" in out.stdout and "True" in out.stdout

    late = corpus_meshes[3]  # not cached: read through the service
    shutil.copy(late, shapes / f"late{late.suffix}")
    with sh_start(serve, project) as proc:
        url = proc.wait_line(r"listening on (http://127\.0\.0\.1:\d+)").group(1)
        wait_http(f"{url}/readyz", proc=proc)
        recipes_json = httpx.get(f"{url}/v1/recipes", timeout=60).json()["recipes"]
        assert any(r["name"] == "point_count" for r in recipes_json)
        read_through = (
            "import spcache\n"
            f"ds = spcache.CachedDataset({url!r}, 'point_count', sources='shapes/', level=6)\n"
            "i = [ds.sample_id(i) for i in range(len(ds))].index('late')\n"
            "print(int(ds[i]['counts'].sum()))\n"
        )
        out = run([sys.executable, "-c", read_through], cwd=project)
        assert out.returncode == 0, out.stderr[-3000:] + proc.output()[-3000:]
        assert int(out.stdout.split()[-1]) > 0
        ctrl_c(proc)
    assert "Traceback" not in proc.stderr(), proc.stderr()[-3000:]


# -- TLS


@pytest.mark.slow
def test_the_tls_line_answers_on_https(tmp_path: Path) -> None:
    tls = REPO_ROOT / "tests" / "data" / "tls"
    shutil.copy(tls / "cert.pem", tmp_path / "cert.pem")
    shutil.copy(tls / "key.pem", tmp_path / "key.pem")
    (line,) = line_of(SERVE, "test_the_tls_line_answers_on_https")
    # the README's line names no cache: SPCACHE_CACHE says which, as the README offers
    with sh_start(line, tmp_path, {"SPCACHE_CACHE": "cache"}) as proc:
        url = proc.wait_line(r"listening on (https://127\.0\.0\.1:\d+)").group(1)
        trust = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
        assert wait_http(f"{url}/healthz", proc=proc, verify=trust).json() == {"status": "ok"}
        ctrl_c(proc)
    assert (tmp_path / "cache").is_dir()


# -- Scale-out on Ray: into a bucket


def _bucket_keys(endpoint: str, bucket: str) -> list[str]:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def _url_folders(root: Path) -> list[str]:
    """Local folders a location that went through ``Path`` would have made."""
    return [str(p) for p in root.rglob("*") if p.name.lower() in ("s3:", "file:")]


@pytest.mark.slow
def test_the_ray_block_into_a_bucket(tmp_path: Path, corpus_meshes: list[Path]) -> None:
    """The three lines as written against moto's S3 server (bucket ``bucket`` made
    first, its address in ``AWS_ENDPOINT_URL``), ``/shared`` and ``/fast`` placed under
    this test's directory; then checked as the user would: the objects in the bucket,
    no local ``s3:`` folder, the hot copy and the snapshot read back."""
    from cache_store import CachedDataset
    from cache_store.stores.opener import open_store
    from tests.helpers.s3 import moto_s3

    shapes = tmp_path / "shared" / "shapes"
    shapes.mkdir(parents=True)
    meshes = [m for m in corpus_meshes if m.suffix == ".obj"][:3]
    for mesh in meshes:
        shutil.copy(mesh, shapes / mesh.name)
    block = line_of(RUN, S3_TEST)
    as_here = [
        line.replace("/shared/", f"{tmp_path}/shared/").replace("/fast/", f"{tmp_path}/fast/")
        for line in block
    ]
    cwd = tmp_path / "work"
    cwd.mkdir()
    with moto_s3() as s3:  # its address and credentials reach the commands' environment
        import boto3

        boto3.client(
            "s3",
            endpoint_url=s3.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket="bucket")
        precompute, merge, import_ = as_here

        out = sh(precompute, cwd)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "done 3, skipped 0, failed 0" in out.stdout, out.stdout
        fp = re.search(r"^fingerprint ([0-9a-f]{32})$", out.stdout, re.M).group(1)  # type: ignore[union-attr]
        keys = _bucket_keys(s3.endpoint, "bucket")
        assert any(k.startswith(f"l8.zarr/{fp}/commits/") for k in keys), keys
        assert any(k.startswith(f"l8.zarr/{fp}/parts/") for k in keys), keys

        out = sh(merge, cwd)
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"l8.zarr/{fp}/index.json" in _bucket_keys(s3.endpoint, "bucket")
        again = sh(merge, cwd)  # idempotent, as the comment says
        assert again.returncode == 0 and again.stdout == out.stdout, again.stderr[-3000:]

        out = sh(import_, cwd)
        assert out.returncode == 0, out.stderr[-3000:]
        with open_store(tmp_path / "fast" / "spcache") as hot:
            assert sorted(hot.get_index(fp).sample_ids.tolist()) == sorted(m.stem for m in meshes)

        snapshot = CachedDataset("s3://bucket/l8.zarr", fp)  # the README's next line
        assert len(snapshot) == 3 and snapshot[0]["octree"].numel() > 0
    assert not _url_folders(tmp_path), _url_folders(tmp_path)
