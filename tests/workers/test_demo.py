"""`spcache demo`, the README's main job, end to end on a loopback port."""

from __future__ import annotations

import re
import sys

import pytest

from cache_store import CachedDataset
from tests.helpers.procs import port_is_free, run, run_spcache


@pytest.mark.slow
def test_demo_precomputes_serves_and_warms_up(tmp_path) -> None:
    # --port 0: the demo binds a free port itself and hands it to the service
    proc = run_spcache(
        "demo", "--dir", tmp_path / "demo", "--port", "0", "--level", "5", "--exit-after", "0"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    started = re.search(r"starting the service on http://127\.0\.0\.1:(\d+) ", out)
    assert started, out
    port = int(started.group(1))
    assert port != 0
    assert "precomputed 6 records (0 already cached, 0 failed)" in out
    assert ": done " in out  # the warm-up job went through the service's worker
    assert f"http://127.0.0.1:{port}/healthz" in out

    assert "precomputing recipe spc_query (level 5) for 6 example shapes" in out
    assert "recipe spc_query, level 5" in out  # the warm-up used the same recipe
    cache = tmp_path / "demo" / "cache"
    queried = CachedDataset(cache, "spc_query", level=5)
    assert len(queried) == 7  # six precomputed, one warmed up over HTTP: one dataset
    assert queried[0]["query_pidx"].shape[1] == 6
    ids = [queried.sample_id(i) for i in range(len(queried))]
    assert ids[-1] == "late_arrival" and queried[6]["octree"].numel() > 0
    # without a terminal the precompute says what it does sample by sample
    assert proc.stderr.count("precompute: ") >= 6
    # The Python it prints is README's one import, and runs as printed from anywhere.
    printed = out.split("In Python", 1)[1].splitlines()[1:4]
    assert [line.split()[0] for line in printed] == ["import", "ds", "ds"], printed
    assert printed[0].strip() == "import spcache" and "cache_store" not in out
    local = "\n".join(line.strip() for line in printed[:2]) + "\nprint(len(ds))\n"
    ran = run([sys.executable, "-c", local], cwd=tmp_path, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip() == "7", ran.stderr[-2000:]
    # The service was stopped with the demo: the port is free again.
    assert port_is_free(port)
