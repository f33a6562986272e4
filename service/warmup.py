"""Turning a warm-up request into a job: validate, resolve, and skip what is ready.

Everything here is plain, synchronous library code (the route runs it in a thread):

* recipe parameters are resolved against the recipe's schema (unknown or out-of-bound
  values -> :class:`ParameterError` listing each problem);
* sample ids are validated (:func:`cache_store.keys.validate_sample_id`);
* source paths go through the source gate (:mod:`cache_store.sources.files`): resolved,
  symlinks included, inside an allowed source root (checked before the file's existence,
  so the answer reveals nothing outside), a regular file within the size limit;
* an item whose records exist with the source's current content (same stat signature,
  or else the same hash; :mod:`cache_store.sources.freshness`), each of the ``variants``
  asked for, is *ready*: it is counted, not queued.

The job itself, and later the dataset index (written by the worker when the job
finishes), keep the request's order.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import time
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
from cache_store.keys import (
    compute_fingerprint,
    record_key,
    validate_sample_id,
    validate_variant_count,
)
from cache_store.sources.freshness import compare_source, stored_metadata
from cache_store.sources.files import (
    DEFAULT_MAX_SOURCE_BYTES,
    SourceLimits,
    check_source,
    inside_roots,
)
from cache_store.jobs.queue import NewItem
from cache_store.recipes.registry import get_recipe_spec
from cache_store.stores.base import Store

__all__ = ["WarmupPlan", "plan_warmup", "request_source", "expand_glob"]

log = logging.getLogger(__name__)

_MAX_PROBLEMS = 50


@dataclass
class WarmupPlan:
    recipe: str
    recipe_version: int
    params: dict[str, Any]
    fingerprint: str
    #: records asked for per sample
    variants: int = 1
    todo: list[NewItem] = field(default_factory=list)
    ready: list[NewItem] = field(default_factory=list)
    #: ids in ``todo`` whose stored record is out of date with its source
    stale: set[str] = field(default_factory=set)


def request_source(
    path: str, roots: Sequence[Path], max_bytes: int = DEFAULT_MAX_SOURCE_BYTES
) -> Path:
    """The source a request names (``path``, as the client wrote it), checked: its real
    path, which must lie inside one of ``roots``.

    A request's rule, on top of the source gate's: a relative path is taken relative to
    the first root (``~`` expanded). The path is checked by the
    source gate (:func:`cache_store.sources.files.check_source`: resolved, inside the
    roots before anything else is looked at, opened without following a final link, a
    regular file of at most ``max_bytes``); raises :class:`SourceError` naming ``path``
    and the reason, never what lies outside the roots.
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
        checked = check_source(candidate, SourceLimits.of(roots, max_bytes), name_target=False)
    except SourceError as exc:
        raise SourceError(path, exc.reason) from None
    return Path(checked.resolved)


#: Default bounds of one glob expansion (the service passes its settings).
GLOB_MAX_ENTRIES = 200_000
GLOB_MAX_SECONDS = 5.0


