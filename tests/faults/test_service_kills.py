"""Case 13: SIGKILL the service; its worker must not be left orphaned.

``spcache serve`` starts one worker child. Killed with SIGKILL, the service cannot stop
it; without a parent-death hook the worker lives on, reparented to init, and the next
service starts a second worker on the same cache. The worker learns
of its parent's death from the kernel (``PR_SET_PDEATHSIG``) and exits; while a worker
still owns the cache (its flock), a new service starts none.

Each round: start serve (with its worker), wait until the worker holds the cache's lock,
SIGKILL the service, time until the worker is gone. Then a new service on the same
cache must get a worker of its own.
"""

from __future__ import annotations

import signal
import statistics
import time
from pathlib import Path

import pytest

from cache_store.jobs.owner_lock import lock_holder
from tests.helpers.faults import env_int, report
from tests.helpers.procs import has_descendant, serve, tree, wait_for, wait_gone

ROUNDS = env_int("SPCACHE_FAULT_SERVICE_KILLS", 4)
#: a bound on waiting for the orphaned worker to go (the figures report how long it took;
#: a worker that outlives it has missed its parent's death)
WORKER_EXIT_BOUND_S = 120.0


@pytest.mark.slow
def test_sigkill_of_the_service_leaves_no_worker(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    exits: list[float] = []
    orphans = 0
    for round_ in range(ROUNDS + 1):
        with serve("--cache", cache, "--device", "cpu") as server:
            proc = server.proc
            # wait_for calls each lambda at once; the defaults bind this round's values
            wait_for(
                lambda proc=proc: has_descendant(proc.pid, "spcache", "worker"),
                what="the worker child",
                proc=proc,
            )
            # a new service gets a worker of its own: the last round's is gone
            wait_for(
                lambda proc=proc: (
                    (lock_holder(cache) or {}).get("pid") in {p.pid for p in tree(proc.pid)[1:]}
                ),
                what="the worker to own the cache",
                proc=proc,
            )
            if round_ == ROUNDS:
                server.stop()
                break
            worker = tree(proc.pid)[1:]
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            killed = time.monotonic()
            left = wait_gone(worker, WORKER_EXIT_BOUND_S)
            if left:
                orphans += 1
            exits.append(time.monotonic() - killed)
            # the kernel drops the flock with the worker's last descriptor
            wait_for(
                lambda: lock_holder(cache) is None,
                WORKER_EXIT_BOUND_S,
                f"the lock to be free (holder {lock_holder(cache)}, left {left})",
            )
    report(
        "13 service SIGKILL",
        {
            "rounds": ROUNDS,
            "orphaned_workers": orphans,
            "worker_exit_s_median": round(statistics.median(exits), 2),
            "worker_exit_s_max": round(max(exits), 2),
        },
    )
    assert orphans == 0
