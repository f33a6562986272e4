"""Reading records over HTTP: bytes, ETags, subsets, batches, 404s."""

from __future__ import annotations

import httpx
import safetensors.numpy

from cache_store.format.wire import BATCH_MEDIA_TYPE, decode_batch
from cache_store.format.decode import decode_record
from cache_store.format.header import record_checksum
from tests.helpers.procs import Server
from tests.helpers.service import Cache


def _url(cache: Cache, sid: str) -> str:
    return f"/v1/caches/{cache.fingerprint}/records/{sid}"


def test_live_records_are_byte_identical_and_parse_with_safetensors(
    live: Server, cache: Cache
) -> None:
    with httpx.Client(base_url=live.url) as http:
        for sid, stored in cache.values.items():
            r = http.get(_url(cache, sid))
            assert r.status_code == 200
            assert r.headers["content-type"] == "application/octet-stream"
            assert r.content == stored
            arrays = safetensors.numpy.load(r.content)
            assert set(arrays) == {"octree", "point_hierarchy", "center", "scale"}
            assert r.headers["etag"] == f'"{record_checksum(stored)}"'


def test_etag_gives_304(client: httpx.Client, cache: Cache) -> None:
    sid = cache.ids[0]
    etag = client.get(_url(cache, sid)).headers["etag"]
    r = client.get(_url(cache, sid), headers={"If-None-Match": etag})
    assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == etag
    assert client.get(_url(cache, sid), headers={"If-None-Match": '"other"'}).status_code == 200


def test_fields_subset(client: httpx.Client, cache: Cache) -> None:
    sid = cache.ids[1]
    r = client.get(_url(cache, sid), params={"fields": "octree,scale"})
    assert r.status_code == 200
    arrays = safetensors.numpy.load(r.content)
    assert set(arrays) == {"octree", "scale"}
    full = decode_record(cache.values[sid])
    assert (arrays["octree"] == full.tensors["octree"].numpy()).all()
    assert r.headers["etag"] != client.get(_url(cache, sid)).headers["etag"]
    bad = client.get(_url(cache, sid), params={"fields": "nope"})
    assert bad.status_code == 422 and "nope" in bad.json()["detail"]


def test_unknown_sample_and_fingerprint_are_404_with_a_reason(
    client: httpx.Client, cache: Cache
) -> None:
    r = client.get(_url(cache, "shapes/absent"))
    assert r.status_code == 404
    assert r.json()["error"] == "RecordNotFound" and "shapes/absent" in r.json()["detail"]
    r = client.get(f"/v1/caches/{'0' * 32}/records/{cache.ids[0]}")
    assert r.status_code == 404
    assert client.get(f"/v1/caches/{'0' * 32}").status_code == 404


def test_malformed_fingerprint_and_sample_id_are_422(client: httpx.Client, cache: Cache) -> None:
    assert client.get("/v1/caches/not-hex/records/a").status_code == 422
    r = client.get(f"/v1/caches/{cache.fingerprint}/records/a/%2e%2e/b")
    assert r.status_code in (404, 422)
    assert client.get(f"/v1/caches/{cache.fingerprint}/records/a%00b").status_code == 422


def test_batch_returns_records_in_order_and_lists_misses(
    client: httpx.Client, cache: Cache
) -> None:
    ids = [cache.ids[2], "shapes/absent", cache.ids[0]]
    r = client.post(f"/v1/caches/{cache.fingerprint}/batch", json={"ids": ids})
    assert r.status_code == 200 and r.headers["content-type"] == BATCH_MEDIA_TYPE
    found, missing = decode_batch(r.content)
    assert list(found) == [cache.ids[2], cache.ids[0]]
    assert bytes(found[cache.ids[0]]) == cache.values[cache.ids[0]]
    assert "RecordNotFound" in missing["shapes/absent"]


def test_batch_size_is_bounded(client: httpx.Client, cache: Cache) -> None:
    r = client.post(f"/v1/caches/{cache.fingerprint}/batch", json={"ids": ["a"] * 1000})
    assert r.status_code == 422


def test_cache_listing_and_detail(client: httpx.Client, cache: Cache) -> None:
    caches = client.get("/v1/caches").json()["caches"]
    assert [c["fingerprint"] for c in caches] == [cache.fingerprint]
    detail = client.get(f"/v1/caches/{cache.fingerprint}", params={"limit": 2}).json()
    assert detail["recipe"] == "spc" and detail["params"] == cache.params
    assert detail["counts"]["records"] == len(cache.ids)
    assert detail["bytes"] == sum(len(v) for v in cache.values.values())
    assert detail["index"]["sample_ids"] == cache.ids[:2] and detail["index"]["total"] == 5


def test_recipes_list_schemas(client: httpx.Client) -> None:
    recipes = {r["name"]: r for r in client.get("/v1/recipes").json()["recipes"]}
    assert {"spc", "spc_query"} <= set(recipes)
    assert recipes["spc"]["params"]["level"]["maximum"] == 15
    assert "octree" in recipes["spc"]["fields"]
