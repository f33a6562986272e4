"""A recipe whose ``prepare`` waits at a gate: runs started together stay together.

``gated`` (named through ``SPCACHE_RECIPES=tests.helpers.gated_recipe:Gated``, with
``PYTHONPATH`` at the repository) writes ``<gate>.waiting.<pid>`` when a process first
reaches the gate, then waits (at most two minutes) until the file ``gate`` exists. A test
starts several runs, waits until each has reached the gate (each has claimed its first
samples), then opens it: every run is under way before any finishes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from spcache.recipes import Field, Param, Recipe

GATE_WAIT_S = 120.0


class Gated(Recipe):
    """The bounding-box extent of a shape's points, once the gate is open."""

    name = "gated"
    version = 1
    params = {"gate": Param(str, "", doc="the file whose existence opens the gate")}
    fields = {"extent": Field("float32", "[3]", "bounding-box size in source units", finite=True)}

    def prepare(self, source, params, generator):
        gate = Path(params["gate"])
        if not gate.exists():
            (gate.parent / f"{gate.name}.waiting.{os.getpid()}").touch()
            deadline = time.monotonic() + GATE_WAIT_S
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        v = source.vertices
        return {"extent": (v.max(axis=0) - v.min(axis=0)).astype(np.float32)}

    def compute(self, prepared, params, device, ops):
        import torch

        return {"extent": torch.from_numpy(prepared["extent"])}
