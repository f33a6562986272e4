"""Precompute on Ray: one actor per GPU (or per CPU), one writer in the driver.

:class:`RayEngine` is an :class:`~workers.engine.Engine` whose :meth:`~RayEngine.run`
fans the work out over Ray actors. The driver (the process that calls ``run``):

1. admits the items exactly as the local engine does (valid, unique sample ids; keys;
   the source hash of any record already stored);
2. skips what is already cached: a file whose stored records (each wanted variant's)
   carry its current content hash is not sent anywhere (the driver hashes only files
   that have a record); a sample with some variants current goes with their hashes, and
   its actor computes only the others (``stale_variants``, the local engine's rule);
3. cuts the rest into shards and hands one shard at a time to each idle actor;
4. writes what comes back into the store in batches (one ``put_many`` transaction per
   batch), reports every item through ``on_result`` after its record has committed, and
   writes the fingerprint's index at the end, as the local engine does.

Each actor (:class:`ShardWorker`, in :mod:`workers.ray_actor`) runs the *local* engine,
:class:`workers.engine.Engine`, on its shard: the same loader, recipe, device code, metadata and record encoding, so a
record computed on Ray is byte-for-byte the record the local engine writes (only the
``created`` time differs). The actor's engine writes into an in-memory buffer
(:class:`ShardBuffer`) instead of a cache, and the actor streams the encoded records back
in batches of ``write_batch`` through a Ray streaming generator. Only plain values cross
the wire: lists, dicts, strings, numbers and the records' safetensors bytes; Ray's own
transport carries them, spcache defines no pickled type.

Faults, as Ray users expect them:

- An actor that dies (a crash, the OOM killer, ``ray.kill``, a lost node) loses only the
  items of its shard that had not come back yet; they are queued again, for another
  actor where there is one. Ray restarts the dead actor (``max_restarts``) unless it was
  killed for good. A shard that kills its actor twice is halved, and halved again, so a
  sample that crashes every actor it touches is isolated and fails alone with a reason
  after ``max_attempts`` deaths; the rest of its shard is computed.
- A sample that fails (bad file, device error) is reported by the actor's engine exactly
  as the local engine reports it, and the run goes on.
- An error that is not about one sample (a backend missing on a node, CUDA requested on
  a node without it) stops the run; what was committed stays, and the index is written.
- The run is resumable exactly like the local one: run it again and the stored records
  are skipped.

The code: this module holds :class:`RayEngine` (options) and re-exports the public names;
:mod:`workers.ray_driver` is the scheduler, :mod:`workers.ray_actor` the actor side,
:mod:`workers.ray_common` what both share; the bookkeeping shared with the local engine
is :mod:`workers.run_ledger`.

The one writer is the ceiling of this design: every record passes through the driver.
``docs/SCALE_OUT.md`` says where that bites and the way past it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cache_store.engine_options import EngineOptions
from cache_store.errors import RayUnavailable, UsageError
from cache_store.keys import validate_variant_count
from cache_store.recipes.registry import require_installed
from cache_store.jobs.failures import FailureLog
from cache_store.stores.base import Store
from workers.engine import Engine
from workers.ray_actor import ShardBuffer, ShardWorker
from workers.ray_common import ActorStats, RaySummary
from workers.ray_driver import RayRun, RayRunOptions
from cache_store.recipes.api import Recipe
from workers.run_ledger import ItemResult

__all__ = [
    "RayEngine",
    "RayRunOptions",
    "RaySummary",
    "ActorStats",
    "ShardWorker",
    "ShardBuffer",
    "RayUnavailable",
]


class RayEngine(Engine):
    """Run a recipe over many samples on Ray actors, writing into ``store`` from here.

    Takes the :class:`workers.engine.Engine` arguments (``options.loaders`` is per actor,
    and None lets each actor choose from its node; ``device`` is ``auto``, ``cpu`` or
    ``cuda``, since Ray picks each actor's GPU) plus:

    Args:
        address: a Ray cluster to join (``"auto"``, ``"ray://host:10001"``,
            ``"host:6379"``). None starts a local Ray instance for the run and stops it
            after; when Ray is already initialised in this process, that instance is used
            and left running.
        actors: how many actors; default one per GPU of the cluster, or one per CPU when
            it has no GPU or ``device="cpu"``.
        shard_size: items handed to an actor at a time; default
            ``ceil(items / (4 * actors))``, at most 512.
        max_attempts: deaths of an actor a single sample may cause before it fails.
        actor_restarts: how often Ray restarts each actor that died (``max_restarts``).
        placement_timeout_s: how long to wait for the cluster to place the actors.
        ray_init: extra keyword arguments for ``ray.init`` when this engine calls it.
        actor_runtime_env: Ray ``runtime_env`` of the actors (e.g. ``{"py_modules":
            [...]}`` to ship a recipe module that is not installed on the nodes). The
            driver's ``SPCACHE_RECIPES``, when set, is added to its ``env_vars``, so the
            actors find the same recipes the driver does.
        actor_fault: test hook handed to every actor (see
            :class:`workers.ray_actor.ShardWorker`; the tests' ``CrashOnce``).
    """

    def __init__(
        self,
        store: Store,
        recipe: str | Recipe,
        params: Mapping[str, Any] | None = None,
        *,
        options: EngineOptions | None = None,
        progress: bool = False,
        address: str | None = None,
        actors: int | None = None,
        shard_size: int | None = None,
        max_attempts: int = 3,
        actor_restarts: int = 2,
        placement_timeout_s: float = 600.0,
        ray_init: Mapping[str, Any] | None = None,
        actor_runtime_env: Mapping[str, Any] | None = None,
        actor_fault: Callable[[str], None] | None = None,
        failure_log: FailureLog | None = None,
        **fields: Any,
    ) -> None:
        options = EngineOptions.of(options, **fields)
        super().__init__(
            store,
            recipe,
            params,
            # the driver loads nothing: its engine only admits, skips and writes
            options=dataclasses.replace(options, loaders=0),
            progress=progress,
            failure_log=failure_log,
        )
        problems = []
        if options.device not in ("auto", "cpu", "cuda"):
            problems.append(
                f"device: {options.device!r}: on Ray each actor owns the GPU Ray gives it; "
                f"use auto, cpu or cuda"
            )
        if actors is not None and actors < 1:
            problems.append(f"actors: {actors} must be at least 1")
        if shard_size is not None and shard_size < 1:
            problems.append(f"shard_size: {shard_size} must be at least 1")
        if max_attempts < 1:
            problems.append(f"max_attempts: {max_attempts} must be at least 1")
        if actor_restarts < 0:
            problems.append(f"actor_restarts: {actor_restarts} is negative")
        if placement_timeout_s <= 0:
            problems.append("placement_timeout_s must be positive")
        if problems:
            raise UsageError("ray engine options: " + "; ".join(problems))
        #: what each actor's engine runs with (loaders None: each actor chooses)
        self.actor_engine_options = options
        self.address = address
        self.actors = actors
        self.shard_size = shard_size
        self.max_attempts = int(max_attempts)
        self.actor_restarts = int(actor_restarts)
        self.placement_timeout_s = float(placement_timeout_s)
        self.ray_init = dict(ray_init or {})
        self.actor_runtime_env = actor_runtime_env_with_recipes(actor_runtime_env)
        self.actor_fault = actor_fault

    def open(self) -> RayEngine:
        """Nothing to start here: each actor opens its own engine (and loader pool)."""
        return self

    def close(self) -> None:
        """Nothing to stop here: a run's actors end with the run."""

    def run(
        self,
        items: Iterable[tuple[str, str | os.PathLike[str]]],
        on_result: Callable[[ItemResult], None] | None = None,
        *,
        variants: int = 1,
    ) -> RaySummary:
        """Compute ``variants`` records of every ``(sample_id, path)`` item on Ray; return
        the :class:`RaySummary` (counting records, as the local engine's does). Each actor's
        local engine computes a sample's variants from one load, as it does locally."""
        require_installed(self.recipe_spec.name, "a Ray actor (another process)")
        variants = validate_variant_count(variants)
        return RayRun(self.run_options(), list(items), on_result, variants).execute()

    def run_options(self) -> RayRunOptions:
        """What a run needs from this engine, frozen: the driver reads nothing else."""
        return RayRunOptions(
            store=self.store,
            fingerprint=self.fingerprint,
            recipe=self.recipe_spec.name,
            recipe_version=self.recipe_spec.version,
            code_digest=self.code_digest,
            params=dict(self.params),
            device=self.device,
            backend=self.backend,
            actor_options=self.actor_options(),
            source_limits=self.source_limits,
            address=self.address,
            ray_init=dict(self.ray_init),
            actors=self.actors,
            shard_size=self.shard_size,
            max_attempts=self.max_attempts,
            actor_restarts=self.actor_restarts,
            placement_timeout_s=self.placement_timeout_s,
            actor_fault=self.actor_fault,
            actor_runtime_env=self.actor_runtime_env,
            progress=self.progress,
            skip_failed=self.skip_failed,
            failure_log=self.failure_log,
            sink=self.sink(),
        )

    def sink(self) -> dict[str, Any] | None:
        """Where the actors write their records themselves: the sharded snapshot this
        engine writes into (None for a cache: the actors send records here)."""
        from cache_store.snapshot.sharded import ShardedSnapshot

        if not isinstance(self.store, ShardedSnapshot):
            return None
        return {
            "location": self.store.location,
            "storage_options": dict(self.store.storage_options),
        }

    def actor_options(self) -> dict[str, Any]:
        """The options each actor's local :class:`Engine` is built with, as plain values
        (:meth:`EngineOptions.as_json`). Failures are the driver's to skip and remember:
        an actor writes no failure log."""
        return dataclasses.replace(self.actor_engine_options, skip_failed=False).as_json()


def actor_runtime_env_with_recipes(runtime_env: Mapping[str, Any] | None) -> dict[str, Any]:
    """``runtime_env`` with the driver's ``SPCACHE_RECIPES`` in its ``env_vars`` (when set
    here and not given there): actors find recipes as every process does."""
    from cache_store.recipes.registry import ENV_VAR

    env = dict(runtime_env or {})
    value = os.environ.get(ENV_VAR)
    if value:
        env_vars = dict(env.get("env_vars") or {})
        env_vars.setdefault(ENV_VAR, value)
        env["env_vars"] = env_vars
    return env
