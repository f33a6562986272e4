"""Caches with several indexed fingerprints, for the housekeeping tests (ls/rm/prune/compact)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cache_store.recipes.registry import get_recipe_spec
from cache_store.format.index import DatasetIndex
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.fault_children import make_small_record
from tests.helpers.synthetic import fingerprint_of


def add_fingerprint(cache: Path, level: int, n: int, nbytes: int, *, batch: int = 2000) -> str:
    """``n`` records of about ``nbytes`` for the ``spc`` recipe at ``level``, indexed;
    returns the fingerprint."""
    spec = get_recipe_spec("spc")
    fp = fingerprint_of("spc", level=level)
    ids = [f"s{i:06d}" for i in range(n)]
    store = LMDBStore(cache, readonly=False)
    try:
        for start in range(0, n, batch):
            store.put_many(
                [
                    (f"{fp}/{sid}", make_small_record(f"{fp}/{sid}", nbytes, level * 10**6 + i))
                    for i, sid in enumerate(ids[start : start + batch], start)
                ]
            )
        store.put_index(
            DatasetIndex(fp, "spc", spec.version, spec.resolve({"level": level}), np.array(ids))
        )
    finally:
        store.close()
    return fp


def record_counts(cache: Path) -> dict[str, int]:
    store = LMDBStore(cache)
    try:
        return {fp: e["records"] for fp, e in store.stats()["fingerprints"].items()}
    finally:
        store.close()
