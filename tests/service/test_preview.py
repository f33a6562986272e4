"""Record pictures: the NumPy renderer, the PNG route (ETag, bounds, hostile input), the
sample search route, and that serving them pulls in neither torch nor workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from cache_store.keys import compute_fingerprint, record_key
from cache_store.jobs.queue import JobQueue
from cache_store.stores.lmdb import LMDBStore
from cache_store.recipes.registry import get_recipe_spec
from cache_store.format.encode import encode_record
from cache_store.format.index import DatasetIndex
from service.preview import (
    BACKGROUND,
    MAX_SIZE,
    PreviewRequest,
    decode_png_rgb,
    encode_png,
    level_voxels,
    render_record,
    render_voxels,
)
from service.settings import Settings
from tests.conftest import REPO_ROOT
from tests.helpers.service import InProcessServer, build_cache

LEVEL = 7


def sphere_spc(
    level: int, radius: float = 0.8, n: int = 60_000, seed: int = 0, queries: int = 0
) -> dict[str, np.ndarray]:
    """An SPC-shaped record of a sphere surface built with NumPy: every level's distinct
    voxels (root first) and the pyramid; with ``queries``, spc_query's query fields."""
    rng = np.random.default_rng(seed)
    points = rng.normal(size=(n, 3))
    points *= radius / np.linalg.norm(points, axis=1, keepdims=True)
    per_level = [
        np.unique(
            np.clip(((points + 1) / 2 * (1 << lv)).astype(np.int64), 0, (1 << lv) - 1), axis=0
        )
        for lv in range(level + 1)
    ]
    counts = [len(v) for v in per_level]
    pyramid = np.zeros((2, level + 2), np.int32)
    pyramid[0, : level + 1] = counts
    pyramid[1, 1:] = np.cumsum(counts)
    out = {
        "point_hierarchy": np.concatenate(per_level).astype(np.int16),
        "pyramid": pyramid,
        "octree": np.zeros(1, np.uint8),
        "exsum": np.zeros(1, np.int32),
        "center": np.zeros(3, np.float32),
        "scale": np.ones((), np.float32),
    }
    if queries:
        q = rng.uniform(-1, 1, size=(queries, 3)).astype(np.float32)
        pidx = np.full((queries, level + 1), -1, np.int32)
        for lv, voxels in enumerate(per_level):
            cells = np.clip(((q + 1) / 2 * (1 << lv)).astype(np.int64), 0, (1 << lv) - 1)
            lookup = {tuple(v): i for i, v in enumerate(voxels.tolist())}
            pidx[:, lv] = [lookup.get(tuple(c), -1) for c in cells.tolist()]
        out.update(query_points=q, query_pidx=pidx, occupancy=(pidx[:, -1] >= 0).astype(np.uint8))
    return out


def foreground(image: np.ndarray) -> int:
    return int((image != BACKGROUND).any(axis=2).sum())


def test_png_round_trip_and_shape() -> None:
    image = np.random.default_rng(1).integers(0, 256, (17, 23, 3), dtype=np.uint8)
    assert np.array_equal(decode_png_rgb(encode_png(image)), image)


def test_levels_differ_and_fill_a_sane_share() -> None:
    spc = sphere_spc(LEVEL)
    counts = {}
    for lv in (3, 6):
        voxels = level_voxels(spc["point_hierarchy"], spc["pyramid"], lv)
        assert len(voxels) == spc["pyramid"][0, lv]
        image = render_voxels(voxels, lv, "iso", 256)
        counts[lv] = foreground(image)
        # A sphere of radius 0.8 covers 10-60% of a picture that frames the whole cube.
        assert 0.10 * 256 * 256 < counts[lv] < 0.60 * 256 * 256, (lv, counts[lv])
    assert counts[3] > counts[6]  # coarse cubes stick out further than fine ones


def test_views_are_different_pictures_of_one_record() -> None:
    spc = sphere_spc(5, radius=0.5)
    # Move the sphere's voxels to one corner: each view sees it in a different place.
    shifted = level_voxels(spc["point_hierarchy"], spc["pyramid"], 5) // 2
    pictures = {v: render_voxels(shifted, 5, v, 128) for v in ("iso", "front", "side", "top")}
    for a in pictures:
        for b in pictures:
            if a < b:
                assert not np.array_equal(pictures[a], pictures[b]), (a, b)
    empty = render_voxels(shifted[:0], 5, "iso", 64)
    assert foreground(empty) == 0


def test_query_points_are_drawn_by_hit_or_miss() -> None:
    spc = sphere_spc(5, queries=3000)
    value = _encode(spc, "spc_query", "q/one")
    with_q = decode_png_rgb(render_record(value, PreviewRequest(level=5, size=256)))
    without = decode_png_rgb(render_record(value, PreviewRequest(level=5, size=256, queries=False)))
    red = (with_q == [215, 50, 40]).all(axis=2).sum()
    green = (with_q == [30, 160, 60]).all(axis=2).sum()
    assert red > 100 and green > 10
    assert not (without == [215, 50, 40]).all(axis=2).any()


