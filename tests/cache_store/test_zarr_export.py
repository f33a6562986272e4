"""The exporter: LMDB -> Zarr snapshot, every dtype and shape, bad records, an existing or
foreign destination, one writer at a time, a killed or remote export, the command line,
and the chunk files it writes itself (the bytes zarr writes)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_store.errors import (
    FingerprintLookupError,
    SpcacheError,
)
from cache_store.snapshot.zarr.export import CODECS, export_snapshot
from cache_store.snapshot.zarr.publish import export_lock, sweep_leftovers
from cache_store.keys import compute_fingerprint
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.decode import decode_record
from cache_store.format.encode import encode_record
from cache_store.format.header import read_header
from cache_store.format.index import DatasetIndex
from cache_store.stores.opener import open_store
from cache_store.snapshot.zarr.store import ZarrStore
from cache_store.testing import (
    FP_A,
    FP_B,
    IDS_A,
    sample_content,
)
from tests.conftest import REPO_ROOT as REPO
from tests.helpers.zarr_snapshots import copy_snapshot, export_sample, fill_lmdb
from tests.helpers.synthetic import make_record, record_metadata


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(records, indexes, lmdb cache dir, snapshot dir), exported once for the module."""
    return export_sample(tmp_path_factory.mktemp("exported"))


@pytest.mark.parametrize("codec", CODECS)
def test_all_dtypes_and_shapes_round_trip(tmp_path: Path, codec: str) -> None:
    params = {"level": 3}
    fp = compute_fingerprint("custom", 2, params)
    ids = ["a", "b", "c/d"]
    records = {}
    for i, sid in enumerate(ids):
        tensors = {
            "bf": torch.randn(i + 1, 2).to(torch.bfloat16),
            "flag": torch.tensor([True, False, True][: i + 1]),
            "zero_d": torch.tensor(float(i), dtype=torch.float64),
            "empty": torch.zeros((0, 3), dtype=torch.int64),
            "no_width": torch.zeros((i + 2, 0), dtype=torch.float32),
            "vary": torch.arange(i * 4, dtype=torch.int16).reshape(i * 2, 2),
        }
        meta = record_metadata(fp, sid) | {"recipe": "custom", "recipe_version": "2"}
        records[f"{fp}/{sid}"] = encode_record(tensors, meta)
    cache = fill_lmdb(tmp_path / "cache", records, [DatasetIndex(fp, "custom", 2, params, ids)])
    export_snapshot(cache, fp, tmp_path / "s.zarr", codec=codec, chunk_bytes=16)
    store = ZarrStore(tmp_path / "s.zarr")
    assert zarr.open_group(str(tmp_path / "s.zarr"), mode="r")[f"{fp}/data/vary"].chunks[0] > 1
    for key, value in records.items():
        assert store.get(key) == value
        a, b = decode_record(value), store.get_record(key)
        for name in a.tensors:
            assert b.tensors[name].dtype == a.tensors[name].dtype
            assert torch.equal(b.tensors[name], a.tensors[name])
    assert store.verify().ok
    cache.close()


def test_empty_index_exports(tmp_path: Path) -> None:
    params = {"level": 4, "surface_samples": 100_000}
    cache = fill_lmdb(tmp_path / "cache", {}, [DatasetIndex(FP_A, "spc", 1, params, [])])
    assert export_snapshot(cache, FP_A, tmp_path / "s.zarr").samples == 0
    store = ZarrStore(tmp_path / "s.zarr")
    assert len(store.get_index(FP_A)) == 0 and list(store.keys()) == []
    assert store.verify().ok
    cache.close()


def test_bad_records_fail_the_export_unless_skipped(tmp_path: Path) -> None:
    records, indexes = sample_content()
    bad_key = f"{FP_A}/chairs/a2"
    value = bytearray(records[bad_key])
    value[read_header(bytes(value)).tensors["point_hierarchy"].begin] ^= 0x40
    records[bad_key] = bytes(value)
    cache = fill_lmdb(tmp_path / "cache", records, indexes)
    ghost = DatasetIndex(FP_A, "spc", 1, indexes[0].params, [*IDS_A, "ghost"])
    cache.put_index(ghost)
    with pytest.raises(SpcacheError, match="2 record") as err:
        export_snapshot(cache, FP_A, tmp_path / "s.zarr")
    assert bad_key in str(err.value) and "ghost" in str(err.value)
    assert not (tmp_path / "s.zarr" / FP_A).exists()
    summary = export_snapshot(cache, FP_A, tmp_path / "s.zarr", skip_bad=True)
    assert set(summary.skipped) == {bad_key, f"{FP_A}/ghost"}
    assert "point_hierarchy" in summary.skipped[bad_key]
    store = ZarrStore(tmp_path / "s.zarr")
    assert store.get_index(FP_A).sample_ids.tolist() == [i for i in IDS_A if i != "chairs/a2"]
    assert not store.has(bad_key) and store.verify().ok
    cache.close()


