"""Headers every response carries, as plain ASGI middleware (safe around streaming responses).

- `X-Content-Type-Options: nosniff` on every response, so a browser never runs a JSON
  body or a stored text as script or markup of another type.
- `Cache-Control: no-store` on every API response (JSON bodies and SSE streams alike):
  they hold a user's conversations and memory, which no shared or browser cache should
  keep. The page and the docs' assets keep the caching they chose (`PAGE_PREFIXES`).

`STREAM_HEADERS` are what every door's event stream (SSE) sends besides: a proxy such as
nginx must pass each event on as it comes (`X-Accel-Buffering: no`), not buffer the stream.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Paths whose own Cache-Control stands (the page revalidates its files; docs assets are versioned).
PAGE_PREFIXES = ("/static/", "/docs-assets/")
PAGE_PATHS = frozenset({"/", "/docs", "/redoc"})
# Every event stream's, on every door (no-cache: no-store replaces it on API paths).
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ResponseHeaders:
    """Adds nosniff to every response, and no-store to every API response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        page = path in PAGE_PATHS or path.startswith(PAGE_PREFIXES)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if name.lower() != b"x-content-type-options"
                    and not (name.lower() == b"cache-control" and not page)
                ]
                headers.append((b"x-content-type-options", b"nosniff"))
                if not page or not any(name.lower() == b"cache-control" for name, _ in headers):
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
