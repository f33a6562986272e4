"""Manifests planted in a sharded snapshot by anyone with write access to it.

Before issue 34, ``spcache precompute --cache DEST.zarr`` with the local engine wrote no
``index.json``; one valid manifest whose ``dataset`` was ``{"bogus": 1}`` made the whole
fingerprint unreadable and ``spcache merge`` exit 2; a manifest describing other
parameters was merged into ``index.json`` (readers then failed while ``verify`` said
clean); and a manifest listing 200,000 ids added them to the dataset for good (still
there after the manifest was deleted and ``merge`` run again). Now a manifest whose
description is not its fingerprint's is set aside by name (its records not read, the
others read and merged, ``verify`` names it), ``merge`` rebuilds the index from the
manifests that exist, and the local engine writes ``index.json``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers.faults import report
from tests.helpers.procs import run_spcache

SPC = ["--recipe", "spc", "--param", "level=3"]
CPU = ["--device", "cpu", "--backend", "torch", "--loaders", "0"]


def _plant(snapshot: Path, fp: str, name: str, **changes: object) -> Path:
    """A manifest beside the committed ones: the first one's document under another
    part name, with ``changes`` applied."""
    commits = snapshot / fp / "commits"
    doc = json.loads(sorted(commits.glob("*.json"))[0].read_text())
    doc.update(part=name, **changes)
    planted = commits / f"{name}.json"
    planted.write_text(json.dumps(doc))
    return planted


def _listed(cwd: Path) -> dict[str, object]:
    listed = run_spcache("ls", "--cache", "dest.zarr", "--json", cwd=cwd)
    assert listed.returncode == 0, listed.stderr
    return dict(json.loads(listed.stdout)[0])


def test_planted_manifests_are_set_aside_and_merge_rebuilds(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    cwd = tmp_path / "work"
    (cwd / "shapes").mkdir(parents=True)
    for mesh in corpus_meshes[:3]:
        shutil.copyfile(mesh, cwd / "shapes" / mesh.name)
    run = run_spcache("precompute", "shapes", *SPC, "--cache", "dest.zarr", *CPU, cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    fp = next(p.name for p in (cwd / "dest.zarr").iterdir() if p.is_dir())
    index_written = (cwd / "dest.zarr" / fp / "index.json").is_file()

    bogus = _plant(cwd / "dest.zarr", fp, "zz-bogus", dataset={"bogus": 1})
    other = _plant(
        cwd / "dest.zarr",
        fp,
        "zz-other",
        dataset={"recipe": "spc", "recipe_version": 1, "params": {"level": 4}},
    )
    merged = run_spcache("merge", "dest.zarr", cwd=cwd)
    verified = run_spcache("verify", "--cache", "dest.zarr", cwd=cwd)
    row = _listed(cwd)
    index = json.loads((cwd / "dest.zarr" / fp / "index.json").read_text())

    many = _plant(
        cwd / "dest.zarr",
        fp,
        "zz-many",
        data_size=10**9,
        records=[[f"x{i:06d}", i, 1, "0" * 32, ""] for i in range(200_000)],
    )
    bogus.unlink()
    other.unlink()
    with_many = run_spcache("merge", "dest.zarr", cwd=cwd)
    many_count = _listed(cwd)["records"]
    many.unlink()
    without = run_spcache("merge", "dest.zarr", cwd=cwd)
    after = _listed(cwd)["records"]
    figures = {
        "index_json_after_precompute": index_written,
        "merge_exit_with_planted": merged.returncode,
        "merge_named": sorted({m for m in ("zz-bogus", "zz-other") if m in merged.stderr}),
        "verify_exit": verified.returncode,
        "verify_names": [line for line in verified.stdout.splitlines() if "zz-" in line],
        "records_listed": row["records"],
        "index_params": index["params"],
        "records_with_200000_id_manifest": many_count,
        "records_after_it_was_deleted": after,
    }
    report("34.7 planted manifests", figures)
    assert index_written
    assert merged.returncode == 0, merged.stderr
    assert "3 record(s) indexed" in merged.stdout
    assert figures["merge_named"] == ["zz-bogus", "zz-other"]  # both set aside by name
    assert verified.returncode == 1 and len(figures["verify_names"]) == 2, verified.stdout
    assert row["records"] == 3 and row["state"] == "complete"
    assert index["params"]["level"] == 3 and len(index["records"]) == 3
    assert with_many.returncode == 0 and without.returncode == 0
    assert many_count == 3 + 200_000  # a well-formed manifest is taken while it exists
    assert after == 3  # and its ids leave with it
