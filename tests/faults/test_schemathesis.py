"""Case 11: schemathesis over the OpenAPI schema with every check on: 0 failures.

``tests/service/test_schema_fuzz.py`` runs a few examples per operation in-process with
the server-error check only; this runs the ``st`` CLI the way a user would, against a
real uvicorn on loopback with the bearer token: ``--checks all``, every phase (examples,
coverage, fuzzing, stateful), deterministic generation and a fixed example budget per
operation (``SPCACHE_FAULT_ST_EXAMPLES``, CI 20).

Two settings, each with its reason:

* ``positive_data_acceptance`` also expects 422 on the operations whose input has rules
  JSON Schema cannot state: sample ids (Unicode folding, control and look-alike
  characters), source paths that must exist inside a source root. A schema-valid request
  there may still be refused, with the reason in the body.
* ``allow_header_conformance`` is excluded: Starlette answers an unrouted method with the
  ``Allow`` header of the first route matching the path (``/v1/jobs/{job_id}`` lists GET
  but not DELETE); the 405 itself is right.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.settings import Settings
from tests.helpers.faults import env_int, report, served
from tests.helpers.service import TOKEN, build_cache

EXAMPLES = env_int("SPCACHE_FAULT_ST_EXAMPLES", 20)

CONFIG = """
[[operations]]
include-path-regex = "^/v1/(warmup|caches/\\\\{fingerprint\\\\}/(records|items|previews)/.*)$"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "422"]
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_schemathesis_every_check_finds_nothing(tmp_path: Path) -> None:
    cache = build_cache(tmp_path / "data", n=4)
    settings = Settings(
        cache=cache.root,
        source_roots=[cache.sources],
        token=TOKEN,
        worker=False,
        max_body_bytes=64 * 1024,
    )
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    with served(settings) as server:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "--config-file",
                str(config),
                "run",
                f"{server.url}/openapi.json",
                "--checks",
                "all",
                "--exclude-checks",
                "allow_header_conformance",
                "--max-examples",
                str(EXAMPLES),
                "--generation-deterministic",
                "--workers",
                "1",
                "--no-color",
                "-H",
                f"Authorization: Bearer {TOKEN}",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=840,
        )
        requests, _, _ = server.app.state.ctx.metrics.snapshot()
    out = result.stdout + result.stderr
    generated = re.search(r"(\d+) generated", out)
    operations = re.search(r"Tested: (\d+)", out)
    statuses = {}
    for (_, _, status), n in requests.items():
        statuses[status] = statuses.get(status, 0) + n
    report(
        "11 schemathesis",
        {
            "examples_per_operation": EXAMPLES,
            "operations": int(operations.group(1)) if operations else None,
            "test_cases_generated": int(generated.group(1)) if generated else None,
            "requests_answered": sum(requests.values()),
            "statuses": dict(sorted(statuses.items())),
            "exit_code": result.returncode,
        },
    )
    assert result.returncode == 0, out[-6000:]
    assert operations and int(operations.group(1)) >= 10
    assert not any(str(s).startswith("5") for s in statuses), statuses
