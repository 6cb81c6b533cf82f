"""Request limits as plain ASGI middleware (safe around streaming responses)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chat_api.errors import error_body


class BodyLimit:
    """Answer 413 to bodies over `max_bytes`, by Content-Length or as they arrive."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> JSONResponse:
        return JSONResponse(
            error_body("payload_too_large", f"request body over {self.max_bytes} bytes"), status_code=413
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._too_large()(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message: Any = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge
            return message  # type: ignore[no-any-return]

        try:
            await self.app(scope, limited_receive, send)
        except BodyTooLarge:
            await self._too_large()(scope, receive, send)


class BodyTooLarge(Exception):
    """Raised from receive() when a streamed body passes the limit."""
