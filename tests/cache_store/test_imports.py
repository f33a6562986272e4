"""What importing the reading side pulls in: no torch for header-only users, never CUDA."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT
from tests.helpers.recipes import recipe_plugin_modules


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sys.modules))"],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return set(out.split())


def test_store_and_record_headers_need_no_torch() -> None:
    mods = _modules_after(
        "import cache_store, cache_store.stores.base, cache_store.stores.lmdb, "
        "cache_store.format.header, cache_store.format.decode, "
        "cache_store.format.encode, cache_store.format.index, cache_store.keys"
    )
    assert "torch" not in mods


def test_reading_records_never_initialises_cuda(tmp_path) -> None:
    code = f"""
import torch
from cache_store import CachedDataset, collate_spc
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.index import DatasetIndex
from tests.helpers.synthetic import fingerprint_of, make_record
fp = fingerprint_of("spc", level=4)
store = LMDBStore({str(tmp_path)!r}, readonly=False)
store.put_many([(f"{{fp}}/s{{i}}", make_record(fp, f"s{{i}}", i)) for i in range(3)])
store.put_index(DatasetIndex(fp, "spc", 1, {{"level": 4, "surface_samples": 100000}}, ["s0", "s1", "s2"]))
ds = CachedDataset({str(tmp_path)!r}, "spc", level=4)
batch = collate_spc([ds[i] for i in range(len(ds))])
assert batch["lengths"].numel() == 3
assert not torch.cuda.is_initialized()
"""
    mods = _modules_after(code) - recipe_plugin_modules()  # "spc" is looked up by name
    assert not {m for m in mods if m.split(".")[0] in {"kaolin", "service", "workers", "fastapi"}}


def test_verify_and_stats_walks_need_no_torch(tmp_path) -> None:
    """``spcache verify`` and ``stats`` (and the service's listings) walk a cache in a
    child process each time: without torch that child starts in a fraction of a second."""
    from cache_store.stores.lmdb import LMDBStore
    from tests.helpers.synthetic import fingerprint_of, make_record

    fp = fingerprint_of("spc", level=4)
    with LMDBStore(tmp_path, readonly=False) as store:
        store.put_many([(f"{fp}/s{i}", make_record(fp, f"s{i}", i)) for i in range(3)])
    code = f"""
from cache_store.housekeeping.isolated import child_answer
report = child_answer("verify", {str(tmp_path)!r}, [])["result"]
assert report["checked"] == 3 and not report["corrupt"], report
assert report["unindexed"] == {{{fp!r}: 3}}, report  # records, no index written
assert child_answer("stats", {str(tmp_path)!r}, [])["result"]
"""
    assert "torch" not in _modules_after(code)
