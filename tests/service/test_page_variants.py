"""A sample's variants on the status page: side by side, each with its augmentation.

A cache made as a user makes it (``spcache precompute --variants 3`` in a subprocess from
a fresh directory, over real meshes of the generated corpus, rotation and scale set), then
one more mesh under the same fingerprint without variants; a real ``spcache serve`` over
it. The JSON routes: the sample listing counts a sample's variants (no ``a#v1`` rows), and
``/v1/caches/{fp}/variants/{id}`` gives each variant's augmentation as stored in its
record. The page, in Debian's chromium driven by Playwright: the sample with 3 variants
shows 3 pictures that load and differ, captioned with their variant number, rotation and
scale; one with 10 shows eight and pages to the rest; the sample with one shows the
single picture as before. Browser tests skip (naming
the package) without chromium or Playwright; ``SPCACHE_PAGE_SCREENSHOTS=<dir>`` keeps the
screenshot (else it goes to the test's temporary directory).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import numpy as np
import pytest

from cache_store.keys import record_key
from cache_store.stores.lmdb.store import LMDBStore
from tests.helpers.procs import Server, run_spcache
from tests.helpers.service import start_server, stop_server
from tests.helpers.browser import launched_chromium, needs_chromium

pytestmark = pytest.mark.slow
AUGMENTED = ("capsule_ascii.ply", "box_quads.obj")  # long shapes: a turn shows
PLAIN = "cone_ascii.stl"  # computed later without variants
MANY = "icosphere.obj"  # and one with more variants than the page shows at once
PARAMS = ("level=6", "surface_samples=20000", "rotation=so3", "scale_min=0.6", "scale_max=1.2")


def _precompute(cwd: Path, sources: str, variants: int) -> dict:
    argv = ["precompute", "--recipe", "spc", "--cache", "cache", "--loaders", "0", "--json"]
    for param in PARAMS:
        argv += ["--param", param]
    done = run_spcache(*argv, "--variants", str(variants), sources, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, corpus_meshes: list[Path]
) -> Iterator[tuple[Server, Path, str]]:
    work = tmp_path_factory.mktemp("variants-page")
    by_name = {mesh.name: mesh for mesh in corpus_meshes}
    for folder, names in (("shapes", AUGMENTED), ("later", (PLAIN,)), ("many", (MANY,))):
        (work / folder).mkdir()
        for name in names:
            shutil.copy(by_name[name], work / folder / name)
    first = _precompute(work, "shapes", 3)
    assert first["done"] == 6, first  # 2 samples x 3 variants
    second = _precompute(work, "later", 1)
    assert second["fingerprint"] == first["fingerprint"] and second["done"] == 1
    assert _precompute(work, "many", 10)["done"] == 10
    server = start_server(work / "cache", work, "--no-worker")
    try:
        yield server, work / "cache", first["fingerprint"]
    finally:
        stop_server(server)


def _ids(name: str) -> str:
    return Path(name).stem


def test_the_listing_counts_variants_and_the_route_gives_their_augmentation(
    served: tuple[Server, Path, str],
) -> None:
    server, cache, fp = served
    listed = httpx.get(f"{server.url}/v1/caches/{fp}/samples", timeout=60)
    assert listed.status_code == 200, listed.text
    rows = {s["sample_id"]: s for s in listed.json()["samples"]}
    assert sorted(rows) == sorted(_ids(n) for n in (*AUGMENTED, PLAIN, MANY))  # no a#v1 rows
    assert {sid: s["variants"] for sid, s in rows.items()} == {
        _ids(AUGMENTED[0]): 3,
        _ids(AUGMENTED[1]): 3,
        _ids(PLAIN): 1,
        _ids(MANY): 10,
    }
    assert all(s["state"] == "ready" for s in rows.values())
    # a cursor inside a sample's variants still pages by samples
    after = httpx.get(
        f"{server.url}/v1/caches/{fp}/samples",
        params={"after": _ids(AUGMENTED[1]), "limit": 1},
        timeout=60,
    ).json()
    assert [s["sample_id"] for s in after["samples"]] == [_ids(AUGMENTED[0])]

    subject = _ids(AUGMENTED[0])
    got = httpx.get(f"{server.url}/v1/caches/{fp}/variants/{subject}", timeout=60)
    assert got.status_code == 200, got.text
    variants = got.json()["variants"]
    assert [v["variant"] for v in variants] == [0, 1, 2]
    assert [v["record_id"] for v in variants] == [subject, f"{subject}#v1", f"{subject}#v2"]
    with LMDBStore(cache) as store:
        for v in variants:
            stored = store.get_record(record_key(fp, subject, v["variant"]))["augmentation"]
            assert np.allclose(np.array(v["augmentation"]), stored.numpy())
            linear = stored.numpy().astype(np.float64)[:3, :3]
            # independent of the route's rule: a row's norm is its axis's factor, and
            # the rotation's angle comes from its trace
            scale = np.linalg.norm(linear, axis=1)
            rotation = linear / scale[:, None]
            angle = math.degrees(math.acos(np.clip((np.trace(rotation) - 1) / 2, -1, 1)))
            assert v["scale"] == pytest.approx(scale.tolist(), abs=1e-3)
            assert v["rotation_deg"] == pytest.approx(angle, abs=1e-2)
            axis = np.array(v["rotation_axis"])
            if v["variant"] == 0:
                assert v["rotation_deg"] == 0.0 and v["scale"] == [1.0, 1.0, 1.0]
            else:
                assert v["rotation_deg"] > 1.0 and abs(np.linalg.norm(axis) - 1) < 1e-3
                assert np.allclose(rotation @ axis, axis, atol=1e-3)  # the axis stays put
    plain = httpx.get(f"{server.url}/v1/caches/{fp}/variants/{_ids(PLAIN)}", timeout=60).json()
    assert [v["record_id"] for v in plain["variants"]] == [_ids(PLAIN)]
    missing = httpx.get(f"{server.url}/v1/caches/{fp}/variants/nothing-here", timeout=60)
    assert missing.status_code == 404
    assert "nothing-here" in missing.json()["detail"]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with launched_chromium() as launched:
        yield launched


def _open_samples(page: object, server: Server, fp: str) -> None:
    page.goto(server.url + "/")
    row = page.locator(f"tr[data-fingerprint='{fp}']")
    row.wait_for(timeout=30_000)
    row.get_by_role("button", name="4 samples").click()
    page.locator("#samples tbody tr[data-sample]").first.wait_for(timeout=30_000)


_LOADED = (
    "n => { const imgs = [...document.querySelectorAll('#preview-variants img')];"
    " return imgs.length === n && imgs.every(i => i.complete && i.naturalWidth > 0); }"
)


@needs_chromium
def test_the_page_shows_a_samples_variants_side_by_side(
    browser: object, served: tuple[Server, Path, str], tmp_path: Path
) -> None:
    server, _, fp = served
    subject = _ids(AUGMENTED[0])
    variants = httpx.get(f"{server.url}/v1/caches/{fp}/variants/{subject}", timeout=60).json()
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    _open_samples(page, server, fp)
    row = page.locator(f"tr[data-sample='{subject}']")
    row.get_by_role("button", name="Show 3 variants").click()
    page.wait_for_function(_LOADED, arg=3, timeout=60_000)
    assert page.locator("#preview-figure").is_hidden()
    assert page.locator("#variants-pager").is_hidden()  # 3 fit on one page

    figures = page.locator("#preview-variants figure")
    assert figures.count() == 3
    boxes = [figures.nth(i).bounding_box() for i in range(3)]
    assert all(b is not None for b in boxes)
    # side by side: one row, left to right
    assert len({round(b["y"]) for b in boxes}) == 1, boxes
    assert boxes[0]["x"] < boxes[1]["x"] < boxes[2]["x"]
    captions = [figures.nth(i).locator("figcaption").inner_text() for i in range(3)]
    assert captions[0].startswith("variant 0") and "unaugmented" in captions[0]
    for k in (1, 2):
        v = variants["variants"][k]
        assert captions[k].startswith(f"variant {k}"), captions[k]
        assert f"rotated {v['rotation_deg']:.1f}°" in captions[k], captions[k]
        assert (
            f"x {v['scale'][0]:.2f} · y {v['scale'][1]:.2f} · z {v['scale'][2]:.2f}"
            in (captions[k])
        ), captions[k]

    # each picture is its own variant's, and they differ (augmentation did something)
    sources = page.eval_on_selector_all("#preview-variants img", "imgs => imgs.map(i => i.src)")
    wanted = [quote(v["record_id"], safe="") for v in variants["variants"]]
    assert [src.split("/previews/")[1].split("?")[0] for src in sources] == wanted
    pictures = [page.request.get(src).body() for src in sources]
    assert len(set(pictures)) == 3
    # the controls redraw every variant
    page.check("input[name=view][value=top]")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#preview-variants img')]"
        ".every(i => i.src.includes('view=top') && i.complete && i.naturalWidth > 0)",
        timeout=60_000,
    )
    where = Path(os.environ.get("SPCACHE_PAGE_SCREENSHOTS") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    page.locator("#preview-panel").screenshot(path=str(where / "page-variants.png"))

    # a sample with one variant: the one picture, as before variants existed
    plain = _ids(PLAIN)
    page.locator(f"tr[data-sample='{plain}']").get_by_role(
        "button", name="Show", exact=True
    ).click()
    page.wait_for_function(
        "id => { const i = document.getElementById('preview');"
        " return i.src.includes(`/previews/${id}?`) && i.complete && i.naturalWidth > 0; }",
        arg=plain,
        timeout=60_000,
    )
    assert page.locator("#preview-variants").is_hidden()
    assert page.locator("#preview-figure").is_visible()
    assert page.locator("#preview-title").inner_text() == f"Preview of {plain}"

    # more variants than fit: eight at a time, the pager shows the rest
    page.locator(f"tr[data-sample='{_ids(MANY)}']").get_by_role(
        "button", name="Show 10 variants"
    ).click()
    page.wait_for_function(_LOADED, arg=8, timeout=60_000)
    assert page.locator("#variants-range").inner_text() == "variants 0\u20137 of 10"
    assert page.locator("#variants-prev").is_disabled()
    page.click("#variants-next")
    page.wait_for_function(_LOADED, arg=2, timeout=60_000)
    shown = page.eval_on_selector_all(
        "#preview-variants figure", "fs => fs.map(f => f.dataset.variant)"
    )
    assert shown == ["8", "9"] and page.locator("#variants-next").is_disabled()
    assert page.locator("#variants-range").inner_text() == "variants 8\u20139 of 10"

    # phone width: the variants stay side by side and nothing is wider than the screen
    phone = browser.new_context(viewport={"width": 390, "height": 844}).new_page()
    _open_samples(phone, server, fp)
    phone.locator(f"tr[data-sample='{subject}']").get_by_role(
        "button", name="Show 3 variants"
    ).click()
    phone.wait_for_function(_LOADED, arg=3, timeout=60_000)
    assert phone.evaluate("document.documentElement.scrollWidth") <= 390
    context.close()
    phone.context.close()
