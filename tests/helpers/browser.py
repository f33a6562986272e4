"""The status page's browser tests: Debian's chromium driven by Playwright for Python.

CI installs chromium (``.ci/run``, as root); elsewhere the tests skip and name the
package. Playwright is a dev dependency.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import pytest

__all__ = ["CHROMIUM", "launched_chromium", "needs_chromium"]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium: apt-get install -y chromium"
)


@contextlib.contextmanager
def launched_chromium() -> Iterator[object]:
    """A headless chromium (a Playwright ``Browser``), closed at the end of the block."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="needs Playwright for Python: pip install playwright"
    )
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()
