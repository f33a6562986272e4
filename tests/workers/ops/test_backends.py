"""get_backend: names, auto selection, and a Kaolin backend that fails clearly where absent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cache_store.errors import BackendUnavailable, UnknownName
from tests.conftest import REPO_ROOT
from workers.ops import BACKENDS, OP_NAMES, get_backend, kaolin_spc, select_backend, torch_spc


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
    with pytest.raises(
        UnknownName, match="unknown SPC backend 'numpy'; known: auto, kaolin, torch"
    ):
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
    code = (
        "import sys, workers.ops, torch; "
        "print('kaolin' in sys.modules, torch.cuda.is_initialized())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    assert out == ["False", "False"]


def _fake_kaolin(monkeypatch, version: str) -> None:
    import types

    for name in ("kaolin", "kaolin.ops", "kaolin.ops.spc"):
        module = types.ModuleType(name)
        module.__version__ = version
        monkeypatch.setitem(sys.modules, name, module)
    kaolin_spc.import_spc.cache_clear()


@pytest.fixture()
def clean_kaolin_cache():
    kaolin_spc.import_spc.cache_clear()
    yield
    kaolin_spc.import_spc.cache_clear()


def test_other_kaolin_releases_are_refused(monkeypatch, clean_kaolin_cache):
    _fake_kaolin(monkeypatch, "0.17.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # else: no CUDA, said first
    with pytest.raises(
        BackendUnavailable, match="found kaolin 0.17.0, but records must match Kaolin 0.18"
    ):
        kaolin_spc.ensure_available()


def test_kaolin_without_cuda_is_refused(monkeypatch, clean_kaolin_cache):
    _fake_kaolin(monkeypatch, "0.18.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailable, match="no CUDA device here"):
        get_backend("kaolin")
    assert get_backend("auto", device="cuda") is torch_spc


def test_kaolin_on_a_cpu_device_is_refused_up_front(monkeypatch, clean_kaolin_cache):
    """Even where Kaolin imports and CUDA works, --device cpu --backend kaolin cannot run:
    refused before any sample, not sample by sample."""
    _fake_kaolin(monkeypatch, "0.18.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert get_backend("kaolin", "cuda:0") is kaolin_spc  # the fake passes the probe
    for device in ("cpu", torch.device("cpu")):
        with pytest.raises(BackendUnavailable, match="device cpu is not a CUDA device"):
            get_backend("kaolin", device)
    assert get_backend("auto", "cpu") is torch_spc


def test_select_backend_says_why(monkeypatch, clean_kaolin_cache):
    assert select_backend("torch", "cuda:0") == (torch_spc, "asked for")
    backend, why = select_backend("auto", "cpu")
    assert backend is torch_spc and "CUDA-only" in why
    _fake_kaolin(monkeypatch, "0.18.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    backend, why = select_backend("auto", "cuda:1")
    assert backend is kaolin_spc and why == "kaolin 0.18.0 imports and cuda:1 is CUDA"
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    _fake_kaolin(monkeypatch, "0.17.0")
    backend, why = select_backend("auto", "cuda:1")
    assert backend is torch_spc and why.startswith("found kaolin 0.17.0")


def test_the_torch_range_note():
    assert kaolin_spc.torch_version_note("2.5.1+cu121") == ""
    assert kaolin_spc.torch_version_note("2.8.0") == ""
    assert kaolin_spc.torch_version_note("2.13.0") == (
        "there is no Kaolin 0.18 for torch 2.13.0 (its wheels are for torch 2.3.0 to 2.8.0)"
    )
    assert "no Kaolin 0.18 for torch 2.2.2" in kaolin_spc.torch_version_note("2.2.2")


def _kaolin_refusal() -> str:
    with pytest.raises(BackendUnavailable) as caught:
        get_backend("kaolin")
    return str(caught.value)


def test_what_is_said_is_true_for_the_machine_at_hand(monkeypatch, clean_kaolin_cache):
    """No CUDA device: said so (a CPU-only build, or a CUDA build that finds none), with
    --backend torch as the advice; CUDA but a torch no Kaolin is built for: said so, with
    the torch versions that have one, never "install kaolin"; CUDA and a torch in range
    without Kaolin: the install that exists."""
    monkeypatch.setitem(sys.modules, "kaolin", None)  # not importable, wherever this runs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    backend, why = select_backend("auto")  # device auto on a CPU-only machine
    assert backend is torch_spc and why.startswith(
        "no CUDA device here (torch 2.13.0+cpu is a CPU-only build): Kaolin's SPC ops are CUDA-only"
    )
    assert "device cuda" not in why
    said = _kaolin_refusal()
    assert "no CUDA device here (torch 2.13.0+cpu is a CPU-only build)" in said
    assert "use --backend torch" in said and "install" not in said
    assert "there is no Kaolin 0.18 for torch 2.13.0+cpu" in said

    monkeypatch.setattr(torch.version, "cuda", "12.1")
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu121")
    said = _kaolin_refusal()
    assert "torch 2.5.1+cu121 is built for CUDA 12.1 but finds no device" in said
    assert "no Kaolin" not in said and "install" not in said

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu128")
    said = _kaolin_refusal()
    assert "kaolin not importable" in said and "CUDA device" not in said
    assert (
        "there is no Kaolin 0.18 for torch 2.13.0+cu128 (its wheels are for torch 2.3.0 to "
        "2.8.0)" in said
    )
    assert "install" not in said and "or a torch from 2.3.0 to 2.8.0 with kaolin==0.18.x" in said
    backend, why = select_backend("auto", "cuda:0")  # the fall-back says the facts alone
    assert backend is torch_spc and "no Kaolin 0.18 for torch 2.13.0+cu128" in why
    assert "--backend" not in why

    kaolin_spc.import_spc.cache_clear()
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu121")
    said = _kaolin_refusal()
    assert "no Kaolin" not in said
    assert "install kaolin==0.18.x built for torch 2.5.1+cu121 and CUDA 12.1" in said


# A fake ``kaolin`` package that misbehaves at import, put first on sys.path of a child
# interpreter run with -W error (pytest's filterwarnings = error does the same).
_PROBE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(message)s")
torch.cuda.is_available = lambda: True  # the probe must run as on a CUDA machine
from workers.ops import get_backend, select_backend
backend, why = select_backend("auto", "cuda:0")
print("SELECTED", backend.name, "|", why)
print("GOT", get_backend("auto", "cuda:0").name)
"""


