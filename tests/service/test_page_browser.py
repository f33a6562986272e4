"""The status page in a real headless browser (Debian's chromium driven by Playwright).

`spcache serve` (subprocess, with its worker) on a real cache; a warm-up of meshes (the
shared ones when present, else shapes written with trimesh) plus one bad file; the page
must show the job reaching 100 %, an error row naming the bad file, the samples with
their states and a preview; ``/docs`` and ``/redoc`` must render with every request that
is not to 127.0.0.1 aborted, and none may be attempted.

Skips (naming the package) where chromium or Playwright is missing; CI installs both.
Set ``SPCACHE_PAGE_SCREENSHOTS=<dir>`` to keep the screenshots (docs/images is made so).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest

from service.preview import BACKGROUND, decode_png_rgb
from tests.conftest import SHARED_DATA
from tests.helpers.procs import Server
from tests.helpers.service import (
    AUTH,
    TOKEN,
    build_cache,
    start_server,
    stop_server,
)
from tests.helpers.browser import launched_chromium, needs_chromium

pytestmark = [
    pytest.mark.slow,
    needs_chromium,
]
SHARED_PICKS = ("bunny.ply", "capsule.obj", "fandisk.obj")
PARAMS = {"level": 7, "surface_samples": 20_000, "uniform_queries": 1500, "surface_queries": 1500}


def _sources(root: Path) -> tuple[list[Path], Path, str]:
    """Good meshes, one bad file, and the id of the mesh whose preview is checked."""
    root.mkdir()
    shared = SHARED_DATA / "meshes"
    if all((shared / name).is_file() for name in SHARED_PICKS):
        good = [shutil.copy(shared / name, root / name) for name in SHARED_PICKS]
        subject = "bunny"
    else:
        import trimesh

        shapes = {
            "sphere": trimesh.creation.icosphere(subdivisions=3),
            "box": trimesh.creation.box(extents=(1.0, 0.6, 0.3)),
            "capsule": trimesh.creation.capsule(height=1.0, radius=0.3),
        }
        good = []
        for name, mesh in shapes.items():
            mesh.export(root / f"{name}.obj")
            good.append(root / f"{name}.obj")
        subject = "sphere"
    bad = root / "broken_mesh.obj"
    bad.write_text("v 0 0 0\nthis is not a mesh\nf 1 2 99\n")
    return [Path(p) for p in good], bad, subject


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with launched_chromium() as launched:
        yield launched


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Server, list[Path], Path, str]]:
    good, bad, subject = _sources(tmp_path / "sources")
    server = start_server(
        tmp_path / "cache", tmp_path / "sources", "--device", "cpu", "--backend", "torch"
    )
    try:
        yield server, good, bad, subject
    finally:
        stop_server(server)


def _offline_page(browser: object, width: int, height: int) -> tuple[object, list[str]]:
    """A page in a fresh context where every request not to 127.0.0.1 is aborted (and
    recorded)."""
    context = browser.new_context(viewport={"width": width, "height": height})
    attempted: list[str] = []

    def guard(route: object) -> None:
        url = route.request.url
        if urlparse(url).hostname == "127.0.0.1":
            route.continue_()
        else:
            attempted.append(url)
            route.abort()

    context.route("**/*", guard)
    return context.new_page(), attempted


def _foreground(png: bytes) -> int:
    return int((decode_png_rgb(png) != BACKGROUND).any(axis=2).sum())


def _shots() -> Path | None:
    where = os.environ.get("SPCACHE_PAGE_SCREENSHOTS")
    return Path(where) if where else None


def test_page_follows_a_warmup_to_the_end(browser: object, served: tuple) -> None:
    server, good, bad, subject = served
    page, attempted = _offline_page(browser, 1280, 800)
    page.goto(server.url + "/")
    assert page.title() == "spcache status"
    items = [{"id": p.stem, "path": str(p)} for p in [*good, bad]]
    r = httpx.post(
        server.url + "/v1/warmup",
        headers=AUTH,
        timeout=30,
        json={"recipe": "spc_query", "params": PARAMS, "items": items},
    )
    assert r.status_code == 202, r.text
    job_id, fp = r.json()["job_id"], r.json()["fingerprint"]

    row = page.locator(f"tr[data-job='{job_id}']")
    row.wait_for(timeout=30_000)
    # The page polls: the row's status becomes final (done with errors: one item of
    # several failed) and the
    # progress text says every item is through.
    page.wait_for_function(
        "id => ['done', 'done_with_errors', 'failed'].includes(document.querySelector(`tr[data-job='${id}']`)"
        "?.dataset.status)",
        arg=job_id,
        timeout=300_000,
    )
    total = len(items)
    progress = row.locator(".progress-text").inner_text()
    assert progress.startswith(f"{total} / {total} (100%)"), progress
    assert "1 failed" in progress
    assert row.locator(".bar").get_attribute("aria-label").startswith(f"{total - 1} done, 1 failed")

    row.get_by_role("button", name="1 error").click()
    errors = page.locator("#errors tbody tr")
    errors.first.wait_for(timeout=10_000)
    assert errors.count() == 1
    assert bad.name in errors.first.inner_text() and "broken_mesh" in errors.first.inner_text()

    # The page polls caches every 5 s; the service re-walks a changed cache at most every
    # stats_ttl_s (10 s): wait for a refresh after the last record committed.
    page.wait_for_function(
        "([fp, n]) => document.querySelector(`tr[data-fingerprint='${fp}']`)"
        "?.cells[3].textContent === String(n)",
        arg=[fp, total - 1],
        timeout=45_000,
    )
    cache_row = page.locator(f"tr[data-fingerprint='{fp}']")
    cells = cache_row.locator("td").all_inner_texts()
    assert cells[1].startswith("spc_query") and int(cells[3]) == total - 1
    # the row's failures: the count, opening to the list with the failed file's id and path
    assert cells[5] != "—"  # Created: the time of the index the worker wrote
    failed = cache_row.locator("details.failed")
    assert failed.locator("summary").inner_text() == "1 failed"
    failed.locator("summary").click()
    item = failed.locator("li").first
    assert item.get_attribute("data-sample") == bad.stem and str(bad) in item.inner_text()
    cache_row.get_by_role("button", name=f"{total - 1} samples").click()
    page.fill("#prefix", subject)
    page.click("#samples-search button")
    # The search's answer replaces the unfiltered first page: one row, the subject's.
    page.wait_for_function(
        "id => { const rows = [...document.querySelectorAll('#samples tbody tr')];"
        " return rows.length === 1 && rows[0].dataset.sample === id; }",
        arg=subject,
        timeout=10_000,
    )
    sample_row = page.locator(f"tr[data-sample='{subject}']")
    assert "ready" in sample_row.inner_text()
    sample_row.get_by_role("button", name="Show").click()
    page.wait_for_function(
        "() => { const i = document.getElementById('preview');"
        " return i.complete && i.naturalWidth > 0; }",
        timeout=30_000,
    )
    alt = page.get_attribute("#preview", "alt")
    assert subject in alt and "level" in alt
    if _shots():
        _shots().mkdir(parents=True, exist_ok=True)
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=str(_shots() / "page-desktop.png"), full_page=False)
        page.locator("#preview-panel").screenshot(path=str(_shots() / "page-preview-panel.png"))

    # The preview route's pictures: valid PNGs, a sane share of the frame, levels differ.
    pictures = {}
    for level in (3, 5, 6):
        resp = page.request.get(
            f"{server.url}/v1/caches/{fp}/previews/{subject}",
            params={"level": level, "size": 256, "queries": "false"},
        )
        assert resp.status == 200 and resp.headers["content-type"] == "image/png"
        pictures[level] = resp.body()
    covered = _foreground(pictures[5])
    assert 0.03 * 256 * 256 < covered < 0.7 * 256 * 256, covered
    assert not np.array_equal(decode_png_rgb(pictures[3]), decode_png_rgb(pictures[6]))
    assert _foreground(pictures[3]) != _foreground(pictures[6])

    # Phone width: nothing wider than the screen (tables scroll inside their boxes).
    phone, phone_attempted = _offline_page(browser, 390, 844)
    phone.goto(server.url + "/")
    phone.locator(f"tr[data-job='{job_id}']").wait_for(timeout=15_000)
    phone.locator(f"tr[data-fingerprint='{fp}']").wait_for(timeout=15_000)
    assert phone.evaluate("document.documentElement.scrollWidth") <= 390
    bar = phone.locator(f"tr[data-job='{job_id}'] .bar").bounding_box()
    assert bar is not None and bar["x"] >= 0 and bar["x"] + bar["width"] <= 390, bar
    if _shots():
        phone.screenshot(path=str(_shots() / "page-phone.png"), full_page=True)
    assert attempted == [] and phone_attempted == []


def test_api_docs_render_offline(browser: object, tmp_path: Path) -> None:
    (tmp_path / "sources").mkdir()
    server = start_server(tmp_path / "cache", tmp_path / "sources", "--no-worker")
    try:
        page, attempted = _offline_page(browser, 1280, 800)
        # what the pages' CSP blocked, but ReDoc's CDN logo (img-src; see routes_page):
        # an inline script or style refused would break the page
        refused: list[str] = []
        page.on(
            "console",
            lambda m: (
                refused.append(m.text)
                if "Content Security Policy" in m.text and "img-src" not in m.text
                else None
            ),
        )
        page.goto(server.url + "/")
        page.get_by_role("link", name="API docs (Swagger UI)").click()
        page.wait_for_url("**/docs")
        page.locator(".swagger-ui .opblock").first.wait_for(timeout=30_000)
        assert page.locator(".swagger-ui .opblock").count() >= 10
        assert page.get_by_text("/v1/caches/{fingerprint}/previews/{sample_id}").count() >= 1
        page.goto(server.url + "/redoc")
        page.wait_for_function(
            "() => document.body.innerText.includes('Get Preview')", timeout=30_000
        )
        assert page.locator("h1").first.inner_text().startswith("spcache")
        time.sleep(0.5)  # late requests (fonts, validators) would show up here
        assert attempted == [], attempted
        assert refused == [], refused
    finally:
        stop_server(server)


def test_cancel_asks_for_the_token_and_sends_it_as_a_header(
    browser: object, tmp_path: Path
) -> None:
    good, bad, _ = _sources(tmp_path / "sources")
    server = start_server(tmp_path / "cache", tmp_path / "sources", "--no-worker")
    try:
        items = [{"id": p.stem, "path": str(p)} for p in [*good, bad]]
        r = httpx.post(
            server.url + "/v1/warmup",
            headers=AUTH,
            timeout=30,
            json={"recipe": "spc", "params": {"level": 4}, "items": items},
        )
        job_id = r.json()["job_id"]  # no worker: it stays pending
        page, attempted = _offline_page(browser, 1280, 800)
        deletes: list[tuple[str, dict]] = []
        page.on(
            "request",
            lambda req: deletes.append((req.url, req.headers)) if req.method == "DELETE" else None,
        )
        dialogs: list[str] = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.accept()))
        page.goto(server.url + "/")
        row = page.locator(f"tr[data-job='{job_id}']")
        row.wait_for(timeout=15_000)
        assert row.get_attribute("data-status") == "pending"

        # Keyboard use: the focus survives the polls that rebuild the rows.
        row.get_by_role("button", name="Cancel").focus()
        page.wait_for_timeout(2500)
        assert page.evaluate("document.activeElement.textContent") == "Cancel"
        assert page.evaluate("document.activeElement.closest('tr').dataset.job") == job_id
        page.keyboard.press("Enter")  # a wrong token first
        page.locator("#token-dialog").wait_for(state="visible")
        page.fill("#token", "not-the-token")
        page.click("#token-ok")
        deadline = time.monotonic() + 10
        while not dialogs and time.monotonic() < deadline:
            page.wait_for_timeout(100)
        assert dialogs and "not accepted" in dialogs[0]
        assert row.get_attribute("data-status") == "pending"

        row.get_by_role("button", name="Cancel").click()  # asked again, the right one
        page.locator("#token-dialog").wait_for(state="visible")
        page.fill("#token", AUTH["Authorization"].removeprefix("Bearer "))
        page.click("#token-ok")
        page.wait_for_function(
            "id => document.querySelector(`tr[data-job='${id}']`)?.dataset.status === 'cancelled'",
            arg=job_id,
            timeout=15_000,
        )
        assert len(deletes) == 2
        token = AUTH["Authorization"].removeprefix("Bearer ")
        for url, headers in deletes:
            assert "token" not in url.lower() and token not in url and "not-the-token" not in url
        assert deletes[0][1]["authorization"] == "Bearer not-the-token"
        assert deletes[1][1]["authorization"] == AUTH["Authorization"]
        assert attempted == []
    finally:
        stop_server(server)


def _remove_row(page: object, fp: str) -> object:
    row = page.locator(f"tr[data-fingerprint='{fp}']")
    row.wait_for(timeout=30_000)
    row.get_by_role("button", name="Remove").click()
    page.locator("#token-dialog").wait_for(state="visible")
    return row


def _shoot(page: object, tmp_path: Path, name: str) -> None:
    where = _shots() or tmp_path
    where.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(where / name))


@pytest.mark.parametrize("token", [TOKEN, None], ids=["with-token", "without-token"])
def test_the_page_asks_for_a_token_only_when_the_service_has_one(
    browser: object, tmp_path: Path, token: str | None
) -> None:
    """Remove and Cancel: with a token, the dialog asks for it (a wrong one is refused by
    the service); without one (any string would do), Remove asks only to confirm and
    Cancel asks nothing, and no Authorization header is sent."""
    built = build_cache(tmp_path, n=2)
    server = start_server(built.root, built.sources, "--no-worker", token=token)
    try:
        ready = httpx.get(server.url + "/readyz", timeout=30).json()
        assert ready["token_required"] is (token is not None)
        items = [{"id": "late", "path": str(built.sources / "shapes" / "s0.obj")}]
        r = httpx.post(
            server.url + "/v1/warmup",
            headers=AUTH if token else {},
            timeout=30,
            json={"recipe": "spc", "params": {"level": 6}, "items": items},
        )
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]  # no worker: it stays pending
        page, attempted = _offline_page(browser, 1280, 800)
        deletes: list[dict] = []
        page.on(
            "request", lambda req: deletes.append(req.headers) if req.method == "DELETE" else None
        )
        page.goto(server.url + "/")
        row = _remove_row(page, built.fingerprint)
        field = page.locator("#token-field")
        if token is None:
            assert field.is_hidden()
            assert "Remove spc" in page.locator("#token-why").inner_text()
            _shoot(page, tmp_path, "page-remove-without-token.png")
            page.click("#token-ok")
        else:
            assert field.is_visible()
            _shoot(page, tmp_path, "page-remove-with-token.png")
            page.fill("#token", "not-the-token")
            page.click("#token-ok")
            page.wait_for_function(
                "() => document.getElementById('caches-message').textContent"
                ".includes('not accepted')",
                timeout=15_000,
            )
            assert row.count() == 1  # refused: still listed
            _remove_row(page, built.fingerprint)
            assert field.is_visible()
            page.fill("#token", token)
            page.click("#token-ok")
        page.wait_for_function(
            "() => document.getElementById('caches-message').textContent.startsWith('Removed')",
            timeout=15_000,
        )
        assert "records" in page.locator("#caches-message").inner_text()
        assert (
            httpx.get(f"{server.url}/v1/caches/{built.fingerprint}", timeout=30).status_code == 404
        )

        jobs = page.locator(f"tr[data-job='{job_id}']")
        jobs.wait_for(timeout=15_000)
        jobs.get_by_role("button", name="Cancel").click()
        # no dialog either way: no token needed, or the accepted one is kept for the tab
        assert page.locator("#token-dialog").is_hidden()
        page.wait_for_function(
            "id => document.querySelector(`tr[data-job='${id}']`)?.dataset.status === 'cancelled'",
            arg=job_id,
            timeout=15_000,
        )
        sent = [headers.get("authorization") for headers in deletes]
        if token is None:
            assert sent == [None, None]
        else:
            assert sent == ["Bearer not-the-token", f"Bearer {token}", f"Bearer {token}"]
        assert attempted == []
    finally:
        stop_server(server)


def test_a_record_without_an_octree_shows_its_fields(
    browser: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin recipe's record with no octree: the preview route answers 422 and the
    page lists the recipe's fields instead of a picture."""
    from cache_store.recipes.registry import ENV_VAR, installed_recipes
    from cache_store.stores.lmdb import LMDBStore
    from tests.conftest import REPO_ROOT
    from workers.engine import Engine

    plugin = "tests.workers.plugin_recipes:Probe"
    monkeypatch.setenv(ENV_VAR, plugin)
    installed_recipes(reload=True)
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "tri.obj").write_text("v 0 0 0\nv 1 0 0\nv 0 1 0\nf 1 2 3\n")
    with LMDBStore(tmp_path / "cache", readonly=False, map_size=1 << 24) as store:
        engine = Engine(store, "probe", {}, device="cpu", backend="torch", loaders=0)
        assert engine.run([("tri", str(sources / "tri.obj"))]).done == 1
    monkeypatch.delenv(ENV_VAR)
    installed_recipes(reload=True)
    server = start_server(
        tmp_path / "cache",
        sources,
        "--no-worker",
        env={ENV_VAR: plugin, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        fp = engine.fingerprint
        r = httpx.get(f"{server.url}/v1/caches/{fp}/previews/tri", timeout=30)
        assert r.status_code == 422 and "no octree in this record" in r.json()["detail"]
        page, attempted = _offline_page(browser, 1280, 800)
        page.goto(server.url + "/")
        cache_row = page.locator(f"tr[data-fingerprint='{fp}']")
        cache_row.wait_for(timeout=30_000)
        cache_row.get_by_role("button", name="1 samples").click()
        sample_row = page.locator("tr[data-sample='tri']")
        sample_row.wait_for(timeout=10_000)
        sample_row.get_by_role("button", name="Show").click()
        page.locator("#preview-fields").wait_for(state="visible", timeout=10_000)
        listed = page.locator("#preview-fields-body").inner_text()
        assert "voxels" in listed and "extent" in listed and "int16" in listed
        assert page.locator("#preview-figure").is_hidden()
        assert attempted == []
    finally:
        stop_server(server)
