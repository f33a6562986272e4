"""get_backend: names, auto selection, and a Kaolin backend that fails clearly where absent."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cache_store.errors import BackendUnavailable, UnknownName
from tests.conftest import REPO_ROOT
from workers.ops import BACKENDS, OP_NAMES, get_backend, kaolin_spc, torch_spc


def test_every_backend_has_every_op_and_a_name():
    for name, backend in BACKENDS.items():
        assert backend.name == name
        for op in OP_NAMES:
            assert callable(getattr(backend, op)), (name, op)
        assert set(OP_NAMES) <= set(backend.__all__)


def test_torch_backend_by_name_and_auto_on_cpu():
    assert get_backend("torch") is torch_spc
    assert get_backend("auto", device="cpu") is torch_spc
    assert get_backend("auto", device=torch.device("cpu")).name == "torch"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownName, match="unknown SPC backend 'numpy'; known: auto, kaolin, torch"):
        get_backend("numpy")
    with pytest.raises(KeyError):
        get_backend("numpy")


def _kaolin_missing() -> bool:
    try:
        kaolin_spc.ensure_available()
    except BackendUnavailable:
        return True
    return False


@pytest.mark.skipif(not _kaolin_missing(), reason="Kaolin and CUDA are both here")
def test_kaolin_backend_fails_clearly_where_it_cannot_run():
    with pytest.raises(BackendUnavailable, match="backend 'kaolin' is unavailable"):
        get_backend("kaolin")
    with pytest.raises(RuntimeError):
        kaolin_spc.points_to_morton(torch.zeros(1, 3, dtype=torch.int16))
    # auto falls back to torch even when a CUDA device is asked for
    assert get_backend("auto", device="cuda") is torch_spc


def test_importing_the_ops_imports_neither_kaolin_nor_cuda_state():
    code = ("import sys, workers.ops, torch; "
            "print('kaolin' in sys.modules, torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == ["False", "False"]


def _fake_kaolin(monkeypatch, version: str) -> None:
    import types

    for name in ("kaolin", "kaolin.ops", "kaolin.ops.spc"):
        module = types.ModuleType(name)
        module.__version__ = version
        monkeypatch.setitem(sys.modules, name, module)
    kaolin_spc._import_spc.cache_clear()


@pytest.fixture()
def clean_kaolin_cache():
    kaolin_spc._import_spc.cache_clear()
    yield
    kaolin_spc._import_spc.cache_clear()


def test_other_kaolin_releases_are_refused(monkeypatch, clean_kaolin_cache):
    _fake_kaolin(monkeypatch, "0.17.0")
    with pytest.raises(BackendUnavailable, match="found kaolin 0.17.0, but records must match "
                                                 "Kaolin 0.18"):
        kaolin_spc.ensure_available()


def test_kaolin_without_cuda_is_refused(monkeypatch, clean_kaolin_cache):
    _fake_kaolin(monkeypatch, "0.18.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailable, match="CUDA is not available"):
        get_backend("kaolin")
    assert get_backend("auto", device="cuda") is torch_spc
