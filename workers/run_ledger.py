"""The bookkeeping of one precompute run, shared by the local and the Ray engine.

Both engines admit the same items, report every item the same way and write the same
dataset index at the end; only how the records get computed differs. :class:`RunLedger`
is that shared part, held (not inherited) by :class:`workers.engine.LocalRun` and by the
Ray driver's run:

- :meth:`RunLedger.admit`: valid, unique sample ids become :class:`WorkItem` s with their
  record keys and the source hash of each wanted variant's record already stored; the
  rest fail at once; an item whose stored records' stat signatures are its file's now
  is skipped here, in the driver, with nothing opened (the re-run fast path; the others
  are decided by their hash in a loader);
- :meth:`RunLedger.finish`: one record's :class:`ItemResult` goes into the
  :class:`Summary`, the progress bar and the caller's ``on_result``;
- :meth:`RunLedger.write_index`: the fingerprint's index is the ids it held before, in
  their order, followed by this run's newly stored ids, in input order, with the number
  of variants each sample has stored (variants 0 .. n-1, all of them);
- the failure log (:mod:`cache_store.jobs.failures`), when the store has one: a failure on a
  known source hash is remembered, a repeat on the same source with the same reason is
  reported as "failed again, same reason", and a sample computed at last is forgotten.

A run asking for ``variants=K`` computes K records per sample (:mod:`cache_store.keys`:
``<fp>/<id>`` for variant 0, ``<fp>/<id>#v<k>`` for the others): everything here counts
records, so "6 done, 12 skipped" are records, and a failure is one record's (its id is
the record id, ``a#v2``, in the summary and the failure log).

Why one module: admission, the per-record report and the index written from what was
stored are one ledger, kept in step by both engines; splitting it would spread the
record-id rule (a sample's variants) over several modules.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cache_store.errors import (
    CorruptRecord,
    FingerprintLookupError,
    FingerprintRemoved,
    InvalidSampleId,
    StoreFull,
)
from cache_store.jobs.failures import Failure, FailureLog
from cache_store.keys import (
    record_id,
    record_key,
    validate_fingerprint,
    validate_sample_id,
    variant_counts,
)
from cache_store.sources.freshness import (
    stored_metadata_many,
    stored_source_hash,
    unchanged_by_stat,
)
from cache_store.format.index import DatasetIndex, append_ids
from cache_store.stores.base import Store
from cache_store.sources.discover import id_clash_reason
from workers.progress import open_bar

__all__ = [
    "REPEATS",
    "SampleError",
    "ItemResult",
    "Summary",
    "WorkItem",
    "RunLedger",
    "run_all",
    "stored_variant_counts",
]

logger = logging.getLogger(__name__)


#: Records whose metadata one admission step asks the store for at once.
_ADMIT_BATCH = 4096

#: ``repeat`` values: a first failure, the same failure again, or not retried.
REPEATS = ("", "again", "skipped")


@dataclass(frozen=True)
class SampleError:
    """Why one sample has no record. ``repeat`` is ``""`` (first failure on this source),
    ``"again"`` (failed before on the same source, for the same reason) or ``"skipped"``
    (failed before on the same source; not retried, ``skip_failed``)."""

    id: str
    path: str
    reason: str
    repeat: str = ""

    def as_json(self) -> dict[str, str]:
        return {"id": self.id, "path": self.path, "reason": self.reason, "repeat": self.repeat}


@dataclass(frozen=True)
class ItemResult:
    """What happened to one record of an item (variant ``variant`` of the sample);
    handed to ``on_result``.

    ``status`` is ``"done"`` (record committed), ``"skipped"`` (an up-to-date record was
    already stored) or ``"failed"`` (``reason`` says why; ``repeat`` as in
    :class:`SampleError`). ``source_hash`` is the content hash the item was computed or
    failed on, when it was read. ``transient``: the failure is the store's (a write that
    failed, a full disk), not the sample's; trying it again later may work.
    """

    sample_id: str
    path: str
    status: str
    key: str = ""
    reason: str = ""
    source_hash: str = ""
    repeat: str = ""
    transient: bool = False
    variant: int = 0

    @property
    def record_id(self) -> str:
        """The record's id: the sample id, with ``#v<k>`` for a variant k >= 1."""
        return record_id(self.sample_id, self.variant)


