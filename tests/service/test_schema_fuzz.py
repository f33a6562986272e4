"""Property-based requests from the app's own OpenAPI schema (schemathesis): never a 5xx.

Bounded: a few examples per operation, against a real uvicorn on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from service.settings import Settings
from tests.helpers.service import AUTH, InProcessServer


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    from tests.helpers.service import build_cache

    cache = build_cache(tmp_path_factory.mktemp("fuzz"))
    s = Settings(
        cache=cache.root,
        source_roots=[cache.sources],
        token=AUTH["Authorization"][7:],
        worker=False,
        max_body_bytes=64 * 1024,
    )
    with InProcessServer(s) as server:
        yield server


@pytest.mark.slow
def test_no_server_errors(fuzz_server: InProcessServer) -> None:
    api = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 10  # every route is in the schema
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=6,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            for headers in (None, AUTH):
                response = case.call(base_url=fuzz_server.url, headers=headers)
                case.validate_response(response, checks=[not_a_server_error])
                assert b"Traceback" not in response.content

        check()
    requests, _, _ = fuzz_server.app.state.ctx.metrics.snapshot()
    statuses = {status for (_, _, status) in requests}
    assert sum(requests.values()) >= 4 * len(operations)  # the examples really ran
    assert not any(s.startswith("5") for s in statuses), requests
