"""Resume tests: small synthetic caches, and the rule every exactness check applies.

The rule (``cache_store.readers.sampler``): across the runs of one epoch, every sample is
yielded exactly once, except the ``(-R) % W`` samples a pass of ``W`` ranks over ``R``
remaining ones repeats at its end (taken from the end of the epoch's order).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from cache_store.format.index import DatasetIndex
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.synthetic import fingerprint_of, make_record

FP = fingerprint_of("spc", level=4)


def sample_ids(n: int) -> list[str]:
    return [f"shapes/s{i:04d}" for i in range(n)]


def write_cache(path: Path, ids: Sequence[str], *, missing: Iterable[str] = ()) -> Path:
    """A cache directory whose index lists ``ids``, with a record for each but ``missing``."""
    absent = set(missing)
    store = LMDBStore(path, readonly=False)
    store.put_many(
        (f"{FP}/{sid}", make_record(FP, sid, seed=i, level=4))
        for i, sid in enumerate(ids)
        if sid not in absent
    )
    store.put_index(
        DatasetIndex(FP, "spc", 1, {"level": 4, "surface_samples": 100_000}, np.array(ids))
    )
    store.close()
    return path


def repeats(yielded: Iterable[str]) -> dict[str, int]:
    """Ids yielded more than once, with their counts."""
    return {sid: n for sid, n in Counter(yielded).items() if n > 1}


def assert_exactly_once(
    yielded: Sequence[str], ids: Sequence[str], padded: Sequence[str] = ()
) -> None:
    """``yielded`` holds every id of ``ids`` once, plus each of ``padded`` once more."""
    assert set(yielded) == set(ids), (
        f"missing {sorted(set(ids) - set(yielded))[:5]}, extra {sorted(set(yielded) - set(ids))[:5]}"
    )
    assert repeats(yielded) == dict.fromkeys(padded, 2), (repeats(yielded), list(padded))
