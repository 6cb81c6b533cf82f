"""The reference chat page: `/`, its static files, and the little it needs to start (`/ui/config`).

The page is plain files under `chat_api/static/` (ES modules, no build step), served from
this process only, so it never asks any other host for anything. A Content-Security-Policy
says the same to the browser: scripts, styles and requests are same-origin only, and inline
script is refused, so even a rendering bug could not run injected markup.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


@router.get("/")
async def index() -> FileResponse:
    """The chat page."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get("/static/{path:path}")
async def static_file(path: str) -> FileResponse:
    """A file of the page; nothing outside the static folder is reachable."""
    candidate = (STATIC_DIR / path).resolve()
    if not candidate.is_relative_to(STATIC_DIR) or not candidate.is_file():
        raise NotFound(f"no static file {path!r}")
    return FileResponse(candidate, headers=PAGE_HEADERS)


@router.get("/ui/config")
async def ui_config(request: Request) -> dict[str, Any]:
    """What the page needs before its first API call.

    `token` is set only by `chatmem up` (the embedded, single-user installation); with a
    configured secret it is null and the page asks the person for a token.
    """
    services = getattr(request.app.state, "services", None)
    settings = services.settings if services is not None else None
    return {
        "token": getattr(request.app.state, "ui_token", None),
        "on_busy": settings.on_busy_default if settings is not None else None,
        "model": services.provider.model if services is not None else None,
        "llm_provider": settings.llm_provider if settings is not None else None,
    }
