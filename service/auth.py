"""Bearer-token guard for mutating routes (when a token is configured)."""

from __future__ import annotations

import secrets

from fastapi import HTTPException, Request

__all__ = ["require_token"]


def require_token(request: Request) -> None:
    """FastAPI dependency: 401 unless ``Authorization: Bearer <token>`` matches.

    Does nothing when the service runs without a token (only allowed on loopback).
    """
    token = request.app.state.ctx.settings.token
    if token is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    expected = token.get_secret_value().encode("utf-8")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        given.strip().encode("utf-8"), expected
    ):
        raise HTTPException(
            401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
