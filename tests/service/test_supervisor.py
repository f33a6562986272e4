"""The worker child of `spcache serve`: restarted when it dies, stopped on shutdown."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from service.supervisor import WorkerSupervisor, worker_command


def _wait(predicate, timeout: float = 120.0) -> bool:  # a bound on a loaded machine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_worker_command_runs_the_worker_module_with_this_python() -> None:
    cmd = worker_command("/c", device="cuda:1", backend="torch")
    assert cmd[:4] == [sys.executable, "-m", "spcache", "worker"]
    assert cmd[cmd.index("--device") + 1] == "cuda:1" and "/c" in cmd
    assert "--source-root" not in cmd


def test_worker_command_passes_the_source_roots_to_the_worker_parser(tmp_path: Path) -> None:
    from spcache import cli

    cmd = worker_command("/c", source_roots=[tmp_path / "a", tmp_path / "b"])
    parser = cli.subcommand_parser("worker", cli.resolve("worker"))
    args = parser.parse_args(cmd[cmd.index("worker") + 1 :])
    assert [str(r) for r in args.source_roots] == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_a_dead_worker_is_restarted_with_backoff_and_stopped_cleanly(tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    script = f"import time; open({str(marker)!r}, 'a').write('x'); time.sleep(60)"
    sup = WorkerSupervisor(
        [sys.executable, "-c", script], first_backoff_s=0.05, max_backoff_s=0.2, stop_grace_s=5
    )
    sup.start()
    try:
        assert _wait(lambda: sup.pid is not None and marker.exists())
        first = sup.pid
        os.kill(first, signal.SIGKILL)
        assert _wait(lambda: sup.pid not in (None, first))
        assert _wait(lambda: marker.read_text() == "xx")
        assert sup.restarts == 1
    finally:
        code = sup.stop()
    assert code == -signal.SIGTERM and sup.pid is None


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(ready)!r}, 'w').close(); time.sleep(60)"
    )
    sup = WorkerSupervisor([sys.executable, "-c", script], stop_grace_s=0.5)
    sup.start()
    assert _wait(ready.exists)
    assert sup.stop() == -signal.SIGKILL


def test_no_second_worker_while_another_live_process_owns_the_cache(tmp_path: Path, caplog) -> None:
    from tests.helpers.procs import start

    marker = tmp_path / "starts"
    script = f"import time; open({str(marker)!r}, 'a').write('x'); time.sleep(60)"
    # another process owns the cache, as a worker started by hand would
    owner = start(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from cache_store.jobs.owner_lock import WorkerLock; "
                f"WorkerLock({str(tmp_path)!r}).acquire(worker_id='other'); print('held', flush=True); "
                "time.sleep(60)"
            ),
        ]
    )
    owner.wait_line("^held$")
    holder = owner.pid
    sup = WorkerSupervisor(
        [sys.executable, "-c", script],
        first_backoff_s=0.1,
        max_backoff_s=0.2,
        stop_grace_s=5,
        cache=tmp_path,
    )
    with caplog.at_level("WARNING", logger="service.supervisor"):
        sup.start()
        try:
            time.sleep(1.0)
            assert sup.pid is None and not marker.exists()
            assert f"is owned by worker pid {holder} on " in caplog.text
            assert "id other" in caplog.text
            owner.kill()  # the owner dies: the kernel drops its lock
            assert _wait(lambda: sup.pid is not None and marker.exists())
        finally:
            sup.stop()
            owner.kill()


def test_the_worker_child_is_told_its_parents_pid(tmp_path: Path) -> None:
    out = tmp_path / "env"
    script = f"import os; open({str(out)!r}, 'w').write(os.environ['SPCACHE_PARENT_PID'])"
    sup = WorkerSupervisor([sys.executable, "-c", script], first_backoff_s=5)
    sup.start()
    try:
        assert _wait(lambda: out.exists() and out.read_text() != "")
    finally:
        sup.stop()
    assert out.read_text() == str(os.getpid())


def test_a_worker_that_refuses_its_options_is_not_restarted(tmp_path: Path, caplog) -> None:
    marker = tmp_path / "starts"
    script = f"import sys; open({str(marker)!r}, 'a').write('x'); sys.exit(2)"
    sup = WorkerSupervisor(
        [sys.executable, "-c", script], first_backoff_s=0.05, max_backoff_s=0.1, stop_grace_s=5
    )
    with caplog.at_level("ERROR", logger="service.supervisor"):
        sup.start()
        try:
            assert _wait(lambda: sup.gave_up)
            time.sleep(0.5)  # several backoffs: a restart would have happened by now
            assert marker.read_text() == "x" and sup.restarts == 0
        finally:
            sup.stop()
    assert "refused to start (exit 2" in caplog.text and "not restarting it" in caplog.text


def test_serve_refuses_a_kaolin_worker_on_a_non_cuda_device(tmp_path: Path, capsys) -> None:
    from spcache.cli import main

    args = ["serve", "--cache", str(tmp_path / "c"), "--port", "0", "--backend", "kaolin"]
    assert main([*args, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--backend kaolin needs a CUDA --device" in err
    assert "not cpu" in err
