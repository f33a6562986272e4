"""The suite's CUDA probe (tests/conftest.py) asks a child interpreter, never this one."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import tests.conftest as conftest
from tests.conftest import REPO_ROOT


def test_the_probe_never_touches_cuda_in_this_process(monkeypatch) -> None:
    # on a CUDA machine an earlier test may have started CUDA here (pin_memory, the gpu
    # tests): what counts is that the probe changes nothing
    was_initialized = torch.cuda.is_initialized()
    touched: list[str] = []

    def refuse(*args, **kwargs):
        touched.append("cuda")
        raise AssertionError("the probe initialised CUDA in the pytest process")

    for name in ("is_available", "_lazy_init", "init", "current_device", "device_count"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    monkeypatch.setattr(conftest, "_CUDA_PROBE", "print('cuda-ok')")
    assert conftest.cuda_works() is True  # the child's answer is what counts
    monkeypatch.setattr(conftest, "_CUDA_PROBE", "print('no-cuda')")
    assert conftest.cuda_works() is False
    monkeypatch.setattr(conftest, "_CUDA_PROBE", "raise SystemExit(3)")
    assert conftest.cuda_works() is False
    assert touched == []
    assert torch.cuda.is_initialized() == was_initialized


def test_the_real_probe_agrees_with_a_fresh_interpreter() -> None:
    was_initialized = torch.cuda.is_initialized()
    code = "import torch; print(torch.cuda.is_available())"
    here = (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
        ).stdout.strip()
        == "True"
    )
    if not here:
        assert conftest.cuda_works() is False
    else:  # a CUDA machine: the probe runs a kernel in the child
        assert conftest.cuda_works() in (True, False)
    assert torch.cuda.is_initialized() == was_initialized


def test_collecting_gpu_tests_leaves_cuda_uninitialised(tmp_path) -> None:
    """A pytest run that collects a gpu test (so the suite's conftest probes CUDA) with a
    tripwire on every in-process way to ask CUDA; a test of the same run checks it never
    fired. (The probe used to call ``torch.cuda.is_available()`` and run a kernel here.)"""
    (tmp_path / "cuda_tripwire.py").write_text(
        "import torch\nCALLS = []\n\n\ndef _trip(name):\n"
        "    def tripped(*a, **k):\n        CALLS.append(name)\n"
        "        raise RuntimeError(f'torch.cuda.{name} called in the pytest process')\n"
        "    return tripped\n\n\n"
        "for _name in ('is_available', '_lazy_init', 'init', 'device_count'):\n"
        "    setattr(torch.cuda, _name, _trip(_name))\n"
    )
    check = tmp_path / "test_after_probe.py"
    check.write_text(
        "import pytest, torch\nimport cuda_tripwire\n\n\n@pytest.mark.gpu\n"
        "def test_gpu():\n    pass\n\n\n"
        "def test_no_cuda_in_this_process():\n"
        "    assert cuda_tripwire.CALLS == []\n"
        "    assert not torch.cuda.is_initialized()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "-p",
            "cuda_tripwire",
            "-p",
            "tests.conftest",
            "--rootdir",
            str(REPO_ROOT),
            "-c",
            str(REPO_ROOT / "pyproject.toml"),
            str(check),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "PASSED" in out and "test_no_cuda_in_this_process" in out
