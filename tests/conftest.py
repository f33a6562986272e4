"""Shared fixtures and marker handling for the whole suite.

Test data comes from two corpora:

- the generated corpus (``tests/data/corpus.py``), built once into
  ``tests/data/.generated/`` and always available: ``corpus_meshes``, ``corpus_points``,
  ``corpus_bad_inputs``;
- the real-mesh corpus in ``../shared/data`` beside the checkout (or
  ``$SPCACHE_SHARED_DATA``), which CI has and a user's clone does not: ``shared_meshes``,
  ``shared_bad_inputs``. Tests that use it carry the ``shared_corpus`` marker and are
  skipped, never failed, when it is absent.

``meshes`` and ``bad_inputs`` are parametrised over both: ``[corpus]`` always runs,
``[shared]`` runs where ../shared/data is present.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.data import corpus as corpus_builder

REPO_ROOT = Path(__file__).resolve().parent.parent
# CI clones the project with ../shared beside it; tests may read its data, users never need it.
SHARED_DATA = Path(os.environ.get("SPCACHE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
SHARED_SKIP = (
    "../shared/data not present: the extra real-mesh corpus is skipped; "
    "set SPCACHE_SHARED_DATA to run it"
)
# Mark a test (or a parameter) that reads ../shared/data with this.
shared_corpus = pytest.mark.shared_corpus
_SHARED_ITEMS = pytest.StashKey[int]()


def shared_data_present() -> bool:
    return (SHARED_DATA / "meshes").is_dir()


# Run in a child interpreter: creating a CUDA context in the pytest process would break the
# tests that assert it never initialises CUDA (a DataLoader forked from it could not use CUDA).
_CUDA_PROBE = (
    "import torch; ok = torch.cuda.is_available() and "
    "torch.zeros(1, device='cuda').item() == 0; print('cuda-ok' if ok else 'no-cuda')"
)


def cuda_works(timeout: float = 120.0) -> bool:
    """Whether CUDA can run a kernel here, asked of a child interpreter (so this process
    never initialises CUDA). Only asked when a gpu-marked test was collected."""
    import subprocess
    import sys

    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CUDA_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO_ROOT,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and proc.stdout.split()[-1:] == ["cuda-ok"]


def pytest_configure(config: pytest.Config) -> None:
    _signals_as_from_a_terminal()
    config.addinivalue_line(
        "markers",
        "shared_corpus: reads the real-mesh corpus in ../shared/data "
        "(SPCACHE_SHARED_DATA); skipped where it is absent",
    )


def _signals_as_from_a_terminal() -> None:
    """Ctrl-C raises KeyboardInterrupt in this run and in every process it starts, however
    the run itself was started.

    A run started in the background by a script (``pytest ... &``: a non-interactive
    shell starts its background jobs with SIGINT ignored) would pass the ignore on to each
    child, and Python installs no KeyboardInterrupt handler where SIGINT is ignored at
    start-up: a ``spcache.precompute`` script a test interrupts as a terminal does went
    on to the end and exited 0 (tests/spcache/test_interrupt_streams.py). Python's own
    handler here gives every child SIGINT's default disposition, as a terminal's
    foreground job has (``exec`` resets a caught signal, never an ignored one); the rule
    is checked in tests/test_suite_rules.py."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # ``nohup pytest ...`` hands every child SIGHUP ignored: a command a test hangs up
    # as a closed terminal does (test_interrupt_streams.py's nohup test, its run
    # without nohup) went on to the end. The children get a terminal's default.
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