def expand_glob(
    root: str,
    pattern: str,
    roots: Sequence[Path],
    limit: int,
    *,
    max_entries: int = GLOB_MAX_ENTRIES,
    max_seconds: float = GLOB_MAX_SECONDS,
) -> list[tuple[str, str]]:
    """``(sample id, path)`` for each file under ``root`` matching ``pattern``, sorted.

    The id is the match's path relative to ``root`` without its extension
    (``chairs/a1.obj`` -> ``chairs/a1``). Pattern segments are ``fnmatch`` patterns;
    one segment may be ``**`` (zero or more directories).

    The walk is bounded, so that no request can hold a pool thread for long: at most one
    ``**``, at most ``max_entries`` directory entries looked at, at most ``max_seconds``
    spent, and more than ``limit`` matches stops it at once. Symlinks (files or
    directories) are followed only when their target lies inside ``roots``; a directory
    is walked once per pattern position however many links lead to it. Raises
    :class:`ParameterError` for a pattern that is absolute, climbs out with ``..``, has
    more than one ``**``, passes a bound, or matches nothing; no message names anything
    outside the roots.
    """
    base = resolve_dir(root, roots)
    if not pattern or Path(pattern).is_absolute():
        raise ParameterError(
            [f"glob: {pattern!r} must be a relative pattern without '..'"], what="warm-up request"
        )
    segments = [s for s in pattern.split("/") if s not in ("", ".")]
    if not segments or ".." in segments:
        raise ParameterError(
            [f"glob: {pattern!r} must be a relative pattern without '..'"], what="warm-up request"
        )
    if sum(1 for s in segments if "**" in s) > 1 or any("**" in s and s != "**" for s in segments):
        raise ParameterError(
            [(f"glob: {pattern!r}: at most one '**', and only as a whole path segment")],
            what="warm-up request",
        )
    walker = _GlobWalk(base, segments, roots, limit, max_entries, max_seconds, pattern, root)
    walker.walk(base, 0, ())
    if not walker.out:
        raise ParameterError(
            [f"glob: {pattern!r} matches no file under {root}"], what="warm-up request"
        )
    return sorted(walker.out)


class _GlobWalk:
    """One bounded glob expansion over ``os.scandir`` (see :func:`expand_glob`)."""

    def __init__(
        self,
        base: Path,
        segments: list[str],
        roots: Sequence[Path],
        limit: int,
        max_entries: int,
        max_seconds: float,
        pattern: str,
        root: str,
    ) -> None:
        self.base = base
        self.segments = segments
        self.roots = [os.path.realpath(r) for r in roots]
        self.limit = limit
        self.max_entries = max_entries
        self.deadline = time.monotonic() + max_seconds
        self.max_seconds = max_seconds
        self.pattern = pattern
        self.root = root
        self.entries = 0
        self.out: list[tuple[str, str]] = []
        self.walked: set[tuple[int, int, int]] = set()

    def _fail(self, why: str) -> ParameterError:
        return ParameterError(
            [
                (
                    f"glob: {self.pattern!r} under {self.root} {why}; narrow the "
                    f"pattern or split the request"
                )
            ],
            what="warm-up request",
        )

    def _inside(self, path: str) -> str | None:
        """The real path of ``path`` when it lies inside a source root, else None."""
        try:
            real = os.path.realpath(path)
        except (OSError, ValueError):
            return None
        return real if inside_roots(real, self.roots) else None

    def walk(self, directory: Path, i: int, rel: tuple[str, ...]) -> None:
        try:
            st = directory.stat()
        except OSError:
            return
        mark = (st.st_dev, st.st_ino, i)
        if mark in self.walked:  # a symlink loop, or two links to one directory
            return
        self.walked.add(mark)
        segment = self.segments[i]
        last = i == len(self.segments) - 1
        if segment == "**":
            if not last:  # zero directories
                self.walk(directory, i + 1, rel)
            for name, path, is_dir, is_file in self._entries(directory):
                if is_dir:
                    self.walk(Path(path), i, rel + (name,))
                elif last and is_file:
                    self._add(rel + (name,), path)
            return
        for name, path, is_dir, is_file in self._entries(directory):
            if not fnmatch.fnmatchcase(name, segment):
                continue
            if last:
                if is_file:
                    self._add(rel + (name,), path)
            elif is_dir:
                self.walk(Path(path), i + 1, rel + (name,))

    def _entries(self, directory: Path) -> list[tuple[str, str, bool, bool]]:
        """``(name, path, is_dir, is_file)`` of each entry, symlinks leaving the roots left out."""
        out = []
        try:
            with os.scandir(directory) as it:
                for entry in it:
                    self.entries += 1
                    if self.entries > self.max_entries:
                        raise self._fail(f"looks at more than {self.max_entries} entries")
                    if time.monotonic() > self.deadline:
                        raise self._fail(f"takes longer than {self.max_seconds:g} s")
                    try:
                        if entry.is_symlink():
                            real = self._inside(entry.path)
                            if real is None:
                                continue
                            is_dir, is_file = os.path.isdir(real), os.path.isfile(real)
                        else:
                            is_dir = entry.is_dir(follow_symlinks=False)
                            is_file = entry.is_file(follow_symlinks=False)
                    except OSError:
                        continue
                    out.append((entry.name, entry.path, is_dir, is_file))
        except OSError:
            return []
        return out

    def _add(self, rel: tuple[str, ...], path: str) -> None:
        self.out.append((Path(*rel).with_suffix("").as_posix(), path))
        if len(self.out) > self.limit:
            raise self._fail(f"matches more than {self.limit} files")


