"""Shared fixtures and marker handling for the whole suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# CI clones the project with ../shared beside it; tests may read its data, users never need it.
SHARED_DATA = Path(os.environ.get("SPCACHE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def _cuda_works() -> bool:
    # Only asked when a gpu-marked test was collected, so CPU runs never touch CUDA.
    try:
        import torch

        return bool(torch.cuda.is_available()) and torch.zeros(1, device="cuda").item() == 0
    except Exception:  # noqa: BLE001 - any failure means "no usable CUDA here"
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items or _cuda_works():
        return
    skip = pytest.mark.skip(reason="needs a working CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` beside the checkout; the tests that need it fail loudly without it."""
    if not (SHARED_DATA / "meshes").is_dir():
        pytest.fail(f"shared test data not found at {SHARED_DATA} (set SPCACHE_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def shared_meshes(shared_data: Path) -> list[Path]:
    return sorted(p for p in (shared_data / "meshes").iterdir() if p.is_file())


@pytest.fixture(scope="session")
def bad_inputs(shared_data: Path) -> list[Path]:
    return sorted(p for p in (shared_data / "bad_inputs").iterdir() if p.is_file())
