"""Helpers for the stop tests: a command's whole process tree, and whether it is gone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from tests.conftest import REPO_ROOT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def spcache(*args: str, log: Path) -> subprocess.Popen[bytes]:
    """``python -m spcache ARGS`` with stdout and stderr into ``log``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPCACHE_")}
    with open(log, "wb") as out:  # the child has its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "spcache", *args],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants now alive."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def has_descendant(pid: int, *words: str) -> bool:
    """A descendant of ``pid`` whose command line holds every one of ``words``."""
    for proc in tree(pid)[1:]:
        try:
            cmdline = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if all(word in cmdline for word in words):
            return True
    return False


def alive(procs: list[psutil.Process]) -> list[str]:
    """Those of ``procs`` still running (not zombies), described."""
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return left


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[str]:
    """Wait up to ``timeout`` for every process to end; returns those left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(procs):
            return []
        time.sleep(0.1)
    return alive(procs)


def kill_all(procs: list[psutil.Process]) -> None:
    """Clean-up after a failed test: SIGKILL what is left of a tree the test started."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
