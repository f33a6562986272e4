"""The Ray driver's actors: Ray started or joined, one actor per GPU (or CPU) placed and
described, and every actor of a run released when it ends.

The driver (:class:`workers.ray_driver.RayRun`) schedules :class:`Shard` s onto the
:class:`ActorSlot` list these functions fill; what each actor runs is
:class:`workers.ray_actor.ShardWorker`. A run's actors are named
``spcache-shard-<run token>-<index>``, so ``ray list actors`` (and a test) can tell them
apart, and :func:`release_actors` can wait until Ray no longer lists them.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cache_store.errors import ParameterError, RayUnavailable
from workers.ray_actor import ShardWorker
from workers.ray_common import ActorStats, ray_get
from workers.run_ledger import WorkItem

__all__ = [
    "WAIT_TICK_S",
    "ActorSlot",
    "Shard",
    "connect",
    "describe_actors",
    "release_actors",
    "start_actors",
]

logger = logging.getLogger(__name__)

#: Seconds between checks for Ctrl-C while waiting on actors, and between "still
#: waiting for actors" log lines.
WAIT_TICK_S = 1.0
_PLACEMENT_LOG_EVERY_S = 30.0
#: Longest wait, after ``ray.kill``, for this run's actors to leave Ray's actor table.
_RELEASE_TIMEOUT_S = 30.0


@dataclass
class Shard:
    """Items one actor computes in one call; ``deaths``: actors it killed so far,
    ``avoid``: those actors (a retry goes elsewhere when it can)."""

    items: list[WorkItem]
    deaths: int = 0
    avoid: set[int] = field(default_factory=set)
    number: int = 0  # names its parts in a sink, with the attempt (deaths + 1)


@dataclass
class ActorSlot:
    """One actor: ``ready`` for a shard, ``busy`` with one, ``restarting`` after a death
    (``probe`` answers once Ray has it back) or ``gone``."""

    stats: ActorStats
    handle: Any
    state: str = "ready"
    shard: Shard | None = None
    stream: Any = None
    outstanding: dict[str, WorkItem] = field(default_factory=dict)
    since: float = 0.0
    probe: Any = None


def connect(ray: Any, address: str | None, ray_init: Mapping[str, Any]) -> bool:
    """Initialise Ray unless it already is (``address``: a cluster to join; None: a
    local one); True when this call started it."""
    if ray.is_initialized():
        if address is not None:
            logger.warning("Ray is already initialised in this process; using it, not %s", address)
        return False
    options: dict[str, Any] = {"logging_level": logging.WARNING}
    if address is None:
        options.update(address="local", include_dashboard=False)
    else:
        options["address"] = address
    options.update(ray_init)
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        ray.init(**options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RayUnavailable(f"cannot start or join Ray at {options['address']}: {exc}") from exc
    finally:
        # ray.init installs its own SIGTERM handler, which ends the process on the
        # spot; the caller's (the CLI's: stop like Ctrl-C, committing and indexing
        # what was computed) must stay in charge.
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    return True


def start_actors(
    ray: Any,
    slots: list[ActorSlot],
    run_token: str,
    *,
    count: int,
    device: str,
    actors: int | None,
    recipe: str,
    params: Mapping[str, Any],
    actor_options: Mapping[str, Any],
    actor_restarts: int,
    actor_runtime_env: Mapping[str, Any],
    actor_fault: Callable[[str], None] | None,
    sink: Mapping[str, Any] | None,
) -> None:
    """Start the actors for ``count`` items into ``slots`` (one at a time, so a failure
    part way leaves the ones started there to release): ``actors`` of them (default:
    one per GPU, or per CPU without a GPU), never more than items. ``device``: ``auto``,
    ``cpu`` or ``cuda``; the rest is what each :class:`ShardWorker` is made with."""
    resources = ray.cluster_resources()
    cluster_gpus, cluster_cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    use_gpu = device == "cuda" or (device == "auto" and cluster_gpus > 0)
    if device == "cuda" and cluster_gpus == 0:
        raise ParameterError(
            ["device: 'cuda' requested but the Ray cluster has no GPU"],
            what="ray engine options",
        )
    capacity = cluster_gpus if use_gpu else cluster_cpus
    wanted = actors if actors is not None else capacity
    if capacity < 1 or wanted > capacity:
        unit = "GPU" if use_gpu else "CPU"
        raise RayUnavailable(
            f"{wanted} actor(s) of one {unit} each asked for, but the Ray "
            f"cluster has {capacity} {unit}(s)"
        )
    wanted = max(1, min(wanted, count))
    options = dict(actor_options)
    options["device"] = "cuda" if use_gpu else "cpu"
    remote = ray.remote(ShardWorker)
    level = logging.getLogger("workers").getEffectiveLevel()
    for index in range(wanted):
        # Named, so that `ray list actors` (and a test) can tell them apart.
        handle = remote.options(
            name=f"spcache-shard-{run_token}-{index}",
            num_cpus=1,
            num_gpus=1 if use_gpu else 0,
            max_restarts=actor_restarts,
            max_task_retries=0,
            **({"runtime_env": dict(actor_runtime_env)} if actor_runtime_env else {}),
        ).remote(
            recipe,
            dict(params),
            options,
            level,
            actor_fault,
            None if sink is None else dict(sink),
        )
        slots.append(ActorSlot(ActorStats(index), handle))


def describe_actors(ray: Any, slots: list[ActorSlot], placement_timeout_s: float) -> None:
    """Wait until every actor is placed and has resolved its device and backend (noted
    in its slot's stats); :class:`RayUnavailable` after ``placement_timeout_s``."""
    pending = {slot.handle.describe.remote(): slot for slot in slots}
    deadline = time.monotonic() + placement_timeout_s
    last_log = time.monotonic()
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=WAIT_TICK_S)
        for ref in ready:
            slot = pending.pop(ref)
            info = ray_get(ray, ref)
            slot.stats.node, slot.stats.device = info["node"], info["device"]
            slot.stats.backend, slot.stats.gpus = info["backend"], info["gpus"]
            logger.info(
                "actor %d on %s: %s (%s), %d loader process(es), %d torch thread(s)",
                slot.stats.actor,
                info["node"],
                info["device"],
                info["backend"],
                info["loaders"],
                info["threads"],
            )
        now = time.monotonic()
        if pending and now > deadline:
            raise RayUnavailable(
                f"{len(pending)} of {len(slots)} Ray actor(s) were not "
                f"placed within {placement_timeout_s:.0f}s"
            )
        if pending and now - last_log > _PLACEMENT_LOG_EVERY_S:
            logger.warning("waiting for the Ray cluster to place %d actor(s)", len(pending))
            last_log = now


