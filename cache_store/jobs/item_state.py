"""Why is a sample (not) ready? A diagnostic over a store and the job queue.

Not queue code: it reads the record (if any) from a store, compares it with its source
and the current recipe version, and falls back to the queue's latest item for the
sample. The service's ``GET /v1/caches/{fingerprint}/items/{sample_id}`` answers with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cache_store.errors import CorruptRecord, RecordNotFound, SourceError
from cache_store.service_api.protocol import FAILED, MISSING, QUEUED, sample_state
from cache_store.keys import record_key
from cache_store.sources.freshness import HashBudget, compare_source
from cache_store.sources.files import SourceLimits
from cache_store.jobs.queue import JobQueue
from cache_store.recipes.registry import code_changed, installed_code_digest
from cache_store.recipes.registry import RECIPE_SPECS

__all__ = ["ItemState", "item_state", "code_comparison"]


@dataclass(frozen=True)
class ItemState:
    """Why a sample is (not) ready under a fingerprint.

    ``state`` is one of ``ready`` (record present, source and recipe unchanged),
    ``stale`` (record present but its source hash or recipe version no longer matches),
    ``failed`` (the last attempt failed; ``reason`` says why), ``queued`` (pending or
    running), ``missing`` (no record, nothing queued) or ``unchecked`` (record present,
    its source changed on disk and the request's hashing budget did not cover it).
    ``queued``, ``failed`` and ``missing`` without a record are
    :func:`cache_store.service_api.protocol.sample_state` of the latest queue item.
    """

    fingerprint: str
    sample_id: str
    state: str
    reason: str
    job_id: str | None = None
    #: the record's recipe code digest against the installed recipe's
    #: (``{"record", "installed", "changed"}``), when a record is stored
    code: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "sample_id": self.sample_id,
            "state": self.state,
            "reason": self.reason,
            "job_id": self.job_id,
            "code": self.code,
        }


class _Unchecked(Exception):
    """The source could not be compared within the request's hashing budget."""


def _stale_reasons(
    meta: dict[str, str], path: str | None, limits: SourceLimits | None, budget: HashBudget | None
) -> list[str]:
    """Why a stored record is not current: recipe version moved on, source changed.
    The source is compared by stat signature, hashed only when that differs and
    ``budget`` allows (else the answer says it was not checked)."""
    spec = RECIPE_SPECS.get(meta.get("recipe", ""))
    problems = []
    if spec is not None and meta.get("recipe_version") != str(spec.version):
        problems.append(
            f"recipe {spec.name} is now version {spec.version}, the record "
            f"has version {meta.get('recipe_version')}"
        )
    if path is not None:
        try:
            seen = compare_source(meta, path, limits, budget=budget)
            if seen.current is None:
                raise _Unchecked(
                    f"record present; source {path} changed on disk since the "
                    f"record was computed (size, mtime, inode or device) and was "
                    f"not hashed: this request's hashing budget is spent; ask "
                    f"for this item alone"
                )
            if not seen.current:
                problems.append(
                    f"source {path} changed (hash {seen.source_hash}, record has "
                    f"{meta.get('source_hash')})"
                )
        except SourceError as exc:
            problems.append(f"source cannot be checked: {exc}")
    return problems


def _ready_reason(meta: dict[str, str], path: str | None) -> str:
    """What was checked of a record found current, and only that: its source when a
    path is known, its recipe version when the recipe is installed here."""
    parts = ["record present"]
    if path is None:
        parts.append("no source path known to compare it with")
    else:
        parts.append(f"source {path} unchanged since it was computed")
    recipe, version = meta.get("recipe", ""), meta.get("recipe_version")
    if RECIPE_SPECS.get(recipe) is None:
        parts.append(f"recipe {recipe!r} is not installed here: version {version} not compared")
    else:
        parts.append(f"recipe {recipe} version {version} is the installed one")
    return "; ".join(parts)


def code_comparison(meta: dict[str, str]) -> dict[str, Any] | None:
    """The record's code digest against the installed recipe's, or None when the recipe
    is not installed here. ``changed`` is None for a record that carries no digest."""
    installed = installed_code_digest(meta.get("recipe", ""))
    if installed is None:
        return None
    recorded = meta.get("code_digest")
    return {
        "record": recorded,
        "installed": installed,
        "changed": code_changed(installed, recorded),
    }


def item_state(
    store: Any,
    queue: JobQueue,
    fingerprint: str,
    sample_id: str,
    *,
    path: str | None = None,
    limits: SourceLimits | None = None,
    budget: HashBudget | None = None,
) -> ItemState:
    """Explain one sample's state from its record (if any) and its latest queue item.

    Args:
        store: a :class:`cache_store.stores.base.Store`, or None when none exists yet.
        path: the source to compare the record's ``source_hash`` with; default: the
            path of the latest queue item for this sample, if any.
        limits: how the source may be opened (roots, size): the source gate's.
        budget: bytes of hashing this answer may still spend (shared across the items of
            one listing); a source whose signature changed beyond it is "stale", unchecked.
    """
    key = record_key(fingerprint, sample_id)
    latest = queue.latest_item(fingerprint, sample_id)
    job_id = latest["job_id"] if latest else None
    queued = latest is not None and sample_state(latest["status"]) == QUEUED
    path = path or (latest["path"] if latest else None)

    def say(state: str, reason: str) -> ItemState:
        return ItemState(fingerprint, sample_id, state, reason, job_id)

    meta = None
    if store is not None:
        try:
            meta = store.record_metadata(key)
        except RecordNotFound:
            meta = None
        except CorruptRecord as exc:
            return say("stale", f"stored record is unreadable: {exc}")
    if meta is not None:
        code = code_comparison(meta)
        try:
            problems = _stale_reasons(meta, path, limits, budget)
        except _Unchecked as exc:
            return ItemState(fingerprint, sample_id, "unchecked", str(exc), job_id, code)
        if problems:
            return ItemState(
                fingerprint,
                sample_id,
                "stale",
                "; ".join(problems) + ("; recomputation queued" if queued else ""),
                job_id,
                code,
            )
        reason = _ready_reason(meta, path)
        if code is not None and code["changed"]:
            reason += (
                f"; but it was computed by different recipe code (digest "
                f"{code['record']}, installed {code['installed']}) under the same "
                "version: bump the recipe's version if its output changed"
            )
        return ItemState(fingerprint, sample_id, "ready", reason, job_id, code)
    if latest is None:
        return say(MISSING, "no record and no queue item for this sample")
    state = sample_state(latest["status"])
    if state == QUEUED:
        return say(QUEUED, f"{latest['status']} (attempt {latest['attempts']} of job {job_id})")
    if state == FAILED:
        return say(FAILED, latest["last_error"] or "failed without an error message")
    if latest["status"] == "cancelled":
        return say(MISSING, f"job {job_id} was cancelled before this sample was computed")
    return say(MISSING, f"queue says {latest['status']} but no record is stored (deleted?)")