def _run_with_fake_kaolin(
    tmp_path, init_body: str, spc_body: str = ""
) -> subprocess.CompletedProcess:
    package = tmp_path / "kaolin"
    (package / "ops").mkdir(parents=True)
    (package / "__init__.py").write_text(init_body)
    (package / "ops" / "__init__.py").write_text("")
    (package / "ops" / "spc.py").write_text(spc_body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", _PROBE],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "init_body, shown",
    [
        (
            "raise RuntimeError('libcudart.so.12: cannot open shared object file')",
            "RuntimeError: libcudart.so.12: cannot open shared object file",
        ),
        ("raise SystemExit(1)", "SystemExit: 1"),
        (
            "import warp_missing_module",
            "ModuleNotFoundError: No module named 'warp_missing_module'",
        ),
        ("raise AttributeError('partially initialized module')", "AttributeError"),
    ],
)
def test_a_broken_kaolin_import_falls_back_to_torch_with_one_line(tmp_path, init_body, shown):
    proc = _run_with_fake_kaolin(tmp_path, init_body)
    assert proc.returncode == 0, proc.stderr
    assert f"SELECTED torch | kaolin not importable ({shown}" in proc.stdout
    assert "GOT torch" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("LOG WARNING")]
    assert len(warnings) == 1 and "use the torch backend: kaolin not importable" in warnings[0]
    assert "Traceback" not in proc.stderr


def test_a_noisy_but_working_kaolin_import_is_used_under_warnings_as_errors(tmp_path):
    init = (
        "import warnings\n__version__ = '0.18.0'\n"
        "warnings.warn('warp: CUDA driver is old', UserWarning)\n"
        "warnings.warn('pxr is deprecated', DeprecationWarning)\n"
    )
    proc = _run_with_fake_kaolin(
        tmp_path, init, "import warnings\nwarnings.warn('spc', FutureWarning)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "SELECTED kaolin | kaolin 0.18.0 imports and cuda:0 is CUDA" in proc.stdout
    assert "GOT kaolin" in proc.stdout


def test_a_lone_point_is_refused_by_points_to_morton():
    """Kaolin 0.18 cannot reshape the code of a (3,) point (``reshape()`` with no size): both
    backends refuse it with the same InvalidTensor; (1, 3) is the way to pass one point."""
    from cache_store.errors import InvalidTensor

    with pytest.raises(
        InvalidTensor,
        match=r"expected shape \(\.\.\., num_points, 3\), got "
        r"\(3\) \(one point is \[\[x, y, z\]\]",
    ):
        torch_spc.points_to_morton(torch.tensor([1, 2, 3], dtype=torch.int16))
    with pytest.raises(InvalidTensor, match="num_points, 3"):
        kaolin_spc.points_to_morton(torch.tensor([1, 2, 3], dtype=torch.int16))
    one = torch_spc.points_to_morton(torch.tensor([[1, 2, 3]], dtype=torch.int16))
    assert one.shape == (1,) and one.tolist() == [29]
    batched = torch_spc.points_to_morton(torch.tensor([[[1, 2, 3], [0, 0, 1]]], dtype=torch.int16))
    assert batched.shape == (1, 2) and batched.tolist() == [[29, 1]]