@dataclass
class Summary:
    """The outcome of :meth:`workers.engine.Engine.run`. Timings are seconds.

    ``load_s`` sums the loaders' time (over all pool processes), ``compute_s`` is device
    time in the calling thread, ``write_s`` the writer thread's encode-and-commit time,
    ``wall_s`` the whole run.
    """

    fingerprint: str
    recipe: str
    recipe_version: int
    params: dict[str, Any]
    device: str = ""
    backend: str = ""
    done: int = 0
    skipped: int = 0
    failed: int = 0
    errors: list[SampleError] = field(default_factory=list)
    load_s: float = 0.0
    compute_s: float = 0.0
    write_s: float = 0.0
    wall_s: float = 0.0
    oom_backoffs: int = 0
    #: skipped samples whose stored record was computed by other recipe code than the
    #: installed one (same fingerprint: the recipe changed without a version bump)
    skipped_other_code: int = 0
    #: files the directory walks passed over, by unsupported type (extension -> count;
    #: set by :func:`workers.precompute.run_precompute`, which discovered the sources)
    left_out: dict[str, int] = field(default_factory=dict)
    #: records asked for per sample (done, skipped and failed count records)
    variants: int = 1

    @property
    def total(self) -> int:
        return self.done + self.skipped + self.failed

    def repeats(self, kind: str) -> list[str]:
        """Ids of the failures whose ``repeat`` is ``kind`` (``"again"``, ``"skipped"``)."""
        return [e.id for e in self.errors if e.repeat == kind]

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "recipe": self.recipe,
            "recipe_version": self.recipe_version,
            "params": self.params,
            "device": self.device,
            "backend": self.backend,
            "done": self.done,
            "skipped": self.skipped,
            "failed": self.failed,
            "errors": [e.as_json() for e in self.errors],
            "failed_again": self.repeats("again"),
            "skipped_failed": self.repeats("skipped"),
            "timings": {
                "load_s": round(self.load_s, 4),
                "compute_s": round(self.compute_s, 4),
                "write_s": round(self.write_s, 4),
                "wall_s": round(self.wall_s, 4),
            },
            "oom_backoffs": self.oom_backoffs,
            "skipped_other_code": self.skipped_other_code,
            "left_out": dict(self.left_out),
            "variants": self.variants,
        }


@dataclass
class WorkItem:
    """One admitted item: its record key, the source hash of its stored record, and the
    source hash of a remembered failure when the run skips those (``skip_failed``).

    A run asking for ``variants=K`` wants K records of the sample: ``key`` and
    ``stored_hash`` are variant 0's, ``more`` the stored source hash of each later one
    (variants 1 .. K-1; None where none is stored).
    """

    sample_id: str
    path: str
    key: str = ""
    stored_hash: str | None = None
    failed_hash: str | None = None
    more: tuple[str | None, ...] = ()

    @property
    def variants(self) -> int:
        """The records wanted of this sample (variants 0 .. variants - 1)."""
        return 1 + len(self.more)

    @property
    def stored_hashes(self) -> tuple[str | None, ...]:
        """The stored source hash of every wanted variant, variant 0 first."""
        return (self.stored_hash, *self.more)


