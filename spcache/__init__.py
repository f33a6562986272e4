"""spcache: precompute GPU-derived 3D features into a cache; read them in training.

The one import for Python code::

    import spcache

    result = spcache.precompute("meshes/", "spc_query", "cache", level=8)
    dataset = spcache.CachedDataset("cache", result.fingerprint)
    loader = DataLoader(dataset, batch_size=8, num_workers=4, collate_fn=spcache.collate_spc)

``__all__`` is the public surface; what it does not list is internal. ``import spcache``
stays light: torch, the engine and the readers load when a name that needs them is first
used (PEP 562), so the service and the command line start without them.

The command line is ``spcache COMMAND ...`` (the package :mod:`spcache.cli`, one module
per command): each command calls the library function that does the work:
``cache_store`` for what reads a cache at rest (verify, stats, export, recipes),
``service`` for ``serve``, ``workers`` for what may touch a GPU (precompute, worker,
demo).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cache_store.errors import __all__ as ERROR_NAMES
from cache_store.errors import *  # noqa: F403 - the error classes, below
from cache_store.lazy_names import lazy_names
from cache_store.version import __version__

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from cache_store.housekeeping import compact, ls, prune, rm
    from cache_store.readers.collate import collate_spc
    from cache_store.readers.dataset import CachedDataset
    from cache_store.readers.loader import DataLoader
    from cache_store.readers.sampler import Sampler
    from cache_store.recipes.functional import recipe
    from cache_store.readers.to_kaolin import to_kaolin_spc
    from cache_store.sources.discover import KEEP_EXTENSION, discover_sources
    from spcache import recipes
    from spcache.compute import FailedSample, PrecomputeResult, Timings, precompute

# public name -> module that defines it, imported on first access (PEP 562)
_LAZY: dict[str, str] = {
    "precompute": "spcache.compute",
    "PrecomputeResult": "spcache.compute",
    "FailedSample": "spcache.compute",
    "Timings": "spcache.compute",
    "CachedDataset": "cache_store.readers.dataset",
    "Sampler": "cache_store.readers.sampler",
    "recipe": "cache_store.recipes.functional",
    "DataLoader": "cache_store.readers.loader",
    "collate_spc": "cache_store.readers.collate",
    "to_kaolin_spc": "cache_store.readers.to_kaolin",
    "discover_sources": "cache_store.sources.discover",
    "KEEP_EXTENSION": "cache_store.sources.discover",
    "ls": "cache_store.housekeeping",
    "rm": "cache_store.housekeeping",
    "prune": "cache_store.housekeeping",
    "compact": "cache_store.housekeeping",
    # the recipe API, a submodule: the value is the module itself
    "recipes": "spcache.recipes",
}

__all__ = [
    "__version__",
    # running
    "precompute",
    "PrecomputeResult",
    "FailedSample",
    "Timings",
    "discover_sources",
    "KEEP_EXTENSION",  # id_template= that keeps the extension (--id-keep-ext)
    # your own features: spcache.recipes.Recipe, Param, Field; spcache.recipe(fn)
    "recipes",
    "recipe",
    # a cache's fingerprints: list, remove, prune least recently used, give disk back
    "ls",
    "rm",
    "prune",
    "compact",
    # reading
    "CachedDataset",
    "Sampler",  # an epoch order for any ranks, resumable; a fresh variant per epoch
    "DataLoader",
    "collate_spc",
    "to_kaolin_spc",
]
# the errors, every one a SpcacheError: the classes of cache_store.errors, whose __all__
# is the one list of them (a small module, stdlib only: loading it keeps the front door
# light)
__all__ += list(ERROR_NAMES)
del ERROR_NAMES


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
