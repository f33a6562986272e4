"""The options a :class:`~cache_store.readers.dataset.CachedDataset` is given, checked
where they enter: every problem listed at once in one ``ParameterError``."""

from __future__ import annotations

import os
from collections.abc import Sequence

from cache_store.errors import ParameterError, UnknownName
from cache_store.keys import is_fingerprint
from cache_store.location import parse_location
from cache_store.readers.skipped import ON_ERROR_CHOICES
from cache_store.views.records import VERIFY_CHOICES

__all__ = ["checked_options"]


def checked_options(
    where: str,
    fingerprint_or_recipe: str,
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None,
    *,
    on_miss: str | None,
    on_stale: str | None,
    id_template: str | None,
    on_error: str,
    warm_ahead: int,
    miss_timeout: float,
    verify: str,
) -> tuple[str, str, str]:
    """``(on_miss, on_stale, kind)``: the read modes with their defaults filled in, and
    the kind of location ``where`` is (``"unknown"``: a scheme no store opens).

    Raises:
        ParameterError: listing every problem of the options together.
    """
    if not isinstance(fingerprint_or_recipe, str):
        raise ParameterError(
            [(f"fingerprint_or_recipe: expected a str, got {type(fingerprint_or_recipe).__name__}")]
        )
    on_miss = on_miss or ("compute" if sources is not None else "error")
    problems = []
    if on_miss not in ("error", "compute"):
        problems.append(f"on_miss: expected 'error' or 'compute', got {on_miss!r}")
    elif on_miss == "compute" and sources is None:
        problems.append("on_miss='compute' needs sources= (the paths to compute from)")
    if id_template is not None and sources is None:
        problems.append("id_template= needs sources= (it names the samples found there)")
    on_stale = on_stale or (
        "serve" if sources is None else "compute" if on_miss == "compute" else "error"
    )
    if on_stale not in ("compute", "error", "serve"):
        problems.append(f"on_stale: expected 'compute', 'error' or 'serve', got {on_stale!r}")
    elif on_stale != "serve" and sources is None:
        problems.append(
            f"on_stale={on_stale!r} needs sources= (the files to compare "
            f"records with); without them what is stored is served"
        )
    elif on_stale == "compute" and on_miss != "compute":
        problems.append(
            "on_stale='compute' needs on_miss='compute' (a stale record is recomputed as a miss is)"
        )
    if sources is not None and is_fingerprint(fingerprint_or_recipe):
        problems.append("sources= needs a recipe name (and parameters), not a fingerprint")
    kind: str
    try:
        kind = parse_location(where).kind
    except UnknownName:  # a scheme no store opens: named by open_store, or here
        kind = "unknown"
    if on_miss == "compute" and kind not in ("lmdb", "http"):
        problems.append(
            f"on_miss='compute' needs a cache directory or the service's "
            f"http(s):// URL; {where} is neither"
        )
    if on_error not in ON_ERROR_CHOICES:
        problems.append(f"on_error: expected 'raise' or 'skip', got {on_error!r}")
    if warm_ahead < 0 or miss_timeout <= 0:
        problems.append("warm_ahead >= 0 and miss_timeout > 0 needed")
    if verify not in VERIFY_CHOICES:
        problems.append(f"verify: expected 'once' or 'always', got {verify!r}")
    if problems:
        raise ParameterError(problems)
    return on_miss, on_stale, kind