def test_existing_export_needs_overwrite(tmp_path: Path) -> None:
    records, indexes = sample_content()
    cache = fill_lmdb(tmp_path / "cache", records, indexes)
    dest = tmp_path / "s.zarr"
    export_snapshot(cache, FP_A, dest)
    reader = ZarrStore(dest, direct_reads=False)  # no chunk cache: every read hits files
    assert reader.get_index(FP_A).sample_ids.tolist() == IDS_A
    with pytest.raises(SpcacheError, match="already exported"):
        export_snapshot(cache, FP_A, dest)
    newer = make_record(FP_A, "zeta", seed=777)
    cache.put_many([(f"{FP_A}/zeta", newer)])
    old_value = reader.get(f"{FP_A}/zeta")
    export_snapshot(cache, FP_A, dest, overwrite=True)
    assert ZarrStore(dest).get(f"{FP_A}/zeta") == newer
    assert old_value != newer
    assert reader.get(f"{FP_A}/zeta") == newer  # the open reader notices and re-opens
    assert reader.get_record(f"{FP_A}/chairs/a1").metadata["sample_id"] == "chairs/a1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "s.zarr"]  # no leftovers
    cache.close()


def test_one_writer_per_local_snapshot(tmp_path: Path, exported) -> None:
    *_, cache_dir, snap = exported
    dest = copy_snapshot(snap, tmp_path / "s.zarr")
    with export_lock(dest):
        with pytest.raises(SpcacheError, match="another export"):
            export_snapshot(cache_dir, FP_A, dest, overwrite=True)


def test_refuses_to_write_into_a_foreign_directory(tmp_path: Path, exported) -> None:
    *_, cache_dir, _ = exported
    (tmp_path / "x.zarr").mkdir()
    (tmp_path / "x.zarr" / "keep.txt").write_text("mine")
    with pytest.raises(SpcacheError, match="not a Zarr snapshot"):
        export_snapshot(cache_dir, FP_A, tmp_path / "x.zarr")
    zarr.create_group(str(tmp_path / "y.zarr"))
    with pytest.raises(SpcacheError, match="not an spcache snapshot"):
        export_snapshot(cache_dir, FP_A, tmp_path / "y.zarr")
    assert (tmp_path / "x.zarr" / "keep.txt").read_text() == "mine"


_KILLED_EXPORT = textwrap.dedent("""
    import os, signal, sys
    import cache_store.snapshot.zarr.export as export
    import cache_store.snapshot.zarr.write as write
    def dying(real):
        def write(self, *args):
            real(self, *args)
            os.kill(os.getpid(), signal.SIGKILL)  # die with chunks half written
        return write
    # compressed chunks go through FieldWriter, uncompressed (the local default) are
    # appended by RawChunkAppender: die in either
    write.FieldWriter.flush = dying(write.FieldWriter.flush)
    write.RawChunkAppender.add = dying(write.RawChunkAppender.add)
    export.export_snapshot(sys.argv[1], sys.argv[2], sys.argv[3])
""")


def test_killed_local_export_is_never_visible_and_is_swept(tmp_path: Path, exported) -> None:
    records, _, cache_dir, _ = exported
    dest = tmp_path / "s.zarr"
    export_snapshot(cache_dir, FP_B, dest)
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_EXPORT, str(cache_dir), FP_A, str(dest)],
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    leftovers = list(tmp_path.glob(".s.zarr.*.staging"))
    assert len(leftovers) == 1
    (dest / FP_B / "zarr.json.0123.partial").write_bytes(b"half")  # as zarr would leave it
    store = ZarrStore(dest)
    assert store.fingerprints() == [FP_B]
    assert not store.has(f"{FP_A}/zeta")
    with pytest.raises(FingerprintLookupError):
        store.get_index(FP_A)
    export_snapshot(cache_dir, FP_A, dest)  # sweeps, then publishes
    assert not list(tmp_path.glob(".s.zarr.*")) and not list(dest.rglob("*.partial"))
    assert ZarrStore(dest).get(f"{FP_A}/zeta") == records[f"{FP_A}/zeta"]
    assert sweep_leftovers(dest) == 0


