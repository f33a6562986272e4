"""Fault injection for the Ray engine's tests: an actor that dies, or stalls, on a
chosen sample.

Handed to :class:`workers.ray_engine.RayEngine` as ``actor_fault``; Ray pickles it to
every actor. The module is registered to pickle by value, so an actor process need not
be able to import ``tests`` (it only needs ``workers``).
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["CrashOnce", "HoldOnce"]


class CrashOnce:
    """Fault injection for tests: the actor process exits abruptly (``os._exit``) when
    its engine reports ``sample_id``, the first time only.

    "First time" is remembered across processes by creating ``marker`` (a path every
    actor can reach), so the retried shard goes through. ``always=True`` crashes every
    time: a poison sample. ``after=n`` lets the sample's first ``n`` reports in an actor
    through (a run of variants: it crashes with some of the sample's records reported).
    """

    def __init__(self, sample_id: str, marker: str, always: bool = False, after: int = 0) -> None:
        self.sample_id = sample_id
        self.marker = marker
        self.always = always
        self.after = after  # reports of the sample let through first (its first variants)
        self.seen = 0

    def __call__(self, sample_id: str) -> None:
        if sample_id != self.sample_id:
            return
        self.seen += 1
        if self.seen <= self.after:
            return
        if not self.always:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return
            os.close(fd)
        os._exit(17)


class HoldOnce:
    """Fault injection for tests: the first actor whose engine reports ``sample_id``
    writes its Ray actor name to ``marker`` and then stalls (up to ``hold_s``) with
    that sample not yet sent, so a test can kill it while it is provably mid-shard.

    Later reports of the sample (the retried shard, on another actor) go through.
    """

    def __init__(self, sample_id: str, marker: str, hold_s: float = 120.0) -> None:
        self.sample_id = sample_id
        self.marker = marker
        self.hold_s = hold_s

    def __call__(self, sample_id: str) -> None:
        if sample_id != self.sample_id:
            return
        try:  # the claim stays, so only the first actor to get here holds
            os.close(os.open(self.marker + ".claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        import ray

        with open(self.marker + ".tmp", "w") as f:
            f.write(ray.get_runtime_context().get_actor_name() or "")
        os.rename(self.marker + ".tmp", self.marker)  # the whole name, or no marker yet
        time.sleep(self.hold_s)


def register_with_ray() -> None:
    """Make Ray's pickler ship this module's classes by value."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
