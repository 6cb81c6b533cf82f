"""Request limits as plain ASGI middleware (safe around streaming responses)."""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chat_api.errors import error_body


class BodyLimit:
    """Answer 413 to bodies over the limit, by Content-Length or as they arrive.

    Imports carry thousands of turns, so paths ending in `/import` get their own limit.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, import_max_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.import_max_bytes = import_max_bytes or max_bytes

    @staticmethod
    def _too_large(limit: int) -> JSONResponse:
        body = error_body("payload_too_large", f"request body over {limit} bytes")
        body["error"].update(type="invalid_request_error", param=None)  # also OpenAI's shape (/openai/v1)
        return JSONResponse(body, status_code=413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.import_max_bytes if scope.get("path", "").endswith("/import") else self.max_bytes
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await self._too_large(limit)(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message: Any = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return message  # type: ignore[no-any-return]

        try:
            await self.app(scope, limited_receive, send)
        except BodyTooLarge:
            await self._too_large(limit)(scope, receive, send)


class BodyTooLarge(HTTPException):
    """Raised from receive() when a streamed body passes the limit.

    An HTTPException, because FastAPI turns any other error raised while it reads a body
    into a 400 ("error parsing the body"): a chunked body with no Content-Length would
    answer 400 where one with a Content-Length answers 413. FastAPI re-raises these as is.
    """

    def __init__(self) -> None:
        super().__init__(status_code=413, detail="request body too large")