def test_url_destination_and_unfinished_remote_export(exported, monkeypatch) -> None:
    records, _, cache_dir, _ = exported
    url = f"memory://spcache-test-{os.getpid()}/snap.zarr"
    export_snapshot(cache_dir, FP_B, url)
    store = open_store(url)
    assert isinstance(store, ZarrStore)
    for sid in ("chairs/a1", "lamps/l1"):
        assert store.get(f"{FP_B}/{sid}") == records[f"{FP_B}/{sid}"]

    import cache_store.snapshot.zarr.write as write

    def broken(self, final):
        raise RuntimeError("connection lost")

    monkeypatch.setattr(write.FieldWriter, "flush", broken)
    with pytest.raises(RuntimeError, match="connection lost"):
        export_snapshot(cache_dir, FP_A, url)
    monkeypatch.undo()
    store = ZarrStore(url)
    assert store.fingerprints() == [FP_B]
    assert store.incomplete_fingerprints() == [FP_A]
    assert not store.has(f"{FP_A}/zeta")
    report = store.verify()
    assert report.corrupt == {f"index:{FP_A}": "export did not finish (group not complete)"}
    export_snapshot(cache_dir, FP_A, url)  # an unfinished group is replaced
    store = ZarrStore(url)
    assert store.fingerprints() == sorted([FP_A, FP_B]) and store.verify().ok
    import fsspec

    fsspec.filesystem("memory").rm(f"/spcache-test-{os.getpid()}", recursive=True)


def test_cli_export_then_verify(tmp_path: Path, exported, capsys) -> None:
    from spcache.cli import main

    records, _, cache_dir, _ = exported
    dest = tmp_path / "cli.zarr"
    args = ["export", FP_A, "--cache", str(cache_dir), "--to", str(dest)]
    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["samples"] == len(IDS_A) and summary["skipped"] == {}
    assert main(args) == 1  # already exported: not exported again
    assert "already exported" in capsys.readouterr().err
    assert main(["export", "0" * 32, "--cache", str(cache_dir), "--to", str(dest)]) == 2
    assert "no dataset index" in capsys.readouterr().err  # no such fingerprint: usage
    assert main(["export", FP_A, "--cache", str(tmp_path / "nope"), "--to", str(dest)]) == 2
    assert ZarrStore(dest).verify().ok


def test_field_names_never_become_paths(tmp_path: Path) -> None:
    params = {"level": 3}
    fp = compute_fingerprint("custom", 1, params)
    meta = record_metadata(fp, "a") | {"recipe": "custom", "recipe_version": "1"}
    value = encode_record({"../../escaped": torch.zeros(3)}, meta)
    cache = fill_lmdb(
        tmp_path / "cache", {f"{fp}/a": value}, [DatasetIndex(fp, "custom", 1, params, ["a"])]
    )
    with pytest.raises(SpcacheError, match="escaped"):
        export_snapshot(cache, fp, tmp_path / "deep" / "s.zarr")
    assert not list(tmp_path.rglob("escaped*"))
    assert not (tmp_path / "deep" / "s.zarr" / fp).exists()
    cache.close()


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_a_record_rewritten_during_the_export_aborts_it(
    tmp_path: Path, exported, codec: str
) -> None:
    records, _, cache_dir, _ = exported
    source = LMDBStore(cache_dir)
    key, real_view = f"{FP_A}/tables/t1", source.read_view
    seen: list[str] = []
    rewritten = make_record(FP_A, "tables/t1", seed=5)

    @contextlib.contextmanager
    def read_view(k: str):  # the first pass checks in place; so does "none"'s second
        seen.append(k)
        if k == key and seen.count(k) > 1:
            yield rewritten
            return
        with real_view(k) as value:
            yield value

    def get(k: str) -> bytes:  # a compressed second pass copies: t1 recomputed by now
        assert k in seen, "the second pass read a record the first did not check"
        return rewritten if k == key else records[k]

    source.read_view, source.get = read_view, get
    with pytest.raises(SpcacheError, match="changed during the export"):
        export_snapshot(source, FP_A, tmp_path / "s.zarr", codec=codec)
    assert not (tmp_path / "s.zarr" / FP_A).exists() and not list(tmp_path.glob(".s.zarr*"))
    source.close()


