"""Sources too big to load fail alone, cheaply.

A 2 GB sparse ``.npy`` took a loader to 8.3 GB RSS, and a 1.2 MB ``.npz`` bomb (zeros
that inflate to gigabytes) to 3.6 GB. Each is loaded here in a fresh child process
(``load_source`` as the engine calls it, with the module defaults), which reports the
error and its peak RSS growth: a clear ``SourceError`` naming the file and the limit,
and the peak within ``RSS_BUDGET_MIB``. Also: a tiny ``.npy`` whose header declares a
huge array (``np.load`` would allocate it before noticing the truncation), an ``.npz``
whose members' headers lie about their size, and an ordinary source still loading.
Figures: per file, its size on disk, the error and the child's peak RSS growth.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

from tests.conftest import REPO_ROOT
from tests.helpers.faults import report

RSS_BUDGET_MIB = 64

_CHILD = """
import json, resource, sys
from cache_store.errors import SourceError
from workers.source_load import load_source
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    src = load_source(sys.argv[1])
    out = {"ok": True, "points": int(len(src.vertices))}
except SourceError as exc:
    out = {"ok": False, "error": str(exc)}
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out["peak_growth_mib"] = round((after - before) / 1024, 1)
print(json.dumps(out))
"""


def _load_in_child(path: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _npy_header(shape: tuple[int, ...], dtype: str = "<f8") -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": dtype, "fortran_order": False, "shape": shape}
    )
    return buf.getvalue()


def _sparse_npy(path: Path, nbytes: int) -> None:
    rows = nbytes // 24
    with open(path, "wb") as fh:
        fh.write(_npy_header((rows, 3)))
        fh.truncate(fh.tell() + rows * 24)  # a hole: no disk used


def _npz_bomb(path: Path, member_bytes: int) -> None:
    rows = member_bytes // 24
    zero = bytes(1 << 20)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        with zf.open("points.npy", "w", force_zip64=True) as fh:
            fh.write(_npy_header((rows, 3)))
            left = rows * 24
            while left > 0:
                fh.write(zero[: min(left, len(zero))])
                left -= len(zero)


def _lying_npz(path: Path) -> None:
    """One member with a small, honest zip size whose .npy header declares 8 GB."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("points.npy", _npy_header((1 << 28, 4)) + bytes(96))


def test_oversized_sources_fail_alone_with_small_rss(tmp_path: Path) -> None:
    cases = {}
    sparse = tmp_path / "sparse.npy"
    _sparse_npy(sparse, 2 << 30)
    bomb = tmp_path / "bomb.npz"
    _npz_bomb(bomb, 1200 << 20)  # inflates to 1.2 GB, over the 1 GiB decoded limit
    header_only = tmp_path / "header_only.npy"
    header_only.write_bytes(_npy_header((1 << 27, 3)) + bytes(240))  # declares 3 GiB
    lying = tmp_path / "lying.npz"
    _lying_npz(lying)
    good = tmp_path / "good.npy"
    np.save(good, np.random.default_rng(0).normal(size=(1000, 3)))
    expect = {
        sparse: "over the per-source limit",
        bomb: "over the decoded size limit",
        header_only: "over the decoded size limit",
        lying: "over the decoded size limit",
    }
    for path, phrase in expect.items():
        got = _load_in_child(path)
        cases[path.name] = {"disk_bytes": path.stat().st_size, **got}
        assert not got["ok"], got
        assert phrase in got["error"] and path.name in got["error"], got
        assert "not a valid" not in got["error"], got
        assert got["peak_growth_mib"] < RSS_BUDGET_MIB, got
    ok = _load_in_child(good)
    cases[good.name] = ok
    assert ok["ok"] and ok["points"] == 1000, ok
    report("source_bombs", {"rss_budget_mib": RSS_BUDGET_MIB, "cases": cases})
