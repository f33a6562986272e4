"""Stopping a loader pool at once never leaves its executor's thread waiting forever.

A worker terminated while it writes a large result leaves half a message in the result
pipe; without the fix the executor's management thread waits for the rest forever and the
interpreter, which joins that thread at exit, never ends (``spcache precompute`` stopped
by SIGTERM hung). The test makes a worker write a big result and stops the pool while it
is writing.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import time

from workers.loader import stop_executor


def _big_result(size: int) -> bytes:
    return b"x" * size


def test_a_worker_stopped_mid_result_lets_the_executor_thread_end() -> None:
    ctx = multiprocessing.get_context("forkserver")
    ended = 0
    for _ in range(3):
        pool = cf.ProcessPoolExecutor(1, mp_context=ctx)
        pool.submit(_big_result, 1).result(timeout=60)  # the worker is up
        future = pool.submit(_big_result, 512 * 1024 * 1024)
        time.sleep(0.6)  # building and then writing half a gigabyte into the pipe
        thread = pool._executor_manager_thread  # the thread the interpreter joins at exit
        stop_executor(pool, timeout_s=1.0)
        assert thread is not None
        thread.join(timeout=15)
        assert not thread.is_alive(), "the executor's thread still waits on a dead worker"
        assert future.done()
        ended += 1
    assert ended == 3
