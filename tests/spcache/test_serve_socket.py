"""Where `spcache serve` listens: a port it binds before anything starts (0: any free one,
logged), or a socket bound by someone else and inherited (``--fd N``)."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from tests.helpers.procs import bound_socket, port_is_free, run_spcache, serve, start_spcache


def test_port_0_binds_a_free_port_and_logs_the_url_it_answers_on(tmp_path: Path) -> None:
    with start_spcache(
        "serve", "--cache", tmp_path / "cache", "--port", "0", "--no-worker"
    ) as proc:
        url = proc.wait_line(r"spcache serve: listening on (http://127\.0\.0\.1:(\d+))").group(1)
        assert not url.endswith(":0")
        answer = None
        while answer is None:  # listening since the line; uvicorn answers once started
            try:
                answer = httpx.get(f"{url}/healthz", timeout=60)
            except httpx.ConnectError:
                assert proc.alive(), proc.output()
        assert answer.json() == {"status": "ok"}
        proc.stop()


def test_an_inherited_socket_is_served_and_the_port_freed_when_it_stops(tmp_path: Path) -> None:
    server = serve("--cache", tmp_path / "cache", "--no-worker")  # binds, then --fd N
    with server:
        assert httpx.get(f"{server.url}/healthz", timeout=60).status_code == 200
        assert f"spcache serve: listening on {server.url}" in server.proc.stderr()
        assert not port_is_free(server.port)
        server.stop()
    assert port_is_free(server.port)  # the test's copy was closed at start: nothing holds it


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fd", "99"], "--fd 99: not a socket (Bad file descriptor)"),
        (["--fd", "0"], "--fd 0: not a socket"),  # stdin: /dev/null, not a socket
        (["--fd", "3", "--port", "8000"], "--fd serves the inherited socket's address"),
    ],
)
def test_a_bad_fd_is_one_line_with_exit_2(tmp_path: Path, extra: list[str], message: str) -> None:
    out = run_spcache("serve", "--cache", tmp_path / "cache", "--no-worker", *extra)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("spcache serve: ") and message in line


def test_an_inherited_udp_socket_is_refused(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        fd = udp.fileno()
        out = run_spcache(
            "serve", "--cache", tmp_path / "cache", "--no-worker", "--fd", str(fd), pass_fds=(fd,)
        )
    assert out.returncode == 2 and f"--fd {fd}: not a TCP socket" in out.stderr, out.stderr


def test_a_busy_port_is_one_line_before_the_worker_starts(tmp_path: Path) -> None:
    with bound_socket() as busy:
        port = busy.getsockname()[1]
        out = run_spcache("serve", "--cache", tmp_path / "cache", "--port", str(port))
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
