"""Record format 2: what a fingerprint's records share is stored once, in a descriptor.

Format-1 records (each carrying its recipe's whole schema) still read, beside format-2
ones; a record is bound to its descriptor by digest, and a wrong or damaged descriptor
is a clear error; ``spcache compact --rewrite-records`` rewrites a cache in format 2.
The store contract (cache_store.testing) reads both formats on every backend.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import lmdb
import numpy as np
import pytest
import safetensors
import torch

from cache_store.errors import CorruptRecord, ParameterError
from cache_store.format.decode import check_record, decode_record
from cache_store.format.descriptor import DESCRIPTOR_METADATA, bind_metadata, parse_descriptor
from cache_store.format.encode import encode_record, upgrade_record
from cache_store.format.header import MANAGED_METADATA, read_header
from cache_store.format.index import DatasetIndex, decode_index
from cache_store.readers.dataset import CachedDataset
from cache_store.recipes.registry import get_recipe_spec
from cache_store.stores.http import HTTPStore
from cache_store.snapshot.sharded import ShardedSnapshot
from cache_store.stores.lmdb import LMDBStore
from service.settings import Settings
from tests.helpers.service import TOKEN, InProcessServer, build_cache
from tests.helpers.synthetic import fingerprint_of, make_record, record_metadata, spc_fields
from cache_store.testing.format1 import as_format_1, encode_record_v1
from tests.helpers.v1_records import GOLDEN_V1, golden_v1_records
from workers.engine import Engine
from workers.ray_actor import ShardBuffer

FP = fingerprint_of("spc", level=4)
OTHER_FP = fingerprint_of("spc", level=5)


def _format_of(value: bytes) -> str:
    return read_header(value).metadata["format_version"]


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


def _plant(cache: Path, db: bytes, key: str, value: bytes) -> None:
    """``value`` under ``key`` in database ``db`` of the LMDB cache, past every check."""
    env = lmdb.open(str(cache / "records"), max_dbs=4, subdir=True)
    try:
        with env.begin(write=True) as txn:
            txn.put(key.encode(), value, db=env.open_db(db, txn=txn))
    finally:
        env.close()


def _spcache(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spcache", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


# ---------------------------------------------------------------- the format itself


def test_golden_format_1_records_read_as_a_format_2_recompute_of_their_sources(
    tmp_path: Path,
) -> None:
    """Records the engine wrote in format 1 (tests/data/records_v1) read as before: the
    engine now computes the same tensors from the same sources, and the same metadata
    once its descriptor is added back."""
    golden = golden_v1_records()
    with LMDBStore(tmp_path / "cache", readonly=False) as store:
        engine = Engine(store, "spc", {"level": 3}, device="cpu", backend="torch", loaders=0)
        ids = [key.split("/", 1)[1] for key in golden]
        summary = engine.run([(sid, str(GOLDEN_V1 / f"{sid}.npy")) for sid in ids])
        assert summary.done == len(golden)
        for key, old_value in golden.items():
            assert key == engine.key(key.split("/", 1)[1])  # same fingerprint
            assert _format_of(old_value) == "1" and _format_of(store.get(key)) == "2"
            old = decode_record(old_value, key=key)
            new = store.get_record(key)
            assert _same_tensors(old.tensors, new.tensors)
            for name in ("recipe", "recipe_version", "fingerprint", "params", "schema"):
                assert old.metadata[name] == new.metadata[name], name
            assert old.metadata["source_hash"] == new.metadata["source_hash"]
            assert new.metadata["code_digest"] == engine.code_digest
            # the schema with its meanings is no longer in each record
            assert b"meaning" in old_value and b"meaning" not in store.get(key)
            assert len(store.get(key)) < len(old_value) * 0.7
    index = decode_index((GOLDEN_V1 / "index.safetensors").read_bytes(), key="index")
    assert index.fingerprint == next(iter(golden)).split("/")[0] and len(index) == 20


def test_the_tests_format_1_writer_writes_what_the_engine_wrote() -> None:
    """(cache_store.testing.format1 builds the old caches of the tests.)"""
    for key, value in golden_v1_records().items():
        record = decode_record(value, key=key)
        meta = {k: v for k, v in record.metadata.items() if k not in MANAGED_METADATA}
        assert encode_record_v1(record.tensors, meta) == value


def test_upgrade_keeps_tensors_and_metadata_and_names_its_descriptor() -> None:
    for key, old_value in golden_v1_records().items():
        new_value = upgrade_record(old_value, key=key)
        assert new_value is not None and _format_of(new_value) == "2"
        descriptor = new_value.descriptor
        assert upgrade_record(new_value, key=key) is None  # format 2 already
        old, new = decode_record(old_value, key=key), decode_record(new_value, key=key)
        assert _same_tensors(old.tensors, new.tensors)
        assert set(new.metadata) & set(DESCRIPTOR_METADATA) == set()
        merged = bind_metadata(new.metadata, key, lambda fp, digest, d=descriptor: d)
        unmanaged = {k: v for k, v in old.metadata.items() if k not in MANAGED_METADATA}
        assert {k: v for k, v in merged.items() if k not in MANAGED_METADATA} == unmanaged
        check_record(new_value, key=key, lookup=lambda fp, digest, d=descriptor: d)
        other = key.split("/")[0] + "/s9999999"  # a format-1 record under another key
        with pytest.raises(CorruptRecord, match="names"):
            upgrade_record(old_value, key=other)


def test_any_safetensors_reader_opens_a_format_2_record(tmp_path: Path) -> None:
    fields = spc_fields(3)
    value = encode_record(fields, record_metadata(FP, "chairs/a1"))
    path = tmp_path / "record.safetensors"
    path.write_bytes(value)
    with safetensors.safe_open(str(path), framework="pt") as opened:
        assert set(opened.keys()) == set(fields)
        for name, tensor in fields.items():
            assert torch.equal(opened.get_tensor(name), tensor)
        meta = opened.metadata()
    assert meta["format_version"] == "2" and meta["descriptor"] == value.descriptor.digest
    assert meta["sample_id"] == "chairs/a1" and "recipe" not in meta


# ---------------------------------------------------------------- binding and damage


def test_a_record_naming_a_descriptor_its_store_lacks_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    good = make_record(FP, "a", 1)
    other = make_record(OTHER_FP, "a", 2)  # its descriptor names another fingerprint
    with LMDBStore(cache, readonly=False) as store:
        store.put_many([(f"{FP}/a", good), (f"{OTHER_FP}/a", other)])
    # planted past put_many: the record of OTHER_FP under FP, and one whose descriptor
    # is not stored at all (another recipe code, say)
    _plant(cache, b"records", f"{FP}/b", make_record(OTHER_FP, "b", 3))
    stray = encode_record(spc_fields(4), {**record_metadata(FP, "c"), "code_digest": "f" * 16})
    _plant(cache, b"records", f"{FP}/c", stray)
    with LMDBStore(cache) as store:
        assert store.get_record(f"{FP}/a").metadata["fingerprint"] == FP
        with pytest.raises(CorruptRecord) as err:
            store.get_record(f"{FP}/b")
        assert err.value.key == f"{FP}/b" and "not stored in" in err.value.reason
        with pytest.raises(CorruptRecord) as err:
            store.get_records([f"{FP}/a", f"{FP}/c"])
        reason = err.value.reason
        assert err.value.key == f"{FP}/c"
        assert f"descriptor {stray.descriptor.digest} of fingerprint {FP}" in reason
        assert f"is not stored in {cache}" in reason
        report = store.verify()
        assert set(report.corrupt) == {f"{FP}/b", f"{FP}/c"}
        assert report.checked == 4


def test_a_damaged_descriptor_is_named_and_verify_goes_on(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    values = {f"{FP}/s{i}": make_record(FP, f"s{i}", i) for i in range(3)}
    with LMDBStore(cache, readonly=False) as store:
        store.put_many(values.items())
        params = get_recipe_spec("spc").resolve({"level": 4})
        store.put_index(DatasetIndex(FP, "spc", 1, params, [f"s{i}" for i in range(3)]))
    digest = values[f"{FP}/s0"].descriptor.digest
    text = values[f"{FP}/s0"].descriptor.text
    _plant(cache, b"descriptors", f"{FP}/{digest}", text.replace('"spc"', '"spd"').encode())
    with LMDBStore(cache) as store:
        with pytest.raises(CorruptRecord) as err:
            store.get_record(f"{FP}/s1")
        assert f"descriptor {digest} of fingerprint {FP} is damaged" in err.value.reason
        report = store.verify()
        assert report.checked == 3 and set(report.corrupt) == set(values)
        assert all(FP in reason and "damaged" in reason for reason in report.corrupt.values())
    # the commands, as a user runs them
    verified = _spcache(tmp_path, "verify", "--cache", str(cache))
    assert verified.returncode != 0
    assert (
        f"descriptor {digest} of fingerprint {FP} is damaged" in verified.stdout + verified.stderr
    )
    assert "Traceback" not in verified.stderr
    stats = _spcache(tmp_path, "stats", "--cache", str(cache), "--json")
    assert stats.returncode == 0, stats.stderr
    # a writer computing the fingerprint again writes the descriptor whole again
    with LMDBStore(cache, readonly=False) as store:
        store.put_many([(f"{FP}/s0", make_record(FP, "s0", 0))])
        assert store.verify().ok


def test_a_writer_needs_the_descriptor_of_what_it_writes(tmp_path: Path) -> None:
    value = make_record(FP, "a", 1)
    with LMDBStore(tmp_path / "cache", readonly=False) as store:
        with pytest.raises(ParameterError) as err:  # plain bytes: the descriptor is lost
            store.put_many([(f"{FP}/a", bytes(value))])
        assert f"{FP}/a" in str(err.value) and value.descriptor.digest in str(err.value)
        assert not store.has(f"{FP}/a")  # nothing written
        store.put_many([(f"{FP}/a", bytes(value))], [value.descriptor])  # given: a copy
        store.put_many([(f"{FP}/b", bytes(make_record(FP, "b", 2)))])  # stored already
        assert [r.metadata["recipe"] for r in store.get_records([f"{FP}/a", f"{FP}/b"])] == [
            "spc",
            "spc",
        ]
        with pytest.raises(ParameterError, match="names"):  # a record under another key
            store.put_many([(f"{FP}/c", make_record(FP, "a", 1))])


def test_records_written_in_key_order_fill_their_pages(tmp_path: Path) -> None:
    """Format-2 records of tiny samples fit a leaf page two by two; written in key order
    they are appended and do (a split page would keep one)."""
    with LMDBStore(tmp_path / "cache", readonly=False) as store:
        sizes = []
        for start in range(0, 200, 32):
            batch = [
                (f"{FP}/s{i:04d}", make_record(FP, f"s{i:04d}", i, num_points=30))
                for i in range(start, min(200, start + 32))
            ]
            sizes += [len(v) for _, v in batch]
            store.put_many(reversed(batch))  # a batch in any order
    assert min(sizes) > 1400 and max(sizes) < 1900  # two fit a 4 KiB page, three do not
    env = lmdb.open(str(tmp_path / "cache" / "records"), max_dbs=4, readonly=True, lock=False)
    with env.begin() as txn:
        stat = txn.stat(env.open_db(b"records", txn=txn, create=False))
    env.close()
    assert stat["overflow_pages"] == 0 and stat["leaf_pages"] <= 105


# ---------------------------------------------------------------- mixed caches


def _mixed_cache(root: Path) -> tuple[Path, dict[str, bytes]]:
    """A cache of one fingerprint whose records are half format 1 (an older recipe
    code), half format 2; and its sources."""
    sources = root / "sources"
    sources.mkdir(parents=True)
    rng = np.random.default_rng(0)
    items = []
    for i in range(8):
        np.save(sources / f"s{i}.npy", rng.normal(size=(64, 3)).astype(np.float32))
        items.append((f"s{i}", str(sources / f"s{i}.npy")))
    cache = root / "cache"
    with LMDBStore(cache, readonly=False) as store:
        engine = Engine(store, "spc", {"level": 3}, device="cpu", backend="torch", loaders=0)
        assert engine.run(items).done == 8
        written = {engine.key(sid): store.get(engine.key(sid)) for sid, _ in items}
    old = {}
    for key in list(written)[::2]:  # as an earlier spcache wrote them, by older code
        record = decode_record(written[key], key=key)
        with LMDBStore(cache) as store:
            meta = store.record_metadata(key)
        meta = {k: v for k, v in meta.items() if k not in MANAGED_METADATA}
        old[key] = encode_record_v1(record.tensors, {**meta, "code_digest": "0" * 16})
        _plant(cache, b"records", key, old[key])
    return cache, {**written, **old}


def test_a_cache_of_both_formats_reads_lists_and_counts_both(tmp_path: Path) -> None:
    cache, values = _mixed_cache(tmp_path)
    fingerprint = next(iter(values)).split("/")[0]
    assert sorted(_format_of(v) for v in values.values()) == ["1"] * 4 + ["2"] * 4
    dataset = CachedDataset(cache, fingerprint)
    for i in range(len(dataset)):
        key = f"{fingerprint}/{dataset.sample_id(i)}"
        want = decode_record(values[key], key=key).tensors
        assert _same_tensors(dict(dataset[i]), want)
    dataset.close()
    with LMDBStore(cache) as store:
        assert store.verify().ok
        entry = store.stats()["fingerprints"][fingerprint]
        assert sorted(entry["code_digests"].values()) == [4, 4]
        assert "0" * 16 in entry["code_digests"] and "mixed_code" in entry
    listed = _spcache(tmp_path, "ls", "--cache", str(cache), "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)[0]["records"] == 8


def test_compact_rewrite_records_rewrites_a_cache_in_format_2(tmp_path: Path) -> None:
    cache, values = _mixed_cache(tmp_path)
    fingerprint = next(iter(values)).split("/")[0]
    damaged = bytearray(values[f"{fingerprint}/s0"])  # format 1, a flipped tensor byte
    damaged[read_header(bytes(damaged)).tensors["octree"].begin] ^= 1
    _plant(cache, b"records", f"{fingerprint}/s0", bytes(damaged))
    with LMDBStore(cache) as store:
        before = {k: store.record_metadata(k) for k in values if not k.endswith("/s0")}
    size_before = (cache / "records" / "data.mdb").stat().st_size

    done = _spcache(tmp_path, "compact", "--rewrite-records", "--cache", str(cache), "--json")
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout)
    assert counts["records"] == 8 and counts["rewritten"] == 3 and counts["unreadable"] == 1
    assert counts["after"] < size_before
    said = _spcache(tmp_path, "compact", "--rewrite-records", "--cache", str(cache))
    assert said.returncode == 0 and "0 of 8 rewritten to format 2" in said.stdout
    with LMDBStore(cache) as store:
        for key, value in values.items():
            stored = store.get(key)
            if key.endswith("/s0"):  # left as it was, still named by verify
                assert stored == bytes(damaged)
                continue
            assert _format_of(stored) == "2"
            record = store.get_record(key)
            assert _same_tensors(record.tensors, decode_record(value, key=key).tensors)
            unmanaged = {k: v for k, v in record.metadata.items() if k not in MANAGED_METADATA}
            assert unmanaged == {k: v for k, v in before[key].items() if k not in MANAGED_METADATA}
        assert list(store.verify().corrupt) == [f"{fingerprint}/s0"]
        assert store.get_index(fingerprint).sample_ids.tolist() == [f"s{i}" for i in range(8)]


# ---------------------------------------------------------------- other stores


def test_the_service_serves_descriptors_and_a_reader_checks_them(tmp_path: Path) -> None:
    built = build_cache(tmp_path, n=3)
    value = built.values[built.ids[0]]
    digest = value.descriptor.digest
    settings = Settings(cache=built.root, source_roots=[built.sources], token=TOKEN, worker=False)
    with InProcessServer(settings) as server, httpx.Client(base_url=server.url) as client:
        route = f"/v1/caches/{built.fingerprint}/descriptors"
        answer = client.get(f"{route}/{digest}")
        assert answer.status_code == 200 and answer.text == value.descriptor.text
        assert answer.headers["etag"] == f'"{digest}"'
        assert "immutable" in answer.headers["cache-control"]
        parse_descriptor(answer.content, fingerprint=built.fingerprint, digest=digest)
        assert client.get(f"{route}/{'0' * 32}").status_code == 404
        assert client.get(f"{route}/not-a-digest").status_code == 422
        dataset = CachedDataset(server.url, built.fingerprint)
        assert [dataset[i]["octree"].numel() for i in range(3)] == [
            decode_record(built.values[sid]).tensors["octree"].numel() for sid in built.ids
        ]
        dataset.close()
        with HTTPStore(server.url) as store:
            record = store.get_record(f"{built.fingerprint}/{built.ids[1]}")
            assert record.metadata["recipe"] == "spc" and record.metadata["descriptor"] == digest


def test_a_sharded_snapshot_keeps_descriptors_in_its_manifests_and_index(tmp_path: Path) -> None:
    location = tmp_path / "snap.zarr"
    values = {f"{FP}/s{i}": make_record(FP, f"s{i}", i) for i in range(4)}
    values[f"{FP}/s3"] = as_format_1(values[f"{FP}/s3"])
    writer = ShardedSnapshot(location, readonly=False)
    writer.put_many(list(values.items())[:2])
    writer.put_many(list(values.items())[2:])
    params = get_recipe_spec("spc").resolve({"level": 4})
    writer.put_index(DatasetIndex(FP, "spc", 1, params, [f"s{i}" for i in range(4)]))
    writer.close()
    digest = values[f"{FP}/s0"].descriptor.digest
    manifests = sorted((location / FP / "commits").glob("*.json"))
    assert [list(json.loads(m.read_text())["descriptors"]) for m in manifests] == [[digest]] * 2
    assert list(json.loads((location / FP / "index.json").read_text())["descriptors"]) == [digest]
    for path in manifests:  # the index alone now says everything
        path.unlink()
    reader = ShardedSnapshot(location)
    for key, value in values.items():
        got = reader.get_record(key)
        assert (
            got.metadata["recipe"] == "spc" and _format_of(value) == got.metadata["format_version"]
        )
    assert reader.verify().ok
    reader.close()


def test_records_leave_a_ray_actor_with_their_descriptors(tmp_path: Path) -> None:
    """The actor's in-memory store hands records and their descriptors over as plain
    values; the driver's store takes both."""
    buffer = ShardBuffer()
    value = make_record(FP, "a", 1)
    buffer.put_many([(f"{FP}/a", value)])
    assert buffer.get_record(f"{FP}/a").metadata["recipe"] == "spc"
    sent = buffer.pop(f"{FP}/a")
    assert type(sent) is bytes
    texts = buffer.descriptor_texts()
    assert texts == [[FP, value.descriptor.digest, value.descriptor.text]]
    descriptors = [parse_descriptor(t, fingerprint=f, digest=d) for f, d, t in texts]
    with LMDBStore(tmp_path / "cache", readonly=False) as store:
        store.put_many([(f"{FP}/a", sent)], descriptors)
        assert store.get_record(f"{FP}/a").metadata["recipe"] == "spc"


