"""Writers' claims: a part being written is never an orphan.

A writer puts ``<fingerprint>/claims/<part>.json`` before it writes ``parts/<part>.bin``
and deletes it once the part's manifest is committed (or the write failed). While the
part is written, a thread rewrites the claim every :data:`CLAIM_REFRESH_S`, so its
last-modified time (a file's mtime, an S3 object's ``LastModified``: no lock or
process id needed, any storage fsspec reaches works) says the writer is alive. The
orphan sweep (:func:`cache_store.snapshot.sharded.maintenance.orphan_parts`) leaves a
part, or a temporary file of it, alone while its claim is younger than
:data:`CLAIM_FRESH_S`, whatever ``--orphan-age`` says; a claim older than that is a dead
writer's and is swept with what it claimed.

The sweep lists commits, then parts, then claims, and looks for a part's manifest once
more right before deleting it: a claim is written before its part and deleted only
after the part's manifest, so a part listed without a fresh claim listed after it is
either committed meanwhile (the second look finds the manifest) or not being written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from cache_store.snapshot.sharded import storage

__all__ = [
    "CLAIMS",
    "CLAIM_FRESH_S",
    "CLAIM_REFRESH_S",
    "claimed",
    "live_claims",
    "part_of",
]

#: the folder, beside ``parts/`` and ``commits/``, that holds the claims
CLAIMS = "claims"
#: a claim rewritten within this many seconds is a live writer's
CLAIM_FRESH_S = 600.0
#: how often a writer rewrites its claim while it writes the part
CLAIM_REFRESH_S = 30.0

log = logging.getLogger(__name__)


def _document(part: str, writer: str) -> bytes:
    return json.dumps(
        {
            "kind": "spcache.shard_claim",
            "part": part,
            "writer": writer,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "refreshed_at": time.time(),
        },
        sort_keys=True,
    ).encode()


@contextlib.contextmanager
def claimed(fs: Any, fingerprint_dir: str, part: str, writer: str) -> Iterator[None]:
    """Hold the claim of ``part`` (under ``fingerprint_dir``) for the ``with`` block,
    rewriting it every :data:`CLAIM_REFRESH_S`; deleted at the end however it ends."""
    path = f"{fingerprint_dir}/{CLAIMS}/{part}.json"
    storage.write(fs, path, _document(part, writer))
    done = threading.Event()

    def refresh() -> None:
        while not done.wait(CLAIM_REFRESH_S):
            try:
                storage.write(fs, path, _document(part, writer))
            except Exception as exc:  # noqa: BLE001 - the part's write goes on; the claim ages
                log.warning("claim %s could not be refreshed: %s", path, exc)

    thread = threading.Thread(target=refresh, name=f"claim-{part}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)


def live_claims(fs: Any, fingerprint_dir: str, now: float) -> tuple[set[str], list[dict[str, Any]]]:
    """The parts claimed by live writers (claims younger than :data:`CLAIM_FRESH_S`),
    and the stale claims (dead writers'; their listing entries), from a fresh listing.
    A claim without a time is taken as live."""
    try:
        listing = fs.ls(f"{fingerprint_dir}/{CLAIMS}", detail=True, refresh=True)
    except FileNotFoundError:
        return set(), []
    live: set[str] = set()
    stale: list[dict[str, Any]] = []
    for info in listing:
        name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
        if info.get("type") == "directory" or not name.endswith(".json"):
            continue
        modified = storage.mtime(info)
        if modified is None or now - modified < CLAIM_FRESH_S:
            live.add(name[: -len(".json")])
        else:
            stale.append(info)
    return live, stale


def part_of(name: str) -> str:
    """The part a file of ``parts/`` or ``commits/`` belongs to: ``<part>.bin``,
    ``<part>.json`` and their temporary files ``.tmp-<part>.bin-<random>``."""
    if name.startswith(".tmp-"):
        name = name[len(".tmp-") :].rsplit("-", 1)[0]
    for suffix in (".bin", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name
