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

from cache_store.errors import SpcacheError

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

    model_config = SettingsConfigDict(env_prefix="SPCACHE_", extra="ignore", validate_default=True)

    cache: Path = Field(description="cache directory (LMDB records + jobs.sqlite)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    token: SecretStr | None = Field(None, description="bearer token for mutating routes")
    source_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=lambda: [Path.cwd()],
        description="warm-up source paths must resolve inside one of these",
    )
    allowed_hosts: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="Host header values served (comma-separated or JSON; '*' = any); "
        "default: the bound host, localhost, 127.0.0.1, ::1 (any when bound "
        "to a wildcard address)",
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest accepted request body")
    body_timeout_s: float = Field(30.0, gt=0, description="a request body must arrive within this")
    max_warmup_items: int = Field(100_000, ge=1)
    max_batch_records: int = Field(256, ge=1)
    max_waiting_requests: int = Field(
        64,
        ge=0,
        description="read-through reads (?wait=) waiting at once; past it: 503 + Retry-After",
    )
    max_wait_s: float = Field(60.0, gt=0, description="longest ?wait= honoured, seconds")

    max_response_bytes: int = Field(
        256 << 20, ge=1 << 20, description="largest record or batch answer (else 413)"
    )
    min_stream_bytes_per_s: int = Field(
        64 << 10,
        ge=1,
        description=(
            "a large record's answer must go at least this fast (after 10 s of grace), "
            "else the client is cut off: a slow client never holds the record's map for long"
        ),
    )
    max_read_bytes_in_flight: int = Field(
        1 << 30,
        ge=1 << 20,
        description="record bytes all answers being built or sent may hold (else 503)",
    )
    max_hash_bytes: int = Field(
        512 << 20,
        ge=1,
        description="largest source an item-state request hashes (and the bytes it may hash)",
    )
    max_listing_hash_bytes: int = Field(
        64 << 20,
        ge=0,
        description="source bytes one sample "
        "listing may hash (sources whose stat signature "
        "changed); the rest are listed 'unchecked'",
    )
    glob_max_entries: int = Field(
        200_000, ge=1, description="directory entries one warm-up glob may look at"
    )
    glob_max_seconds: float = Field(5.0, gt=0, description="time one warm-up glob may take")
    pool_check_s: float = Field(
        2.0,
        gt=0,
        description="/healthz: the thread pool must run a trivial task within this, else 503",
    )
    job_errors_page: int = Field(100, ge=1, le=10_000)
    worker: bool = Field(True, description="run one worker child process (spcache serve)")
    worker_device: str | None = None
    worker_backend: str = "auto"
    worker_restart_max_s: float = Field(60.0, gt=0)
    stats_ttl_s: float = Field(
        10.0,
        ge=0,
        description="reuse the per-fingerprint stats walk (a "
        "child process) this long once the cache changed",
    )
    record_key: SecretStr | None = Field(
        None,
        min_length=16,
        description="secret shared with readers: each record is sent "
        "with a keyed tag (HMAC-SHA256) binding it to its key (cache_store.format.tag)",
    )
    log_level: str = "info"
    tls_certfile: Path | None = Field(
        None, description="serve HTTPS with this certificate chain (PEM); needs tls_keyfile"
    )
    tls_keyfile: Path | None = Field(None, description="the certificate's private key (PEM)")

    @field_validator("cache", mode="before")
    @classmethod
    def _local_cache(cls, value: Any) -> Any:
        """``file:///x`` is the path ``/x``; a URL (``s3://``, ``http://``) is refused by
        name rather than folded by ``Path`` into a local ``s3:/...`` directory."""
        from cache_store.location import Location, local_path

        if isinstance(value, str | os.PathLike | Location):
            try:
                return local_path(value)
            except (ValueError, SpcacheError) as exc:
                raise ValueError(f"{value}: not a local cache directory") from exc
        return value

    @field_validator("worker_device")
    @classmethod
    def _device(cls, value: str | None) -> str | None:
        """The one device check (``auto``, ``cpu``, ``cuda``, ``cuda:N``), as the worker's."""
        from cache_store.engine_options import check_device

        return None if value is None else check_device(value)

    @field_validator("worker_backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        from cache_store.engine_options import BACKENDS

        if value not in BACKENDS:
            raise ValueError(f"{value!r}: expected one of {', '.join(BACKENDS)}")
        return value

    @field_validator("source_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [p for p in text.split(os.pathsep) if p]
        return value

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [h.strip() for h in text.split(",") if h.strip()]
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
    def _load_tls(self) -> Settings:
        """Both TLS files or neither, and they must load: a bad certificate is a one-line
        error at start, not a traceback from inside uvicorn."""
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile go together (give both, or neither)")
        if self.tls_certfile is not None:
            import ssl

            from cache_store.sources.files import SourceLimits, check_source

            for path in (self.tls_certfile, self.tls_keyfile):
                if path is None:  # not reached: both or neither (checked above)
                    continue
                try:  # a FIFO or a device would block the load forever: regular files only
                    check_source(path, SourceLimits(max_bytes=1 << 20))
                except SpcacheError as exc:
                    raise ValueError(f"TLS file {exc}") from None

            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                    self.tls_certfile, self.tls_keyfile
                )
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(
                    f"cannot load TLS certificate {self.tls_certfile} with key "
                    f"{self.tls_keyfile}: {exc.strerror or exc}"
                ) from None
        return self

    @property
    def url(self) -> str:
        """Where the service answers: ``http(s)://host:port``."""
        scheme = "https" if self.tls_certfile is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    @model_validator(mode="after")
    def _refuse_open_bind(self) -> Settings:
        if self.token is None and not is_loopback(self.host):
            raise ValueError(
                f"refusing to bind to {self.host!r} without a token: set "
                "SPCACHE_TOKEN (or --token), or bind to 127.0.0.1"
            )
        return self
