"""The example recipe package (``examples/voxel_normals``) as an installed distribution.

CI pip-installs it into the test venv (README's test command), so the tests use it as a
user would: found by entry point, imported from site-packages. Where it is not installed
(a developer's older venv), :func:`ensure_installed` installs it once per session into a
temporary target directory (``pip install --no-deps --target``) and puts that on
``sys.path`` and ``PYTHONPATH``: still a built distribution with its entry point, never
the source tree.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

DISTRIBUTION = "spcache-voxel-normals"
SOURCE = REPO_ROOT / "examples" / "voxel_normals"
NAME = "voxel_normals"


def ensure_installed(target: Path) -> str | None:
    """Make the example importable and found; returns the directory added to the path
    (for child processes' ``PYTHONPATH``), or None when it was installed already."""
    from cache_store.recipes.registry import installed_recipes

    try:
        importlib.metadata.distribution(DISTRIBUTION)
        return None
    except importlib.metadata.PackageNotFoundError:
        pass
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(SOURCE),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p
    )
    importlib.invalidate_caches()
    installed_recipes(reload=True)
    return str(target)
