"""Code cells run as a notebook runs them: a real Jupyter kernel (ipykernel) driven by
nbclient, both installed by the dev extra."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers.procs import environment

__all__ = ["run_notebook"]


def run_notebook(cells: list[str], cwd: Path, *, timeout: int = 300) -> Any:
    """Run ``cells`` in order in a fresh ``python3`` kernel whose working directory is
    ``cwd``; returns the executed notebook (``.cells[i].outputs``). A cell that raises
    raises ``CellExecutionError``. The kernel's connection file and profile go under
    ``cwd`` (never the user's Jupyter folders)."""
    import nbclient
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(code) for code in cells]
    with environment(
        JUPYTER_RUNTIME_DIR=str(cwd / ".jupyter-runtime"), IPYTHONDIR=str(cwd / ".ipython")
    ):
        nbclient.NotebookClient(
            notebook,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(cwd)}},
        ).execute()
    return notebook