@pytest.mark.parametrize(
    ("request_", "problem"),
    [
        (PreviewRequest(level=9), "outside this record's levels 0..7"),
        (PreviewRequest(level=3, view="diagonal"), "unknown view"),
        (PreviewRequest(level=3, size=MAX_SIZE + 1), "outside 16..1024"),
        (PreviewRequest(level=-1), "negative"),
    ],
)
def test_bad_requests_are_parameter_errors(request_: PreviewRequest, problem: str) -> None:
    from cache_store.errors import ParameterError

    value = _encode(sphere_spc(LEVEL, n=2000), "spc", "a")
    with pytest.raises(ParameterError, match=problem):
        render_record(value, request_)


def test_corrupt_pyramid_is_a_corrupt_record() -> None:
    from cache_store.errors import CorruptRecord

    spc = sphere_spc(4, n=500)
    spc["pyramid"][1, 4] = 10**6
    with pytest.raises(CorruptRecord, match="exceeds"):
        render_record(_encode(spc, "spc", "bad"), PreviewRequest(level=4))
    spc = sphere_spc(4, n=500)
    spc["point_hierarchy"][-1] = [99, 0, 0]
    with pytest.raises(CorruptRecord, match="outside 0..15"):
        render_record(_encode(spc, "spc", "bad2"), PreviewRequest(level=4))


def _fingerprint(recipe: str, level: int) -> tuple[str, dict]:
    spec = get_recipe_spec(recipe)
    params = spec.resolve({"level": level})
    return compute_fingerprint(recipe, spec.version, params), params


def _encode(arrays: dict[str, np.ndarray], recipe: str, sample_id: str) -> bytes:
    level = arrays["pyramid"].shape[1] - 2
    fp, _ = _fingerprint(recipe, level)
    return encode_record(
        arrays,
        {
            "recipe": recipe,
            "recipe_version": "1",
            "fingerprint": fp,
            "sample_id": sample_id,
            "source_hash": "xxh3_128:0",
            "backend": "numpy",
            "device": "cpu",
        },
    )


@pytest.fixture
def sphere_cache(tmp_path: Path) -> tuple[Path, str, list[str]]:
    cache = tmp_path / "cache"
    fp, params = _fingerprint("spc", LEVEL)
    ids = ["balls/a", "balls/b", "cubes/c", "ü/é"]
    store = LMDBStore(cache, readonly=False)
    for i, sid in enumerate(ids):
        store.put_many(
            [(record_key(fp, sid), _encode(sphere_spc(LEVEL, n=5000, seed=i), "spc", sid))]
        )
    flipped = bytearray(_encode(sphere_spc(LEVEL, n=500), "spc", "bad/flipped"))
    flipped[-3] ^= 0x40  # a data byte: the header stays valid, a field checksum does not
    store.put_many([(record_key(fp, "bad/flipped"), bytes(flipped))])
    store.put_index(DatasetIndex(fp, "spc", 1, params, np.array(ids)))
    store.close()
    queue = JobQueue(cache)
    queue.submit("spc", params, fp, [("balls/queued", str(tmp_path / "q.obj"))])
    queue.close()
    return cache, fp, ids


@pytest.fixture
def sphere_client(sphere_cache: tuple[Path, str, list[str]], tmp_path: Path):
    cache, _, _ = sphere_cache
    settings = Settings(cache=cache, source_roots=[tmp_path], worker=False)
    with InProcessServer(settings) as server, httpx.Client(base_url=server.url) as client:
        yield client


def test_preview_route_png_etag_and_304(
    sphere_client: httpx.Client, sphere_cache: tuple[Path, str, list[str]]
) -> None:
    _, fp, _ = sphere_cache
    url = f"/v1/caches/{fp}/previews/balls/a"
    r = sphere_client.get(url, params={"level": 5, "view": "front", "size": 200})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    image = decode_png_rgb(r.content)
    assert image.shape == (200, 200, 3) and foreground(image) > 1000
    etag = r.headers["etag"]
    again = sphere_client.get(
        url, params={"level": 5, "view": "front", "size": 200}, headers={"If-None-Match": etag}
    )
    assert again.status_code == 304 and again.headers["etag"] == etag
    other = sphere_client.get(url, params={"level": 6, "view": "front", "size": 200})
    assert other.headers["etag"] != etag and other.content != r.content
    deepest = sphere_client.get(url, params={"size": 64})  # level defaults to the deepest
    assert deepest.status_code == 200 and f"-l{LEVEL}-" in deepest.headers["etag"]
    unicode = sphere_client.get(f"/v1/caches/{fp}/previews/%C3%BC/%C3%A9", params={"size": 32})
    assert unicode.status_code == 200


