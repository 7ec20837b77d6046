"""The API's HTML beyond the dashboard: the interactive docs (off by default) and the
Content-Security-Policy every HTML answer gets.

FastAPI's `/docs` and `/redoc` pages load their script and style from a third-party CDN;
served on the dashboard's origin, that script could read the dashboard's answers. They are
off unless TORCHYARD_API_DOCS=true; `/openapi.json` (the same document, as JSON) is always
served and any OpenAPI viewer reads it. When an operator turns them on, each page gets a CSP
naming exactly the sources it loads (and the hash of its inline script), nothing else.

`HtmlPolicy` is the net under everything: an HTML response that set no CSP of its own gets
the dashboard's headers (api/routers/ui.py: PAGE_HEADERS), so no page the API serves runs
script from anywhere but its own origin.
"""

from __future__ import annotations

import base64
import hashlib
import re
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from torchyard.api.routers.ui import PAGE_HEADERS

_SRC = re.compile(r"""<(?:script|link)\b[^>]*?\b(?:src|href)="([^"]+)\"""", re.I)
_INLINE = re.compile(r"<script>(.*?)</script>", re.S | re.I)
_HEADERS = [(k.lower().encode(), v.encode()) for k, v in PAGE_HEADERS.items()]


def page_csp(html: str) -> str:
    """A CSP for `html` that allows the origins it loads from and its inline scripts (by
    hash), and nothing else."""
    origins = sorted({_origin(u) for u in _SRC.findall(html)} - {""})
    hashes = [
        "'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"
        for s in _INLINE.findall(html)
    ]
    ext = " ".join(origins)
    return (
        f"default-src 'none'; script-src 'self' {ext} {' '.join(hashes)}; "
        f"style-src 'self' {ext} 'unsafe-inline'; img-src 'self' data: {ext}; "
        "connect-src 'self'; font-src 'self' " + ext + "; worker-src blob:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme in ("http", "https") else ""


def _with_policy(page: HTMLResponse) -> HTMLResponse:
    headers = {
        **PAGE_HEADERS,
        "Content-Security-Policy": page_csp(bytes(page.body).decode()),
        "Cache-Control": "no-cache",
    }
    return HTMLResponse(page.body, headers=headers)


def add_docs(app: FastAPI) -> None:
    """`/docs` and `/redoc` (FastAPI's pages, each under its own narrow CSP): only for an
    app whose settings turned them on."""

    async def swagger(request: Request) -> HTMLResponse:
        del request
        return _with_policy(get_swagger_ui_html(openapi_url="/openapi.json", title=app.title))

    async def redoc(request: Request) -> HTMLResponse:
        del request
        return _with_policy(get_redoc_html(openapi_url="/openapi.json", title=app.title))

    app.add_api_route("/docs", swagger, methods=["GET"], include_in_schema=False)
    app.add_api_route("/redoc", redoc, methods=["GET"], include_in_schema=False)


class HtmlPolicy:
    """Adds the dashboard's security headers to any HTML response that has no CSP."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = message.get("headers") or []
                if _is_html(headers) and not any(
                    k.lower() == b"content-security-policy" for k, _ in headers
                ):
                    names = {k.lower() for k, _ in headers}
                    message["headers"] = [*headers, *(h for h in _HEADERS if h[0] not in names)]
            await send(message)

        await self.app(scope, receive, guarded)


def _is_html(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/html") for k, v in headers)
