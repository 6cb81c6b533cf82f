"""The body limit, as plain ASGI middleware (safe around streaming responses).

Every body is held to MAX_BODY_BYTES, by its Content-Length before anything is read, or
as it arrives. The routes that take more (the import: thousands of turns; the doors whose
clients send the whole history with every message) are named by their route, method and
path pattern (`LargeBody`), not by how a path ends: a limit keyed on the suffix `/import`
gave any such path, `PATCH /v1/memory/items/import` included, the 25 MB import limit.
A larger limit lets no one make the server read more before authentication: nothing here
reads a body, and a route reads its body only after the door (chat_api.admission.door).
The 413 is chatmem's error shape (OpenAI's too), except on a path whose clients read errors
in another protocol's shape, which gives its own answer (`/mcp`: a JSON-RPC error).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chat_api.errors import error_body


@dataclass(frozen=True, slots=True)
class LargeBody:
    """A route allowed a larger body than the rest."""

    methods: frozenset[str]
    path: re.Pattern[str]
    max_bytes: int

    @classmethod
    def of(cls, route: Route, max_bytes: int) -> LargeBody:
        return cls(frozenset(route.methods or ()), route.path_regex, max_bytes)

    def matches(self, scope: Scope) -> bool:
        return scope.get("method") in self.methods and self.path.match(scope.get("path", "")) is not None


class BodyLimit:
    """Answer 413 to bodies over the limit, by Content-Length or as they arrive."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        large: Sequence[LargeBody] = (),
        answers: Mapping[str, Callable[[int], Response]] | None = None,
    ) -> None:
        """`answers`: by exact path, the 413 (given the limit) of a protocol with its own error shape."""
        self.app = app
        self.max_bytes = max_bytes
        self.large = tuple(large)
        self.answers = dict(answers or {})

    def limit(self, scope: Scope) -> int:
        """The largest body this request may carry."""
        return next((route.max_bytes for route in self.large if route.matches(scope)), self.max_bytes)

    @staticmethod
    def _too_large(limit: int) -> JSONResponse:
        body = error_body("payload_too_large", BodyTooLarge(limit).detail)
        body["error"].update(type="invalid_request_error", param=None)  # also OpenAI's shape (/openai/v1)
        return JSONResponse(body, status_code=413)

    def _refusal(self, scope: Scope, limit: int) -> Response:
        answer = self.answers.get(scope.get("path", ""), self._too_large)
        return answer(limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit(scope)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await self._refusal(scope, limit)(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message: Any = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message  # type: ignore[no-any-return]

        try:
            await self.app(scope, limited_receive, send)
        except BodyTooLarge:
            await self._refusal(scope, limit)(scope, receive, send)


class BodyTooLarge(HTTPException):
    """Raised from receive() when a streamed body passes the limit.

    An HTTPException, because FastAPI turns any other error raised while it reads a body
    into a 400 ("error parsing the body"): a chunked body with no Content-Length would
    answer 400 where one with a Content-Length answers 413. FastAPI re-raises these as is;
    a route class that answers errors itself (OpenAIRoute) maps it in its own shape.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=f"request body over {limit} bytes")
        self.limit = limit
