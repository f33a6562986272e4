"""docker-compose.yml cannot run here (no Docker engine), so check what can be checked:
it parses, each service's command is a real `spcache` subcommand whose arguments parse,
and the services agree on the cache volume, the GPU and the source mount."""

from __future__ import annotations

import argparse
import re
import tomllib

import pytest
import yaml

from tests.conftest import REPO_ROOT
from spcache.cli import COMMANDS, resolve

COMPOSE = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _parse(command: list[str]) -> argparse.Namespace:
    name, *rest = command
    assert name in COMMANDS, f"{name!r} is not an spcache subcommand ({sorted(COMMANDS)})"
    target = resolve(name)
    assert not isinstance(target, str), target
    parser = argparse.ArgumentParser(prog=f"spcache {name}", exit_on_error=False)
    target.configure_parser(parser)
    try:
        return parser.parse_args(rest)
    except SystemExit as exc:  # argparse still exits on some errors
        pytest.fail(f"`spcache {' '.join(command)}` does not parse (exit {exc.code})")


def test_compose_has_the_api_and_the_worker() -> None:
    assert set(SERVICES) == {"api", "worker"}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_each_command_is_a_real_subcommand(service: str) -> None:
    args = _parse(SERVICES[service]["command"])
    assert str(args.cache) == "/cache"


def test_api_serves_without_its_own_worker_and_needs_a_token() -> None:
    api = SERVICES["api"]
    args = _parse(api["command"])
    assert args.worker is False
    assert args.host == "0.0.0.0"  # so it must refuse to start without a token
    assert "SPCACHE_TOKEN" in api["environment"]
    assert "deploy" not in api, "the API is CPU only: no GPU reservation"


def test_worker_reserves_one_nvidia_gpu() -> None:
    worker = SERVICES["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    args = _parse(worker["command"])
    assert str(args.device).startswith("cuda")


def test_services_share_one_named_cache_volume_and_the_sources() -> None:
    assert "cache" in COMPOSE["volumes"]
    for service in SERVICES.values():
        assert "cache:/cache" in service["volumes"]
        assert any(v.endswith(":/sources:ro") for v in service["volumes"])
    roots = _parse(SERVICES["api"]["command"]).source_roots
    assert [str(r) for r in roots] == ["/sources"]
    worker_roots = _parse(SERVICES["worker"]["command"]).source_roots
    assert [str(r) for r in worker_roots] == ["/sources"], "the worker reads only /sources"


def test_dockerfile_runs_spcache_and_installs_kaolin_before_the_project() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["spcache"\]', dockerfile, re.M)
    kaolin = dockerfile.index("kaolin==")
    project = dockerfile.index('pip install "torch==${TORCH_VERSION}" .')
    assert kaolin < project


def test_dockerfile_copies_every_package_the_distribution_ships() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert packages  # spcache, cache_store, workers, service
    missing = [p for p in packages if not re.search(rf"^COPY {p} \./{p}$", dockerfile, re.M)]
    assert not missing, f"the image would be built without {missing} (pip install . needs them)"
