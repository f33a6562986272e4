"""The project's shape: packages import without side effects and arrows point one way."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.helpers.recipes import recipe_plugin_modules


def _imported_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, check=True, capture_output=True, text=True
    ).stdout
    return set(out.split())


PACKAGES = ("spcache", "cache_store", "workers", "service")
#: What importing every module of a package must not pull in (the arrows of DESIGN.md:
#: cache_store is CPU-only bytes at rest; the service is CPU only and torch-free, and
#: imports no module of workers: a recipe class it reads a schema from is found by the
#: registry at run time, like any plugin's; the front door imports a package only when
#: one of its commands runs). The arrows in the source: tests/test_import_graph.py.
FORBIDDEN = {
    "spcache": {"service", "workers", "torch", "fastapi", "starlette", "kaolin", "ray"},
    "cache_store": {"service", "workers", "fastapi", "starlette", "kaolin", "ray"},
    "service": {"workers", "torch", "kaolin", "ray"},
    "workers": {"service", "fastapi", "kaolin", "ray"},
}


#: loaded at run time wherever a recipe is looked up (tests/helpers/recipes.py)
RECIPE_PLUGINS = recipe_plugin_modules()


def submodules(package: str) -> list[str]:
    """Every module of ``package`` (found on disk, so a new file is covered at once)."""
    root = REPO_ROOT / package
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # importing it runs the CLI
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_is_found() -> None:
    for package in PACKAGES:
        mods = submodules(package)
        assert package in mods and len(mods) > 3
    assert {
        "cache_store.jobs.queue",
        "cache_store.snapshot.zarr.export",
        "cache_store.snapshot.zarr.store",
        "cache_store.snapshot.zarr.format",
        "cache_store.format.wire",
    } <= set(submodules("cache_store"))


def test_every_module_of_each_package_imports_and_the_arrows_hold() -> None:
    """Import every module of one package in a fresh interpreter, then check sys.modules
    (a broken import anywhere fails here, not only in the modules the tests use)."""
    for package in PACKAGES:
        code = (
            f"import importlib, sys\n"
            f"for name in {submodules(package)!r}:\n"
            f"    importlib.import_module(name)\n"
            f"cuda = 'torch' in sys.modules and sys.modules['torch'].cuda.is_initialized()\n"
            f"print('CUDA' if cuda else 'no-cuda')\n"
            f"print('\\n'.join(sorted(sys.modules)))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, f"{package}: a module failed to import:\n{proc.stderr}"
        first, *mods = proc.stdout.split()
        assert first == "no-cuda", f"importing {package} initialised CUDA"
        # cache_store.testing's contract records look their recipes up when imported
        allowed = RECIPE_PLUGINS if package == "cache_store" else set()
        forbidden = {m for m in mods if m.split(".")[0] in FORBIDDEN[package]} - allowed
        assert not forbidden, f"importing {package} pulled in {sorted(forbidden)}"


def test_the_service_imports_no_torch_and_runs_no_recipe_code(tmp_path) -> None:
    """The service learns every recipe's schema through the registry, which imports each
    installed recipe's class (the built-ins are a plugin in ``workers/``, torch-free at
    import) and runs none of its code: after a running app listed the recipes, neither
    torch nor the built-ins' computation (``workers.builtin_compute``) is loaded."""
    code = (
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "from service.app import create_app\n"
        "from service.settings import Settings\n"
        f"app = create_app(Settings(cache={str(tmp_path)!r}, worker=False))\n"
        "with TestClient(app, base_url='http://127.0.0.1') as client:\n"
        "    answer = client.get('/v1/recipes').json()\n"
        "print(' '.join(sorted(r['name'] for r in answer['recipes'])))\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    assert {"spc", "spc_query", "spc_sdf"} <= set(out[0].split()), out[0]
    mods = set(out[1:])
    assert "workers.builtin_recipes" in mods  # the schema is read from the class itself
    assert not {m for m in mods if m.split(".")[0] in {"torch", "kaolin", "ray"}}
    assert not {"workers.builtin_compute", "workers.engine", "workers.recipe_run"} & mods


def test_cache_store_imports_neither_service_workers_nor_fastapi() -> None:
    mods = _imported_after("cache_store")
    forbidden = {m for m in mods if m.split(".")[0] in {"service", "workers", "fastapi", "kaolin"}}
    assert not forbidden


def test_the_distribution_ships_each_package() -> None:
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(include) == sorted(f"{p}*" for p in PACKAGES)
    assert project["project"]["scripts"] == {"spcache": "spcache.cli:main"}
    for package in PACKAGES:
        assert (REPO_ROOT / package / "__init__.py").is_file()


#: What ``import spcache`` loads of the packages below it: the error classes (it exports
#: ``cache_store.errors.__all__``, the one list of them), the version and the lazy-name
#: rule; stdlib only.
FRONT_DOOR_LOADS = {
    "cache_store",
    "cache_store.errors",
    "cache_store.lazy_names",
    "cache_store.version",
}


def test_the_front_door_imports_no_package_until_a_command_runs() -> None:
    mods = _imported_after("spcache.cli")
    assert mods >= FRONT_DOOR_LOADS
    assert not {
        m
        for m in mods - FRONT_DOOR_LOADS
        if m.split(".")[0] in {"cache_store", "service", "workers", "torch", "fastapi"}
    }
    assert not {m for m in mods if m.split(".")[0] in {"numpy", "lmdb", "re2", "orjson"}}


def test_no_package_imports_the_front_door() -> None:
    """Arrows point one way: spcache -> service, workers -> cache_store."""
    offenders = []
    for package in PACKAGES[1:]:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            # the import statements themselves (a string that prints "import spcache" for
            # the user, as the demo's does, is not one)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or ""]
                else:
                    continue
                if any(name == "spcache" or name.startswith("spcache.") for name in names):
                    offenders.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert not offenders


def test_cache_store_helpers_of_the_cli_need_no_torch() -> None:
    mods = _imported_after(
        "cache_store.sources.discover, cache_store.jobs.owner_lock, "
        "cache_store.location, cache_store.recipes.table"
    )
    assert "torch" not in mods and "trimesh" not in mods


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    lines = readme.splitlines()
    marker = next(i for i, line in enumerate(lines) if "ci:test-command" in line)
    command = next(line for line in lines[marker + 1 :] if line and not line.startswith("```"))
    assert "torch==2.13.0" in command
    assert command.index("torch==2.13.0") < command.index("-e '.[dev]'")
    assert "pytest" in command


def _fake_ci_checkout(tmp_path, ruff_rc: int, mypy_rc: int, tests_rc: int):
    """A checkout whose README command installs nothing and whose tools are stand-ins that
    record their call and exit with the given status."""
    import shutil

    root = tmp_path / "checkout"
    (root / ".ci").mkdir(parents=True)
    shutil.copy(REPO_ROOT / ".ci" / "run", root / ".ci" / "run")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool, rc in (("ruff", ruff_rc), ("mypy", mypy_rc)):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} >> calls\nexit {rc}\n")
        (bin_dir / tool).chmod(0o755)
    path_dir = tmp_path / "path"  # so .ci/run never tries to install a browser here
    path_dir.mkdir()
    (path_dir / "chromium").write_text("#!/bin/sh\n")
    (path_dir / "chromium").chmod(0o755)
    (root / "README.md").write_text(
        "<!-- ci:test-command: .ci/run runs the next line exactly -->\n```\n"
        f"echo install >> calls && echo pytest >> calls; exit {tests_rc}\n```\n"
    )
    return root, {**os.environ, "PATH": f"{path_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize(
    "ruff_rc, mypy_rc, tests_rc, expected",
    [(0, 0, 0, 0), (1, 0, 0, 1), (0, 1, 0, 1), (0, 0, 3, 3), (1, 1, 5, 5)],
)
def test_ci_runs_ruff_and_mypy_between_install_and_tests_and_fails_on_a_finding(
    tmp_path, ruff_rc: int, mypy_rc: int, tests_rc: int, expected: int
) -> None:
    root, env = _fake_ci_checkout(tmp_path, ruff_rc, mypy_rc, tests_rc)
    proc = subprocess.run(
        ["bash", ".ci/run"], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == expected, proc.stdout + proc.stderr
    # ruff runs twice: the lint, then the format check
    assert (root / "calls").read_text().split() == ["install", "ruff", "ruff", "mypy", "pytest"]
    assert ("or mypy reported findings" in proc.stderr) == bool(ruff_rc or mypy_rc)


def test_the_code_passes_ruff() -> None:
    """The lint CI runs (pyproject.toml [tool.ruff]), here too so a finding fails pytest."""
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_no_large_file_is_tracked_outside_test_data() -> None:
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing is tracked")
    tracked = (
        subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    large = [
        name
        for name in tracked
        if name
        and not name.startswith("tests/data/")
        and (REPO_ROOT / name).is_file()
        and (REPO_ROOT / name).stat().st_size > 1 << 20
    ]
    assert not large, f"files over 1 MiB tracked outside tests/data: {large}"


def test_the_command_line_is_one_layer() -> None:
    """``spcache COMMAND`` is the only way in: no other package has a ``__main__``, a
    parser or a command of its own (back doors skip the dispatcher's recipe loading,
    parent watch, SIGHUP handling and exit statuses), and every command is a module of
    ``spcache/cli/``. The walk's internal child (``cache_store.housekeeping.isolated``) takes
    its two arguments from its parent, not from a user."""
    from spcache.cli import COMMANDS

    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            relative = str(path.relative_to(REPO_ROOT))
            if relative.startswith("spcache/cli/") or relative == "spcache/__main__.py":
                continue
            text = path.read_text()
            runs_itself = 'if __name__ == "__main__"' in text
            if (
                path.name == "__main__.py"
                or "import argparse" in text
                or (runs_itself and relative != "cache_store/housekeeping/isolated.py")
            ):
                offenders.append(relative)
    assert not offenders, f"a command outside spcache/cli: {offenders}"
    modules = {p.stem for p in (REPO_ROOT / "spcache" / "cli").glob("*.py")}
    assert {m.rsplit(".", 1)[1] for m, _ in COMMANDS.values()} == modules - {
        "__init__",
        "args",
        "exits",
    }
