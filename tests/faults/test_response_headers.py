"""What every answer of the service says about itself: no docs page allows an inline
script (``/docs`` allows no inline style either: they once ran under a CSP allowing
``'unsafe-inline'``), and every answer (pages, JSON, records, errors, a refused Host)
carries ``X-Content-Type-Options: nosniff``.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from service.settings import Settings
from tests.helpers.faults import report
from tests.helpers.service import TOKEN, InProcessServer, build_cache


def test_no_inline_script_on_the_docs_and_nosniff_on_every_answer(tmp_path: Path) -> None:
    cache = build_cache(tmp_path)
    settings = Settings(cache=cache.root, source_roots=[cache.sources], token=TOKEN, worker=False)
    with InProcessServer(settings) as server, httpx.Client(base_url=server.url) as client:
        docs = client.get("/docs")
        redoc = client.get("/redoc")
        for page in (docs, redoc):
            policy = page.headers["content-security-policy"]
            script = re.search(r"script-src ([^;]*)", policy).group(1)
            assert "'unsafe-inline'" not in script, policy
            assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", page.text), page.text
        assert "'unsafe-inline'" not in docs.headers["content-security-policy"]
        init = re.findall(r'<script src="([^"]+)"', docs.text)
        assert all(client.get(src).status_code == 200 for src in init), init
        fp = cache.fingerprint
        answers = {
            "page": client.get("/"),
            "docs": docs,
            "redoc": redoc,
            "script": client.get("/ui/page.js"),
            "health": client.get("/healthz"),
            "json": client.get("/v1/caches"),
            "record": client.get(f"/v1/caches/{fp}/records/{cache.ids[0]}"),
            "missing": client.get(f"/v1/caches/{fp}/records/nope"),
            "bad host": client.get("/healthz", headers={"Host": "evil.example"}),
        }
    without = {
        name: r.status_code
        for name, r in answers.items()
        if r.headers.get("x-content-type-options") != "nosniff"
    }
    assert without == {}, f"answers without nosniff: {without}"
    report("docs_csp_nosniff", {"answers_checked": len(answers), "without_nosniff": 0})
