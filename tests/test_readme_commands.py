"""Every shell command of README.md, run as a user runs it.

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

import json
import os
import re
import shutil
import signal
import ssl
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT
from tests.helpers.procs import Proc, run, run_spcache, start, wait_http

README = REPO_ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent
#: programs whose inline spans are commands a user would paste (``spcache X`` needs an
#: argument beyond the command name: ``spcache serve`` alone names the command)
PROGRAMS = ("spcache", "python", "python3", "pip", "pytest", "git", "apt-get", "docker")

RUN, SERVE, SYNOPSIS, OUTPUT, UNAVAILABLE, ELSEWHERE = (
    "run",
    "serve",
    "synopsis",
    "output",
    "unavailable",
    "elsewhere",
)


@dataclass(frozen=True)
class How:
    kind: str
    where: str  # the test of this module that runs it, the other test, or why not here


DEMO_TEST = "test_the_demo_then_the_precompute_line"
S3_TEST = "test_the_ray_block_into_a_bucket"
INSTALL = (
    "downloads PyTorch (about 200 MB from PyTorch's CPU index, 2.7 GB of CUDA wheels from "
    "PyPI) into a new venv: not here. The test venv is this line's result; "
    "test_unavailable_commands_as_far_as_they_go checks the pins and paths it names"
)

COMMANDS: dict[str, How] = {
    # -- Two commands
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 --index-url "
    "https://download.pytorch.org/whl/cpu && .venv/bin/pip install -e . && "
    ".venv/bin/spcache demo": How(UNAVAILABLE, f"{INSTALL}; its `spcache demo`: {DEMO_TEST}"),
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install "
    "-e . && .venv/bin/spcache demo": How(
        UNAVAILABLE, f"{INSTALL}; its `spcache demo`: {DEMO_TEST}"
    ),
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install "
    "-e '.[dev]' && .venv/bin/pip install ./examples/voxel_normals && .venv/bin/python -m "
    "pytest": How(
        ELSEWHERE,
        ".ci/run runs it, as CI (this suite is its last part); test_the_ci_line_is_what_ci_runs",
    ),
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 --index-url "
    "https://download.pytorch.org/whl/cpu && .venv/bin/pip install -e '.[dev]' && "
    ".venv/bin/pip install ./examples/voxel_normals && .venv/bin/python -m pytest": How(
        UNAVAILABLE, INSTALL
    ),
    ".venv/bin/ruff check .": How(ELSEWHERE, ".ci/run; tests/test_layout.py runs ruff check"),
    ".venv/bin/mypy": How(ELSEWHERE, ".ci/run (mypy configured in pyproject.toml)"),
    "pip install pre-commit && pre-commit install": How(
        UNAVAILABLE,
        "installs git hooks into the clone; checked: .pre-commit-config.yaml runs ruff, "
        "ruff format and mypy",
    ),
    "spcache --version": How(RUN, "test_version_line"),
    "git clone ... spcache && cd spcache": How(
        UNAVAILABLE, "`...` is the clone's URL; every test runs in the clone"
    ),
    # -- Using the cache in training
    "spcache precompute spcache-demo/sources --recipe spc_query --param level=7 --cache "
    "spcache-demo/cache": How(RUN, DEMO_TEST),
    "python -": How(
        ELSEWHERE,
        "names a way to start Python; tests/spcache/test_precompute_anywhere.py runs "
        "spcache.precompute from it",
    ),
    "python -c": How(ELSEWHERE, "as `python -`: tests/spcache/test_precompute_anywhere.py"),
    "spcache worker --cache DIR": How(SYNOPSIS, "test_synopsis_lines_name_real_options"),
    # -- Training an SPC neural field
    "spcache precompute meshes/*.obj --recipe spc_sdf --param level=7 --cache cache": How(
        RUN, "test_the_sdf_line_then_its_snippet"
    ),
    # -- Your own features
    "mkdir my_recipes && cd my_recipes && mkdir my_recipes": How(
        RUN, "test_your_own_recipe_from_an_empty_directory"
    ),
    "pip install -e .": How(
        RUN,
        "test_your_own_recipe_from_an_empty_directory (the plugin, into the test venv, "
        "uninstalled after); in the Kaolin block it installs spcache, as the test venv was",
    ),
    "spcache recipes                                  # point_count (version 1) ... listed": How(
        RUN, "test_your_own_recipe_from_an_empty_directory"
    ),
    "spcache precompute shapes/ --recipe point_count --param level=6 --cache cache": How(
        RUN, "test_your_own_recipe_from_an_empty_directory"
    ),
    "spcache serve --cache cache --source-root shapes/   # warm-up, read-through, GET "
    "/v1/recipes": How(SERVE, "test_your_own_recipe_from_an_empty_directory"),
    # -- The CLI (a synopsis)
    "spcache recipes [--json]                                       # each recipe's "
    "parameters, defaults, bounds": How(SYNOPSIS, "test_synopsis_lines_name_real_options"),
    "spcache precompute SOURCE... --recipe spc_query --param level=8 --cache CACHE_DIR "
    "[--device auto|cpu|cuda:N] [--backend auto|torch|kaolin] [--loaders N] [--skip-failed] "
    "[--time-limit SECONDS] [--id-template T | --id-keep-ext] [--json]": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "spcache worker --cache CACHE_DIR [--device cuda:0] [--backend auto] [--loaders N] "
    "[--time-limit SECONDS] [--source-root DIR]... [--max-source-bytes N] [--max-size SIZE]": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "python -m spcache COMMAND": How(
        ELSEWHERE,
        "names the second way in: tests/spcache/test_dispatch.py::"
        "test_python_dash_m_spcache_is_the_one_way_in_besides_the_script runs it",
    ),
    "spcache ls | head -1": How(
        ELSEWHERE,
        "a fragment (no --cache) showing a closed pipe: tests/spcache/test_dispatch.py::"
        "test_output_to_a_closed_pipe_ends_quietly_with_the_sigpipe_status runs `ls` so",
    ),
    "spcache serve  --cache CACHE_DIR [--host 127.0.0.1] [--port 8000 | --fd N] [--no-worker] "
    "[--token T] [--source-root DIR]... [--max-size SIZE]": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "spcache export FINGERPRINT --cache CACHE_DIR --to DEST.zarr [--codec "
    "none|lz4|lz4hc|zstd]   # a shareable snapshot": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "spcache merge DEST.zarr [--fingerprint FP] [--remove-orphans]                 # index a "
    "sharded snapshot (written by --engine ray)": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "spcache import DEST.zarr --cache CACHE_DIR [--fingerprint FP]                # copy a "
    "snapshot into a local cache": How(SYNOPSIS, "test_synopsis_lines_name_real_options"),
    "spcache verify --cache CACHE_DIR_OR_SNAPSHOT": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "spcache stats  --cache CACHE_DIR_OR_SNAPSHOT": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    'spcache ls     --cache CACHE_DIR_OR_SNAPSHOT [--json]             # see "Housekeeping"': How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "spcache rm FINGERPRINT... --cache CACHE_DIR [--failed] [--compact]": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "spcache prune  --cache CACHE_DIR [--max-size SIZE] [--unused-for DURATION] [--keep N] "
    "[--dry-run]": How(SYNOPSIS, "test_synopsis_lines_name_real_options"),
    "spcache compact --cache CACHE_DIR [--rewrite-records]": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "spcache demo [--port 8000] [--level 7]                         # --level: octree level": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    # -- Housekeeping (each line on the cache the `ls` line shows)
    "spcache ls --cache runs/cache            # one row per fingerprint, least recently used "
    "first": How(RUN, "test_the_housekeeping_block"),
    "FINGERPRINT                       RECIPE        RECORDS  SIZE       STATE     FAILED  LAST "
    "WRITTEN         LAST READ": How(OUTPUT, "test_the_housekeeping_block"),
    "4e2c9ec4d244890b73411cf9b684a3c3  spc v1        50       235.0 KiB  complete  0       "
    "2026-11-25 00:35:20  -": How(OUTPUT, "test_the_housekeeping_block"),
    "...": How(OUTPUT, "test_the_housekeeping_block (more rows)"),
    "spcache rm 4e2c9ec4 --cache runs/cache   # a fingerprint, or a unique prefix (6+ "
    "characters)": How(RUN, "test_the_housekeeping_block"),
    "spcache rm --failed 4e2c9ec4 --cache runs/cache   # only forget its failures: they are "
    "retried": How(RUN, "test_the_housekeeping_block"),
    "spcache prune --cache runs/cache --max-size 50G --keep 3 --dry-run   # say what would go": How(
        RUN, "test_the_housekeeping_block"
    ),
    "spcache prune --cache runs/cache --unused-for 30d": How(RUN, "test_the_housekeeping_block"),
    "spcache compact --cache runs/cache       # give the disk back": How(
        RUN, "test_the_housekeeping_block"
    ),
    "spcache ls --json | head -1": How(
        ELSEWHERE,
        "a fragment (no --cache) showing a closed pipe: "
        "tests/spcache/test_interrupt_streams.py::"
        "test_output_into_a_closed_pipe_ends_the_command_quietly runs one",
    ),
    "spcache compact --rewrite-records": How(
        ELSEWHERE,
        "a fragment (no --cache): tests/cache_store/test_descriptors.py::"
        "test_compact_rewrite_records_rewrites_a_cache_in_format_2 runs it on a cache of "
        "both record formats and reads every record back",
    ),
    "spcache serve --max-size SIZE": How(SYNOPSIS, "test_synopsis_lines_name_real_options"),
    "spcache worker --max-size SIZE": How(SYNOPSIS, "test_synopsis_lines_name_real_options"),
    # -- The HTTP API / status page
    "spcache serve --tls-certfile cert.pem --tls-keyfile key.pem": How(
        SERVE, "test_the_tls_line_answers_on_https"
    ),
    "apt-get install -y chromium": How(
        UNAVAILABLE,
        "installs a system package; .ci/run installs it as root when missing (checked)",
    ),
    # -- Running on a GPU with Kaolin
    "python bench/gpu_check.py": How(RUN, "test_the_gpu_check_line"),
    "pip install torch==2.5.1 --index-url <PyTorch's CUDA 12.1 wheel index>": How(
        UNAVAILABLE,
        "a placeholder index and a CUDA torch download; checked: the pair is the one the "
        "Dockerfile pins",
    ),
    "pip install kaolin==0.18.0 -f https://nvidia-kaolin.s3.us-east-2.amazonaws.com/torch-"
    "2.5.1_cu121.html": How(
        UNAVAILABLE,
        "NVIDIA's wheel index and a GPU; checked: the versions are the Dockerfile's",
    ),
    "spcache worker --cache CACHE_DIR --device cuda:0      # --backend auto picks kaolin "
    "there": How(SYNOPSIS, "test_synopsis_lines_name_real_options (a GPU: gpu-marked tests)"),
    "pytest -m gpu": How(RUN, "test_the_gpu_tests_line"),
    # -- docker-compose
    "SPCACHE_TOKEN=$(openssl rand -hex 24) SOURCES=/path/to/meshes docker compose up --build": How(
        UNAVAILABLE,
        "no Docker engine here; tests/test_compose.py checks docker-compose.yml, this test "
        "that it takes SPCACHE_TOKEN and SOURCES and that the token command works",
    ),
    "spcache serve --no-worker": How(SYNOPSIS, "test_synopsis_lines_name_real_options"),
    # -- Scale-out on Ray
    "spcache precompute ... --engine ray [--address auto] [--actors N]": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "spcache precompute /shared/shapes --recipe spc --param level=8 --cache "
    "s3://bucket/l8.zarr --engine ray": How(
        RUN, f"{S3_TEST} (moto's S3 server; /shared and /fast under the test's directory)"
    ),
    "spcache merge s3://bucket/l8.zarr                     # merge the manifests into the "
    "index (idempotent)": How(RUN, S3_TEST),
    "spcache import s3://bucket/l8.zarr --cache /fast/spcache   # a local LMDB hot copy for "
    "training": How(RUN, S3_TEST),
    # -- More
    "python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0 && "
    ".venv-bench/bin/pip install -c bench/constraints.txt -e '.[bench]'": How(
        UNAVAILABLE,
        "a second venv with 2.7 GB of PyTorch's CUDA wheels; checked: the constraints file "
        "and the bench extra exist",
    ),
}

#: shell blocks that hold no command (the first line names the block)
NOT_COMMANDS = {
    "sources (meshes, point clouds)          training job(s): DataLoader workers (forked, "
    "CPU only)": "the diagram of the processes",
}


# --------------------------------------------------------------------------- extraction


def shell_blocks(text: str) -> list[list[str]]:
    """The non-empty lines (stripped) of each ```` ``` ```` and ```` ```bash ```` block."""
    blocks, current, language = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current, language = [], line[3:].strip()
            else:
                if language in ("", "bash", "sh", "shell", "console"):
                    blocks.append([x.strip() for x in current if x.strip()])
                current = None
            continue
        if current is not None:
            current.append(line)
    return blocks


def inline_commands(text: str) -> list[str]:
    """Inline code spans (outside fenced blocks) that are commands: they start with one
    of :data:`PROGRAMS` (or a venv's ``bin/``) followed by an argument."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    found = []
    for span in re.findall(r"`([^`]+)`", prose):
        words = span.split()
        program = words[0]
        if re.fullmatch(r"\.venv[\w-]*/bin/\w+", program):  # a venv's program, even alone
            found.append(" ".join(words))
            continue
        if program not in PROGRAMS or len(words) < 2:
            continue
        if program == "spcache" and not re.fullmatch(r"[a-z]+|-.*", words[1]):
            continue  # `spcache serve: listening on ...`: a line it prints
        if program == "spcache" and len(words) == 2 and not words[1].startswith("-"):
            continue  # `spcache serve`: the command's name in a sentence
        found.append(" ".join(words))
    return found


def readme_commands() -> list[str]:
    text = README.read_text()
    lines = []
    for block in shell_blocks(text):
        if block and block[0] in NOT_COMMANDS:
            continue
        lines.extend(block)
    return lines + inline_commands(text)


# --------------------------------------------------------------------------- running


def shell_env(extra: dict[str, str | None] | None = None) -> dict[str, str | None]:
    """The test venv's ``bin`` first on PATH (as after ``source .venv/bin/activate``)."""
    return {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(extra or {})}


def sh(line: str, cwd: Path, env: dict[str, str | None] | None = None, timeout: float = 900):
    """``bash -c LINE`` in ``cwd``: a README line as a user pastes it."""
    return run(["bash", "-c", line], cwd=cwd, env=shell_env(env), timeout=timeout)


def sh_start(line: str, cwd: Path, env: dict[str, str | None] | None = None) -> Proc:
    """A long-lived README line in the background; ``SPCACHE_PORT=0``: a free port."""
    return start(["bash", "-c", line], cwd=cwd, env=shell_env({"SPCACHE_PORT": "0", **(env or {})}))


def ctrl_c(proc: Proc, timeout: float = 120) -> int:
    """Ctrl-C as a terminal sends it (SIGINT to the process group); the exit status."""
    os.killpg(proc.pid, signal.SIGINT)
    return proc.wait(timeout)


def line_of(kind: str, test: str) -> list[str]:
    """The README commands of ``kind`` that ``test`` runs, in README order."""
    return [
        line
        for line in readme_commands()
        if line in COMMANDS
        and COMMANDS[line].kind == kind
        and COMMANDS[line].where.split()[0] == test
    ]


# --------------------------------------------------------------------------- the table


def test_every_readme_command_is_in_the_table() -> None:
    found = readme_commands()
    missing = [line for line in found if line not in COMMANDS]
    assert not missing, (
        "README commands with no row in tests/test_readme_commands.py::COMMANDS (say how "
        "each is tested):\n" + "\n".join(missing)
    )
    stale = sorted(set(COMMANDS) - set(found))
    assert not stale, "rows whose command is no longer in README.md:\n" + "\n".join(stale)
    tests = {name for name in globals() if name.startswith("test_")}
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


def _readme_python(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


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
    (tmp_path / "sdf.py").write_text(_readme_python('"spc_sdf"'))
    snippet = sh("python sdf.py", tmp_path)
    assert snippet.returncode == 0, snippet.stderr[-3000:]


# -- Housekeeping


def _housekeeping_cache(root: Path, corpus_meshes: list[Path], bad: Path) -> Path:
    """``runs/cache`` as the README's `ls` shows it: ``spc`` level 3 (fingerprint
    4e2c9ec4...) with one failed sample, and level 4 beside it, both made by precompute."""
    shapes = root / "shapes"
    shapes.mkdir(parents=True)
    for mesh in corpus_meshes[:6]:
        shutil.copy(mesh, shapes / mesh.name)
    shutil.copy(bad, shapes / bad.name)
    for level in (3, 4):
        out = run_spcache(
            "precompute", shapes, "--recipe", "spc", "--param", f"level={level}",
            "--cache", root / "runs" / "cache", "--device", "cpu", "--loaders", "0",
        )  # fmt: skip
        assert out.returncode == 1, out.stderr[-3000:]  # the bad one failed alone
    return root / "runs" / "cache"


def _ls(cwd: Path) -> dict[str, dict]:
    out = run_spcache("ls", "--cache", "runs/cache", "--json", cwd=cwd)
    assert out.returncode == 0, out.stderr
    return {row["fingerprint"]: row for row in json.loads(out.stdout)}


@pytest.mark.slow
def test_the_housekeeping_block(
    tmp_path: Path, corpus_meshes: list[Path], corpus_bad_inputs: list[Path]
) -> None:
    bad = next(p for p in corpus_bad_inputs if p.name == "nan_vertices.obj")
    template = _housekeeping_cache(tmp_path / "template", corpus_meshes, bad)
    fp = "4e2c9ec4d244890b73411cf9b684a3c3"
    original = _ls(tmp_path / "template")
    assert original[fp]["failed"] == 1 and original[fp]["records"] == 6
    (other,) = set(original) - {fp}
    block = next(b for b in shell_blocks(README.read_text()) if b[0].startswith("spcache ls"))

    def fresh() -> Path:  # each line on the cache as `ls` shows it
        cwd = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        shutil.copytree(template, cwd / "runs" / "cache")
        return cwd

    for line in block:
        how = COMMANDS[line]
        if how.kind == OUTPUT:
            continue
        cwd = fresh()
        if "--unused-for 30d" in line:  # the level-4 fingerprint last used 40 days ago
            for kind in ("read", "written"):
                usage = cwd / "runs" / "cache" / "usage" / f"{other}.{kind}"
                usage.touch()
                days_40 = usage.stat().st_mtime - 40 * 86400
                os.utime(usage, (days_40, days_40))
        out = sh(line, cwd)
        assert out.returncode == 0, f"{line}: {out.stderr[-3000:]}"
        after = _ls(cwd)
        if line.startswith("spcache ls"):
            header, row = block[1].split(), block[2].split()
            printed = out.stdout.splitlines()
            assert printed[0].split() == header, printed[0]
            mine = next(p.split() for p in printed if p.startswith(fp))
            # fingerprint, recipe, the size's unit and state as the README shows them
            # (the size is two words: "235.0 KiB"); its one failure
            assert mine[:3] == row[:3] and mine[5:7] == row[5:7] and mine[7] == "1", mine
            assert after == original
        elif line.startswith("spcache rm --failed"):
            assert after[fp]["failed"] == 0 and after[fp]["records"] == 6
        elif line.startswith("spcache rm"):
            assert set(after) == {other}
        elif "--dry-run" in line:
            assert after == original  # 50G and keep 3: nothing would go, nothing went
        elif "--unused-for" in line:
            assert set(after) == {fp}, out.stdout
        elif line.startswith("spcache compact"):
            assert after == original
            assert json.loads(sh("spcache verify --cache runs/cache --json", cwd).stdout)["ok"]
        else:
            raise AssertionError(f"a housekeeping line this test does not check: {line}")


# -- Your own features


@pytest.fixture
def uninstalls_my_recipes() -> Iterator[None]:
    """The README installs its plugin into the environment spcache runs in: the test
    venv. It goes again after the test, whatever happened."""
    yield
    run([sys.executable, "-m", "pip", "uninstall", "--yes", "my-recipes"])


@pytest.mark.slow
def test_your_own_recipe_from_an_empty_directory(
    tmp_path: Path, corpus_meshes: list[Path], uninstalls_my_recipes: None
) -> None:
    text = README.read_text()
    section = text[text.index("## Your own features") : text.index("## The CLI")]
    (mkdir,) = line_of(RUN, "test_your_own_recipe_from_an_empty_directory")[:1]
    out = sh(mkdir, tmp_path)
    assert out.returncode == 0, out.stderr
    project = tmp_path / "my_recipes"  # where `cd my_recipes` left the user
    assert (project / "my_recipes").is_dir()
    (project / "my_recipes" / "__init__.py").write_text("")
    (project / "my_recipes" / "counts.py").write_text(
        re.findall(r"```python\n(.*?)```", section, re.S)[0]
    )
    (project / "pyproject.toml").write_text(re.findall(r"```toml\n(.*?)```", section, re.S)[0])
    shapes = project / "shapes"
    shapes.mkdir()
    for mesh in corpus_meshes[:3]:
        shutil.copy(mesh, shapes / mesh.name)

    block = next(b for b in shell_blocks(section) if b and b[0] == "pip install -e .")
    install, recipes, precompute, serve = block
    out = sh(install, project)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]

    out = sh(recipes, project)
    assert out.returncode == 0, out.stderr
    assert "point_count (version 1)" in out.stdout, out.stdout
    listed = json.loads(run_spcache("recipes", "--json", cwd=project).stdout)
    assert listed["point_count"]["origin"]["package"] == "my-recipes"

    out = sh(precompute, project)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done 3, skipped 0, failed 0" in out.stdout, out.stdout
    reader = _readme_python('"point_count", level=6)').split("# read-through")[0] + (
        "batch = next(iter(loader))\n"
        "print(len(ds), sorted(batch), int(batch['counts'].sum()) > 0)\n"
    )
    (project / "read.py").write_text(reader)
    out = sh("python read.py", project)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "3" and "'voxels'" in out.stdout and "True" in out.stdout

    late = corpus_meshes[3]  # not cached: read through the service
    shutil.copy(late, shapes / f"late{late.suffix}")
    with sh_start(serve, project) as proc:
        url = proc.wait_line(r"listening on (http://127\.0\.0\.1:\d+)").group(1)
        wait_http(f"{url}/readyz", proc=proc)
        recipes_json = httpx.get(f"{url}/v1/recipes", timeout=60).json()["recipes"]
        assert any(r["name"] == "point_count" for r in recipes_json)
        read_through = (
            "import spcache\n"
            f"ds = spcache.CachedDataset({url!r}, 'point_count', sources='shapes/', level=6)\n"
            "i = [ds.sample_id(i) for i in range(len(ds))].index('late')\n"
            "print(int(ds[i]['counts'].sum()))\n"
        )
        out = run([sys.executable, "-c", read_through], cwd=project)
        assert out.returncode == 0, out.stderr[-3000:] + proc.output()[-3000:]
        assert int(out.stdout.split()[-1]) > 0
        ctrl_c(proc)
    assert "Traceback" not in proc.stderr(), proc.stderr()[-3000:]


# -- TLS


@pytest.mark.slow
def test_the_tls_line_answers_on_https(tmp_path: Path) -> None:
    tls = REPO_ROOT / "tests" / "data" / "tls"
    shutil.copy(tls / "cert.pem", tmp_path / "cert.pem")
    shutil.copy(tls / "key.pem", tmp_path / "key.pem")
    (line,) = line_of(SERVE, "test_the_tls_line_answers_on_https")
    # the README's line names no cache: SPCACHE_CACHE says which, as the README offers
    with sh_start(line, tmp_path, {"SPCACHE_CACHE": "cache"}) as proc:
        url = proc.wait_line(r"listening on (https://127\.0\.0\.1:\d+)").group(1)
        trust = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
        assert wait_http(f"{url}/healthz", proc=proc, verify=trust).json() == {"status": "ok"}
        ctrl_c(proc)
    assert (tmp_path / "cache").is_dir()


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


# -- Scale-out on Ray: into a bucket


def _bucket_keys(endpoint: str, bucket: str) -> list[str]:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def _url_folders(root: Path) -> list[str]:
    """Local folders a location that went through ``Path`` would have made."""
    return [str(p) for p in root.rglob("*") if p.name.lower() in ("s3:", "file:")]


@pytest.mark.slow
def test_the_ray_block_into_a_bucket(tmp_path: Path, corpus_meshes: list[Path]) -> None:
    """The three lines as written against moto's S3 server (bucket ``bucket`` made
    first, its address in ``AWS_ENDPOINT_URL``), ``/shared`` and ``/fast`` placed under
    this test's directory; then checked as the user would: the objects in the bucket,
    no local ``s3:`` folder, the hot copy and the snapshot read back."""
    from cache_store import CachedDataset
    from cache_store.stores.opener import open_store
    from tests.helpers.s3 import moto_s3

    shapes = tmp_path / "shared" / "shapes"
    shapes.mkdir(parents=True)
    meshes = [m for m in corpus_meshes if m.suffix == ".obj"][:3]
    for mesh in meshes:
        shutil.copy(mesh, shapes / mesh.name)
    block = line_of(RUN, S3_TEST)
    as_here = [
        line.replace("/shared/", f"{tmp_path}/shared/").replace("/fast/", f"{tmp_path}/fast/")
        for line in block
    ]
    cwd = tmp_path / "work"
    cwd.mkdir()
    with moto_s3() as s3:  # its address and credentials reach the commands' environment
        import boto3

        boto3.client(
            "s3",
            endpoint_url=s3.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket="bucket")
        precompute, merge, import_ = as_here

        out = sh(precompute, cwd)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "done 3, skipped 0, failed 0" in out.stdout, out.stdout
        fp = re.search(r"^fingerprint ([0-9a-f]{32})$", out.stdout, re.M).group(1)  # type: ignore[union-attr]
        keys = _bucket_keys(s3.endpoint, "bucket")
        assert any(k.startswith(f"l8.zarr/{fp}/commits/") for k in keys), keys
        assert any(k.startswith(f"l8.zarr/{fp}/parts/") for k in keys), keys

        out = sh(merge, cwd)
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"l8.zarr/{fp}/index.json" in _bucket_keys(s3.endpoint, "bucket")
        again = sh(merge, cwd)  # idempotent, as the comment says
        assert again.returncode == 0 and again.stdout == out.stdout, again.stderr[-3000:]

        out = sh(import_, cwd)
        assert out.returncode == 0, out.stderr[-3000:]
        with open_store(tmp_path / "fast" / "spcache") as hot:
            assert sorted(hot.get_index(fp).sample_ids.tolist()) == sorted(m.stem for m in meshes)

        snapshot = CachedDataset("s3://bucket/l8.zarr", fp)  # the README's next line
        assert len(snapshot) == 3 and snapshot[0]["octree"].numel() > 0
    assert not _url_folders(tmp_path), _url_folders(tmp_path)