@pytest.mark.slow
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    width=st.integers(1, 4),
    chunk_bytes=st.integers(1, 600),
)
def test_any_row_counts_and_chunk_sizes_round_trip(
    tmp_path_factory, rows, width, chunk_bytes
) -> None:
    root = tmp_path_factory.mktemp("prop")
    fp = compute_fingerprint("custom", 1, {"w": width})
    ids = [f"s{i}" for i in range(len(rows))]
    records = {}
    for i, (sid, r) in enumerate(zip(ids, rows, strict=True)):
        tensors = {
            "points": torch.arange(r * width, dtype=torch.float32).reshape(r, width) + i,
            "fixed": torch.full((3,), i, dtype=torch.int64),
        }
        meta = record_metadata(fp, sid) | {"recipe": "custom", "recipe_version": "1"}
        records[f"{fp}/{sid}"] = encode_record(tensors, meta)
    cache = fill_lmdb(root / "cache", records, [DatasetIndex(fp, "custom", 1, {"w": width}, ids)])
    export_snapshot(cache, fp, root / "s.zarr", chunk_bytes=chunk_bytes)
    cache.close()
    for direct in (True, False):
        store = ZarrStore(root / "s.zarr", direct_reads=direct)
        assert [store.get(k) for k in records] == list(records.values())


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", ["int32", "uint8", "float64", "int16"])
def test_direct_chunk_writes_are_the_bytes_zarr_writes(
    tmp_path: Path, codec: str, dtype: str
) -> None:
    # the export's own chunk writer must write exactly what zarr's pipeline writes, so
    # any zarr client reads a snapshot; a partial last chunk included (padded with 0)
    from cache_store.snapshot.zarr.write import compressors_for
    from cache_store.snapshot.zarr.chunks import (
        ChunkWriterPool,
        LocalChunkWriter,
        RawChunkAppender,
    )

    data = (np.arange(37 * 3, dtype=np.int64) * 7919 % 251).astype(dtype).reshape(37, 3)
    files = {}
    for how in ("zarr", "direct"):
        group = zarr.create_group(zarr.storage.LocalStore(tmp_path / how))
        arr = group.create_array(
            "a",
            shape=data.shape,
            dtype=data.dtype,
            chunks=(8, 3),
            compressors=compressors_for(data.dtype, 3, codec),
            fill_value=0,
        )
        if how == "zarr":
            arr[:] = data
        elif codec == "none":
            appender = RawChunkAppender(str(tmp_path / how / "a"), arr)
            for lo, hi in ((0, 5), (5, 5), (5, 21), (21, 37)):  # across chunk boundaries
                appender.add(data[lo:hi])
            appender.flush(final=True)
        else:
            pool = ChunkWriterPool(threads=2)
            writer = LocalChunkWriter(str(tmp_path / how / "a"), arr, pool)
            writer.write(0, data[:16])
            writer.write(16, data[16:])
            pool.finish()
            pool.close()
        chunk_dir = tmp_path / how / "a" / "c"
        files[how] = {
            p.relative_to(chunk_dir): p.read_bytes()
            for p in sorted(chunk_dir.rglob("*"))
            if p.is_file()
        }
        assert np.array_equal(zarr.open_array(tmp_path / how / "a", mode="r")[:], data)
    assert len(files["direct"]) == 5
    assert files["direct"] == files["zarr"]


def test_direct_chunk_writer_refuses_a_write_off_a_chunk_boundary(tmp_path: Path) -> None:
    from cache_store.snapshot.zarr.write import compressors_for
    from cache_store.snapshot.zarr.chunks import ChunkWriterPool, LocalChunkWriter

    group = zarr.create_group(zarr.storage.LocalStore(tmp_path))
    arr = group.create_array(
        "a",
        shape=(20,),
        dtype="int32",
        chunks=(8,),
        compressors=compressors_for(np.dtype("int32"), 3, "lz4"),
        fill_value=0,
    )
    pool = ChunkWriterPool(threads=1)
    with pytest.raises(ValueError, match="not a chunk boundary"):
        LocalChunkWriter(str(tmp_path / "a"), arr, pool).write(3, np.zeros(4, np.int32))
    pool.close()


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_a_chunk_write_that_fails_aborts_the_export_and_leaves_nothing(
    tmp_path: Path, exported, monkeypatch, codec: str
) -> None:
    from cache_store.snapshot.zarr import chunks as zarr_chunks

    _, _, cache_dir, _ = exported
    writer, method = (
        (zarr_chunks.LocalChunkWriter, "_write_chunk")
        if codec != "none"
        else (zarr_chunks.RawChunkAppender, "add")
    )
    real, calls = getattr(writer, method), []

    def failing(self, *args):  # the disk fills up after a few chunks
        calls.append(args)
        if len(calls) > 3:
            raise OSError(28, "No space left on device")
        return real(self, *args)

    monkeypatch.setattr(writer, method, failing)
    with pytest.raises(OSError, match="No space left"):
        export_snapshot(cache_dir, FP_A, tmp_path / "s.zarr", codec=codec)
    assert len(calls) > 3
    assert not (tmp_path / "s.zarr" / FP_A).exists() and not list(tmp_path.glob(".s.zarr*"))
