"""The API docs (`/docs`, `/redoc`) served with their assets from this process.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, which a machine without
internet (or a browser that must not talk to outside hosts) cannot reach. The assets come
instead from the `fastapi-offline` package (pinned in pyproject.toml), served under
`/docs-assets/`, so the docs work offline and name no outside host.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse

from memory.errors import NotFound

ASSETS_DIR = (Path(fastapi_offline.__file__).resolve().parent / "static").resolve()
ASSETS_URL = "/docs-assets"
ASSET_FILES = frozenset({"swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png"})


def install_docs(app: FastAPI) -> None:
    """Serve `/docs`, its OAuth2 redirect and `/redoc` with local assets (app made with docs_url=None)."""
    router = APIRouter(include_in_schema=False)
    openapi_url = app.openapi_url or "/openapi.json"
    oauth2_redirect = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"

    @router.get("/docs")
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}{oauth2_redirect}",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            # Swagger UI would otherwise ask validator.swagger.io for a badge: an outside host.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @router.get(oauth2_redirect)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @router.get("/redoc")
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )

    @router.get(ASSETS_URL + "/{name}")
    async def asset(name: str) -> FileResponse:
        if name not in ASSET_FILES:
            raise NotFound("no such docs asset")
        # Versioned by the pinned package: a day of caching is safe.
        return FileResponse(ASSETS_DIR / name, headers={"Cache-Control": "public, max-age=86400"})

    app.include_router(router)
