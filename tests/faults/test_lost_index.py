"""A flipped LMDB meta page loses the index written last, and ``spcache verify`` says so.

LMDB keeps two meta pages and opens the one with the higher transaction id; nothing
checks them. A flip that lowers the newest one's id rolls the store back one commit:
after ``spcache precompute``, the commit that wrote the index. Before issue 34 the
records stayed, the index was gone (``len()`` 0, readers saw no dataset) and ``verify``
said "cache verifies clean", exit 0. Now verify compares each fingerprint's records with
its index and names a fingerprint with records and no index (exit 1), unless a live
worker holds the cache (a run that writes the index at its end may be under way).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from cache_store.jobs.claims import RunClaims
from cache_store.jobs.owner_lock import WorkerLock
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.faults import report
from tests.helpers.procs import run_spcache

SPC = ["--recipe", "spc", "--param", "level=3"]
CPU = ["--device", "cpu", "--backend", "torch", "--loaders", "0"]
PAGE = 4096
MDB_MAGIC = 0xBEEFC0DE
#: in a 64-bit LMDB meta page: the page header (16 bytes), then magic, version, address,
#: map size, two database records (48 bytes each), last page, and then the txn id
MAGIC_AT, TXNID_AT = 16, 16 + 4 + 4 + 8 + 8 + 2 * 48 + 8


def _roll_back_one_commit(data: Path) -> tuple[int, int]:
    """Zero the newest meta page's transaction id (a flip LMDB cannot see); returns
    the (newest, older) ids as they were."""
    raw = bytearray(data.read_bytes()[: 2 * PAGE])
    txnids = []
    for page in (0, 1):
        (magic,) = struct.unpack_from("<I", raw, page * PAGE + MAGIC_AT)
        assert magic == MDB_MAGIC, f"meta page {page} not where expected"
        txnids.append(struct.unpack_from("<Q", raw, page * PAGE + TXNID_AT)[0])
    newest = 0 if txnids[0] > txnids[1] else 1
    with open(data, "r+b") as fh:
        fh.seek(newest * PAGE + TXNID_AT)
        fh.write(struct.pack("<Q", 0))
    return txnids[newest], txnids[1 - newest]


def test_verify_names_a_fingerprint_whose_index_a_meta_flip_lost(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    cwd = tmp_path / "work"
    (cwd / "shapes").mkdir(parents=True)
    for mesh in corpus_meshes[:3]:
        shutil.copyfile(mesh, cwd / "shapes" / mesh.name)
    run = run_spcache("precompute", "shapes", *SPC, "--cache", "hot", *CPU, cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    before = run_spcache("verify", "--cache", "hot", cwd=cwd)
    assert before.returncode == 0, before.stdout
    with LMDBStore(cwd / "hot") as store:
        (fp,) = store.fingerprints()

    newest, older = _roll_back_one_commit(cwd / "hot" / "records" / "data.mdb")
    with LMDBStore(cwd / "hot") as store:  # the fault as the issue saw it
        assert store.fingerprints() == [], "the rollback did not take the index away"
        records = len(list(store.keys(fp + "/")))
    assert records == 3

    verified = run_spcache("verify", "--cache", "hot", cwd=cwd)
    as_json = run_spcache("verify", "--cache", "hot", "--json", cwd=tmp_path / "work")
    data = json.loads(as_json.stdout)
    with WorkerLock(cwd / "hot"):  # a live worker: a run may be about to write the index
        live = run_spcache("verify", "--cache", "hot", cwd=cwd)
    run_claims = RunClaims(cwd / "hot", fp)  # a live precompute run: it claims samples
    assert run_claims.claim(["a-sample"]) == {"a-sample"}
    try:
        running = run_spcache("verify", "--cache", "hot", cwd=cwd)
    finally:
        run_claims.close()
    rerun = run_spcache("precompute", "shapes", *SPC, "--cache", "hot", *CPU, cwd=cwd)
    after = run_spcache("verify", "--cache", "hot", cwd=cwd)
    report(
        "34.10e a flipped meta page loses the last index",
        {
            "txnids_newest_older": [newest, older],
            "records_left": records,
            "verify_exit": verified.returncode,
            "verify_said": verified.stdout.strip().splitlines(),
            "verify_exit_with_live_worker": live.returncode,
            "verify_exit_with_live_run": running.returncode,
            "rerun_exit": rerun.returncode,
            "verify_exit_after_rerun": after.returncode,
        },
    )
    assert verified.returncode == 1, verified.stdout
    assert f"unindexed {fp}: 3 record(s)" in verified.stdout
    assert "1 problem(s)" in verified.stdout
    assert as_json.returncode == 1 and data["unindexed"] == {fp: 3} and not data["ok"]
    # a live worker holding the cache: said, not counted
    assert live.returncode == 0, live.stdout
    assert f"note: {fp}: 3 record(s) and no index yet" in live.stdout
    assert running.returncode == 0, running.stdout  # a live run's claims: the same
    assert f"no index yet, while run pid {os.getpid()} on" in running.stdout
    # what verify advises repairs it: the same run writes the index again
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert after.returncode == 0, after.stdout
    with LMDBStore(cwd / "hot") as store:
        assert len(store.get_index(fp).sample_ids) == 3
