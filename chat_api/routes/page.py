"""The reference chat page: `/`, its static files, and the little it needs to start (`/ui/config`).

The page is plain files under `chat_api/static/` (ES modules, no build step), served from
this process only, so it never asks any other host for anything. A Content-Security-Policy
says the same to the browser: scripts, styles and requests are same-origin only, and inline
script is refused, so even a rendering bug could not run injected markup.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from memory.errors import NotFound

STATIC_DIR = (Path(__file__).resolve().parent.parent / "static").resolve()

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Always revalidated: a new version of the page must never mix with cached old modules.
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def loopback_request(host: str | None, origin: str | None) -> bool:
    """True when `Host` names this machine's loopback and `Origin`, if sent, is a loopback page."""
    if not host:
        return False
    try:
        host_name = urlsplit(f"//{host}").hostname
        origin_name = None if origin is None else urlsplit(origin).hostname
    except ValueError:  # a malformed port or bracket
        return False
    if host_name not in LOOPBACK_NAMES:
        return False
    return origin is None or origin_name in LOOPBACK_NAMES


@router.get("/")
async def index() -> FileResponse:
    """The chat page."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get("/static/{path:path}")
async def static_file(path: str) -> FileResponse:
    """A file of the page; nothing outside the static folder is reachable."""
    try:
        candidate = (STATIC_DIR / path).resolve()
        found = candidate.is_relative_to(STATIC_DIR) and candidate.is_file()
    except (ValueError, OSError):  # a NUL in the path, a name too long for the file system
        found = False
    if not found:
        raise NotFound("no such static file")
    return FileResponse(candidate, headers=PAGE_HEADERS)


@router.get("/ui/config")
async def ui_config(request: Request) -> dict[str, Any]:
    """What the page needs before its first API call.

    `token` is set only by `chatmem up` (the embedded, single-user installation); with a
    configured secret it is null and the page asks the person for a token. Even then it
    is handed only to a request addressed to a loopback name (`Host`) and, when the
    browser says where the page came from (`Origin`), from a loopback page: a DNS-rebinding
    page reaches the port under its own host name, and gets null. UI_TOKEN_HANDOUT=false
    turns the handout off.
    """
    services = getattr(request.app.state, "services", None)
    settings = services.settings if services is not None else None
    token = getattr(request.app.state, "ui_token", None)
    handout = settings is None or settings.ui_token_handout
    if not handout or not loopback_request(request.headers.get("host"), request.headers.get("origin")):
        token = None
    return {
        "token": token,
        "on_busy": settings.on_busy_default if settings is not None else None,
        "model": services.provider.model if services is not None else None,
        "llm_provider": settings.llm_provider if settings is not None else None,
    }
