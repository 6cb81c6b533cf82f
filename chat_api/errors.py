"""The one place that maps errors to HTTP: every error body is {"error": {"code", "message"}}.

Also the unexpected ones: an exception no handler knows answers 500 with the same shape
and a fixed message, so no internal detail (SQL, a traceback, a path) ever reaches a
client; the exception itself is logged by the server.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from chat_api.auth import AuthError
from memory.errors import Conflict, DomainError, InvalidInput, NotFound

STATUS_BY_ERROR: list[tuple[type[DomainError], int]] = [
    (NotFound, 404),
    (InvalidInput, 422),
    (Conflict, 409),
]


def error_body(code: str, message: str, **details: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"code": code, "message": message}
    if details:
        body["details"] = details
    return {"error": body}


class Forbidden(Exception):
    """The caller is known but may not do this (403), with a machine-readable `code`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RateLimited(Exception):
    """Too many requests; retry after `retry_after` seconds."""

    status = 429
    code = "rate_limited"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(RateLimited):
    """This process is shutting down (a deploy): no new reply here; retry after `retry_after` seconds,
    which reaches another replica. Refused like a limit, before anything is stored, but as a 503."""

    status = 503
    code = "shutting_down"


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn exceptions into machine-readable 4xx bodies."""

    @app.exception_handler(DomainError)
    async def _domain(_: Request, exc: DomainError) -> JSONResponse:
        status = next((s for cls, s in STATUS_BY_ERROR if isinstance(exc, cls)), 400)
        return JSONResponse(error_body(exc.code, exc.message, **exc.details), status_code=status)

    @app.exception_handler(AuthError)
    async def _auth(_: Request, exc: AuthError) -> JSONResponse:
        return JSONResponse(
            error_body("unauthorized", str(exc)), status_code=401, headers={"WWW-Authenticate": "Bearer"}
        )

    @app.exception_handler(Forbidden)
    async def _forbidden(_: Request, exc: Forbidden) -> JSONResponse:
        return JSONResponse(error_body(exc.code, str(exc)), status_code=403)

    @app.exception_handler(RateLimited)
    async def _limited(_: Request, exc: RateLimited) -> JSONResponse:
        return JSONResponse(
            error_body(exc.code, str(exc)),
            status_code=exc.status,
            headers={"Retry-After": str(exc.retry_after)},
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {
                "loc": [str(p) for p in err.get("loc", ())],
                "msg": err.get("msg", ""),
                "type": err.get("type", ""),
            }
            for err in exc.errors()
        ]
        malformed = any(err["type"] == "json_invalid" for err in errors)
        code = "malformed_json" if malformed else "validation_error"
        message = "request body is not valid JSON" if malformed else "request does not match the schema"
        return JSONResponse(error_body(code, message, errors=errors), status_code=422)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body("internal_error", "internal server error"), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
            # FastAPI's body parser: the JSON nests deeper than Python's parser goes.
            return JSONResponse(
                error_body("json_out_of_bounds", "the body is nested too deep to parse", field="body"),
                status_code=422,
            )
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
            exc.status_code, "http_error"
        )
        return JSONResponse(
            error_body(code, str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )
