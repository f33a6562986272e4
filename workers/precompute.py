"""One precompute run from start to end: check the options, find the sources, open the
cache, run the engine (local or Ray), close everything.

The one code path behind both ``spcache precompute`` (:mod:`spcache.cli.precompute`,
which adds argument parsing, exit statuses and printing) and the library call
:func:`spcache.precompute` (which turns the :class:`~workers.run_ledger.Summary` into a
frozen result). It raises instead of exiting, and leaves nothing open when it returns or
raises: the loader processes have ended, the store (its LMDB environment) and the failure
log (SQLite) are closed, the writer thread has finished, and a SIGTERM handler it
installed is the previous one again. So a script can fork DataLoader workers right after
it, and a notebook can call it again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from cache_store.engine_options import EngineOptions
from cache_store.errors import SpcacheError, UsageError
from cache_store.keys import validate_variant_count
from cache_store.location import LocationLike, check_cache_dir, parse_location
from cache_store.process_local import this_process_only
from cache_store.sources.discover import describe_left_out, discover

__all__ = ["ENGINES", "run_precompute"]

log = logging.getLogger(__name__)

#: The engines a run may use: this process and its loaders, or Ray actors.
ENGINES = ("local", "ray")


def run_precompute(
    sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    recipe: str,
    cache: LocationLike,
    *,
    params: Mapping[str, Any] | None = None,
    options: EngineOptions | None = None,
    progress: bool = False,
    engine: str = "local",
    address: str | None = None,
    actors: int | None = None,
    id_template: str | None = None,
    variants: int = 1,
) -> Any:
    """Compute ``recipe`` with ``params`` over ``sources`` into the cache ``cache``.

    ``sources``: files, directories (searched recursively) and manifests, as
    :func:`cache_store.sources.discover.discover_sources` reads them. ``cache``: a cache
    directory, or a ``*.zarr`` sharded snapshot (a path or a URL), as a string or a parsed
    :class:`~cache_store.location.Location`. ``options``: how the engine runs
    (:class:`~cache_store.engine_options.EngineOptions`; its defaults when None; with
    ``engine="ray"``, ``loaders`` is per actor). Returns the engine's
    :class:`workers.run_ledger.Summary` (a :class:`workers.ray_common.RaySummary` with
    ``engine="ray"``); samples that failed are in it, not raised. ``id_template`` makes
    the sample ids from the files' relative paths
    (:func:`cache_store.sources.discover.sample_id_for`; ``"{path}"`` keeps the extension).
    ``variants``: records computed per sample (variant 0 and ``variants - 1`` more, each
    from its own seeded generator; :mod:`workers.engine`).

    Raises:
        UsageError: a bad option, no source found, or a cache that cannot be opened.
        ParameterError: a recipe parameter out of its schema (UnknownName: no such recipe).
        BackendUnavailable: the ops backend (or the device) asked for does not work here.
        StoreFull: the cache filled up; the records committed before it are kept.
        KeyboardInterrupt: Ctrl-C, or SIGTERM while this runs in the main thread; what was
            computed is committed and indexed first.
    """
    from workers.recipe_run import get_recipe

    variants = validate_variant_count(variants)
    options = options or EngineOptions()
    resolved = get_recipe(recipe).spec.resolve(dict(params or {}))
    if engine not in ENGINES:
        raise UsageError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if engine == "local" and (address is not None or actors is not None):
        raise UsageError("address and actors need the ray engine (--engine ray)")
    if actors is not None and actors < 1:
        raise UsageError(f"actors {actors}: must be 1 or more")
    if options.backend == "kaolin" and engine == "local":
        # kaolin on a CPU device, or without Kaolin or CUDA: refused before the cache or any
        # sample is touched (never one failure per sample); asks CUDA only is_available()
        from workers.ops import select_backend

        select_backend("kaolin", options.device)
    try:
        location = parse_location(cache)
    except SpcacheError as exc:
        raise UsageError(f"cache {cache}: {exc}") from exc
    if location.kind == "http":
        raise UsageError(
            f"cache {cache}: precompute writes into a cache directory or a "
            f"snapshot (*.zarr, local or s3://...), not a service URL"
        )
    if location.is_local:
        check_cache_dir(location, write=True)
    source_list = [sources] if isinstance(sources, str | os.PathLike) else list(sources)
    found = discover(source_list, id_template=id_template)
    items, left_out = found.items, describe_left_out(found.left_out)
    if not items:
        raise UsageError(
            "no supported source files found in "
            + ", ".join(map(str, source_list))
            + (f" ({left_out})" if left_out else "")
        )
    if left_out:
        log.info("%s", left_out)

    from cache_store.stores.opener import open_store

    try:
        # a local location is a path from here on; a URL never becomes one
        store = open_store(location.path() if location.is_local else location, readonly=False)
    except (SpcacheError, OSError) as exc:
        raise UsageError(f"cannot open cache {cache}: {exc}") from exc
    try:
        try:
            runner = _make_engine(
                store,
                recipe,
                resolved,
                options,
                engine=engine,
                progress=progress,
                address=address,
                actors=actors,
            )
        except (SpcacheError, OSError) as exc:
            raise UsageError(f"cannot open cache {cache}: {exc}") from exc
        with _sigterm_as_interrupt(), _progress_logging(progress):
            summary = runner.run(items, variants=variants)
        summary.left_out = dict(found.left_out)
        return summary
    finally:
        store.close()


def _make_engine(
    store: Any,
    recipe: str,
    params: dict[str, Any],
    options: EngineOptions,
    *,
    engine: str,
    progress: bool,
    address: str | None,
    actors: int | None,
) -> Any:
    if engine == "ray":  # Ray is imported only on this path
        from workers.ray_engine import RayEngine

        return RayEngine(
            store,
            recipe,
            params,
            options=options,
            progress=progress,
            address=address,
            actors=actors,
        )
    from workers.engine import Engine

    return Engine(store, recipe, params, options=options, progress=progress)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (``docker stop``; SIGHUP via the CLI) ends the run like Ctrl-C: what was
    computed is committed and indexed. Only the main thread can set a handler; elsewhere
    (a worker thread of the caller's) the process's handling is left alone. The previous
    handler is back when the run ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, this_process_only(_terminate))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _progress_logging(progress: bool) -> Iterator[None]:
    """While a bar is shown, log lines go through the bar so they do not break it."""
    if not progress:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    from workers.progress import progress_bar_class

    with logging_redirect_tqdm(tqdm_class=progress_bar_class()):
        yield
