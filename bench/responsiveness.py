"""How fast spcache answers a user, measured here instead of asserted in tests.

Tests wait for these events with generous bounds (the suite runs on a loaded shared
machine, where a duration asserted against the clock fails for reasons of its own); the
figures live here and in docs/BENCHMARKS.md:

* ``ctrl-c``: Ctrl-C (SIGINT to the process group, as a terminal sends it) on a
  ``spcache precompute`` whose two loader processes are busy with slow loads: seconds to
  its "stopping" line and to its exit (the README says: at once, and within a second or
  two). Baseline in the same run: the same command's start-up to its first loader, and
  ``spcache --version``'s whole run.
* ``dedupe``: a warm-up of ``--items`` sources with ``"dedupe": true`` against the same
  without, over HTTP against a live ``spcache serve --no-worker`` (issue 26 found the
  dedupe one quadratic); the ratio is the figure.

Usage: ``python bench/responsiveness.py [--part ctrl-c|dedupe|all] [--rounds 3]
[--items 24000]``. Prints one JSON line per measurement; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPCACHE = [sys.executable, "-m", "spcache"]


def _children(pid: int) -> int:
    import psutil

    try:
        return len(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return 0


def ctrl_c(rounds: int) -> dict:
    import trimesh

    root = Path(tempfile.mkdtemp(prefix="bench-ctrl-c-"))
    sources = root / "sources"
    sources.mkdir()
    mesh = trimesh.creation.icosphere(subdivisions=3)
    for i in range(24):
        mesh.export(sources / f"s{i:02d}.obj")
    said, stopped, started, version = [], [], [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        subprocess.run([*SPCACHE, "--version"], check=True, capture_output=True)
        version.append(time.perf_counter() - t0)
        command = [
            *SPCACHE, "precompute", str(sources), "--recipe", "spc",
            "--param", "level=6", "--param", "surface_samples=4000000",
            "--cache", str(root / f"cache{r}"), "--device", "cpu", "--loaders", "2",
        ]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True
        )
        while _children(proc.pid) < 4 and proc.poll() is None:  # its loaders are up
            time.sleep(0.02)
        time.sleep(1.0)  # and busy with their loads
        started.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.stderr is not None
        for line in proc.stderr:
            if b"stopping" in line:
                said.append(time.perf_counter() - t0)
                break
        proc.wait()
        stopped.append(time.perf_counter() - t0)
        proc.stderr.close()
    return {
        "part": "ctrl-c",
        "rounds": rounds,
        "stopping_line_s": [round(x, 3) for x in said],
        "exit_s": [round(x, 3) for x in stopped],
        "exit_s_median": round(statistics.median(stopped), 3),
        "baseline_start_to_busy_loaders_s_median": round(statistics.median(started), 3),
        "baseline_spcache_version_s_median": round(statistics.median(version), 3),
    }


def dedupe(items: int) -> dict:
    import httpx

    root = Path(tempfile.mkdtemp(prefix="bench-dedupe-"))
    sources = root / "sources"
    sources.mkdir()
    for i in range(items):
        (sources / f"s{i:05d}.xyz").write_bytes(b"0 0 0\n1 1 1\n")
    body_items = [{"id": f"s{i:05d}", "path": str(sources / f"s{i:05d}.xyz")} for i in range(items)]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    service = subprocess.Popen(
        [
            *SPCACHE, "serve", "--cache", str(root / "cache"), "--source-root", str(sources),
            "--no-worker", "--log-level", "warning", "--fd", str(sock.fileno()),
        ],
        pass_fds=(sock.fileno(),),
        env={**os.environ, "SPCACHE_MAX_BODY_BYTES": str(16 << 20)},
    )  # fmt: skip
    sock.close()
    seconds = {}
    try:
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        for name, level in (("plain", 4), ("dedupe", 5)):  # two fingerprints: no reuse
            body = {"recipe": "spc", "params": {"level": level}, "items": body_items}
            body["dedupe"] = name == "dedupe"
            t0 = time.perf_counter()
            answer = httpx.post(f"{url}/v1/warmup", json=body, timeout=600)
            seconds[name] = time.perf_counter() - t0
            assert answer.status_code == 202, answer.text[:300]
    finally:
        service.terminate()
        service.wait()
    return {
        "part": "dedupe",
        "items": items,
        "plain_s": round(seconds["plain"], 2),
        "dedupe_s": round(seconds["dedupe"], 2),
        "ratio_dedupe_to_plain": round(seconds["dedupe"] / seconds["plain"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="responsiveness.py", description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["ctrl-c", "dedupe", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=3, help="Ctrl-C rounds (default 3)")
    parser.add_argument("--items", type=int, default=24_000, help="warm-up items (default 24000)")
    args = parser.parse_args()
    if args.part in ("ctrl-c", "all"):
        print(json.dumps(ctrl_c(args.rounds)), flush=True)
    if args.part in ("dedupe", "all"):
        print(json.dumps(dedupe(args.items)), flush=True)


if __name__ == "__main__":
    main()
