"""Service settings: environment (``SPCACHE_`` prefix) and CLI flags meet here, and only here.

Every other module takes a :class:`Settings` (or plain arguments); nothing reads the
environment at import time. List-valued variables take ``os.pathsep``-separated paths
(``SPCACHE_SOURCE_ROOTS=/data/a:/data/b``) or a JSON list.
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["Settings", "is_loopback"]


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``)."""
    if host.lower() in {"localhost", "localhost.localdomain"}:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """What the service needs to run; see ``spcache serve --help`` for each flag."""

    model_config = SettingsConfigDict(env_prefix="SPCACHE_", extra="ignore",
                                      validate_default=True)

    cache: Path = Field(description="cache directory (LMDB records + jobs.sqlite)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    token: SecretStr | None = Field(None, description="bearer token for mutating routes")
    source_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=lambda: [Path.cwd()],
        description="warm-up source paths must resolve inside one of these")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest accepted request body")
    body_timeout_s: float = Field(30.0, gt=0, description="a request body must arrive within this")
    max_warmup_items: int = Field(100_000, ge=1)
    max_batch_records: int = Field(256, ge=1)
    max_waiting_requests: int = Field(64, ge=0, description="read-through reads (?wait=) "
                                      "waiting at once; past it: 503 + Retry-After")
    max_wait_s: float = Field(60.0, gt=0, description="longest ?wait= honoured, seconds")
    job_errors_page: int = Field(100, ge=1, le=10_000)
    worker: bool = Field(True, description="run one worker child process (spcache serve)")
    worker_device: str | None = None
    worker_backend: str = "auto"
    worker_restart_max_s: float = Field(60.0, gt=0)
    stats_ttl_s: float = Field(30.0, ge=0, description="cache per-fingerprint stats this long")
    log_level: str = "info"

    @field_validator("source_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [p for p in text.split(os.pathsep) if p]
        return value

    @field_validator("source_roots")
    @classmethod
    def _resolve_roots(cls, roots: list[Path]) -> list[Path]:
        if not roots:
            raise ValueError("at least one source root is needed")
        return [Path(r).expanduser().resolve() for r in roots]

    @field_validator("token")
    @classmethod
    def _no_empty_token(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None and not token.get_secret_value():
            return None
        return token

    @model_validator(mode="after")
    def _refuse_open_bind(self) -> Settings:
        if self.token is None and not is_loopback(self.host):
            raise ValueError(f"refusing to bind to {self.host!r} without a token: set "
                             "SPCACHE_TOKEN (or --token), or bind to 127.0.0.1")
        return self
