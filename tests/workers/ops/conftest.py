"""Fixtures for the SPC ops tests: the backends to run them against."""

from __future__ import annotations

from types import ModuleType

import pytest

from workers.ops import torch_spc


@pytest.fixture()
def ops() -> ModuleType:
    """The pure-PyTorch backend (the one every machine has)."""
    return torch_spc
