"""Stopping: SIGTERM, SIGINT or SIGHUP to an spcache process that started children leaves
no process and no bound port; a second worker on an owned cache is refused by name.

Real process trees (``python -m spcache ...``) watched with psutil.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO_ROOT
from tests.helpers.proctree import (
    free_port,
    has_descendant,
    kill_all,
    port_is_free,
    spcache,
    tree,
    wait_for,
    wait_gone,
)


def _log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"]
)
def test_a_signal_to_serve_stops_it_and_its_worker(tmp_path: Path, signum: int) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    proc = spcache(
        "serve", "--cache", str(tmp_path / "cache"), "--port", str(port), "--device", "cpu", log=log
    )
    procs = []
    try:
        wait_for(lambda: not port_is_free(port), 60, "serve to listen")
        wait_for(lambda: has_descendant(proc.pid, "spcache", "worker"), 60, "the worker child")
        wait_for(lambda: (tmp_path / "cache" / "worker.lock").exists(), 60, "the worker's lock")
        procs = tree(proc.pid)
        assert len(procs) >= 2
        proc.send_signal(signum)
        proc.wait(timeout=60)
        assert wait_gone(procs, 30) == [], _log(log)[-3000:]
        assert port_is_free(port)
    finally:
        kill_all(procs or tree(proc.pid))


@pytest.mark.slow
def test_sigterm_to_a_worker_stops_it(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    (tmp_path / "cache").mkdir()
    proc = spcache(
        "worker", "--cache", str(tmp_path / "cache"), "--device", "cpu", "--poll", "0.2", log=log
    )
    try:
        wait_for(lambda: "draining" in _log(log), 60, "the worker to start")
        procs = tree(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert wait_gone(procs, 10) == []
    finally:
        kill_all(tree(proc.pid))


@pytest.mark.slow
def test_sigterm_to_precompute_stops_it_and_its_loaders(tmp_path: Path) -> None:
    import trimesh

    sources = tmp_path / "sources"
    sources.mkdir()
    mesh = trimesh.creation.icosphere(subdivisions=3)
    for i in range(24):
        mesh.export(sources / f"s{i:02d}.obj")
    log = tmp_path / "precompute.log"
    proc = spcache(
        "precompute",
        str(sources),
        "--recipe",
        "spc",
        "--param",
        "level=6",
        "--param",
        "surface_samples=4000000",
        "--cache",
        str(tmp_path / "cache"),
        "--device",
        "cpu",
        "--loaders",
        "2",
        "--json",
        log=log,
    )
    try:
        wait_for(lambda: len(tree(proc.pid)) >= 3, 60, "the loader processes")
        procs = tree(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130, _log(log)[-3000:]
        assert wait_gone(procs, 15) == []
    finally:
        kill_all(tree(proc.pid))


@pytest.mark.slow
def test_ctrl_c_on_precompute_says_so_at_once_and_stops_within_seconds(tmp_path: Path) -> None:
    import trimesh

    sources = tmp_path / "sources"
    sources.mkdir()
    mesh = trimesh.creation.icosphere(subdivisions=3)
    for i in range(24):
        mesh.export(sources / f"s{i:02d}.obj")
    log = tmp_path / "precompute.log"
    # loads that take seconds each (4 M surface samples): the loaders are busy when it lands
    proc = spcache(
        "precompute",
        str(sources),
        "--recipe",
        "spc",
        "--param",
        "level=6",
        "--param",
        "surface_samples=4000000",
        "--cache",
        str(tmp_path / "cache"),
        "--device",
        "cpu",
        "--loaders",
        "2",
        log=log,
    )
    try:
        # main, resource tracker, forkserver and its 2 loaders, busy with their loads
        wait_for(lambda: len(tree(proc.pid)) >= 5, 60, "the loader processes")
        time.sleep(1)
        procs = tree(proc.pid)
        start = time.monotonic()
        for p in procs:  # a terminal's Ctrl-C reaches the whole process group
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGINT)
        wait_for(lambda: "stopping" in _log(log), 2, "the stopping line")
        said = time.monotonic() - start
        assert proc.wait(timeout=60) == 130, _log(log)[-3000:]
        stopped = time.monotonic() - start
        assert wait_gone(procs, 15) == []
    finally:
        kill_all(tree(proc.pid))
    assert said < 1.0 and stopped < 4.0, (said, stopped)
    assert _log(log).splitlines()[0].startswith("spcache precompute: stopping")


@pytest.mark.slow
def test_sigterm_to_demo_stops_it_the_service_and_the_worker(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "demo.log"
    proc = spcache(
        "demo", "--dir", str(tmp_path / "demo"), "--port", str(port), "--level", "4", log=log
    )
    procs = []
    try:
        wait_for(
            lambda: "Ctrl-C stops the service." in _log(log) or proc.poll() is not None,
            300,
            "the demo to serve",
        )
        assert proc.poll() is None, _log(log)[-3000:]
        procs = tree(proc.pid)
        assert has_descendant(proc.pid, "spcache", "serve")
        assert has_descendant(proc.pid, "spcache", "worker")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert wait_gone(procs, 30) == [], _log(log)[-3000:]
        assert port_is_free(port)
    finally:
        kill_all(procs or tree(proc.pid))


def test_demo_on_a_busy_port_says_to_use_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "spcache",
                "demo",
                "--dir",
                str(tmp_path / "d"),
                "--port",
                str(port),
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2
    assert f"port {port}" in out.stderr and "--port" in out.stderr
    assert not (tmp_path / "d").exists()  # refused before doing anything


@pytest.mark.slow
def test_a_second_worker_on_an_owned_cache_is_refused_naming_the_holder(tmp_path: Path) -> None:
    cache, log = tmp_path / "cache", tmp_path / "first.log"
    cache.mkdir()
    first = spcache("worker", "--cache", str(cache), "--device", "cpu", log=log)
    try:
        wait_for(lambda: "draining" in _log(log), 60, "the first worker")
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "spcache",
                "worker",
                "--cache",
                str(cache),
                "--device",
                "cpu",
                "--drain",
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2
        assert f"already owned by worker pid {first.pid} on " in second.stderr
        holder = json.loads((cache / "worker.lock").read_text())
        assert holder["pid"] == first.pid
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=30)
    # once the holder is gone, the cache is free again
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "spcache",
            "worker",
            "--cache",
            str(cache),
            "--device",
            "cpu",
            "--drain",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-2000:]
