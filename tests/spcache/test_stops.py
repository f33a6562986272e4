"""Stopping: SIGTERM, SIGINT or SIGHUP to an spcache process that started children leaves
no process and no bound port; a second worker on an owned cache is refused by name.

Real process trees (``python -m spcache ...``) watched with psutil.
"""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

import psutil
import pytest

from tests.helpers.procs import (
    has_descendant,
    port_is_free,
    run_spcache,
    serve,
    start_spcache,
    tree,
    wait_file,
    wait_for,
    wait_gone,
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"]
)
def test_a_signal_to_serve_stops_it_and_its_worker(tmp_path: Path, signum: int) -> None:
    with serve("--cache", tmp_path / "cache", "--device", "cpu") as server:
        proc = server.proc
        wait_for(lambda: has_descendant(proc.pid, "spcache", "worker"), what="the worker child")
        wait_file(tmp_path / "cache" / "worker.lock", proc=proc)
        procs = tree(proc.pid)
        assert len(procs) >= 2
        proc.send_signal(signum)
        proc.wait()
        assert wait_gone(procs) == [], proc.output()[-3000:]
        assert port_is_free(server.port)


@pytest.mark.slow
def test_sigterm_to_a_worker_stops_it(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    with start_spcache(
        "worker", "--cache", tmp_path / "cache", "--device", "cpu", "--poll", "0.2"
    ) as proc:
        proc.wait_line("draining")
        procs = tree(proc.pid)
        assert proc.stop(signal.SIGTERM) == 0
        assert wait_gone(procs) == []


@pytest.mark.slow
def test_sigterm_to_precompute_stops_it_and_its_loaders(tmp_path: Path) -> None:
    import trimesh

    sources = tmp_path / "sources"
    sources.mkdir()
    mesh = trimesh.creation.icosphere(subdivisions=3)
    for i in range(24):
        mesh.export(sources / f"s{i:02d}.obj")
    with start_spcache(
        "precompute",
        sources,
        "--recipe",
        "spc",
        "--param",
        "level=6",
        "--param",
        "surface_samples=4000000",
        "--cache",
        tmp_path / "cache",
        "--device",
        "cpu",
        "--loaders",
        "2",
        "--json",
    ) as proc:
        wait_for(lambda: len(tree(proc.pid)) >= 3, what="the loader processes", proc=proc)
        procs = tree(proc.pid)
        assert proc.stop(signal.SIGTERM) == 130, proc.output()[-3000:]
        assert wait_gone(procs) == []


@pytest.mark.slow
def test_ctrl_c_on_precompute_says_so_first_and_stops_it_and_its_loaders(tmp_path: Path) -> None:
    import trimesh

    sources = tmp_path / "sources"
    sources.mkdir()
    mesh = trimesh.creation.icosphere(subdivisions=3)
    for i in range(24):
        mesh.export(sources / f"s{i:02d}.obj")
    # loads that take seconds each (4 M surface samples): the loaders are busy when it
    # lands. How fast it stops is measured by bench/responsiveness.py, not asserted here.
    with start_spcache(
        "precompute",
        sources,
        "--recipe",
        "spc",
        "--param",
        "level=6",
        "--param",
        "surface_samples=4000000",
        "--cache",
        tmp_path / "cache",
        "--device",
        "cpu",
        "--loaders",
        "2",
    ) as proc:
        # main, resource tracker, forkserver and its 2 loaders, busy with their loads
        wait_for(lambda: len(tree(proc.pid)) >= 5, what="the loader processes", proc=proc)
        procs = tree(proc.pid)
        for p in procs:  # a terminal's Ctrl-C reaches the whole process group
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGINT)
        proc.wait_line("stopping")
        assert proc.wait() == 130, proc.output()[-3000:]
        assert wait_gone(procs) == []
    assert proc.lines[0].startswith("spcache precompute: stopping"), proc.output()[-3000:]


@pytest.mark.slow
def test_sigterm_to_demo_stops_it_the_service_and_the_worker(tmp_path: Path) -> None:
    with start_spcache("demo", "--dir", tmp_path / "demo", "--port", "0", "--level", "4") as proc:
        started = proc.wait_line(r"starting the service on http://127\.0\.0\.1:(\d+) ", 300)
        proc.wait_line("Ctrl-C stops the service.", 300)
        procs = tree(proc.pid)
        assert has_descendant(proc.pid, "spcache", "serve")
        assert has_descendant(proc.pid, "spcache", "worker")
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        assert wait_gone(procs) == [], proc.output()[-3000:]
        assert port_is_free(int(started.group(1)))


def test_demo_on_a_busy_port_says_to_use_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run_spcache("demo", "--dir", tmp_path / "d", "--port", str(port))
    assert out.returncode == 2
    assert f"port {port}" in out.stderr and "--port" in out.stderr
    assert not (tmp_path / "d").exists()  # refused before doing anything


@pytest.mark.slow
def test_a_second_worker_on_an_owned_cache_is_refused_naming_the_holder(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    with start_spcache("worker", "--cache", cache, "--device", "cpu") as first:
        first.wait_line("draining")
        second = run_spcache("worker", "--cache", cache, "--device", "cpu", "--drain")
        assert second.returncode == 2
        assert f"already owned by worker pid {first.pid} on " in second.stderr
        holder = json.loads((cache / "worker.lock").read_text())
        assert holder["pid"] == first.pid
        first.stop(signal.SIGTERM)
    # once the holder is gone, the cache is free again
    again = run_spcache("worker", "--cache", cache, "--device", "cpu", "--drain")
    assert again.returncode == 0, again.stderr[-2000:]
