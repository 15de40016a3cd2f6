"""Serves the dashboard page and its static files; every bit of data comes from `/v1` with a token."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from service.strict_json import StrictJSONRoute

STATIC = Path(__file__).resolve().parent / "static"

# Its CSP, nosniff and referrer policy come from service.headers, for this page and every other
# HTML file under /static alike; a new version of the page is fetched as soon as there is one.
_HEADERS = {"Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False, route_class=StrictJSONRoute)


@router.get("/")
def dashboard() -> FileResponse:
    """The dashboard page; it shows nothing until the user signs in with an API token."""
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=_HEADERS)


def install_dashboard(app: FastAPI) -> None:
    """Serve the page at `/` and its scripts, styles and the vendored uPlot under `/static`."""
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