class RunLedger:
    """Admission, per-item reporting and the index of one run (see the module doc).

    Args:
        store: the store the run writes into (read here for stored hashes and the index).
        summary: the summary to count into (a :class:`Summary` or a subclass); its
            fingerprint, recipe, version and params say what the run computes.
        on_result: the caller's callback, called for every item.
        progress: show a tqdm bar on stderr (opened by :meth:`open_progress`).
        failures: the failure log to consult and update; None remembers nothing.
        skip_failed: admitted items carry their remembered failure's source hash, so the
            engine can skip an unchanged source that failed before.
    """

    def __init__(
        self,
        store: Store,
        summary: Summary,
        on_result: Callable[[ItemResult], None] | None,
        *,
        progress: bool = False,
        failures: FailureLog | None = None,
        skip_failed: bool = False,
        requested_at: float | None = None,
        code_digest: str | None = None,
    ) -> None:
        self.store = store
        # the installed recipe's code digest: a skipped record made by other code is
        # counted and reported (report_other_code); None checks nothing
        self.code_digest = code_digest
        # sample id -> code digest of its stored record, where it differs from code_digest
        self.other_code: dict[str, str] = {}
        # when the work was asked for: a removal of the fingerprint (spcache rm) after it
        # keeps refusing this run's writes; one before it is lifted (see admit)
        self.requested_at = time.time() if requested_at is None else requested_at
        self.summary = summary
        self.on_result = on_result
        self.progress = progress
        self.failures = failures
        self.skip_failed = skip_failed
        # record id -> its remembered failure
        self.known_failures: dict[str, Failure] = {}
        # record ids (the sample id, "<id>#v<k>" for a later variant) stored now
        self.stored_ids: set[str] = set()
        self.admitted: list[str] = []  # valid, unique sample ids in input order
        self.variants = 1  # records wanted per sample (admit)
        self.bar: Any = None
        self.index_unwritten: StoreFull | None = None
        # record id -> source hash of each record in a commit not yet reported: an
        # interrupt between the commit and its report must not leave a stored record
        # out of the index (see _write_index)
        self.committing: dict[str, str] = {}
        # whether this run stored any record (skipped ones are not stored)
        self.wrote = False

    def key(self, sample_id: str, variant: int = 0) -> str:
        return record_key(self.summary.fingerprint, sample_id, variant)

    def admit(self, items: list[tuple[str, Any]], variants: int = 1) -> list[WorkItem]:
        """Valid, unique items with their keys and stored source hashes (of each of the
        ``variants`` records wanted per sample); the rest fail now (each of their
        records)."""
        self.variants = self.summary.variants = variants
        revive = getattr(self.store, "revive", None)  # a removed fingerprint asked for again
        if callable(revive) and not self.store.readonly:
            revive(self.summary.fingerprint, self.requested_at)
        seen: dict[str, str] = {}
        work: list[WorkItem] = []
        fingerprint = validate_fingerprint(self.summary.fingerprint)
        for sample_id, path in items:
            path = str(path)
            try:
                sample_id = validate_sample_id(sample_id)
            except InvalidSampleId as exc:
                self.fail_all(str(sample_id), path, str(exc), variants)
                continue
            if sample_id in seen:
                self.fail_all(
                    sample_id, path, id_clash_reason(sample_id, seen[sample_id]), variants
                )
                continue
            seen[sample_id] = path
            self.admitted.append(sample_id)
            key = f"{fingerprint}/{sample_id}"  # both parts checked
            work.append(WorkItem(sample_id, path, key, None, None, (None,) * (variants - 1)))
        work = self.skip_unchanged(work)
        if self.failures is not None and work:
            try:
                self.known_failures = self.failures.get_many(
                    self.summary.fingerprint,
                    [record_id(item.sample_id, v) for item in work for v in range(variants)],
                )
            except Exception:  # the log is advice: without it, retry everything
                logger.exception(
                    "cannot read the failure log %s; every sample is tried",
                    getattr(self.failures, "path", ""),
                )
            if self.skip_failed:
                for item in work:
                    known = self.known_failures.get(item.sample_id)
                    item.failed_hash = known.source_hash if known is not None else None
        return work

    def fail_all(self, sample_id: str, path: str, reason: str, variants: int, **more: Any) -> None:
        """Fail each of the ``variants`` records of a sample for one reason of the sample's
        (its id, its source)."""
        for variant in range(variants):
            self.finish(
                ItemResult(sample_id, path, "failed", reason=reason, variant=variant, **more)
            )

    def finish_all(self, item: WorkItem, status: str, **more: Any) -> None:
        """Report each wanted record of ``item`` with one status (a failure or skip of
        the whole sample)."""
        prefix = f"{self.summary.fingerprint}/"  # the id was validated when admitted
        for variant in range(item.variants):
            key = prefix + record_id(item.sample_id, variant) if status == "skipped" else ""
            self.finish(
                ItemResult(item.sample_id, item.path, status, key=key, variant=variant, **more)
            )

    def skip_failures(self, item: WorkItem, source_hash: str) -> None:
        """Report an item not retried: its source is unchanged since it failed
        (``skip_failed``); each of its records, with the reason remembered for it (or
        for variant 0, the sample's)."""
        first = self.known_failures[item.sample_id]
        for variant in range(item.variants):
            known = self.known_failures.get(record_id(item.sample_id, variant), first)
            self.finish(
                ItemResult(
                    item.sample_id,
                    item.path,
                    "failed",
                    reason=known.reason,
                    source_hash=source_hash,
                    repeat="skipped",
                    variant=variant,
                )
            )

    def add_committed(self, sample_ids: Iterable[str]) -> None:
        """Record ids whose records are known to be committed, reported or not (the local
        engine's writer keeps them): an interrupt between a commit and its report must
        not leave a stored record out of the index. (The Ray driver, whose commit an
        interrupt can cut short, uses ``committing`` and checks the store instead.)"""
        committed = set(sample_ids)
        self.stored_ids.update(committed)
        self.wrote = self.wrote or bool(committed)

    def skip_unchanged(self, work: list[WorkItem]) -> list[WorkItem]:
        """Each item with its stored records' source hashes (every wanted variant's); the
        items whose records' stat signatures are the file's now (:func:`unchanged_by_stat`:
        nothing opened) are finished here as skipped, never shipped to a loader. Notes
        records made by other recipe code."""
        if getattr(self.store, "source_hash_of", None) is not None:
            for item in work:  # a store that knows its source hashes (sharded manifests)
                hashes = [
                    self.stored_source_hash(self.key(item.sample_id, v))
                    for v in range(item.variants)
                ]
                item.stored_hash, item.more = hashes[0], tuple(hashes[1:])
            return work
        left = []
        for start in range(0, len(work), _ADMIT_BATCH):
            batch = work[start : start + _ADMIT_BATCH]
            rids = [[record_id(it.sample_id, v) for v in range(it.variants)] for it in batch]
            keys = [f"{self.summary.fingerprint}/{rid}" for group in rids for rid in group]
            found = iter(stored_metadata_many(self.store, keys))
            for item, group in zip(batch, rids, strict=True):
                metas = [next(found) for _ in group]
                for rid, meta in zip(group, metas, strict=True):
                    digest = None if meta is None else meta.get("code_digest")
                    if self.code_digest is not None and digest and digest != self.code_digest:
                        self.other_code[rid] = digest
                hashes = [None if meta is None else meta.get("source_hash") for meta in metas]
                item.stored_hash, item.more = hashes[0], tuple(hashes[1:])
                if all(
                    meta is not None
                    and meta.get("source_hash") is not None
                    and unchanged_by_stat(meta, item.path)
                    for meta in metas
                ):
                    self.finish_all(item, "skipped", source_hash=item.stored_hash)
                else:
                    left.append(item)
        return left

    def report_other_code(self) -> None:
        """One WARNING when skipped records were computed by other recipe code than the
        installed one (the recipe's code changed, its version did not)."""
        count = self.summary.skipped_other_code
        if count:
            logger.warning(
                "recipe %r, fingerprint %s: %d skipped record(s) were computed by other "
                "code than the installed recipe's (code digest %s); they were kept: bump "
                "the recipe's version to recompute them",
                self.summary.recipe,
                self.summary.fingerprint,
                count,
                self.code_digest,
            )

    def stored_source_hash(self, key: str) -> str | None:
        """The ``source_hash`` of the record stored under ``key``; None when there is no
        readable record."""
        return stored_source_hash(self.store, key)

    def finish(self, result: ItemResult) -> None:
        """Count one item's result, advance the bar and hand it to ``on_result``."""
        summary = self.summary
        rid = result.record_id
        if result.status == "done":
            summary.done += 1
            self.stored_ids.add(rid)
            self.wrote = True
            if rid in self.known_failures and self.failures is not None:
                try:
                    self.failures.forget(summary.fingerprint, [rid])
                except Exception:  # the log is advice; the record is stored
                    logger.exception("cannot forget the old failure of %s", rid)
        elif result.status == "skipped":
            summary.skipped += 1
            if rid in self.other_code:
                summary.skipped_other_code += 1
            self.stored_ids.add(rid)
        else:
            result = self._remember(result)
            summary.failed += 1
            summary.errors.append(SampleError(rid, result.path, result.reason, result.repeat))
            logger.warning("%s (%s): %s", rid, result.path, result.reason)
        if self.bar is not None:
            self.bar.update(1)
        if self.on_result is not None:
            self.on_result(result)

    def _remember(self, result: ItemResult) -> ItemResult:
        """Record a failure in the log; say so in its reason when it is a repeat. A
        transient one (the store's, not the source's) is not recorded: ``skip_failed``
        must never skip a sample because the disk was full once. A failure before the
        source was hashed (an empty or missing file, a duplicate id) is recorded with an
        empty hash, which no source matches: listed, never skipped."""
        if result.repeat == "skipped":
            return dataclasses.replace(
                result,
                reason="not retried: failed before on this "
                "unchanged source (skip_failed): " + result.reason,
            )
        rid = result.record_id
        known = self.known_failures.get(rid)
        if (
            known is not None
            and known.source_hash == (result.source_hash or "")
            and known.reason == result.reason
        ):
            result = dataclasses.replace(
                result, repeat="again", reason="failed again, same reason: " + result.reason
            )
        if self.failures is not None and not result.transient:
            raw = known.reason if result.repeat == "again" and known is not None else result.reason
            try:
                self.failures.record(
                    self.summary.fingerprint, rid, result.path, result.source_hash or "", raw
                )
            except Exception:  # the log is advice; the failure is still reported
                logger.exception("cannot remember the failure of %s", rid)
        return result

    def open_progress(self, total: int) -> None:
        if self.progress:
            self.bar = open_bar(total, initial=self.summary.total)

    def close_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def write_index(self) -> None:
        """The index: ids already indexed, in order, then this run's stored ids in input order.

        Called from the drivers' ``finally``: a full store (:class:`StoreFull`) is logged
        and kept in ``index_unwritten`` rather than raised, so it never replaces the error
        that ended a run; a driver whose run ended well raises it then.
        """
        try:
            self._write_index()
        except FingerprintRemoved as exc:  # removed while this run was under way: stay removed
            logger.info("the index of %s was not written: %s", self.summary.fingerprint, exc)
        except StoreFull as exc:
            logger.error(
                "the index of %s was not written (%s): its records stored in this "
                "run are found again by the next run over the same sources",
                self.summary.fingerprint,
                exc,
            )
            self.index_unwritten = exc

    def _write_index(self) -> None:
        store, summary = self.store, self.summary
        fingerprint = summary.fingerprint
        for rid, source_hash in self.committing.items():  # an interrupted commit
            if (
                rid not in self.stored_ids
                and self.stored_source_hash(f"{fingerprint}/{rid}") == source_hash
            ):
                self.stored_ids.add(rid)
                self.wrote = True
        self.committing = {}
        ran = [sid for sid in self.admitted if sid in self.stored_ids]
        try:
            index = store.get_index(fingerprint)
            old = index.sample_ids.tolist()
            old_counts = dict(zip(old, index.variant_counts().tolist(), strict=True))
        except FingerprintLookupError:
            old, old_counts = [], {}
        except CorruptRecord as exc:
            # Rebuild from what is stored: this run's ids first, then the others sorted.
            logger.warning("index of %s is unreadable (%s); rebuilding it", fingerprint, exc)
            old_counts = stored_variant_counts(store, fingerprint)
            old = ran + sorted(set(old_counts) - set(ran))
        counts = dict(old_counts)
        for sid in ran:
            n = 1
            while n < self.variants and record_id(sid, n) in self.stored_ids:
                n += 1
            counts[sid] = max(n, old_counts.get(sid, 1))
        ids = append_ids(old, ran)
        if not self.wrote and len(ids) == len(old) and counts == old_counts:
            # this run stored nothing and the index lists all it found: nothing to write
            # (a re-run over unchanged sources rewrote a million ids). A run that stored
            # records writes the index even when it lists them all: a sharded snapshot's
            # lists every committed record before its index.json is written.
            return
        store.put_index(
            DatasetIndex(
                fingerprint,
                summary.recipe,
                summary.recipe_version,
                dict(summary.params),
                np.array(ids, dtype=str),
                variants=np.array([counts.get(sid, 1) for sid in ids], dtype=np.uint16),
            )
        )


def stored_variant_counts(store: Store, fingerprint: str) -> dict[str, int]:
    """Sample id -> how many variants (0 .. n-1, all present) ``store`` holds records
    of, for every sample of ``fingerprint`` whose variant 0 is stored (from its keys)."""
    prefix = fingerprint + "/"
    return variant_counts(key[len(prefix) :] for key in store.keys(prefix))


def run_all(*steps: Callable[[], object]) -> None:
    """Run every step of a run's cleanup, even when a KeyboardInterrupt (SIGTERM via the
    CLI, or Ctrl-C, arriving as the run ends) lands in one of them; then raise the first
    such interrupt. The index is written by a late step: a signal during the loader pool's
    shutdown or the Ray actors' release must not skip it."""
    interrupt: KeyboardInterrupt | None = None
    for step in steps:
        try:
            step()
        except KeyboardInterrupt as exc:
            interrupt = interrupt or exc
    if interrupt is not None:
        raise interrupt
