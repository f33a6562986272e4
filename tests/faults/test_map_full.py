"""Case 4: the LMDB map fills while 16 readers read.

The cache starts with a 1 MiB map. A writer process then commits batches well past it
(each full map doubles it and retries the batch) while 16 reader processes read and
decode random stored records as fast as they can. Figures: the map sizes the writer went
through and the readers saw (a read-only mapping starts at 10 MiB and follows the
writer's growth only when the data outgrows it), reads done, read errors (must be 0), and the writer finished.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cache_store.stores.lmdb import LMDBStore
from tests.helpers.faults import Child, env_float, env_int, report

READERS = env_int("SPCACHE_FAULT_MAP_READERS", 16)
READ_SECONDS = env_float("SPCACHE_FAULT_MAP_READ_SECONDS", 12.0)
START_MAP = 1 << 20


@pytest.mark.slow
def test_writes_succeed_after_the_map_grows_and_readers_never_fail(
    tmp_path: Path, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    writer_args = (
        "writer",
        str(cache),
        "--size",
        "400",
        "--record-bytes",
        "4096",
        "--map-size",
        str(START_MAP),
    )
    first = Child(*writer_args, "--batches", "1")
    assert first.wait(120) == 0
    readers = [
        Child("read-loop", str(cache), str(READ_SECONDS), str(seed)) for seed in range(READERS)
    ]
    children.extend(readers)
    for reader in readers:
        reader.expect("ready", timeout=120)
    writer = Child(*writer_args, "--batches", "10")
    children.append(writer)
    assert writer.wait(300) == 0
    written = writer.drain()
    results = [json.loads(reader.expect("{", timeout=READ_SECONDS + 120)) for reader in readers]
    with LMDBStore(cache) as store:
        stats = store.stats()
        verified = store.verify()
    seen_sizes = sorted({size for r in results for size in r["map_sizes"]})
    figures = {
        "readers": READERS,
        "read_seconds": READ_SECONDS,
        "reads": sum(r["reads"] for r in results),
        "read_errors": sum(r["error_count"] for r in results),
        "map_bytes_start": START_MAP,
        "map_bytes_end": stats["lmdb"]["map_size"],
        "map_sizes_seen_by_readers": seen_sizes,
        "batches_committed_while_reading": sum(x.startswith("committed") for x in written),
        "records": stats["records"],
        # the writer stores records and no index: every record checks, none is indexed
        "verify_ok": not (verified.corrupt or verified.missing or verified.damaged),
    }
    report("4 map full under 16 readers", figures)
    assert figures["read_errors"] == 0, [r["errors"] for r in results if r["errors"]]
    assert all(r["reads"] > 0 for r in results)
    assert "finished" in written and stats["records"] == 10 * 400 and figures["verify_ok"]
    assert verified.checked == 10 * 400
    assert stats["lmdb"]["used_bytes"] >= 16 * START_MAP  # the data grew past the map, many times
    assert figures["batches_committed_while_reading"] >= 8  # and readers were there while it did
