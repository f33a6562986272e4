"""``spcache compact`` on a disk without room for its copy, and the copy a killed one left.

The compacting copy is written beside the cache before the swap, so it needs free space
of about the data the cache holds. Compaction checks that first and says what it needs;
a copy that fails anyway is removed, the cache left as it was. Before issue 34 it ran
out of space half-way, said "cache damaged" (the cache was fine) and left the partial
copy, holding all the free space, again on each retry. A ``records.compact/`` left by a
killed compaction is named by ``spcache ls`` and removed by the next compaction.

The small disk is a real one: a 24 MiB tmpfs mounted in a private mount namespace
(``unshare``), where the commands run as a user runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cache_store.stores.lmdb import COMPACT_DIR, LMDBStore
from tests.helpers.faults import report
from tests.helpers.housekeeping import add_fingerprint
from tests.helpers.procs import run_spcache

REPO = Path(__file__).resolve().parents[2]

# The cache on the small disk: 10 MiB of records, then half of them removed, so a
# compaction has something to give back, and the disk filled up to leave 2 MiB free.
_ON_SMALL_DISK = r"""
set -u
mount -t tmpfs -o size=24m spcache-test "$DISK"
cd "$DISK"
"$PY" - <<'EOF'
from pathlib import Path
from tests.helpers.housekeeping import add_fingerprint
add_fingerprint(Path("cache"), 3, n=40, nbytes=128 << 10)
add_fingerprint(Path("cache"), 4, n=40, nbytes=128 << 10)
EOF
first=$("$PY" -m spcache ls --cache cache --json | "$PY" -c \
  'import json, sys; print(json.load(sys.stdin)[0]["fingerprint"])')
"$PY" -m spcache rm "$first" --cache cache > /dev/null
free=$(df -B1 --output=avail . | tail -1)
fallocate -l $((free - (2 << 20))) ballast
echo "free-before $(df -B1 --output=avail . | tail -1)"
for try in 1 2; do
  "$PY" -m spcache compact --cache cache > "$LOGS/out.txt" 2> "$LOGS/err.txt"
  echo "compact-exit $?"
  echo "compact-stderr $(tr "\n" " " < "$LOGS/err.txt")"
  echo "leftover $(test -e cache/records.compact && echo yes || echo no)"
  echo "free-after $(df -B1 --output=avail . | tail -1)"
done
"$PY" -m spcache verify --cache cache > /dev/null 2>&1
echo "verify-exit $?"
echo "records-size $(stat -c %s cache/records/data.mdb)"
rm ballast
"$PY" -m spcache compact --cache cache --json > "$LOGS/out.txt" 2> "$LOGS/err.txt"
echo "roomy-exit $? $(cat "$LOGS/out.txt")"
"""


def _can_mount() -> bool:
    if shutil.which("unshare") is None or shutil.which("fallocate") is None:
        return False
    probe = ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m t /mnt"]
    return subprocess.run(probe, capture_output=True, timeout=60).returncode == 0


def test_compact_without_room_says_what_it_needs_and_leaves_nothing(tmp_path: Path) -> None:
    if not _can_mount():
        pytest.skip("needs unshare with mount namespaces (to mount a small tmpfs)")
    disk = tmp_path / "disk"
    disk.mkdir()
    env = {
        **os.environ,
        "DISK": str(disk),
        "LOGS": str(tmp_path),  # off the small disk, which is full
        "PY": sys.executable,
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        ["unshare", "-rm", "bash", "-c", textwrap.dedent(_ON_SMALL_DISK)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    lines: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        name, _, value = line.partition(" ")
        lines.setdefault(name, []).append(value)
    roomy = lines["roomy-exit"][0].split(" ", 1)
    figures = {
        "free_bytes_before": int(lines["free-before"][0]),
        "compact_exits": lines["compact-exit"],
        "message": lines["compact-stderr"][0],
        "partial_copy_left": lines["leftover"],
        "free_bytes_after": [int(x) for x in lines["free-after"]],
        "verify_exit": int(lines["verify-exit"][0]),
        "with_room": roomy,
    }
    report("34.8 compact without room", figures)
    assert lines["compact-exit"] == ["1", "1"], done.stdout
    message = lines["compact-stderr"][0]
    assert "spcache compact: no space left on" in message and "needs" in message, message
    assert "damaged" not in message
    assert lines["leftover"] == ["no", "no"]
    assert figures["free_bytes_after"] == [figures["free_bytes_before"]] * 2
    assert figures["verify_exit"] == 0
    assert roomy[0] == "0" and json.loads(roomy[1])["after"] < int(lines["records-size"][0])


def test_a_copy_left_by_a_killed_compaction_is_shown_by_ls_and_removed(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    add_fingerprint(cache, 3, n=20, nbytes=4096)
    leftover = cache / COMPACT_DIR
    leftover.mkdir()
    (leftover / "data.mdb").write_bytes(os.urandom(300 << 10))  # a copy cut short
    listed = run_spcache("ls", "--cache", str(cache), cwd=tmp_path)
    compacted = run_spcache("compact", "--cache", str(cache), cwd=tmp_path)
    after = run_spcache("ls", "--cache", str(cache), cwd=tmp_path)
    figures = {
        "ls_says": [line for line in listed.stderr.splitlines() if COMPACT_DIR in line],
        "compact_exit": compacted.returncode,
        "left_after": leftover.exists(),
    }
    report("34.8 leftover compaction copy", figures)
    assert listed.returncode == 0
    assert figures["ls_says"] and "spcache compact" in figures["ls_says"][0]
    assert str(300 << 10) in figures["ls_says"][0]
    assert compacted.returncode == 0 and not leftover.exists()
    assert COMPACT_DIR not in after.stderr
    with LMDBStore(cache) as store:
        assert store.verify().ok
