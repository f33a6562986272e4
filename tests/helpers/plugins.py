"""Hostile recipe plugins, installed the way a user installs one that is not packaged: a
module in a directory on ``PYTHONPATH``, named in ``SPCACHE_RECIPES``.

:func:`install` writes :data:`SOURCE` as ``hostile_plugins.py`` into a directory and
returns the environment that makes ``spcache`` processes (and this one, with
:func:`use_here`) find the recipes named. Each recipe counts the points of a point
cloud (one ``int64`` field) and misbehaves in one way, steered by files in a control
directory (``SPCACHE_TEST_CONTROL``) so a test decides when:

- ``held``: ``compute`` writes ``<control>/entered-<id>`` and waits while ``<control>/hold``
  exists (a worker holding a lease while the test kills it);
- ``hangs``: ``compute`` never returns for ids starting with ``hang``, ``prepare`` for
  ids starting with ``prep``; ``time_limit_s = 2``; ``stalls`` the same with 20 s;
- ``mutates``: ``compute`` does ``params["level"] += 1`` and records the level it saw;
- ``pooled``: ``compute`` maps over a ``multiprocessing.Pool`` (fork) of 2 processes;
- ``forks``: ``compute`` forks children that exit at once (``os.fork``, 10 times);
- ``broken_init``: its constructor raises.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["MODULE", "SOURCE", "install", "use_here"]

MODULE = "hostile_plugins"

SOURCE = '''
"""Recipes that misbehave on purpose (spcache's fault tests)."""

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np

from spcache.recipes import Field, Param, Recipe


def _control(name):
    return Path(os.environ["SPCACHE_TEST_CONTROL"]) / name


class _Counting(Recipe):
    params = {"level": Param(int, 3, minimum=1, maximum=16, doc="a level")}
    fields = {
        "count": Field("int64", "[1]", "points in the cloud"),
        "level": Field("int64", "[1]", "the level compute saw"),
    }

    def prepare(self, source, params, generator):
        return {"points": np.asarray(source.vertices, dtype=np.float32)}

    def result(self, prepared, level):
        import torch

        return {
            "count": torch.tensor([len(prepared["points"])], dtype=torch.int64),
            "level": torch.tensor([level], dtype=torch.int64),
        }

    def compute(self, prepared, params, device, ops):
        return self.result(prepared, params["level"])


def _sample_id(source):
    return Path(source.path).stem


class Held(_Counting):
    name = "held"
    version = 1

    def prepare(self, source, params, generator):
        return {**super().prepare(source, params, generator),
                "id": np.frombuffer(_sample_id(source).encode(), dtype=np.uint8)}

    def compute(self, prepared, params, device, ops):
        _control("entered-" + bytes(prepared["id"]).decode()).touch()
        while _control("hold").exists():
            time.sleep(0.05)
        return self.result(prepared, params["level"])


class Hangs(_Counting):
    name = "hangs"
    version = 1
    time_limit_s = 2

    def prepare(self, source, params, generator):
        sid = _sample_id(source)
        if sid.startswith("prep"):
            _control("entered-" + sid).touch()
            while True:
                time.sleep(1)
        return {**super().prepare(source, params, generator),
                "id": np.frombuffer(sid.encode(), dtype=np.uint8)}

    def compute(self, prepared, params, device, ops):
        sid = bytes(prepared["id"]).decode()
        if sid.startswith(("hang", "stall")):
            _control("entered-" + sid).touch()
            while True:
                time.sleep(1)
        return self.result(prepared, params["level"])


class Stalls(Hangs):
    name = "stalls"
    version = 1
    time_limit_s = 20


class Mutates(_Counting):
    name = "mutates"
    version = 1

    def compute(self, prepared, params, device, ops):
        seen = params["level"]
        params["level"] += 1
        return self.result(prepared, seen)


def _square(x):
    return x * x


class Pooled(_Counting):
    name = "pooled"
    version = 1

    def compute(self, prepared, params, device, ops):
        with multiprocessing.get_context("fork").Pool(2) as pool:
            squares = pool.map(_square, range(4))
        assert squares == [0, 1, 4, 9]
        return self.result(prepared, params["level"])


class Forks(_Counting):
    name = "forks"
    version = 1

    def compute(self, prepared, params, device, ops):
        for _ in range(10):  # often enough to land while the writer thread commits
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        return self.result(prepared, params["level"])


class BrokenInit(_Counting):
    name = "broken_init"
    version = 1

    def __init__(self):
        raise RuntimeError("this plugin cannot start: no licence file")
'''


def install(directory: Path, *recipes: str, control: Path | None = None) -> dict[str, str]:
    """Write the plugin module into ``directory``; the environment (``PYTHONPATH``,
    ``SPCACHE_RECIPES`` naming ``recipes`` by class, ``SPCACHE_TEST_CONTROL``) a child
    process needs to find them."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{MODULE}.py").write_text(SOURCE)
    classes = {
        "held": "Held",
        "hangs": "Hangs",
        "stalls": "Stalls",
        "mutates": "Mutates",
        "pooled": "Pooled",
        "forks": "Forks",
        "broken_init": "BrokenInit",
    }
    control = control if control is not None else directory / "control"
    control.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": path,
        "SPCACHE_RECIPES": ",".join(f"{MODULE}:{classes[r]}" for r in recipes),
        "SPCACHE_TEST_CONTROL": str(control),
    }


def use_here(env: dict[str, str], monkeypatch: object) -> None:
    """Make this process find the plugins too (``monkeypatch``: pytest's fixture)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # type: ignore[attr-defined]
    directory = env["PYTHONPATH"].split(os.pathsep)[0]
    monkeypatch.syspath_prepend(directory)  # type: ignore[attr-defined]
    sys.modules.pop(MODULE, None)
