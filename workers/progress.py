"""A run's progress bar: a widget in a Jupyter kernel that has ipywidgets, text on stderr
everywhere else.

A text bar's writes never fail the run: once its stream refuses a write (stderr is a pipe
whose reader is gone, or a closed file) the bar writes nothing more.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any

__all__ = ["open_bar", "progress_bar_class"]


@functools.cache
def progress_bar_class() -> Any:
    """The tqdm class of a run's bar (a notebook without ipywidgets gets the text bar,
    without tqdm's warning about the missing widgets). Its bars start no monitor thread,
    so a run leaves no thread behind (a DataLoader may fork right after it)."""
    from tqdm import TqdmWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)
        from tqdm.auto import tqdm

    return type("RunProgressBar", (tqdm,), {"monitor_interval": 0})


def open_bar(total: int, *, initial: int = 0) -> Any:
    """A bar over ``total`` samples, ``initial`` of them already reported."""
    bar_class = progress_bar_class()
    widget = any(c.__module__ == "tqdm.notebook" for c in bar_class.__mro__)
    return bar_class(
        total=total,
        unit="sample",
        # a widget chooses its own output when given sys.stderr itself
        file=sys.stderr if widget else _BarStream(sys.stderr),
        dynamic_ncols=True,
        initial=initial,
    )


class _BarStream:
    """The stream a text bar writes to: a write that fails ends the bar's output, never
    the run. Everything else is the stream's (tqdm asks for its ``fileno``, ``encoding``)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.failed = False

    def write(self, text: str) -> int:
        if not self.failed:
            try:
                self.stream.write(text)
            except (OSError, ValueError):  # ValueError: a closed file
                self.failed = True
        return len(text)

    def flush(self) -> None:
        if not self.failed:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self.failed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)
