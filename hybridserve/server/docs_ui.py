"""`GET /docs` without a CDN: Swagger UI from the `swagger-ui-bundle` package's local copy when it is
installed (its assets under `/docs/assets/`), else a plain page that links `/openapi.json`."""

from __future__ import annotations

import html
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response

from hybridserve.server.errors import APIError

# The only files the page loads; no other name is served from the package directory.
SWAGGER_ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css",
                  "favicon-32x32.png": "image/png"}


def swagger_ui_dir() -> Path | None:
    """The directory of the installed Swagger UI distribution, or None without the package."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    directory = Path(str(swagger_ui_path))
    return directory if all((directory / name).is_file() for name in SWAGGER_ASSETS) else None


def _plain_docs_page(openapi_url: str, title: str) -> str:
    url = html.escape(openapi_url, quote=True)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body><h1>{html.escape(title)}</h1><p>The OpenAPI schema of this server: "
            f"<a href='{url}'>{url}</a>. (The interactive page needs the <code>swagger-ui-bundle</code> "
            "package; it is not installed.)</p></body></html>")


def install_docs_routes(app: FastAPI, assets: Path | None) -> None:
    """Route `/docs` (and with `assets`, `/docs/assets/{name}`) on `app`, whose own docs are off."""

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> Response:
        root = request.scope.get("root_path", "").rstrip("/")
        openapi_url = f"{root}{app.openapi_url}"
        if assets is None:
            return HTMLResponse(_plain_docs_page(openapi_url, app.title))
        return get_swagger_ui_html(openapi_url=openapi_url, title=f"{app.title} - docs",
                                   swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
                                   swagger_favicon_url=f"{root}/docs/assets/favicon-32x32.png")

    if assets is None:
        return

    @app.get("/docs/assets/{name}", include_in_schema=False)
    async def docs_asset(name: str) -> Response:
        media_type = SWAGGER_ASSETS.get(name)
        if media_type is None:
            raise APIError(404, "route not found")
        return FileResponse(assets / name, media_type=media_type)
