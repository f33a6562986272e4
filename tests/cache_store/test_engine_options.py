"""EngineOptions: the one place an engine run's options get their defaults and checks
(the doors that build one: tests/spcache/test_dispatch.py, tests/workers/test_engine.py,
tests/workers/test_ray_scheduling.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cache_store.engine_options import EngineOptions, auto_loaders, check_device
from cache_store.errors import UnknownName, UsageError


def test_defaults_are_documented_once() -> None:
    options = EngineOptions()
    assert (options.device, options.backend, options.loaders) == ("auto", "auto", None)
    assert (options.query_chunk, options.min_query_chunk, options.write_batch) == (1 << 18, 256, 32)
    assert (options.prefetch, options.source_roots, options.skip_failed) == (None, None, False)
    assert options.max_source_bytes == 1 << 30
    assert options.loader_count == max(1, min(8, (os.cpu_count() or 2) - 1)) == auto_loaders()
    assert [auto_loaders(c) for c in (1, 2, 4, 64)] == [1, 1, 3, 8]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"device": "tpu"}, "device 'tpu': expected auto, cpu, cuda or cuda:N"),
        ({"device": "cuda:x"}, "device 'cuda:x'"),
        ({"loaders": -1}, "loaders: -1 must be 0 or more"),
        ({"query_chunk": 0}, "query_chunk: 0 must be 1 or more"),
        ({"write_batch": 0}, "write_batch: 0 must be 1 or more"),
        ({"prefetch": 0}, "prefetch: 0 must be 1 or more"),
        ({"max_source_bytes": 0}, "max_source_bytes: 0"),
        ({"loaders": 1.5}, "loaders: 1.5 is not a whole number"),
        ({"write_batch": True}, "write_batch: True is not a whole number"),
    ],
)
def test_a_bad_value_is_refused_by_name(changes: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineOptions(**changes)
    with pytest.raises(UsageError, match="engine options: "):  # also through a replace
        EngineOptions.of(EngineOptions(), **changes)


def test_an_unknown_backend_or_field_is_named() -> None:
    with pytest.raises(UnknownName, match="SPC backend 'cudnn'; known: auto, kaolin, torch"):
        EngineOptions(backend="cudnn")
    with pytest.raises(TypeError, match="jobs"):
        EngineOptions.of(None, jobs=3)
    assert check_device("cuda:1") == "cuda:1"


def test_it_crosses_to_a_ray_actor_as_plain_values_and_comes_back_equal(tmp_path: Path) -> None:
    options = EngineOptions(
        device="cpu", loaders=3, source_roots=[tmp_path, str(tmp_path / "b")], skip_failed=True
    )
    assert options.source_roots == (str(tmp_path), str(tmp_path / "b"))
    data = options.as_json()
    assert all(isinstance(v, (str, int, bool, list, type(None))) for v in data.values())
    assert EngineOptions.from_json(data) == options
    assert options.source_limits().roots == (str(tmp_path.resolve()), str(tmp_path / "b"))
    with pytest.raises(AttributeError):
        options.device = "cuda"  # type: ignore[misc]
