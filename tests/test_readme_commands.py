"""Every shell command of README.md, run as a user runs it: the table, and the commands
that run on their own (the version, the demo, the SDF line, the GPU lines);
``tests/test_readme_workflows.py`` runs the README's multi-command workflows.

The commands are the lines of README.md's shell blocks (```` ``` ```` and ```` ```bash ````)
and the inline code spans that start with a program a user would run (``spcache``,
``pip``, ``python``, ``pytest``, ...; see :func:`inline_commands`). :data:`COMMANDS` says
how each one is tested, and ``test_every_readme_command_is_in_the_table`` fails on a
README command that is not in it (and on a row whose command left the README), as
``tests/test_readme.py`` does for the Python snippets.

How a command is tested (:class:`How`):

- ``RUN``: run as written through ``bash -c`` with the test venv's ``bin`` first on
  ``PATH``, in a fresh temporary directory holding the sources and caches the README
  names (made first, the way a user would make them); then checked as the user would
  check it (exit status, the folder or the cache read back, the next README command on
  the result).
- ``SERVE``: a long-lived command (``spcache serve``, ``spcache demo``), run as written,
  waited for (its "listening"/"Ctrl-C" line), exercised once over HTTP, and stopped
  with Ctrl-C. ``SPCACHE_PORT=0`` is in its environment so that it binds a free port
  (and logs it) instead of 8000, which a parallel run could hold.
- ``SYNOPSIS``: a line with placeholders (``CACHE_DIR``, ``FINGERPRINT``, ``DEST.zarr``,
  ``...``): its command exists and every option it names is in ``spcache COMMAND --help``.
- ``OUTPUT``: a line showing what the command above it prints; compared with what it
  prints.
- ``UNAVAILABLE``: needs what this machine lacks (a Docker engine, a GPU, downloads of
  PyTorch's wheels); the row says why, and ``test_unavailable_commands_as_far_as_they_go``
  checks what can be checked (the files they name exist, the pins agree).
- ``ELSEWHERE``: run as written by another test, named in the row.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import tomllib
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT
from tests.helpers.procs import run_spcache
from tests.helpers.readme_commands import (
    readme_python,
    README,
    RUN,
    SERVE,
    SYNOPSIS,
    OUTPUT,
    UNAVAILABLE,
    ELSEWHERE,
    DEMO_TEST,
    COMMANDS,
    shell_blocks,
    inline_commands,
    readme_commands,
    sh,
    sh_start,
    ctrl_c,
    line_of,
)


# --------------------------------------------------------------------------- the table


def test_every_readme_command_is_in_the_table() -> None:
    found = readme_commands()
    missing = [line for line in found if line not in COMMANDS]
    assert not missing, (
        "README commands with no row in tests/helpers/readme_commands.py::COMMANDS (say how "
        "each is tested):\n" + "\n".join(missing)
    )
    stale = sorted(set(COMMANDS) - set(found))
    assert not stale, "rows whose command is no longer in README.md:\n" + "\n".join(stale)
    workflows = ast.parse((Path(__file__).parent / "test_readme_workflows.py").read_text())
    tests = {name for name in globals() if name.startswith("test_")} | {
        node.name for node in workflows.body if isinstance(node, ast.FunctionDef)
    }
    for line, how in COMMANDS.items():
        assert how.kind in (RUN, SERVE, SYNOPSIS, OUTPUT, UNAVAILABLE, ELSEWHERE), line
        if how.kind in (RUN, SERVE, SYNOPSIS, OUTPUT):
            assert how.where.split()[0] in tests, f"{line!r}: no test {how.where.split()[0]}"


def test_the_table_finds_commands_in_blocks_and_prose() -> None:
    text = (
        "a `spcache stats --cache x` b `spcache serve` c `spcache.precompute(x)` "
        "d `spcache serve: listening on http://x`\n```\nls\n```\n"
    )
    assert inline_commands(text) == ["spcache stats --cache x"]
    assert shell_blocks(text + "```python\nx = 1\n```\n```bash\n\ncd y\n```\n") == [
        ["ls"],
        ["cd y"],
    ]


# --------------------------------------------------------------------------- synopsis lines


def _options_of(line: str) -> tuple[str, list[str]]:
    words = line.split("#", 1)[0].split()
    assert words[0] == "spcache", line
    command = words[1]
    return command, sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", " ".join(words))))


def test_synopsis_lines_name_real_options() -> None:
    helps: dict[str, str] = {}
    for line, how in COMMANDS.items():
        if how.kind != SYNOPSIS:
            continue
        command, options = _options_of(line)
        if command not in helps:
            out = run_spcache(command, "--help")
            assert out.returncode == 0, f"`spcache {command} --help`: {out.stderr[-2000:]}"
            helps[command] = out.stdout
        unknown = [opt for opt in options if not re.search(rf"{opt}\b", helps[command])]
        assert not unknown, f"README: `{line}`: not in `spcache {command} --help`: {unknown}"


# --------------------------------------------------------------------------- what cannot run


def test_unavailable_commands_as_far_as_they_go(tmp_path: Path) -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    torch_pin = next(d for d in project["dependencies"] if d.startswith("torch"))
    bounds = re.findall(r"([<>]=?)\s*([\d.]+)", torch_pin)
    version = (2, 13, 0)

    def as_tuple(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split("."))

    for op, bound in bounds:  # torch==2.13.0 is accepted: pip install -e . keeps it
        assert {
            "<": version < as_tuple(bound),
            "<=": version <= as_tuple(bound),
            ">": version > as_tuple(bound),
            ">=": version >= as_tuple(bound),
        }[op], torch_pin
    for line in COMMANDS:
        if "pip install" in line:
            for extra in re.findall(r"'\.\[(\w+)\]'", line):
                assert extra in project["optional-dependencies"], line
            for folder in re.findall(r"pip install (\./\S+)", line):
                assert (REPO_ROOT / folder).is_dir(), line
            for constraints in re.findall(r"-c (\S+)", line):
                assert (REPO_ROOT / constraints).is_file(), line
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "ruff check" in ci and "mypy" in ci
    assert "apt-get install -y" in ci and "chromium" in ci
    hooks = (REPO_ROOT / ".pre-commit-config.yaml").read_text()
    assert all(hook in hooks for hook in ("id: ruff", "id: ruff-format", "mypy")), hooks
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(r"TORCH_VERSION=2\.5\.1\b", dockerfile), "the Kaolin block's torch"
    assert re.search(r"CUDA_TAG=cu121\b", dockerfile) and "KAOLIN_VERSION=0.18.0" in dockerfile
    compose = (REPO_ROOT / "docker-compose.yml").read_text()
    assert "${SOURCES" in compose and "SPCACHE_TOKEN" in compose
    token = sh("openssl rand -hex 24", tmp_path)
    assert token.returncode == 0 and re.fullmatch(r"[0-9a-f]{48}\n", token.stdout), token


def test_the_ci_line_is_what_ci_runs() -> None:
    text = README.read_text()
    marker = text.index("ci:test-command")
    ci_line = shell_blocks(text[marker:])[0][0]
    assert COMMANDS[ci_line].kind == ELSEWHERE
    assert "ci:test-command" in (REPO_ROOT / ".ci" / "run").read_text()


# --------------------------------------------------------------------------- run as written


def test_version_line(tmp_path: Path) -> None:
    import spcache as package

    (line,) = line_of(RUN, "test_version_line")
    out = sh(line, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"spcache {package.__version__}"


@pytest.mark.slow
def test_the_demo_then_the_precompute_line(tmp_path: Path) -> None:
    """`spcache demo` (the install lines' last step) from an empty directory, then the
    README's precompute line over what it made: everything cached, nothing recomputed."""
    from cache_store import CachedDataset
    from cache_store.stores.opener import open_store

    install = next(line for line in COMMANDS if "/whl/cpu && " in line and "demo" in line)
    demo = install.rsplit("&& ", 1)[1].replace(".venv/bin/", "")  # the venv's bin is on PATH
    with sh_start(demo, tmp_path) as proc:
        url = proc.wait_line(r"starting the service on (http://127\.0\.0\.1:\d+) ", 900).group(1)
        proc.wait_line("Ctrl-C stops the service.", 900)
        caches = httpx.get(f"{url}/v1/caches", timeout=60).json()["caches"]
        assert [c["recipe"] for c in caches] == ["spc_query"], caches
        assert ctrl_c(proc) == 0, proc.output()[-3000:]
    assert "stopping the service" in proc.stdout()
    cache = tmp_path / "spcache-demo" / "cache"
    with open_store(cache) as store:
        before = {key: store.get(key) for key in store.keys()}
    assert len(before) == 7  # six precomputed, one warmed up over HTTP

    (line,) = line_of(RUN, DEMO_TEST)
    out = sh(line, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done 0, skipped 7, failed 0" in out.stdout, out.stdout
    with open_store(cache) as store:
        assert {key: store.get(key) for key in store.keys()} == before  # none recomputed
    assert len(CachedDataset(str(cache), "spc_query", level=7)) == 7  # the next README step
    assert sorted(os.listdir(tmp_path)) == ["spcache-demo"]  # nothing else written here


@pytest.mark.slow
def test_the_sdf_line_then_its_snippet(tmp_path: Path, corpus_meshes: list[Path]) -> None:
    meshes = tmp_path / "meshes"
    meshes.mkdir()
    for mesh in corpus_meshes:
        if mesh.name in ("icosphere.obj", "box_quads.obj"):  # closed meshes, as .obj
            shutil.copy(mesh, meshes / mesh.name)
    (line,) = line_of(RUN, "test_the_sdf_line_then_its_snippet")
    out = sh(line, tmp_path, {"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done 2, skipped 0, failed 0" in out.stdout, out.stdout
    (tmp_path / "sdf.py").write_text(readme_python('"spc_sdf"'))
    snippet = sh("python sdf.py", tmp_path)
    assert snippet.returncode == 0, snippet.stderr[-3000:]


# -- GPU lines, on a machine without a GPU


def test_the_gpu_check_line(tmp_path: Path) -> None:
    from tests.conftest import cuda_works

    if cuda_works():
        pytest.skip("a GPU is here: bench/gpu_check.py runs the GPU check itself")
    (line,) = line_of(RUN, "test_the_gpu_check_line")
    before = set(REPO_ROOT.iterdir())
    out = sh(line, REPO_ROOT)  # "from the checkout"
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == [
        "gpu_check: no CUDA device here; nothing to check (run it on a GPU machine)"
    ]
    assert set(REPO_ROOT.iterdir()) == before  # no report written


@pytest.mark.slow
def test_the_gpu_tests_line() -> None:
    from tests.conftest import cuda_works

    (line,) = line_of(RUN, "test_the_gpu_tests_line")
    out = sh(line, REPO_ROOT)  # from the checkout
    assert out.returncode == 0, out.stdout[-3000:]
    tally = out.stdout.strip().splitlines()[-1]
    assert "deselected" in tally and ("passed" if cuda_works() else "skipped") in tally, tally
