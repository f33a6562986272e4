"""A re-run over a finished corpus decides "current" from the stored stat signature, in
the driver, without opening the file or shipping the sample to a loader; a source whose
signature changed is hashed (and computed again only if its bytes changed); a record
without a signature is hashed.

Each run is ``spcache precompute`` in a subprocess from a fresh directory; what it did
is its JSON summary and the records read back.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import lmdb
import numpy as np

from cache_store.stores.lmdb import LMDBStore
from tests.spcache.test_summaries import TINY, point_clouds, spcache


def test_a_rerun_decides_by_the_stat_signature_and_hashes_where_it_changed(
    tmp_path: Path,
) -> None:
    sources = point_clouds(tmp_path / "sources", 6)
    cache = tmp_path / "cache"
    first = spcache(tmp_path / "a", "precompute", sources, "--cache", cache, *TINY)
    assert first["done"] == 6
    fp = first["fingerprint"]
    with LMDBStore(cache) as store:
        stamps = {sid: store.get(f"{fp}/{sid}") for sid in ("p0000", "p0001", "p0002")}
    written = last_write(cache)

    # nothing changed: every sample is decided in the driver, none goes to a loader
    # (the loaders' time, summed over the samples they loaded, is nothing), and nothing
    # is written: not even the index, which lists them all already
    same = spcache(tmp_path / "b", "precompute", sources, "--cache", cache, *TINY)
    assert (same["done"], same["skipped"], same["failed"]) == (0, 6, 0)
    assert same["timings"]["load_s"] == 0
    assert last_write(cache) == written

    # p0000: other bytes of the same size, its mtime put back: its change time moved, so
    # the signature differs and the hash decides: computed again
    path = sources / "p0000.npy"
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    # p0001: touched (same bytes): hashed in a loader, found current, kept
    old = time.time() - 30
    os.utime(sources / "p0001.npy", (old, old))
    # p0002: new bytes: hashed, computed again
    np.save(sources / "p0002.npy", np.random.default_rng(9).normal(size=(64, 3)).astype(np.float32))
    os.utime(sources / "p0002.npy", (old, old))

    again = spcache(tmp_path / "c", "precompute", sources, "--cache", cache, *TINY)
    assert (again["done"], again["skipped"], again["failed"]) == (2, 4, 0)
    assert again["timings"]["load_s"] > 0
    with LMDBStore(cache) as store:
        after = {sid: store.get(f"{fp}/{sid}") for sid in stamps}
    assert after["p0001"] == stamps["p0001"]
    assert after["p0000"] != stamps["p0000"] and after["p0002"] != stamps["p0002"]


def last_write(cache: Path) -> int:
    """The id of the last write transaction of the cache's LMDB environment."""
    env = lmdb.open(str(cache / "records"), max_dbs=16, readonly=True, lock=False)
    try:
        return int(env.info()["last_txnid"])
    finally:
        env.close()


def test_a_record_without_a_signature_is_decided_by_the_hash(tmp_path: Path) -> None:
    """Sources whose mtime is not safely in the past when read (here: in the future)
    give records without a signature: the re-run hashes them, and finds the one whose
    bytes changed although its size, mtime and inode did not."""
    sources = tmp_path / "sources"
    sources.mkdir()
    rng = np.random.default_rng(1)
    later = time.time() + 3600
    for i in range(3):
        np.save(sources / f"q{i}.npy", rng.normal(size=(64, 3)).astype(np.float32))
        os.utime(sources / f"q{i}.npy", (later, later))
    cache = tmp_path / "cache"
    first = spcache(tmp_path / "a", "precompute", sources, "--cache", cache, *TINY)
    with LMDBStore(cache) as store:
        assert not store.record_metadata(f"{first['fingerprint']}/q0").get("source_stat")
    path = sources / "q0.npy"
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = spcache(tmp_path / "b", "precompute", sources, "--cache", cache, *TINY)
    assert (again["done"], again["skipped"]) == (1, 2)