def resolve_dir(root: str, roots: Sequence[Path]) -> Path:
    try:
        candidate = Path(root).expanduser()
    except RuntimeError as exc:
        raise SourceError(root, f"cannot be resolved: {exc}") from None
    if not candidate.is_absolute():
        candidate = roots[0] / candidate
    try:
        real = Path(os.path.realpath(candidate))
    except (OSError, ValueError) as exc:
        raise SourceError(root, f"cannot be resolved: {exc}") from None
    if not inside_roots(str(real), [os.path.realpath(r) for r in roots]):
        raise SourceError(
            root, f"resolves outside the allowed source roots ({', '.join(str(r) for r in roots)})"
        )
    if not real.is_dir():
        raise SourceError(root, "is not a directory")
    return real


def plan_warmup(
    recipe: str,
    params: dict[str, Any] | None,
    items: Sequence[tuple[str, str]],
    roots: Sequence[Path],
    store: Store | None,
    variants: int = 1,
) -> WarmupPlan:
    """Validate a warm-up request and split its items into ``todo`` and ``ready``
    (``variants``: the records wanted per sample, each checked).

    Raises:
        UnknownName: the recipe does not exist.
        ParameterError: bad parameters, or bad items (every problem listed, one line
            each, naming the item's index, id or path and the reason).
    """
    spec = get_recipe_spec(recipe)
    resolved = spec.resolve(params or {})
    fingerprint = compute_fingerprint(spec.name, spec.version, resolved)
    try:
        validate_variant_count(variants)
    except ParameterError as exc:
        raise ParameterError(exc.problems, what="warm-up request") from None
    plan = WarmupPlan(spec.name, spec.version, resolved, fingerprint, variants)
    problems: list[str] = []
    seen: dict[str, int] = {}
    checked: list[tuple[str, Path]] = []
    for i, (sample_id, path) in enumerate(items):
        try:
            sid = validate_sample_id(sample_id)
            if sid in seen:
                raise InvalidSampleId(sid, f"duplicate (also items[{seen[sid]}])")
            seen[sid] = i
            checked.append((sid, request_source(path, roots)))
        except SpcacheError as exc:
            problems.append(f"items[{i}]: {exc}")
            if len(problems) >= _MAX_PROBLEMS:
                problems.append("... (further items not checked)")
                break
    if problems:
        raise ParameterError(problems, what="warm-up items")
    limits = SourceLimits.of(roots)
    for sid, real in checked:
        item = NewItem(sid, str(real))
        metas = [
            None if store is None else stored_metadata(store, record_key(fingerprint, sid, v))
            for v in range(variants)
        ]
        if all(meta is not None and _current(meta, real, limits) for meta in metas):
            plan.ready.append(item)
            continue
        plan.todo.append(item)
        if any(meta is not None and not _current(meta, real, limits) for meta in metas):
            plan.stale.add(sid)
    return plan


def _current(meta: dict[str, str], path: Path, limits: SourceLimits) -> bool:
    try:
        return compare_source(meta, path, limits).current is True
    except SourceError:
        return False
