"""Exceptions to HTTP responses, in one place.

Library code raises :class:`cache_store.errors.SpcacheError` subclasses and never an
``HTTPException``; this module says which status each one means. Every error body is
JSON ``{"error": <class name>, "detail": <reason>}`` (plus ``problems`` where there is a
list), never a traceback: unexpected exceptions are logged with theirs and answered 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from cache_store.service_api.protocol import ERROR_HEADER
from cache_store.errors import (
    CacheDamaged,
    CorruptRecord,
    FingerprintLookupError,
    InvalidSampleId,
    JobNotFound,
    MissTimeout,
    NoWorkerAlive,
    ParameterError,
    QueueDamaged,
    ReadBudgetBusy,
    ReadOnlyStoreError,
    RecordNotFound,
    ResponseTooLarge,
    SourceError,
    SpcacheError,
    StoreBusy,
    StoreFull,
    UnknownName,
    WaitingFull,
)

__all__ = [
    "STATUS_BY_ERROR",
    "ERROR_RESPONSES",
    "ErrorBody",
    "status_for",
    "error_response",
    "install_error_handlers",
]

log = logging.getLogger(__name__)


#: Most specific class first; the first ``isinstance`` match wins.
STATUS_BY_ERROR: tuple[tuple[type[BaseException], int], ...] = (
    (ResponseTooLarge, 413),
    (ReadBudgetBusy, 503),
    (RecordNotFound, 404),
    (JobNotFound, 404),
    (FingerprintLookupError, 404),
    (InvalidSampleId, 422),
    (ParameterError, 422),
    (UnknownName, 422),
    (SourceError, 422),
    (ReadOnlyStoreError, 503),
    (StoreBusy, 503),
    (WaitingFull, 503),
    (NoWorkerAlive, 503),
    (MissTimeout, 504),
    (CacheDamaged, 503),  # the reason says what is damaged; an operator must salvage
    (QueueDamaged, 503),  # warm-ups refused until the queue file is back
    (StoreFull, 503),
    (CorruptRecord, 500),
    (SpcacheError, 500),
)

_RETRY_AFTER_S = "1"


class ErrorBody(BaseModel):
    """Every error answer's body (documented in the schema for 4XX and 5XX)."""

    error: str
    detail: str
    problems: list[str] | None = None


#: ``responses=`` for every router: the error shape, for any client or server error.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": "client error"},
    "5XX": {"model": ErrorBody, "description": "server error (503: retry after Retry-After)"},
}


def status_for(exc: BaseException) -> int:
    for cls, status in STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return status
    return 500


def error_response(
    status: int,
    error: str,
    detail: str,
    *,
    problems: list[Any] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {"error": error, "detail": detail}
    # HEAD answers lose their body: the error's name also travels as a header.
    headers = {**(headers or {}), ERROR_HEADER: error}
    if problems is not None:
        body["problems"] = problems
    return JSONResponse(body, status_code=status, headers=headers)


def _detail(exc: BaseException) -> str:
    if isinstance(exc, StoreBusy):  # the store names the setting; clients need less
        return "too many concurrent readers of the cache; retry shortly"
    return str(exc)


async def _spcache_error(request: Request, exc: Exception) -> JSONResponse:
    status = status_for(exc)
    headers = {"Retry-After": _RETRY_AFTER_S} if status == 503 else None
    if status >= 500:
        log.error("%s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    problems = getattr(exc, "problems", None)
    return error_response(
        status,
        type(exc).__name__,
        _detail(exc),
        problems=list(problems) if problems is not None else None,
        headers=headers,
    )


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
    return error_response(
        422, "RequestValidationError", "invalid request: " + "; ".join(problems), problems=problems
    )


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    name = {
        401: "Unauthorized",
        403: "Forbidden",
        404: "NotFound",
        405: "MethodNotAllowed",
        408: "RequestTimeout",
        413: "RequestTooLarge",
    }.get(exc.status_code, "HTTPError")
    return error_response(
        exc.status_code, name, str(exc.detail), headers=dict(exc.headers) if exc.headers else None
    )


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, "InternalError", "internal error; the service log has the details")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(SpcacheError, _spcache_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
