"""Issue 34, case 10 (a smaller one): a recipe plugin whose constructor raises.

``spcache precompute --recipe broken_init`` printed a raw traceback (the engine built the
recipe with ``cls()`` unguarded). The registry now builds a plugin once when it finds it:
one whose constructor raises is left out like any other broken plugin, with one line
naming the entry and the reason; asking for it by name is
:class:`~cache_store.errors.RecipeUnusable` carrying that line (``spcache precompute``
exit 2, the service's warm-up 422); ``spcache recipes`` names it and exits 1.

The plugin is installed as a user installs one that is not packaged: a module on
``PYTHONPATH``, named in ``SPCACHE_RECIPES``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

import spcache
from cache_store.errors import RecipeUnusable
from tests.helpers.faults import report
from tests.helpers.plugins import install, use_here
from tests.helpers.procs import run_spcache
from tests.helpers.service import AUTH, start_server, stop_server

REASON = "its constructor raised RuntimeError: this plugin cannot start: no licence file"


def test_a_plugin_whose_constructor_raises_is_named_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = tmp_path / "sources"
    sources.mkdir()
    np.save(sources / "a.npy", np.random.default_rng(0).uniform(-1, 1, size=(50, 3)))
    env = install(tmp_path / "plugins", "broken_init")
    ran = run_spcache(
        "precompute", sources, "--recipe", "broken_init", "--cache", tmp_path / "cache",
        "--device", "cpu", "--backend", "torch", "--loaders", "0",
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert ran.returncode == 2, ran.stderr
    assert "Traceback" not in ran.stderr, ran.stderr
    line = next(x for x in ran.stderr.splitlines() if x.startswith("spcache precompute:"))
    assert "recipe 'broken_init' cannot be used" in line and REASON in line, ran.stderr

    listed = run_spcache("recipes", cwd=tmp_path, env=env)
    assert listed.returncode == 1 and "Traceback" not in listed.stderr, listed.stderr
    assert f"hostile_plugins:BrokenInit' from SPCACHE_RECIPES: not a usable recipe: {REASON}" in (
        listed.stderr
    )
    assert "broken_init" not in listed.stdout  # left out of the table

    use_here(env, monkeypatch)
    with pytest.raises(RecipeUnusable, match="its constructor raised RuntimeError"):
        spcache.precompute(sources, "broken_init", cache=tmp_path / "lib", device="cpu")

    server = start_server(tmp_path / "served", sources, "--no-worker", env=env)
    try:
        answer = httpx.post(
            f"{server.url}/v1/warmup",
            json={"recipe": "broken_init", "items": [{"id": "a", "path": str(sources / "a.npy")}]},
            headers=AUTH,
            timeout=60,
        )
    finally:
        stop_server(server)
    assert answer.status_code == 422 and REASON in answer.text, answer.text
    report(
        "34.10 plugin constructor raises",
        {
            "precompute_exit": ran.returncode,
            "precompute_stderr_lines": len(ran.stderr.splitlines()),
            "recipes_exit": listed.returncode,
            "warmup_status": answer.status_code,
        },
    )
