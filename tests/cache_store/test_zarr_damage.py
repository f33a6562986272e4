"""A damaged Zarr snapshot: flipped bytes in chunks, headers and ids are reported, a
damaged uncompressed chunk fails only its records, a BOOL byte of 2 is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from cache_store.errors import (
    CorruptRecord,
    SpcacheError,
)
from cache_store.snapshot.zarr.export import export_snapshot
from cache_store.keys import compute_fingerprint
from cache_store.format.encode import encode_record
from cache_store.format.header import read_header
from cache_store.format.index import DatasetIndex
from cache_store.snapshot.zarr.store import ZarrStore
from cache_store.testing import (
    FP_A,
    FP_B,
    IDS_A,
    sample_content,
)
from tests.helpers.zarr_snapshots import copy_snapshot, export_all, export_sample, fill_lmdb
from tests.helpers.synthetic import record_metadata


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(records, indexes, lmdb cache dir, snapshot dir), exported once for the module."""
    return export_sample(tmp_path_factory.mktemp("exported"))


def _chunk_files(group_dir: Path, array: str) -> list[Path]:
    return sorted(p for p in (group_dir / array / "c").rglob("*") if p.is_file())


@pytest.mark.parametrize("direct_reads", [True, False])
def test_flipped_bytes_in_a_chunk_are_reported(tmp_path: Path, exported, direct_reads) -> None:
    records, *_, snap = exported
    dest = copy_snapshot(snap, tmp_path / "s.zarr")
    (chunk,) = _chunk_files(dest / FP_A, "data/point_hierarchy")
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    chunk.write_bytes(bytes(raw))
    store = ZarrStore(dest, direct_reads=direct_reads)
    with pytest.raises(CorruptRecord, match="point_hierarchy"):
        store.get(f"{FP_A}/zeta")
    report = store.verify()
    assert not report.ok and report.checked == len(records)
    # One chunk holds every record of this small field: all of FP_A, nothing else.
    assert sorted(report.corrupt) == sorted(f"{FP_A}/{s}" for s in IDS_A)
    assert all("point_hierarchy" in reason for reason in report.corrupt.values())
    assert store.verify(FP_B).ok
    assert store.get(f"{FP_B}/lamps/l1") == records[f"{FP_B}/lamps/l1"]


def test_uncompressed_chunks_damaged_fail_only_their_records(tmp_path: Path) -> None:
    # codec "none": a record's rows are read in place, so a flipped byte fails the
    # record whose rows hold it (its field's xxh3), and a truncated chunk file is named
    records, indexes = sample_content()
    cache = fill_lmdb(tmp_path / "cache", records, indexes)
    export_all(cache, tmp_path / "s.zarr", codec="none")
    cache.close()
    store = ZarrStore(tmp_path / "s.zarr")
    group = zarr.open_group(str(tmp_path / "s.zarr" / FP_A), mode="r")
    offsets = group["offsets/point_hierarchy"][:]
    victim = int(np.flatnonzero(np.diff(offsets))[0])  # a record with rows in this field
    row_bytes = 3 * np.dtype(group["data/point_hierarchy"].dtype).itemsize
    (chunk,) = _chunk_files(tmp_path / "s.zarr" / FP_A, "data/point_hierarchy")
    raw = bytearray(chunk.read_bytes())
    raw[int(offsets[victim]) * row_bytes] ^= 0x01
    chunk.write_bytes(bytes(raw))
    ids = group["sample_ids"][:].tobytes().decode()
    id_offsets = group["sample_id_offsets"][:]
    victim_key = f"{FP_A}/{ids[id_offsets[victim] : id_offsets[victim + 1]]}"
    fresh = ZarrStore(tmp_path / "s.zarr")
    with pytest.raises(CorruptRecord, match="point_hierarchy"):
        fresh.get(victim_key)
    report = fresh.verify()
    assert sorted(report.corrupt) == [victim_key]
    for key, value in records.items():
        if key != victim_key:
            assert fresh.get(key) == value
    chunk.write_bytes(bytes(raw[:-9]))  # truncated
    with pytest.raises(CorruptRecord, match="bytes, expected"):
        ZarrStore(tmp_path / "s.zarr").get(victim_key)
    store.close()