def release_actors(ray: Any, slots: list[ActorSlot], run_token: str) -> None:
    """Kill a run's actors and wait (boundedly) until Ray no longer lists them.

    ``ray.kill`` only asks; the actor is torn down asynchronously. A caller that keeps
    Ray running (a notebook, a test, a driver doing several runs) must get the CPUs
    and GPUs back when :meth:`RayEngine.run` returns, not some time later.
    """
    for slot in slots:
        try:
            ray.kill(slot.handle)
        except Exception as exc:  # noqa: BLE001 - already gone; nothing to release
            logger.debug("ray.kill(actor %d): %s", slot.stats.actor, exc)
    if not run_token or not slots:
        return
    prefix = f"spcache-shard-{run_token}-"
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while True:
        try:
            left = [n for n in ray.util.list_named_actors() if n.startswith(prefix)]
        except Exception as exc:  # noqa: BLE001 - Ray itself is going; nothing to wait on
            logger.debug("list_named_actors: %s", exc)
            return
        if not left:
            return
        if time.monotonic() > deadline:
            logger.warning(
                "%d Ray actor(s) still listed %.0fs after ray.kill: %s",
                len(left),
                _RELEASE_TIMEOUT_S,
                ", ".join(sorted(left)),
            )
            return
        time.sleep(0.05)
