"""``spcache.precompute(...)``: compute a recipe over sources into a cache, from Python.

The same run as ``spcache precompute`` (both call :func:`workers.precompute.run_precompute`);
the result is what ``spcache precompute --json`` prints, as a frozen dataclass. Importing
this module imports neither torch nor the engine: they load when :func:`precompute` runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from cache_store.engine_options import EngineOptions

if TYPE_CHECKING:
    from cache_store.recipes.api import Recipe
    from cache_store.readers.dataset import CachedDataset

__all__ = ["FailedSample", "PrecomputeResult", "Timings", "precompute"]

#: the engine options' defaults, shown in :func:`precompute`'s signature
_DEFAULTS = EngineOptions()


@dataclass(frozen=True)
class FailedSample:
    """A sample that has no record after the run, and why.

    ``repeat``: ``""`` (first failure on this source), ``"again"`` (it failed before on the
    same unchanged source, for the same reason) or ``"skipped"`` (it failed before on the
    same unchanged source and was not retried: ``skip_failed=True``).
    """

    id: str
    path: str
    reason: str
    repeat: str = ""


@dataclass(frozen=True)
class Timings:
    """Seconds. ``load_s`` sums the loader processes' time, ``compute_s`` is device time,
    ``write_s`` the encode-and-commit time, ``wall_s`` the whole run; ``actor_start_s``
    (Ray only) the time until every actor was placed and ready."""

    load_s: float = 0.0
    compute_s: float = 0.0
    write_s: float = 0.0
    wall_s: float = 0.0
    actor_start_s: float | None = None


@dataclass(frozen=True)
class PrecomputeResult:
    """The outcome of :func:`precompute` (what ``spcache precompute --json`` prints).

    ``done`` records were computed and stored in this run, ``skipped`` ones were already
    stored and up to date, ``failed`` ones are not stored: ``errors`` says why, one
    :class:`FailedSample` each. A record is one variant of a sample: a run of ``variants``
    per sample reports ``samples x variants`` records (a failed variant's id is
    ``<sample id>#v<k>``). ``fingerprint`` names the recipe, version and parameters
    in the cache: ``CachedDataset(cache, fingerprint)`` reads the records
    (:meth:`dataset`). ``extra`` holds what only one engine reports (with
    ``engine="ray"``: ``actors`` and ``shard_retries``).
    """

    cache: str
    fingerprint: str
    recipe: str
    recipe_version: int
    params: Mapping[str, Any]
    device: str
    backend: str
    engine: str
    done: int
    skipped: int
    failed: int
    errors: tuple[FailedSample, ...] = ()
    failed_again: tuple[str, ...] = ()
    skipped_failed: tuple[str, ...] = ()
    timings: Timings = field(default_factory=Timings)
    oom_backoffs: int = 0
    #: of ``skipped``, records computed by other recipe code than the installed one
    #: (the recipe's code changed without a version bump; they were kept, not recomputed)
    skipped_other_code: int = 0
    #: files the directories named held but no loader reads, by type (extension ->
    #: count, ``""`` for none): left out, not samples (``spcache precompute`` says
    #: "left out 7 files of unsupported types: .dae 3, ...")
    left_out: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: records asked for per sample
    variants: int = 1

    @property
    def total(self) -> int:
        """Records the run reported on: ``done + skipped + failed``."""
        return self.done + self.skipped + self.failed

    @property
    def ok(self) -> bool:
        """No sample failed (``spcache precompute`` exits 0)."""
        return self.failed == 0

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], *, cache: str | os.PathLike[str] = "", engine: str = "local"
    ) -> PrecomputeResult:
        """The result from ``spcache precompute --json``'s object (keys it does not know
        go into ``extra``)."""
        known = {
            "fingerprint",
            "recipe",
            "recipe_version",
            "params",
            "device",
            "backend",
            "engine",
            "done",
            "skipped",
            "failed",
            "errors",
            "failed_again",
            "skipped_failed",
            "timings",
            "oom_backoffs",
            "skipped_other_code",
            "left_out",
            "variants",
        }
        timings = dict(data.get("timings", {}))
        return cls(
            cache=os.fspath(cache),
            fingerprint=str(data["fingerprint"]),
            recipe=str(data["recipe"]),
            recipe_version=int(data["recipe_version"]),
            params=MappingProxyType(dict(data.get("params", {}))),
            device=str(data.get("device", "")),
            backend=str(data.get("backend", "")),
            engine=str(data.get("engine", engine)),
            done=int(data["done"]),
            skipped=int(data["skipped"]),
            failed=int(data["failed"]),
            errors=tuple(
                FailedSample(
                    str(e["id"]), str(e["path"]), str(e["reason"]), str(e.get("repeat", ""))
                )
                for e in data.get("errors", ())
            ),
            failed_again=tuple(map(str, data.get("failed_again", ()))),
            skipped_failed=tuple(map(str, data.get("skipped_failed", ()))),
            timings=Timings(
                **{k: float(v) for k, v in timings.items() if k in Timings.__dataclass_fields__}
            ),
            oom_backoffs=int(data.get("oom_backoffs", 0)),
            skipped_other_code=int(data.get("skipped_other_code", 0)),
            left_out=MappingProxyType(
                {str(k): int(v) for k, v in dict(data.get("left_out", {})).items()}
            ),
            extra=MappingProxyType({k: v for k, v in data.items() if k not in known}),
            variants=int(data.get("variants", 1)),
        )

    def as_json(self) -> dict[str, Any]:
        """The object ``spcache precompute --json`` prints for this run."""
        timings = {
            "load_s": self.timings.load_s,
            "compute_s": self.timings.compute_s,
            "write_s": self.timings.write_s,
            "wall_s": self.timings.wall_s,
        }
        if self.timings.actor_start_s is not None:
            timings["actor_start_s"] = self.timings.actor_start_s
        data: dict[str, Any] = {
            "fingerprint": self.fingerprint,
            "recipe": self.recipe,
            "recipe_version": self.recipe_version,
            "params": dict(self.params),
            "device": self.device,
            "backend": self.backend,
            "done": self.done,
            "skipped": self.skipped,
            "failed": self.failed,
            "errors": [
                {"id": e.id, "path": e.path, "reason": e.reason, "repeat": e.repeat}
                for e in self.errors
            ],
            "failed_again": list(self.failed_again),
            "skipped_failed": list(self.skipped_failed),
            "timings": timings,
            "oom_backoffs": self.oom_backoffs,
            "skipped_other_code": self.skipped_other_code,
            "left_out": dict(self.left_out),
            "variants": self.variants,
            **self.extra,
        }
        if self.engine != "local":
            data["engine"] = self.engine
        return data

    def dataset(self, **options: Any) -> CachedDataset:
        """``CachedDataset(cache, fingerprint, **options)``: this run's records."""
        from cache_store.readers.dataset import CachedDataset

        return CachedDataset(self.cache, self.fingerprint, **options)


