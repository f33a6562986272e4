"""SIGKILL during ``spcache rm``, ``prune`` and ``compact``.

Each case kills the command in the middle of its work (seen from outside: the tombstone
written but records left, or the compacted copy half written), then checks that the cache
opens, ``spcache verify`` is clean, no surviving fingerprint lost a record, and that
running the same command again finishes the job.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from cache_store.stores.lmdb import COMPACT_DIR, LMDBStore
from tests.helpers.faults import report
from tests.helpers.housekeeping import add_fingerprint, record_counts
from tests.helpers.procs import Proc, run_spcache, start_spcache


def _kill_when(proc: Proc, ready: Callable[[], bool], timeout: float = 120) -> bool:
    """SIGKILL ``proc`` as soon as ``ready()``; True if it was killed (not finished)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            proc.wait(10)
            return False
        if ready():
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            return True
        time.sleep(0.001)
    raise AssertionError("the command never reached the point to kill it at")


def _deleting(cache: Path, fp: str, n: int) -> Callable[[], bool]:
    """Ready once ``fp`` is tombstoned and some (not all) of its ``n`` records are gone."""
    store = LMDBStore(cache)

    def ready() -> bool:
        return store.removed_at(fp) is not None and store.fingerprint_size(fp)[0] < n

    return ready


def _check_after(cache: Path, survivors: dict[str, int]) -> None:
    verify = run_spcache("verify", "--cache", str(cache))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    counts = record_counts(cache)
    for fp, n in survivors.items():
        assert counts.get(fp) == n, f"{fp} lost records: {counts.get(fp)} of {n}"


def test_sigkill_during_rm_then_rm_again_finishes(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    a = add_fingerprint(cache, 3, n=300, nbytes=2048)
    gone = add_fingerprint(cache, 4, n=30000, nbytes=600)
    c = add_fingerprint(cache, 5, n=300, nbytes=2048)
    survivors = {a: 300, c: 300}
    proc = start_spcache("rm", gone, "--cache", str(cache))
    assert _kill_when(proc, _deleting(cache, gone, 30000))
    left = record_counts(cache).get(gone, 0)
    assert 0 < left < 30000, left  # killed in the middle of the deletion
    _check_after(cache, survivors)
    listed = run_spcache("ls", "--cache", str(cache))
    assert "removing" in listed.stdout  # ls says a removal is unfinished
    again = run_spcache("rm", gone, "--cache", str(cache))
    assert again.returncode == 0, again.stderr
    assert gone not in record_counts(cache)
    _check_after(cache, survivors)
    report("rm-kill", {"records": 30000, "left_at_kill": left, "survivors_intact": True})


def test_sigkill_during_prune_then_prune_again_finishes(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    old = add_fingerprint(cache, 3, n=30000, nbytes=600)
    older = add_fingerprint(cache, 4, n=2000, nbytes=600)
    new = add_fingerprint(cache, 5, n=300, nbytes=2048)
    now = time.time()
    usage_dir = cache / "usage"
    for fp, age in ((older, 3000), (old, 2000), (new, 10)):
        for kind in ("read", "written"):
            path = usage_dir / f"{fp}.{kind}"
            path.touch()
            os.utime(path, (now - age, now - age))
    size_new = LMDBStore(cache).fingerprint_size(new)[1]
    proc = start_spcache("prune", "--cache", str(cache), "--max-size", str(size_new))
    assert _kill_when(proc, _deleting(cache, old, 30000))  # older went first, old is under way
    left = record_counts(cache).get(old, 0)
    assert 0 < left < 30000 and older not in record_counts(cache)
    _check_after(cache, {new: 300})
    again = run_spcache("prune", "--cache", str(cache), "--max-size", str(size_new))
    assert again.returncode == 0, again.stderr
    assert set(record_counts(cache)) == {new}
    _check_after(cache, {new: 300})
    report("prune-kill", {"records": 30000, "left_at_kill": left})


def test_sigkill_during_compact_then_compact_again_finishes(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    a = add_fingerprint(cache, 3, n=20000, nbytes=3000)
    gone = add_fingerprint(cache, 4, n=5000, nbytes=3000)
    assert run_spcache("rm", gone, "--cache", str(cache)).returncode == 0
    spare = cache / COMPACT_DIR / "data.mdb"
    proc = start_spcache("compact", "--cache", str(cache))
    killed = _kill_when(proc, lambda: spare.exists() and spare.stat().st_size > 0)
    assert killed
    assert spare.exists()  # a half-written copy is left beside the cache
    partial = spare.stat().st_size
    _check_after(cache, {a: 20000})
    store = LMDBStore(cache, readonly=False)  # writers are not held off by the dead compaction
    store.put_many([])
    store.close()
    before = (cache / "records" / "data.mdb").stat().st_size
    again = run_spcache("compact", "--cache", str(cache))
    assert again.returncode == 0, again.stderr
    assert not (cache / COMPACT_DIR).exists()
    after = (cache / "records" / "data.mdb").stat().st_size
    assert after < before
    _check_after(cache, {a: 20000})
    report("compact-kill", {"partial_copy_bytes": partial, "before": before, "after": after})
