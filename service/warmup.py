"""Turning a warm-up request into a job: validate, resolve, and skip what is ready.

Everything here is plain, synchronous library code (the route runs it in a thread):

* recipe parameters are resolved against the recipe's schema (unknown or out-of-bound
  values -> :class:`ParameterError` listing each problem);
* sample ids are validated (:func:`cache_store.fingerprint.validate_sample_id`);
* source paths are resolved, symlinks included, and must land inside an allowed source
  root (checked before the file's existence, so the answer reveals nothing outside);
* an item whose record exists with the source's current content hash is *ready*: it is
  counted, not queued.

The job itself, and later the dataset index (written by the worker when the job
finishes), keep the request's order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cache_store.errors import (
    InvalidSampleId,
    ParameterError,
    SourceError,
    SpcacheError,
)
from cache_store.fingerprint import compute_fingerprint, record_key, validate_sample_id
from cache_store.freshness import record_is_current
from cache_store.jobs import NewItem
from cache_store.recipes import get_recipe_spec
from cache_store.store import Store

__all__ = ["WarmupPlan", "plan_warmup", "resolve_source", "expand_glob"]

log = logging.getLogger(__name__)

_MAX_PROBLEMS = 50


@dataclass
class WarmupPlan:
    recipe: str
    recipe_version: int
    params: dict[str, Any]
    fingerprint: str
    todo: list[NewItem] = field(default_factory=list)
    ready: list[NewItem] = field(default_factory=list)


def resolve_source(path: str, roots: Sequence[Path]) -> Path:
    """The real path of a source file, which must lie inside one of ``roots``.

    Relative paths are taken relative to the first root. Raises :class:`SourceError`
    naming ``path`` when it escapes every root (through ``..`` or a symlink), does not
    exist or is not a regular file.
    """
    if not path or "\x00" in path:
        raise SourceError(repr(path), "not a usable path")
    try:
        candidate = Path(path).expanduser()
    except RuntimeError as exc:  # "~nobody/...": no such user, no home directory
        raise SourceError(path, f"cannot be resolved: {exc}") from None
    if not candidate.is_absolute():
        candidate = roots[0] / candidate
    try:
        real = candidate.resolve(strict=False)
    except (OSError, RuntimeError) as exc:  # symlink loops
        raise SourceError(path, f"cannot be resolved: {exc}") from None
    if not any(real.is_relative_to(root) for root in roots):
        raise SourceError(path, "resolves outside the allowed source roots "
                                f"({', '.join(str(r) for r in roots)})")
    try:
        if not real.is_file():
            raise SourceError(path, "does not exist" if not real.exists()
                              else "is not a regular file")
    except OSError as exc:  # e.g. a name too long for the filesystem
        raise SourceError(path, f"cannot be checked: {exc.strerror or exc}") from None
    return real


def expand_glob(root: str, pattern: str, roots: Sequence[Path],
                limit: int) -> list[tuple[str, str]]:
    """``(sample id, path)`` for each file under ``root`` matching ``pattern``, sorted.

    The id is the match's path relative to ``root`` without its extension
    (``chairs/a1.obj`` -> ``chairs/a1``). Raises :class:`ParameterError` for a pattern
    that is absolute or climbs out with ``..``, or one matching more than ``limit`` files.
    """
    base = resolve_dir(root, roots)
    parts = Path(pattern).parts
    if not pattern or Path(pattern).is_absolute() or ".." in parts:
        raise ParameterError([f"glob: {pattern!r} must be a relative pattern without '..'"],
                             what="warm-up request")
    out: list[tuple[str, str]] = []
    for match in sorted(base.glob(pattern)):
        if not match.is_file():
            continue
        rel = match.relative_to(base).with_suffix("")
        out.append((rel.as_posix(), str(match)))
        if len(out) > limit:
            raise ParameterError([f"glob: {pattern!r} under {root} matches more than {limit} "
                                  f"files; split the request"], what="warm-up request")
    if not out:
        raise ParameterError([f"glob: {pattern!r} matches no file under {root}"],
                             what="warm-up request")
    return out


def resolve_dir(root: str, roots: Sequence[Path]) -> Path:
    try:
        candidate = Path(root).expanduser()
    except RuntimeError as exc:
        raise SourceError(root, f"cannot be resolved: {exc}") from None
    if not candidate.is_absolute():
        candidate = roots[0] / candidate
    real = candidate.resolve(strict=False)
    if not any(real.is_relative_to(r) for r in roots):
        raise SourceError(root, "resolves outside the allowed source roots "
                                f"({', '.join(str(r) for r in roots)})")
    if not real.is_dir():
        raise SourceError(root, "is not a directory")
    return real


def plan_warmup(recipe: str, params: dict[str, Any] | None, items: Sequence[tuple[str, str]],
                roots: Sequence[Path], store: Store | None) -> WarmupPlan:
    """Validate a warm-up request and split its items into ``todo`` and ``ready``.

    Raises:
        UnknownName: the recipe does not exist.
        ParameterError: bad parameters, or bad items (every problem listed, one line
            each, naming the item's index, id or path and the reason).
    """
    spec = get_recipe_spec(recipe)
    resolved = spec.resolve(params or {})
    fingerprint = compute_fingerprint(spec.name, spec.version, resolved)
    plan = WarmupPlan(spec.name, spec.version, resolved, fingerprint)
    problems: list[str] = []
    seen: dict[str, int] = {}
    checked: list[tuple[str, Path]] = []
    for i, (sample_id, path) in enumerate(items):
        try:
            sid = validate_sample_id(sample_id)
            if sid in seen:
                raise InvalidSampleId(sid, f"duplicate (also items[{seen[sid]}])")
            seen[sid] = i
            checked.append((sid, resolve_source(path, roots)))
        except SpcacheError as exc:
            problems.append(f"items[{i}]: {exc}")
            if len(problems) >= _MAX_PROBLEMS:
                problems.append("... (further items not checked)")
                break
    if problems:
        raise ParameterError(problems, what="warm-up items")
    for sid, real in checked:
        item = NewItem(sid, str(real))
        (plan.ready if _is_ready(store, fingerprint, sid, real) else plan.todo).append(item)
    return plan


def _is_ready(store: Store | None, fingerprint: str, sample_id: str,
              path: os.PathLike[str]) -> bool:
    return store is not None and record_is_current(store, record_key(fingerprint, sample_id), path)
