"""A reader whose listing names a part reclaimed since lists the commits again, once.

``spcache merge --remove-superseded`` deletes a part once none of its records is the
copy readers read (:mod:`cache_store.snapshot.sharded.superseded`). A reader that listed
the commits before the copy read instead was committed still names the old part; when
a read finds it gone, the commits are listed afresh once and the copy that listing
names is read (:meth:`ShardedSnapshot.read_located`): through ``get``, ``get_many``,
views and ``local_cache``. A part truly lost (deleted by hand, its manifest still
there) is still the clear ``CorruptRecord`` after that one listing, and costs no
listing when read again. The end-to-end test, a training script across a recompute and
a reclaim, is ``tests/faults/test_sharded_reclaim_readers.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_store.errors import CorruptRecord
from cache_store.local_cache import LocalCache
from cache_store.snapshot.sharded import ShardedSnapshot, superseded_parts
from cache_store.stores.opener import open_store
from cache_store.stores.base import Store
from cache_store.testing import contract_record
from tests.helpers.local_cache import FP
from tests.helpers.s3 import S3Server, moto_s3, snapshot_destination

H1, H2 = "1" * 16, "2" * 16


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_s3() as server:
        yield server


@pytest.fixture
def dest(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    return snapshot_destination(request, tmp_path)


def _commit(location: str, options: dict[str, Any], records: list[tuple[str, int, str]]) -> str:
    """Commit ``records`` (``(sample id, seed, source hash)``) as one part, merged into
    the index; returns the part's name."""
    with ShardedSnapshot(location, readonly=False, storage_options=options) as writer:
        writer.put_many(
            [
                (f"{FP}/{sid}", contract_record(FP, sid, seed, source_hash=source))
                for sid, seed, source in records
            ]
        )
        [part] = [n for n in writer.commit_names(FP) if n.startswith(f"{writer.writer}-")]
        writer.merge_index(FP)
    return part


def _listings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every listing of the commits any store makes from now on (its fingerprint)."""
    made: list[str] = []
    real = ShardedSnapshot.commit_names

    def counting(self: ShardedSnapshot, fingerprint: str) -> list[str]:
        made.append(fingerprint)
        return real(self, fingerprint)

    monkeypatch.setattr(ShardedSnapshot, "commit_names", counting)
    return made


def _tensors(store: Store, key: str, read: str) -> dict[str, Any]:
    if read == "get":
        return dict(store.get_record(key).tensors)
    if read == "get_many":
        return dict(store.get_records([key])[0].tensors)
    viewed = store.view_records([key], None, "full")
    assert viewed is not None, store.views_refused()
    return dict(viewed[0].tensors)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(a[f].equal(b[f]) for f in a)


#: (where, how a reader reads): views need the snapshot on this machine's file system,
#: local_cache a remote one
WAYS = [
    *[("local", read) for read in ("get", "get_many", "views")],
    *[("s3", read) for read in ("get", "get_many", "local_cache")],
]


def _open(location: str, options: dict[str, Any], tmp_path: Path, through: str) -> Store:
    if through == "local_cache":
        return open_store(
            location,
            readonly=True,
            storage_options=options,
            local_cache=LocalCache(str(tmp_path / "local"), 64 << 20),
        )
    return ShardedSnapshot(location, storage_options=options)


def _fresh(location: str, options: dict[str, Any], key: str) -> dict[str, Any]:
    """``key``'s record as a reader opened now reads it."""
    with ShardedSnapshot(location, storage_options=options) as snap:
        return dict(snap.get_record(key).tensors)


@pytest.mark.parametrize(("dest", "read"), WAYS, indirect=["dest"])
def test_a_reader_listed_before_the_reclaim_reads_the_new_copy(
    dest: tuple[str, dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    read: str,
) -> None:
    location, options = dest
    old = _commit(location, options, [("x", 1, H1)])
    _commit(location, options, [("y", 2, H1)])
    before = _fresh(location, options, f"{FP}/x")
    reader = _open(location, options, tmp_path, read)
    how = "get" if read == "local_cache" else read
    assert reader.get_index(FP).sample_ids.tolist() == ["x", "y"]  # the listing it keeps
    _tensors(reader, f"{FP}/y", how)
    _commit(location, options, [("x", 4, H2)])  # x's source changed and was recomputed
    taken = superseded_parts(location, storage_options=options, older_than_s=0, remove=True)
    assert [path.rsplit("/", 1)[-1] for path in taken] == [f"{old}.bin"]
    listings = _listings(monkeypatch)
    got = _tensors(reader, f"{FP}/x", how)  # its listing names the reclaimed part
    assert listings == [FP]  # listed again, once
    after = _fresh(location, options, f"{FP}/x")
    assert _same(got, after) and not _same(got, before)  # the recomputed copy
    listings.clear()
    for _ in range(3):  # the fresh listing is kept: no more listings
        assert _same(_tensors(reader, f"{FP}/x", how), after)
        _tensors(reader, f"{FP}/y", how)
    assert listings == []
    reader.close()


@pytest.mark.parametrize(("dest", "read"), WAYS, indirect=["dest"])
def test_a_part_lost_by_hand_is_corrupt_after_one_listing(
    dest: tuple[str, dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    read: str,
) -> None:
    location, options = dest
    lost = _commit(location, options, [("x", 1, H1), ("z", 3, H1)])
    _commit(location, options, [("y", 2, H1)])
    reader = _open(location, options, tmp_path, read)
    how = "get" if read == "local_cache" else read
    assert reader.get_index(FP).sample_ids.tolist() == ["x", "z", "y"]
    with ShardedSnapshot(location, storage_options=options) as snap:
        snap.fs.rm_file(snap.path(FP, "parts", f"{lost}.bin"))  # its manifest stays
    listings = _listings(monkeypatch)
    with pytest.raises(CorruptRecord, match=f"committed part {lost}.bin is missing") as exc:
        _tensors(reader, f"{FP}/x", how)
    assert exc.value.key == f"{FP}/x"
    assert listings == [FP]  # one fresh listing, which still names the part
    for key in (f"{FP}/x", f"{FP}/z"):  # read again: the same error, no listing
        with pytest.raises(CorruptRecord, match=f"committed part {lost}.bin is missing"):
            _tensors(reader, key, how)
    assert listings == [FP]
    assert _tensors(reader, f"{FP}/y", how)  # the other part reads
    reader.close()
