"""How a loader process starts: from the forkserver, without the caller's ``__main__``.

multiprocessing starts a ``spawn`` or ``forkserver`` child by sending it "preparation
data" (:func:`multiprocessing.spawn.get_preparation_data`) ahead of its task. Among them
is the parent's main module, by path or by module name, and the child runs that module
again as ``__mp_main__`` before it reads its task (``spawn.prepare``), so that functions
defined in a script unpickle there. That is why a script needs ``if __name__ ==
"__main__":`` under these start methods: without the guard the child reruns the whole
script, and its own ``spcache.precompute`` call cannot start processes while the child
is still starting. From ``python -`` the "path" is ``<stdin>``, which no child can read
again. Each loader died as it started, and the engine took every sample for one that
killed its loader.

A loader needs nothing from the caller's main module: it runs spcache's code
(:func:`workers.loader.load_sample`) on plain values, and finds the recipe by name the way
every process does (built-ins, entry points, ``SPCACHE_RECIPES``:
:mod:`cache_store.recipes.registry`). So its preparation data leave the main module out
(:func:`loader_preparation_data`); the rest (``sys.path``, the working directory,
``sys.argv``, the authentication key, the logging level) goes as multiprocessing sends
it. A script with or without the guard, ``python -``, ``python -c``, a notebook and an
embedded interpreter start loaders the same way.

The stdlib has no switch for this, so :class:`LoaderPopen` replaces the one method of
``multiprocessing.popen_forkserver.Popen`` that builds and sends the data (its protocol is
the same from Python 3.11 to 3.14). Where the platform has no forkserver, loaders start
by ``spawn``, which imports the main module as multiprocessing always does.
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.context
import multiprocessing.spawn
import os
from typing import Any

__all__ = ["MAIN_MODULE_KEYS", "loader_context", "loader_preparation_data"]

#: The preparation data that make a child run its parent's main module again.
MAIN_MODULE_KEYS = ("init_main_from_name", "init_main_from_path")

#: What the forkserver imports once, so that each loader forks ready (CPU only: the
#: server never runs an op). The first module makes the server ignore Ctrl-C.
FORKSERVER_PRELOAD = ["workers.loader_preload", "workers.loader", "trimesh"]


def loader_preparation_data(name: str) -> dict[str, Any]:
    """What a loader process is told about its parent before its task: multiprocessing's
    preparation data without the parent's main module (:data:`MAIN_MODULE_KEYS`)."""
    data = multiprocessing.spawn.get_preparation_data(name)
    for key in MAIN_MODULE_KEYS:
        data.pop(key, None)
    return data


def loader_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context the loader pool starts its processes with: the
    forkserver (preloaded with :data:`FORKSERVER_PRELOAD` when this process starts it)
    and :class:`LoaderPopen`; ``spawn`` where there is no forkserver."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = _LoaderContext()
    # Takes effect when this process first starts its forkserver (shared with any other
    # forkserver user of this process).
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


if "forkserver" in multiprocessing.get_all_start_methods():
    from multiprocessing import forkserver, popen_forkserver, reduction, util

    class LoaderPopen(popen_forkserver.Popen):
        """Starts one loader through the forkserver (see the module doc)."""

        def _launch(self, process_obj: Any) -> None:
            message = io.BytesIO()
            # Process objects hold their authentication key; it pickles only while
            # this Popen is the one "spawning" (as multiprocessing checks).
            multiprocessing.context.set_spawning_popen(self)
            try:
                reduction.dump(loader_preparation_data(process_obj._name), message)
                reduction.dump(process_obj, message)
            finally:
                multiprocessing.context.set_spawning_popen(None)
            # The forkserver forks the child and hands back the read end of its exit
            # status (the sentinel) and the write end of the child's data pipe.
            self.sentinel, data_fd = forkserver.connect_to_new_process(
                self._fds  # type: ignore[attr-defined]  # the fds the process object sends
            )
            # The child learns that its parent is gone from end-of-file on its data pipe:
            # a copy of the write end stays open for as long as this Popen lives.
            parent_fd = os.dup(data_fd)
            self.finalizer = util.Finalize(
                self,
                util.close_fds,  # type: ignore[attr-defined]
                (parent_fd, self.sentinel),
            )
            with open(data_fd, "wb", closefd=True) as pipe:
                pipe.write(message.getbuffer())
            self.pid = forkserver.read_signed(self.sentinel)

    class LoaderProcess(multiprocessing.context.ForkServerProcess):
        """A process of the loader pool, started by :class:`LoaderPopen`."""

        @staticmethod
        def _Popen(process_obj: Any) -> LoaderPopen:
            return LoaderPopen(process_obj)

    class _LoaderContext(multiprocessing.context.ForkServerContext):
        Process = LoaderProcess
