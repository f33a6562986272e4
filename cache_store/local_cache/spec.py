"""``local_cache=`` and ``cache_limit=`` as a reader takes them, parsed where they enter.

:class:`LocalCache` is the parsed value (an absolute directory and a limit in bytes,
the size read by :func:`cache_store.housekeeping.units.parse_size`, the one size
parser); :func:`local_cache_option` checks the pair against the location it is for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cache_store.errors import ParameterError
from cache_store.housekeeping.units import parse_size
from cache_store.location import is_remote

__all__ = ["LocalCache", "local_cache_option"]


@dataclass(frozen=True)
class LocalCache:
    """``local_cache=`` and ``cache_limit=`` as given to a reader, parsed: a directory
    (absolute) and a limit in bytes. Plain values, so a dataset holding one forks cheaply."""

    directory: str
    limit: int

    @classmethod
    def parse(cls, directory: str | os.PathLike[str], limit: int | str | None) -> LocalCache:
        """Parse ``cache_limit`` (bytes, or a size: ``"20G"``) once, where it enters."""
        if limit is None:
            raise ParameterError(["local_cache= needs cache_limit= (bytes, or a size: '20G')"])
        try:
            value = parse_size(limit)
        except (ValueError, TypeError) as exc:
            raise ParameterError([f"cache_limit: {exc}"]) from None
        if value <= 0:
            raise ParameterError([f"cache_limit: must be more than 0 bytes, got {limit!r}"])
        return cls(os.path.abspath(os.fspath(directory)), value)


def local_cache_option(
    cache: object,
    kind: str,
    local_cache: str | os.PathLike[str] | None,
    cache_limit: int | str | None,
) -> LocalCache | None:
    """A reader's ``local_cache=`` and ``cache_limit=`` over ``cache`` (a location of kind
    ``kind``, or a Store), parsed; None without them. ``ParameterError`` naming the
    argument and the reason."""
    if local_cache is None:
        if cache_limit is not None:
            raise ParameterError(["cache_limit= needs local_cache= (the directory it bounds)"])
        return None
    where = getattr(cache, "location", None) or os.fspath(cache)  # type: ignore[call-overload]
    if not isinstance(cache, (str, os.PathLike)):
        raise ParameterError(
            [f"local_cache= needs a location (s3://....zarr), not a built {type(cache).__name__}"]
        )
    if kind == "http":
        raise ParameterError(
            [
                (
                    f"local_cache=: {where} is the service; its records are not read "
                    f"through a local directory (a remote snapshot, s3://....zarr, is): "
                    f"read it without local_cache="
                )
            ]
        )
    if kind != "zarr" or not is_remote(where):
        raise ParameterError(
            [
                (
                    f"local_cache=: {where} is on this machine already; local_cache is "
                    f"for a remote snapshot (s3://....zarr)"
                )
            ]
        )
    return LocalCache.parse(local_cache, cache_limit)
