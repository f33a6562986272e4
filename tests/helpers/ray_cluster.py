"""One local Ray instance for a test module: two CPUs, no dashboard, stopped after."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

import psutil


def ray_processes(parent: int) -> list[psutil.Process]:
    """The Ray daemons started by process ``parent`` (not those of other Ray users on
    this machine, e.g. another test run at the same time)."""
    names = ("raylet", "gcs_server")
    return [
        p
        for p in psutil.process_iter(["name", "ppid"])
        if p.info["name"] in names and p.info["ppid"] == parent
    ]


@contextlib.contextmanager
def local_ray(num_cpus: int = 2) -> Iterator[Any]:
    import ray

    from tests.helpers.ray_faults import register_with_ray

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    register_with_ray()  # actors unpickle CrashOnce without importing tests/
    started = ray_processes(os.getpid())
    assert started, "ray.init started no raylet/gcs_server of its own"
    try:
        yield ray
    finally:
        ray.shutdown()
        for sig, handler in handlers.items():  # ray.init replaced them for this process
            signal.signal(sig, handler)
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, f"Ray processes left running: {alive}"
