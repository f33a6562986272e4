"""Which of a run's items it loads, and when, while other runs compute into the same cache.

:func:`claimed` hands the engine's pipeline the admitted items a batch at a time, each
batch claimed first (:class:`cache_store.jobs.claims.RunClaims`): an item this run holds
is loaded and computed here; one another live run holds is set aside. Once the run's own
items are handed out, the set-aside ones are looked at again until none is left: an item
whose record has since been written is handed out (the ledger skips it by its stat
signature, or the loader by its hash: skipped, not computed again), one whose claim was
let go (that run ended without computing it) or whose run died is claimed and handed
out, and the others are waited for (:data:`WAITING`, the pipeline's cue to sleep a
little while its loads in flight go on).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cache_store.jobs.claims import RunClaims
from cache_store.stores.base import Store
from workers.run_ledger import RunLedger, WorkItem

__all__ = ["WAITING", "claimed", "claims_beside"]

#: Yielded by :func:`claimed` while the items left are other runs' to compute.
WAITING = None


def claims_beside(store: Store, fingerprint: str) -> RunClaims | None:
    """This run's claims in a local cache directory; None for other stores (a snapshot,
    a URL: a sharded snapshot's writers divide their work by their shards)."""
    from cache_store.stores.lmdb import LMDBStore

    if isinstance(store, LMDBStore) and not store.readonly:
        return RunClaims(store.path, fingerprint)
    return None


def claimed(
    work: list[WorkItem], claims: RunClaims | None, ledger: RunLedger, batch: int
) -> Iterator[WorkItem | Any]:
    """The items of ``work`` this run should load, in order (see the module doc)."""
    if claims is None:
        yield from work
        return
    batch = max(1, batch)
    deferred: list[WorkItem] = []
    for start in range(0, len(work), batch):
        chunk = work[start : start + batch]
        held = claims.claim([item.sample_id for item in chunk])
        for item in chunk:
            if item.sample_id in held:
                yield item
            else:
                deferred.append(item)
    while deferred:
        before = {item.sample_id: item.stored_hash for item in deferred}
        left = ledger.skip_unchanged(deferred)  # records written since: skipped by stat
        written = [item for item in left if item.stored_hash != before[item.sample_id]]
        unwritten = [item for item in left if item.stored_hash == before[item.sample_id]]
        yield from written  # a record that is newer than admission: the loader decides
        held = claims.claim([item.sample_id for item in unwritten]) if unwritten else set()
        deferred = []
        for item in unwritten:
            if item.sample_id in held:
                yield item
            else:
                deferred.append(item)
        if deferred:
            yield WAITING
