"""The status page's Remove button, in a real headless browser (Debian's chromium).

A service on a cache with two fingerprints: Remove on one row asks for confirmation and
the token, sends DELETE /v1/caches/{fp}, says what it removed, and the row goes; the other
row stays and its records still read. Skips (naming the package) without chromium or
Playwright. ``SPCACHE_PAGE_SCREENSHOTS=<dir>`` keeps the screenshots.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.housekeeping import add_fingerprint, record_counts
from tests.helpers.service import TOKEN, start_server, stop_server
from tests.helpers.browser import launched_chromium, needs_chromium

pytestmark = [
    pytest.mark.slow,
    needs_chromium,
]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with launched_chromium() as launched:
        yield launched


def test_remove_button_removes_one_fingerprint(browser: object, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    keep = add_fingerprint(cache, 3, n=12, nbytes=2048)
    gone = add_fingerprint(cache, 4, n=25, nbytes=2048)
    server = start_server(cache, tmp_path, "--no-worker")
    shots = os.environ.get("SPCACHE_PAGE_SCREENSHOTS")
    try:
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        page = context.new_page()
        page.goto(server.url + "/")
        row = page.locator(f"tr[data-fingerprint='{gone}']")
        row.wait_for(timeout=30_000)
        page.locator(f"tr[data-fingerprint='{keep}']").wait_for(timeout=30_000)
        row.get_by_role("button", name="Remove").click()
        dialog = page.locator("#token-dialog")
        dialog.wait_for(state="visible", timeout=5_000)
        text = dialog.inner_text()
        assert "Remove a fingerprint" in text and "25 records" in text, text
        page.fill("#token", TOKEN)
        if shots:
            Path(shots).mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(Path(shots) / "page-remove-dialog.png"))
        page.click("#token-ok")
        page.wait_for_function(
            "fp => document.getElementById('caches-message').textContent.includes(fp)",
            arg=gone,
            timeout=30_000,
        )
        assert "25 records" in page.inner_text("#caches-message")
        page.wait_for_function(
            "fp => !document.querySelector(`tr[data-fingerprint='${fp}']`)",
            arg=gone,
            timeout=30_000,
        )
        assert page.locator(f"tr[data-fingerprint='{keep}']").count() == 1
        if shots:
            page.screenshot(path=str(Path(shots) / "page-removed.png"))
        context.close()
        assert record_counts(cache) == {keep: 12}
        r = httpx.get(f"{server.url}/v1/caches/{keep}/records/s000003", timeout=10)
        assert r.status_code == 200
    finally:
        stop_server(server)


def test_remove_with_a_wrong_token_removes_nothing(browser: object, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    fp = add_fingerprint(cache, 3, n=5, nbytes=1024)
    server = start_server(cache, tmp_path, "--no-worker")
    try:
        page = browser.new_page()
        page.goto(server.url + "/")
        row = page.locator(f"tr[data-fingerprint='{fp}']")
        row.wait_for(timeout=30_000)
        row.get_by_role("button", name="Remove").click()
        page.fill("#token", "not-the-token")
        page.click("#token-ok")
        page.wait_for_function(
            "() => document.getElementById('caches-message').textContent.includes('not accepted')",
            timeout=30_000,
        )
        page.close()
        assert record_counts(cache) == {fp: 5}
    finally:
        stop_server(server)