def test_a_descriptor_is_one_small_canonical_document() -> None:
    value = make_record(FP, "a", 1)
    text = value.descriptor.text
    assert json.loads(text) == {
        "format": "spcache.descriptor",
        "format_version": "2",
        "metadata": value.descriptor.metadata,
    }
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    with pytest.raises(CorruptRecord, match="names fingerprint"):
        parse_descriptor(text, fingerprint=OTHER_FP, digest=value.descriptor.digest)
    with pytest.raises(CorruptRecord, match="damaged"):
        parse_descriptor(text + " ", fingerprint=FP, digest=value.descriptor.digest)
    (n,) = struct.unpack("<Q", value[:8])
    assert value.descriptor.digest.encode() in value[8 : 8 + n]


def test_rm_takes_a_fingerprints_descriptors_with_its_records(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with LMDBStore(cache, readonly=False) as store:
        store.put_many([(f"{FP}/a", make_record(FP, "a", 1))])
        store.put_many([(f"{OTHER_FP}/a", make_record(OTHER_FP, "a", 2))])
    removed = _spcache(tmp_path, "rm", FP, "--cache", str(cache))
    assert removed.returncode == 0, removed.stderr
    env = lmdb.open(str(cache / "records"), max_dbs=4, readonly=True, lock=False)
    with env.begin() as txn:
        named = [bytes(k).decode() for k, _ in txn.cursor(db=env.open_db(b"descriptors", txn=txn))]
    env.close()
    assert [key.split("/")[0] for key in named] == [OTHER_FP]
    with LMDBStore(cache) as store:
        assert store.get_record(f"{OTHER_FP}/a").metadata["recipe"] == "spc"