def test_flipped_bytes_in_headers_and_ids_are_reported(tmp_path: Path, exported) -> None:
    *_, snap = exported
    dest = copy_snapshot(snap, tmp_path / "s.zarr")
    for array in ("headers", "sample_ids"):
        group = FP_B if array == "headers" else FP_A
        (chunk,) = _chunk_files(dest / group, array)
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 3] ^= 0x08
        chunk.write_bytes(bytes(raw))
    store = ZarrStore(dest)
    report = store.verify()
    assert f"index:{FP_A}" in report.corrupt  # ids unreadable: no record can be located
    assert sorted(k for k in report.corrupt if k.startswith(FP_B)) == [
        f"{FP_B}/chairs/a1",
        f"{FP_B}/lamps/l1",
    ]
    with pytest.raises(CorruptRecord):
        store.get_index(FP_A)


def _bool_record(fingerprint: str, sample_id: str, flags: list[bool]) -> bytes:
    return encode_record(
        {"flags": torch.tensor(flags), "points": torch.arange(6.0)},
        record_metadata(fingerprint, sample_id),
    )


def _with_bool_byte_two(value: bytes) -> bytes:
    """``value`` with its ``flags`` field's first byte set to 2, its field checksum and
    header checksum recomputed (as a bug or an attacker could): only the BOOL rule is left
    to catch it."""
    import xxhash

    header = read_header(value)
    info = header.tensors["flags"]
    out = bytearray(value)
    out[info.begin] = 2
    text = bytes(out[8 : header.data_start])
    old = header.field_checksums["flags"].encode()
    new = xxhash.xxh3_64_hexdigest(bytes(out[info.begin : info.end])).encode()
    assert text.count(old) == 1
    text = text.replace(old, new)
    at = text.index(b'"checksum":"') + len(b'"checksum":"')
    blank = text[:at] + b"0" * 32 + text[at + 32 :]
    text = text[:at] + xxhash.xxh3_128_hexdigest(blank).encode() + text[at + 32 :]
    out[8 : header.data_start] = text
    return bytes(out)


def test_a_bool_byte_of_two_is_refused_by_export_and_zarr_verify(tmp_path: Path) -> None:
    """The Zarr path (export, ``get``, ``verify``) refuses what the LMDB verify refuses: a
    BOOL byte other than 0 or 1, even with every checksum re-signed to match."""
    fp = compute_fingerprint("spc", 1, {"level": 4, "surface_samples": 100_000})
    ids = ["a", "b"]
    clean = {f"{fp}/{s}": _bool_record(fp, s, [False, True, False]) for s in ids}
    bad_key = f"{fp}/b"
    bad = _with_bool_byte_two(clean[bad_key])
    index = DatasetIndex(fp, "spc", 1, {"level": 4, "surface_samples": 100_000}, ids)
    cache = fill_lmdb(tmp_path / "cache", {**clean, bad_key: bad}, [index])
    assert list(cache.verify().corrupt) == [bad_key]  # the LMDB verify's answer
    with pytest.raises(SpcacheError, match="BOOL") as err:
        export_snapshot(cache, fp, tmp_path / "refused.zarr")
    assert bad_key in str(err.value)
    cache.close()

    # A snapshot whose stored bytes were edited the same way after a clean export.
    cache = fill_lmdb(tmp_path / "clean", clean, [index])
    dest = tmp_path / "s.zarr"
    export_snapshot(cache, fp, dest, codec="none")
    cache.close()
    group = zarr.open_group(str(dest / fp), mode="r")
    row = ids.index("b")
    (flags_chunk,) = _chunk_files(dest / fp, "data/flags")
    raw = bytearray(flags_chunk.read_bytes())
    raw[int(group["offsets/flags"][row])] = 2
    flags_chunk.write_bytes(bytes(raw))
    (headers_chunk,) = _chunk_files(dest / fp, "headers")
    raw = bytearray(headers_chunk.read_bytes())
    n = len(read_header(clean[bad_key]).metadata) and read_header(clean[bad_key]).data_start - 8
    old_text = clean[bad_key][8 : 8 + n]
    new_text = bad[8 : 8 + n]
    assert raw.count(old_text) == 1
    headers_chunk.write_bytes(bytes(raw).replace(old_text, new_text))
    store = ZarrStore(dest)
    with pytest.raises(CorruptRecord, match="BOOL"):
        store.get(bad_key)
    report = store.verify()
    assert bad_key in report.corrupt and "BOOL" in report.corrupt[bad_key]
    assert f"{fp}/a" not in report.corrupt
