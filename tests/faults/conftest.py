"""Fixtures for the fault suite (the helpers behind them live in ``tests/helpers/faults.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.faults import Child


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """Children started by a test; any still alive at the end is killed."""
    started: list[Child] = []
    yield started
    for child in started:
        child.kill()
