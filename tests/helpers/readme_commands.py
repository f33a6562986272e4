"""README.md's shell commands, and how each is tested: the table the README tests go by.

:data:`COMMANDS` maps every command line of README.md's shell blocks and inline spans
(:func:`readme_commands`) to a :class:`How`; ``tests/test_readme_commands.py`` explains
the kinds and checks the table against the README, and it and
``tests/test_readme_workflows.py`` run the commands (``sh``, ``sh_start``, ``ctrl_c``:
a README line as a user pastes it, in bash, with the test venv first on ``PATH``)."""

from __future__ import annotations

import os
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO_ROOT
from tests.helpers.procs import Proc, run, start

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
    "spcache precompute meshes/ --recipe spc --param level=6 --param rotation=so3 --variants 4 "
    "--cache cache": How(
        ELSEWHERE,
        "tests/spcache/test_variants_training.py::"
        "test_the_readme_variants_line_then_more_variants_then_ls runs it from a fresh "
        "directory, then with --variants 6, then spcache ls",
    ),
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
    "[--device auto|cpu|cuda:N] [--backend auto|torch|kaolin] [--loaders N] [--variants K] "
    "[--skip-failed] [--time-limit SECONDS] [--id-template T | --id-keep-ext] [--json]": How(
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
    "[--token T] [--source-root DIR]... [--max-size SIZE] [--time-limit SECONDS]": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "spcache export FINGERPRINT --cache CACHE_DIR --to DEST.zarr [--codec "
    "none|lz4|lz4hc|zstd]   # a shareable snapshot": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "spcache merge DEST.zarr [--fingerprint FP] [--remove-orphans] [--remove-superseded] "
    "[--orphan-age SECONDS]   # index and keep a sharded snapshot": How(
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
    "spcache serve --time-limit": How(SYNOPSIS, "test_synopsis_lines_name_real_options"),
    # -- Scale-out on Ray
    # -- Several GPUs on one machine
    "spcache precompute SOURCE... --recipe spc --param level=8 --cache CACHE_DIR --device "
    "cuda:0": How(
        ELSEWHERE,
        "no GPU here: tests/spcache/test_shared_cache.py::test_two_precomputes_started_"
        "together_compute_each_sample_once starts two such runs (--device cpu) together",
    ),
    "spcache precompute SOURCE... --recipe spc --param level=8 --cache CACHE_DIR --device "
    "cuda:1": How(ELSEWHERE, "as the cuda:0 line: tests/spcache/test_shared_cache.py"),
    "spcache precompute ... --engine ray [--address auto] [--actors N]": How(
        SYNOPSIS, "test_synopsis_lines_name_real_options"
    ),
    "spcache precompute /shared/shapes --recipe spc --param level=8 --cache "
    "s3://bucket/l8.zarr --engine ray": How(
        RUN, f"{S3_TEST} (moto's S3 server; /shared and /fast under the test's directory)"
    ),
    "spcache merge s3://bucket/l8.zarr                     # merge the manifests into the "
    "index (idempotent)": How(RUN, S3_TEST),
    "spcache merge DEST.zarr --remove-superseded": How(
        ELSEWHERE,
        "tests/faults/test_sharded_superseded.py::test_two_runs_into_one_destination_then_"
        "merge_reclaims_the_duplicates runs it after two runs into one directory and one "
        "S3 destination (with --orphan-age 0 too)",
    ),
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


def readme_python(marker: str) -> str:
    """The one ```` ```python ```` block of README.md holding ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (block,) = [b for b in blocks if marker in b]
    return block
