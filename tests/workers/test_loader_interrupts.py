"""Stopping the loader pool at its awkward moments: Ctrl-C (or SIGTERM through
precompute's handler) while it starts a process (held until the executor has recorded
the child, ``workers.loader.interrupts_held``, so stopping the run stops that child too),
and a loader stopped halfway through writing its result (``stop_executor`` turns the
executor's wait for the rest into end-of-file), and a broken pool with a loader that
lives on (``end_pool`` stops it instead of joining it for ever)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.helpers.procs import wait_for
from workers.loader import interrupts_held


def _let_python_run_handlers() -> None:
    for _ in range(20):  # pending handlers run between bytecodes on the main thread
        time.sleep(0.005)


def test_a_ctrl_c_inside_is_delivered_once_on_the_way_out() -> None:
    seen: list[str] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append("handler"))
    try:
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            _let_python_run_handlers()
            seen.append("body done")
        seen.append("after")
        _let_python_run_handlers()
        assert seen == ["body done", "handler", "after"]
        assert signal.getsignal(signal.SIGINT) is not None and seen.count("handler") == 1
    finally:
        signal.signal(signal.SIGINT, previous)


def test_with_the_default_handler_the_interrupt_comes_after_the_body() -> None:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    finished = False
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            _let_python_run_handlers()
            finished = True
        assert finished
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_sigterm_that_raises_is_held_too_and_a_default_one_is_left_alone() -> None:
    """``spcache precompute`` turns SIGTERM into the same interrupt as Ctrl-C."""
    seen: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("terminate"))
    try:
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGTERM)
            _let_python_run_handlers()
            seen.append("body done")
        assert seen == ["body done", "terminate"]
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with interrupts_held():
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_off_the_main_thread_it_changes_nothing() -> None:
    handler = signal.getsignal(signal.SIGINT)
    errors: list[BaseException] = []

    def body() -> None:
        try:
            with interrupts_held():
                assert signal.getsignal(signal.SIGINT) is handler
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert not errors


SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from workers.loader import LoaderPool
    from workers.loader_process import LoaderPopen
    from workers.run_ledger import WorkItem

    launch = LoaderPopen._launch

    def launch_then_interrupt(self, process_obj):
        launch(self, process_obj)  # the child is forked; the executor has not recorded it
        os.kill(os.getpid(), signal.SIGINT)

    if __name__ == "__main__":
        LoaderPopen._launch = launch_then_interrupt
        pool = LoaderPool("spc", {"level": 3, "surface_samples": 100}, "f" * 32, loaders=1)
        pool.open()
        try:
            pool.submit(WorkItem("a", sys.argv[1]))
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        finally:
            pool.abort()
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="the forkserver start method is Linux's")
def test_an_interrupt_while_a_loader_starts_leaves_no_loader_behind(
    tmp_path: Path, corpus_meshes: list[Path]
) -> None:
    script = tmp_path / "interrupt_at_start.py"
    script.write_text(SCRIPT)
    # stderr stays open until every process holding it (a leftover loader too) exits
    proc = subprocess.run(
        [sys.executable, str(script), str(corpus_meshes[0])],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "interrupted"
    assert "Traceback" not in proc.stderr, proc.stderr


HALF_WRITTEN = textwrap.dedent(
    """
    import concurrent.futures as cf, gc, multiprocessing, os, struct, sys, time
    from multiprocessing.queues import SimpleQueue
    from workers.loader import stop_executor

    def half_a_result(marker):
        # as a loader terminated while it writes a large result: a length header
        # promising 1 GiB, a few bytes of it, and no more
        queue = next(o for o in gc.get_objects() if isinstance(o, SimpleQueue))
        os.write(queue._writer.fileno(), struct.pack("!i", 1 << 30) + b"partial")
        open(marker, "w").close()
        time.sleep(600)

    if __name__ == "__main__":
        marker = sys.argv[1]
        pool = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"))
        future = pool.submit(half_a_result, marker)
        while not os.path.exists(marker):
            time.sleep(0.02)
        stop_executor(pool)
        print("stopped", flush=True)
        # the interpreter now joins the executor's thread: it must see end-of-file
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="the forkserver start method is Linux's")
def test_a_loader_stopped_mid_result_lets_the_interpreter_exit(tmp_path: Path) -> None:
    script = tmp_path / "half_written.py"
    script.write_text(HALF_WRITTEN)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "written")],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "stopped"


def _stuck_loader(started: str) -> None:
    """A load that neither SIGTERM nor the executor's end-of-work message can end."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(started).touch()
    time.sleep(3600)


def _dying_loader() -> None:
    os._exit(1)


def test_a_broken_pool_with_a_loader_that_lives_on_is_ended_not_waited_for(
    tmp_path: Path,
) -> None:
    """A loader dies (the pool breaks) while another lives on and never ends by itself:
    ``end_pool`` (what the loader pool's restart and close call) stops it; the executor's
    own ``shutdown(wait=True)`` joins it for ever (a full test run hung there, in
    tests/spcache/test_precompute_anywhere.py's crashing-loader test)."""
    import concurrent.futures as cf
    import multiprocessing

    from workers.loader import end_pool

    pool = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"))
    started = tmp_path / "started"
    stuck = pool.submit(_stuck_loader, str(started))
    wait_for(started.exists, 60, "the stuck loader to start")
    with pytest.raises(cf.process.BrokenProcessPool):
        pool.submit(_dying_loader).result(timeout=60)
    loaders = list(pool._processes.values())
    ended = threading.Event()
    thread = threading.Thread(target=lambda: (end_pool(pool), ended.set()), daemon=True)
    thread.start()
    assert ended.wait(120), "end_pool waited on a loader that never ends"
    assert stuck.done()
    assert loaders and not any(loader.is_alive() for loader in loaders)
