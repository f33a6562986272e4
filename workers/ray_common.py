"""What the Ray driver and its actors share: the error that carries an actor's spcache
error back to the driver, the Ray flavour of the run summary, and getting Ray itself.

Nothing here imports Ray at module level: the local engine's path never loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cache_store.errors import RayUnavailable, SpcacheError, error_from_values, error_values
from workers.run_ledger import Summary

__all__ = [
    "RemoteError",
    "local_error",
    "ActorStats",
    "RaySummary",
    "import_ray",
    "ray_get",
    "raise_local",
]


class RemoteError(Exception):
    """An spcache error raised in an actor, as plain values, so Ray can carry it back.

    spcache's errors take their own constructor arguments (``SourceError(path, reason)``),
    which Ray's exception transport cannot rebuild; this one carries
    :func:`~cache_store.errors.error_values` and is rebuilt by :func:`local_error` in the
    driver as the original class with its attributes.
    """

    def __init__(self, values: dict[str, Any]) -> None:
        super().__init__(values)

    @classmethod
    def of(cls, exc: SpcacheError) -> RemoteError:
        return cls(error_values(exc))


def local_error(exc: BaseException) -> BaseException:
    """The error an actor raised, as the driver should raise it: a carried spcache error
    comes back as its own class (:func:`~cache_store.errors.error_from_values`); anything
    else is Ray's error, with the actor's traceback."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, RemoteError):
        return error_from_values(cause.args[0])
    return exc


@dataclass
class ActorStats:
    """What one actor did during a run (kept by the driver, so a restart loses nothing).

    ``busy_s`` is the time the actor held a shard, from dispatch to its last batch;
    ``samples_per_s`` is ``done / busy_s``.
    """

    actor: int
    node: str = ""
    device: str = ""
    backend: str = ""
    gpus: list[str] = field(default_factory=list)
    shards: int = 0
    done: int = 0
    failed: int = 0
    deaths: int = 0
    busy_s: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.done / self.busy_s if self.busy_s > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "actor": self.actor,
            "node": self.node,
            "device": self.device,
            "backend": self.backend,
            "gpus": list(self.gpus),
            "shards": self.shards,
            "done": self.done,
            "failed": self.failed,
            "deaths": self.deaths,
            "busy_s": round(self.busy_s, 4),
            "samples_per_s": round(self.samples_per_s, 3),
        }


@dataclass
class RaySummary(Summary):
    """:class:`workers.engine.Summary` plus the Ray side of the run.

    ``load_s`` and ``compute_s`` are summed over the actors' engines; ``write_s`` is the
    driver's commit time (the one writer). ``actors`` has one entry per actor;
    ``shard_retries`` counts shards (or parts of shards) queued again after an actor
    died; ``actor_start_s`` is the time from joining Ray until every actor was placed
    and ready (part of ``wall_s``).
    """

    engine: str = "ray"
    actors: list[ActorStats] = field(default_factory=list)
    shard_retries: int = 0
    actor_start_s: float = 0.0

    def as_json(self) -> dict[str, Any]:
        data = super().as_json()
        data["engine"] = self.engine
        data["actors"] = [a.as_json() for a in self.actors]
        data["shard_retries"] = self.shard_retries
        data["timings"]["actor_start_s"] = round(self.actor_start_s, 4)
        return data

    def detail_lines(self) -> list[str]:
        """One human-readable line per actor (the CLI prints them under the summary)."""
        lines = []
        for a in self.actors:
            where = f"{a.node} {a.device}" + (f" gpu {','.join(a.gpus)}" if a.gpus else "")
            lines.append(
                f"  actor {a.actor} ({where}): {a.done} done, {a.failed} failed, "
                f"{a.samples_per_s:.2f} samples/s over {a.busy_s:.1f}s busy"
                + (f", died {a.deaths}x" if a.deaths else "")
            )
        if self.shard_retries:
            lines.append(f"  {self.shard_retries} shard(s) retried after an actor died")
        return lines


# --- talking to Ray ------------------------------------------------------------------------


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable(
            f"the ray engine needs Ray: pip install 'spcache[ray]' ({exc})"
        ) from exc
    return ray


def ray_get(ray: Any, ref: Any) -> Any:
    """``ray.get`` that raises the actor's own error (a ParameterError, a
    BackendUnavailable) rather than Ray's wrapper."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as exc:
        raise RayUnavailable(f"a Ray actor died while starting: {exc}") from exc
    except ray.exceptions.RayTaskError as exc:
        raise_local(exc)


def raise_local(exc: BaseException) -> None:
    error = local_error(exc)
    if error is exc:
        raise exc
    raise error from exc