_SHARED_FIXTURES = frozenset({"shared_data", "shared_meshes", "shared_bad_inputs"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:  # a test asking for ../shared by fixture needs no marker of its own
        if _SHARED_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(shared_corpus)
    if not shared_data_present():
        skip_shared = pytest.mark.skip(reason=SHARED_SKIP)
        for item in items:
            if item.get_closest_marker("shared_corpus"):
                item.add_marker(skip_shared)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items or cuda_works():
        return
    skip = pytest.mark.skip(reason="needs a working CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    # After -k/-m deselection: the tests that will really be asked to use ../shared/data.
    session.config.stash[_SHARED_ITEMS] = sum(
        1 for item in session.items if item.get_closest_marker("shared_corpus")
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests.helpers import procs

    procs.kill_leftovers()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    count = config.stash.get(_SHARED_ITEMS, 0)
    if not count:
        return
    if shared_data_present():
        line = f"shared real-mesh corpus: RAN ({count} tests over {SHARED_DATA})"
    else:
        line = f"shared real-mesh corpus: SKIPPED ({count} tests): {SHARED_SKIP} (looked in {SHARED_DATA})"
    terminalreporter.write_sep("-", "spcache test data")
    terminalreporter.write_line(line)


# --- the generated corpus: always there ------------------------------------------------------


def _sources_in(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix.lower() in corpus_builder.SOURCE_SUFFIXES
    )


@pytest.fixture(scope="session")
def corpus_data() -> Path:
    """The generated corpus (``meshes/``, ``points/``, ``bad_inputs/``), built on first use."""
    return corpus_builder.ensure()


@pytest.fixture(scope="session")
def corpus_meshes(corpus_data: Path) -> list[Path]:
    """Good meshes in every supported mesh format (.mtl companions left out)."""
    return _sources_in(corpus_data / "meshes")


@pytest.fixture(scope="session")
def corpus_points(corpus_data: Path) -> list[Path]:
    """Good point clouds: .npy .npz .xyz .pts and a face-less .ply."""
    return _sources_in(corpus_data / "points")


@pytest.fixture(scope="session")
def corpus_bad_inputs(corpus_data: Path) -> list[Path]:
    """Hostile files; each one's expected outcome is in ``corpus.hostile_expectations()``."""
    return _sources_in(corpus_data / "bad_inputs")


# --- ../shared/data: extra, skipped when absent -------------------------------------------------


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` beside the checkout; a test that needs it is skipped without it."""
    if not shared_data_present():
        pytest.skip(SHARED_SKIP)
    return SHARED_DATA


@pytest.fixture(scope="session")
def shared_meshes(shared_data: Path) -> list[Path]:
    return sorted(p for p in (shared_data / "meshes").iterdir() if p.is_file())


@pytest.fixture(scope="session")
def shared_bad_inputs(shared_data: Path) -> list[Path]:
    return sorted(p for p in (shared_data / "bad_inputs").iterdir() if p.is_file())


# --- both: [corpus] always, [shared] where present --------------------------------------------

BOTH = ["corpus", pytest.param("shared", marks=shared_corpus)]


@pytest.fixture(scope="session", params=BOTH)
def meshes(request: pytest.FixtureRequest) -> list[Path]:
    """Every good mesh of one corpus: the generated one, then (where present) ../shared."""
    return request.getfixturevalue(f"{request.param}_meshes")


@pytest.fixture(scope="session", params=BOTH)
def bad_inputs(request: pytest.FixtureRequest) -> list[Path]:
    """Every hostile file of one corpus: the generated one, then (where present) ../shared."""
    return request.getfixturevalue(f"{request.param}_bad_inputs")


@pytest.fixture(scope="session")
def example_recipe(tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """The example recipe package installed (see tests/helpers/example_recipe.py); the
    directory added to PYTHONPATH, or None when the venv has it already (CI)."""
    from tests.helpers.example_recipe import ensure_installed

    return ensure_installed(tmp_path_factory.mktemp("example_recipe"))


# --- processes: none outlives its test --------------------------------------------------------


@pytest.fixture(autouse=True)
def reap_processes() -> Iterator[None]:
    """What a test started through ``tests/helpers/procs.py`` and left running is killed,
    with its process tree, when the test ends (processes of wider-scoped fixtures stay
    for the tests that share them)."""
    from tests.helpers import procs

    before = procs.live()
    yield
    procs.kill_leftovers(keep=before)
