"""What the README says of spc_sdf's sign on open surfaces holds: a flat open sheet is
positive everywhere; a curved open one is negative only on its hollow side; and each
record says whether its mesh was closed (the sign exact) or not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trimesh

from cache_store.stores.opener import open_store
from workers.engine import Engine


@pytest.mark.slow
def test_open_surfaces_sign_as_the_readme_says(tmp_path: Path, corpus_meshes: list[Path]) -> None:
    flat = tmp_path / "flat_sheet.obj"
    grid = np.stack(np.meshgrid(np.linspace(-1, 1, 9), np.linspace(-1, 1, 9)), -1).reshape(-1, 2)
    vertices = np.column_stack([grid, np.zeros(len(grid))])
    faces = [[r * 9 + c, r * 9 + c + 1, (r + 1) * 9 + c] for r in range(8) for c in range(8)]
    faces += [
        [r * 9 + c + 1, (r + 1) * 9 + c + 1, (r + 1) * 9 + c] for r in range(8) for c in range(8)
    ]
    trimesh.Trimesh(vertices, faces, process=False).export(flat)
    bowl = next(p for p in corpus_meshes if p.name == "hemisphere_open.obj")
    box = next(p for p in corpus_meshes if p.name == "box_binary.stl")  # unwelded, closed
    with open_store(tmp_path / "cache", readonly=False) as store:
        engine = Engine(store, "spc_sdf", {"level": 5}, device="cpu", backend="torch", loaders=0)
        summary = engine.run([("flat", str(flat)), ("bowl", str(bowl)), ("box", str(box))])
        assert summary.done == 3, summary.errors
        records = {
            s: store.get_record(f"{engine.fingerprint}/{s}") for s in ("flat", "bowl", "box")
        }
    closed = {s: r.tensors["closed"] for s, r in records.items()}
    assert all(c.dtype == torch.bool and c.shape == () for c in closed.values())
    assert {s: bool(c) for s, c in closed.items()} == {"flat": False, "bowl": False, "box": True}
    box_sdf = records["box"].tensors["sdf"]
    assert float(box_sdf.min()) < 0.0 < float(box_sdf.max())  # closed: a real inside
    flat_sdf, bowl_sdf = records["flat"].tensors["sdf"], records["bowl"].tensors["sdf"]
    assert float(flat_sdf.min()) >= 0.0  # no side of a flat sheet is "inside"
    share = float((bowl_sdf < 0).float().mean())
    assert 0.05 < share < 0.95  # the hollow side only
