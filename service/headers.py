"""Security headers on every response: one middleware, so no route or static file can forget them."""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The dashboard only talks to its own origin and builds the DOM with textContent, never HTML from
# data; the CSP makes that a rule for every HTML page the app serves (`/`, `/static/*.html`). uPlot
# positions its elements with inline styles, hence 'unsafe-inline' for styles only (no inline script).
DASHBOARD_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
# FastAPI's /docs and /redoc pages (on only with DPTRAIN_API_DOCS) load Swagger UI and ReDoc from
# jsDelivr and start them with an inline script: allowed there, and nowhere else. ReDoc runs a web
# worker from a blob and fetches Google's fonts.
DOCS_CSP = (
    "default-src 'none'; script-src https://cdn.jsdelivr.net 'unsafe-inline'; "
    "style-src https://cdn.jsdelivr.net https://fonts.googleapis.com 'unsafe-inline'; "
    "font-src https://fonts.gstatic.com; img-src 'self' data: https:; connect-src 'self'; worker-src blob:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


class SecurityHeaders:
    """ASGI middleware: nosniff everywhere, a CSP on HTML pages, no-store where a route sets no caching.

    A header a route set itself is kept: the job routes' `Cache-Control: no-cache` (their ETags make
    polls cheap), the event stream's. Everything else an API answers (a user's token above all) is
    for its caller only and stored by no cache, `no-store`; static assets are left to the browser.
    """

    def __init__(self, app: ASGIApp, *, docs_paths: frozenset[str] = frozenset()) -> None:
        self.app, self.docs_paths = app, docs_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                # Browsers then never run a JSON answer or an uploaded file as a script or a page.
                headers.setdefault("X-Content-Type-Options", "nosniff")
                if headers.get("content-type", "").startswith("text/html"):
                    csp = DOCS_CSP if path in self.docs_paths else DASHBOARD_CSP
                    headers.setdefault("Content-Security-Policy", csp)
                    headers.setdefault("Referrer-Policy", "no-referrer")
                if not path.startswith("/static/"):
                    headers.setdefault("Cache-Control", "no-store")
            await send(message)

        await self.app(scope, receive, send_with_headers)