def precompute(
    sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    recipe: str | type[Recipe] | Recipe,
    cache: str | os.PathLike[str],
    *,
    device: str = _DEFAULTS.device,
    backend: str = _DEFAULTS.backend,
    loaders: int | None = _DEFAULTS.loaders,
    skip_failed: bool = _DEFAULTS.skip_failed,
    progress: bool = True,
    engine: str = "local",
    address: str | None = None,
    actors: int | None = None,
    query_chunk: int = _DEFAULTS.query_chunk,
    write_batch: int = _DEFAULTS.write_batch,
    id_template: str | None = None,
    variants: int = 1,
    time_limit_s: float | None = _DEFAULTS.time_limit_s,
    **params: Any,
) -> PrecomputeResult:
    """Compute ``recipe`` over ``sources`` into the cache directory ``cache``; samples
    already stored with an unchanged source are skipped, so a second call is cheap.

    Args:
        sources: a file, a directory (searched recursively) or a manifest (``.txt``: one
            path a line; ``.jsonl``: ``{"id": ..., "path": ...}`` a line), or several.
        recipe: the recipe's name (``spcache recipes`` lists them), or a recipe class
            of this process (one made by :func:`spcache.recipe`, or a ``Recipe`` subclass).
        cache: the cache directory (created if missing).
        device: ``"auto"`` (CUDA where it works, else CPU), ``"cpu"``, ``"cuda"``,
            ``"cuda:N"``.
        backend: SPC ops: ``"kaolin"`` (Kaolin on CUDA), ``"torch"`` (pure PyTorch, any
            device) or ``"auto"``.
        loaders: loader processes reading sources (0: in this process; default one per
            core but one, at most 8; with ``engine="ray"``, per actor, chosen from its
            node). They never import the caller's ``__main__`` (no ``if __name__ ==
            "__main__":`` guard needed); where they cannot work at all, one WARNING says
            why and the samples are loaded in this process. These options' defaults and
            checks are :class:`cache_store.engine_options.EngineOptions`'s.
        skip_failed: do not retry samples that failed before on an unchanged source.
        progress: show a progress bar (a widget in Jupyter with ipywidgets, else text
            on stderr).
        engine: ``"local"`` (this process) or ``"ray"`` (Ray actors, one per GPU; needs
            ``spcache[ray]``), with ``address`` (a cluster to join; default a local
            Ray) and ``actors`` (default one per GPU, or per CPU without GPUs).
        query_chunk: queries per device call before any out-of-memory back-off.
        write_batch: records per write transaction.
        id_template: how sample ids are made from the files' paths relative to their
            directory or ``.txt`` manifest (``"{parts[0]}/{parts[1]}"``; ``"{path}"``
            keeps the extension), as ``--id-template`` (see
            :func:`cache_store.sources.discover.sample_id_for`).
        variants: records per sample: variant 0 (the sample itself) and ``variants - 1``
            more, each prepared from its own seeded generator (augmented where the
            recipe's augmentation parameters are set: ``rotation``, ``scale_min``,
            ``scale_max``, ``jitter`` for the built-ins). Not part of the fingerprint:
            asking for 6 after 4 computes the 2 new ones.
        time_limit_s: seconds a sample's loading (with ``prepare``) or ``compute`` may
            take (default: the recipe's ``time_limit_s``, 600 unless it declares one).
            A sample past it fails alone, naming the limit: its computation is
            interrupted in this process (a native computation that does not return to
            Python within 10 s more cannot be: an ERROR line names the sample).
        **params: the recipe's parameters (e.g. ``level=8``); defaults fill the rest.

    Returns:
        A :class:`PrecomputeResult`. Samples that fail are reported in it, not raised.

    Raises:
        ValueError: a bad option, no source found, or a cache directory that cannot be
            used (:class:`spcache.UsageError`; :class:`spcache.ParameterError` for a recipe
            parameter out of its bounds).
        spcache.UnknownName: no such recipe or backend.
        spcache.BackendUnavailable: the backend or device asked for does not work here.
        spcache.StoreFull: the cache filled up; the records committed before it are kept,
            and the same call later goes on where it stopped.
        KeyboardInterrupt: interrupted (Ctrl-C, a notebook's stop button, SIGTERM): what
            was computed is committed and indexed first.

    Nothing is left open when it returns or raises (loader processes, the LMDB
    environment, SQLite connections, signal handlers), so DataLoader workers may fork
    right after it.
    """
    from cache_store.recipes.registry import recipe_name_of
    from workers.precompute import run_precompute

    recipe = recipe_name_of(recipe)  # a recipe class (spcache.recipe): usable here
    options = EngineOptions(
        device=device,
        backend=backend,
        loaders=loaders,
        query_chunk=query_chunk,
        write_batch=write_batch,
        skip_failed=skip_failed,
        time_limit_s=time_limit_s,
    )
    summary = run_precompute(
        sources,
        recipe,
        cache,
        params=params,
        options=options,
        progress=progress,
        engine=engine,
        address=address,
        actors=actors,
        id_template=id_template,
        variants=variants,
    )
    from cache_store.location import is_remote

    where = os.fspath(cache) if is_remote(cache) else os.path.abspath(cache)
    return PrecomputeResult.from_json(summary.as_json(), cache=where, engine=engine)