@pytest.mark.parametrize(
    ("path", "params", "status", "error"),
    [
        ("balls/a", {"level": 9}, 422, "ParameterError"),
        ("balls/a", {"level": 99}, 422, "RequestValidationError"),
        ("balls/a", {"view": "diagonal"}, 422, "RequestValidationError"),
        ("balls/a", {"size": 100_000}, 422, "RequestValidationError"),
        ("balls/nope", {}, 404, "RecordNotFound"),
        ("bad%5Cid", {}, 422, "InvalidSampleId"),  # a backslash
    ],
)
def test_preview_route_hostile_input(
    sphere_client: httpx.Client,
    sphere_cache: tuple[Path, str, list[str]],
    path: str,
    params: dict,
    status: int,
    error: str,
) -> None:
    _, fp, _ = sphere_cache
    r = sphere_client.get(f"/v1/caches/{fp}/previews/{path}", params=params)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"] == error and body["detail"]


def test_preview_of_a_damaged_record_is_a_json_corrupt_record(
    sphere_client: httpx.Client, sphere_cache: tuple[Path, str, list[str]]
) -> None:
    _, fp, _ = sphere_cache
    r = sphere_client.get(f"/v1/caches/{fp}/previews/bad/flipped", params={"size": 32})
    assert r.status_code == 500 and r.json()["error"] == "CorruptRecord"
    assert "bad/flipped" in r.json()["detail"] and "Traceback" not in r.text


def test_preview_of_a_record_without_levels_is_422(tmp_path: Path) -> None:
    built = build_cache(tmp_path, n=1)  # conftest's records: random bytes, no pyramid
    settings = Settings(cache=built.root, source_roots=[built.sources], worker=False)
    with InProcessServer(settings) as server, httpx.Client(base_url=server.url) as client:
        r = client.get(f"/v1/caches/{built.fingerprint}/previews/{built.ids[0]}")
    assert r.status_code == 422 and "no octree in this record" in r.json()["detail"]
    assert "its fields: center, octree, point_hierarchy, scale" in r.json()["detail"]


def test_sample_search_by_prefix_with_states_and_cursor(
    sphere_client: httpx.Client, sphere_cache: tuple[Path, str, list[str]]
) -> None:
    _, fp, _ = sphere_cache
    page = sphere_client.get(f"/v1/caches/{fp}/samples", params={"prefix": "balls/"}).json()
    assert [s["sample_id"] for s in page["samples"]] == ["balls/a", "balls/b", "balls/queued"]
    assert [s["state"] for s in page["samples"]] == ["ready", "ready", "queued"]
    assert page["next"] is None
    # precomputed, never queued: no source path is known, and the reason says so alone
    spec = get_recipe_spec("spc")
    assert page["samples"][0]["reason"] == (
        "record present; no source path known to compare it with; "
        f"recipe spc version {spec.version} is the installed one"
    )
    pages, after = [], ""
    while True:  # pages of 2 by cursor, in key (UTF-8 byte) order, records and queue merged
        got = sphere_client.get(
            f"/v1/caches/{fp}/samples", params={"limit": 2, "after": after}
        ).json()
        pages.append([(x["sample_id"], x["state"]) for x in got["samples"]])
        if got["next"] is None:
            break
        assert got["next"] == pages[-1][-1][0]
        after = got["next"]
    assert pages == [
        [("bad/flipped", "ready"), ("balls/a", "ready")],  # header intact
        [("balls/b", "ready"), ("balls/queued", "queued")],
        [("cubes/c", "ready"), ("ü/é", "ready")],
    ]
    none = sphere_client.get(f"/v1/caches/{fp}/samples", params={"prefix": "zzz"}).json()
    assert none["samples"] == [] and none["next"] is None


def test_page_and_offline_docs_are_served_locally(sphere_client: httpx.Client) -> None:
    page = sphere_client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for asset in (
        "/ui/page.js",
        "/ui/page.css",
        "/docs-assets/swagger-ui-bundle.js",
        "/docs-assets/redoc.standalone.js",
    ):
        assert sphere_client.get(asset).status_code == 200, asset
    for docs in ("/docs", "/redoc"):
        html = sphere_client.get(docs).text
        assert "/docs-assets/" in html
        assert "cdn" not in html.lower() and "fonts.googleapis" not in html
    schema = sphere_client.get("/openapi.json").json()
    assert "/" not in schema["paths"]
    assert "/v1/caches/{fingerprint}/previews/{sample_id}" in schema["paths"]


def test_serving_pages_and_previews_imports_neither_torch_nor_workers() -> None:
    code = (
        "import sys, service.app, service.routes_page, service.preview; "
        "print('\\n'.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    assert "torch" not in out
    assert not [m for m in out if m.split(".")[0] == "workers"]


def test_every_page_asset_is_package_data() -> None:
    """`pip install .` (the Dockerfile) ships only listed non-Python files; a missing one
    would break GET / (and StaticFiles refuses a missing directory at start-up)."""
    import fnmatch
    import tomllib

    patterns = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["service"]
    assets = [
        p.relative_to(REPO_ROOT / "service").as_posix()
        for p in (REPO_ROOT / "service" / "static").iterdir()
    ]
    assert {"static/index.html", "static/page.js", "static/page.css"} <= set(assets)
    for asset in assets:
        assert any(fnmatch.fnmatch(asset, pattern) for pattern in patterns), asset
