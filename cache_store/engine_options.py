"""What an engine run is asked for besides the recipe: one frozen options object.

:class:`EngineOptions` holds the device, the SPC ops backend, the loader processes, the
query chunk, the write batch, the source roots and the largest source, and skip-failed;
its defaults and its checks live here and nowhere else. ``spcache precompute`` and
``spcache worker`` build one from their flags, :func:`spcache.precompute` from its
keyword arguments, the worker loop and the Ray engine (driver and actors) from what they
are given; the engines only read it.

The defaults, one per option:

* ``device="auto"``: the current CUDA device where CUDA works, else the CPU.
* ``backend="auto"``: Kaolin's ops on a CUDA device where Kaolin imports, else torch.
* ``loaders=None`` (auto): :func:`auto_loaders` where the engine runs, one loader
  process per core but one, between 1 and 8. A Ray actor counts its node's CPUs per GPU
  instead, and a CPU-only actor loads in its own process (0): the node's cores are
  already shared out between its actors.
* ``query_chunk=2**18`` queries per device call before any out-of-memory back-off, which
  gives up below ``min_query_chunk=256``; ``write_batch=32`` records per transaction;
  ``prefetch=None``: ``2 * loaders + 2`` samples loaded ahead of the device.
* ``source_roots=None``: any path may be read; ``max_source_bytes=1 GiB``.
* ``skip_failed=False``: samples that failed before are tried again.
* ``time_limit_s=None``: each sample's stages (loading with ``prepare``, and ``compute``)
  get the recipe's own limit, its ``time_limit_s`` class attribute, whose default for
  every recipe is :data:`DEFAULT_TIME_LIMIT_S` (600 s); a number here replaces it for
  the run. What happens to a sample past its limit: :mod:`workers.time_limits`.

No torch here: the service checks its worker's ``--device`` with :func:`check_device`
too, so a device string is checked one way everywhere.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cache_store.errors import UnknownName, UsageError
from cache_store.sources.files import DEFAULT_MAX_SOURCE_BYTES, SourceLimits

__all__ = [
    "BACKENDS",
    "DEFAULT_MIN_QUERY_CHUNK",
    "DEFAULT_QUERY_CHUNK",
    "DEFAULT_TIME_LIMIT_S",
    "DEFAULT_WRITE_BATCH",
    "DEVICE_PATTERN",
    "EngineOptions",
    "MAX_AUTO_LOADERS",
    "auto_loaders",
    "check_backend",
    "check_device",
    "time_limit_problem",
]

#: What ``device`` may be: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
#: The SPC ops backends a run may ask for.
BACKENDS = ("auto", "torch", "kaolin")
DEFAULT_QUERY_CHUNK = 1 << 18
DEFAULT_MIN_QUERY_CHUNK = 256
DEFAULT_WRITE_BATCH = 32
#: the most loader processes ``loaders=None`` starts
MAX_AUTO_LOADERS = 8
#: how long one stage of one sample may take when neither the recipe nor the run says
DEFAULT_TIME_LIMIT_S = 600.0


def check_device(device: object) -> str:
    """``device`` if it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; else
    :class:`~cache_store.errors.UsageError` naming it."""
    if not isinstance(device, str) or not DEVICE_PATTERN.match(device):
        raise UsageError(f"device {device!r}: expected auto, cpu, cuda or cuda:N")
    return device


def check_backend(backend: object) -> str:
    """``backend`` if it is one of :data:`BACKENDS`; else
    :class:`~cache_store.errors.UnknownName` listing them."""
    if backend not in BACKENDS:
        raise UnknownName("SPC backend", str(backend), list(BACKENDS))
    return str(backend)


def auto_loaders(cpus: float | None = None) -> int:
    """Loader processes for ``loaders=None``: one per core but one (the device step needs
    one), between 1 and :data:`MAX_AUTO_LOADERS`. ``cpus``: the cores the engine has
    (default: this machine's)."""
    cores = (os.cpu_count() or 2) if cpus is None else cpus
    return int(max(1, min(MAX_AUTO_LOADERS, cores - 1)))


def time_limit_problem(value: object) -> str:
    """Why ``value`` is not a time limit (a finite number of seconds above 0), or ""."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{value!r} is not a number of seconds"
    if not math.isfinite(value) or value <= 0:
        return f"{value!r} must be a finite number of seconds above 0"
    return ""


@dataclass(frozen=True)
class EngineOptions:
    """How an engine runs a recipe (see the module docstring for each default).

    Attributes:
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        backend: SPC ops: ``"auto"``, ``"torch"`` (pure PyTorch, any device) or
            ``"kaolin"`` (CUDA only).
        loaders: loader processes reading sources ahead of the device; 0 reads in the
            engine's process; None: :func:`auto_loaders` where the engine runs.
        query_chunk: queries per device call before any out-of-memory back-off.
        min_query_chunk: the back-off gives up below this chunk size.
        write_batch: records per write transaction.
        prefetch: samples loaded ahead of the device; None: ``2 * loaders + 2``.
        source_roots: directories every source must resolve into (checked again when the
            file is opened); None allows any path. Kept as a tuple of strings.
        max_source_bytes: the largest source file read; a larger one fails alone.
        skip_failed: do not retry a sample whose unchanged source failed before with the
            same recipe and parameters.
        time_limit_s: seconds each stage of a sample may take (loading with ``prepare``,
            then ``compute``); None: the recipe's own ``time_limit_s``.

    Raises :class:`~cache_store.errors.UsageError` naming every value out of its range,
    :class:`~cache_store.errors.UnknownName` for an unknown backend.
    """

    device: str = "auto"
    backend: str = "auto"
    loaders: int | None = None
    query_chunk: int = DEFAULT_QUERY_CHUNK
    min_query_chunk: int = DEFAULT_MIN_QUERY_CHUNK
    write_batch: int = DEFAULT_WRITE_BATCH
    prefetch: int | None = None
    source_roots: tuple[str, ...] | None = None
    max_source_bytes: int = DEFAULT_MAX_SOURCE_BYTES
    skip_failed: bool = False
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        check_backend(self.backend)
        problems = []
        try:
            check_device(self.device)
        except UsageError as exc:
            problems.append(str(exc))
        for name, least in (
            ("loaders", 0),
            ("query_chunk", 1),
            ("min_query_chunk", 1),
            ("write_batch", 1),
            ("prefetch", 1),
            ("max_source_bytes", 1),
        ):
            value = getattr(self, name)
            if value is None and name in ("loaders", "prefetch"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                problems.append(f"{name}: {value!r} is not a whole number")
            elif value < least:
                problems.append(f"{name}: {value} must be {least} or more")
        if self.time_limit_s is not None and (problem := time_limit_problem(self.time_limit_s)):
            problems.append(f"time_limit_s: {problem}")
        if problems:
            raise UsageError("engine options: " + "; ".join(problems))
        if self.source_roots is not None:  # a list, paths: kept as plain strings
            roots: Any = self.source_roots
            if isinstance(roots, str | os.PathLike):
                roots = (roots,)
            object.__setattr__(self, "source_roots", tuple(os.fspath(r) for r in roots))

    @classmethod
    def of(cls, options: EngineOptions | None = None, **changes: Any) -> EngineOptions:
        """``options`` (default: the defaults) with ``changes`` (field names; an unknown
        one is a ``TypeError``), checked again."""
        return dataclasses.replace(options or cls(), **changes)

    @property
    def loader_count(self) -> int:
        """``loaders``, with None resolved for this machine (:func:`auto_loaders`)."""
        return auto_loaders() if self.loaders is None else self.loaders

    def source_limits(self, roots: Sequence[str | os.PathLike[str]] | None = None) -> SourceLimits:
        """The source gate's limits: ``source_roots`` (or ``roots``, given) resolved and
        ``max_source_bytes``."""
        return SourceLimits.of(self.source_roots if roots is None else roots, self.max_source_bytes)

    def as_json(self) -> dict[str, Any]:
        """Plain values (what crosses to a Ray actor); :meth:`from_json` reads them back."""
        data = dataclasses.asdict(self)
        data["source_roots"] = None if self.source_roots is None else list(self.source_roots)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EngineOptions:
        return cls(**data)
