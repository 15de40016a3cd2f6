"""The dashboard's sweep page in a real browser, against canned API answers (no server at all).

Playwright's `page.route` answers every request of the page: `/` and `/static/*` from the
dashboard's files on disk, `/v1/*` with the sweep contract of issue 34 as JSON. That checks the page
(its table ranking, best mark, charts, compare link, inert user text, a missing API) for the cost of
a Chromium and no stack; the real routes are the sweeps branch's to test. The scripts also get a
`node --check`, which the browser test alone would only report as an empty page.
"""

from __future__ import annotations

import json
import mimetypes
import subprocess
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from playwright.sync_api import Browser, Page, Route, expect

from tests.e2e.helpers import ROOT

pytestmark = pytest.mark.e2e

STATIC = ROOT / "service" / "dashboard" / "static"
ORIGIN = "http://dashboard.test"
SWEEP_ID = "sw_0123456789abcdef"
HOSTILE = '<img src=x onerror="window.pwned=1">'
REPORTS = ROOT / "test-reports"


def _trial(number: int, objective: float | None, status: str, lr: float, opt: str) -> dict[str, Any]:
    params = {"hyperparameters.lr": lr, "hyperparameters.optimizer": opt}
    return {
        "number": number,
        "job_id": f"job{number:04d}abcdef",
        "params": params,
        "status": status,
        "objective": objective,
    }


TRIALS = [
    _trial(0, 0.50, "succeeded", 0.1, "sgd"),
    _trial(1, 0.20, "succeeded", 0.003, "adam"),
    _trial(2, None, "pruned", 0.05, "sgd"),
    _trial(3, 0.35, "succeeded", 0.0004, HOSTILE),
]
SWEEP = {
    "id": SWEEP_ID,
    "name": HOSTILE,
    "owner": "alice",
    "state": "succeeded",
    "spec": {
        "name": "lr-search",
        "base": {"recipe": "mlp", "resources": {"processes_per_node": 2, "device": "cpu"}},
        "space": {
            "hyperparameters.lr": {"log_uniform": [1e-4, 1e-1]},
            "hyperparameters.optimizer": {"choice": ["sgd", "adam", HOSTILE]},
        },
        "objective": {"metric": "eval/loss", "direction": "minimize"},
        "sampler": "tpe",
        "pruner": {"type": "asha"},
        "max_trials": 4,
        "max_concurrent_trials": 2,
        "seed": 1,
    },
    "trials": TRIALS,
    "best": TRIALS[1],
    "created_at": "2026-11-26T10:00:00Z",
    "finished_at": "2026-11-26T10:05:00Z",
}


def _series(job_id: str) -> dict[str, Any]:
    number = int(job_id[3:7])
    final = TRIALS[number]["objective"] or 0.9
    points = [
        [step, final + (10 - step) * 0.05] for step in range(2, 11 if TRIALS[number]["objective"] else 5, 2)
    ]
    return {"job_id": job_id, "series": {"eval/loss": points}}


Api = Callable[[str, dict[str, list[str]]], tuple[int, Any]]


def _open(browser: Browser, api: Api, requests: list[str]) -> Page:
    """A signed-in page whose `/v1` requests `api(path, query)` answers; the others are the static files."""
    page = browser.new_page(viewport={"width": 1300, "height": 1400})

    def handle(route: Route) -> None:
        url = urlparse(route.request.url)
        if url.path.startswith("/v1/"):
            requests.append(f"{url.path}?{url.query}")
            status, body = api(url.path, parse_qs(url.query))
            route.fulfill(status=status, content_type="application/json", body=json.dumps(body))
            return
        file = STATIC / "index.html" if url.path == "/" else STATIC / url.path.removeprefix("/static/")
        if not file.resolve().is_relative_to(STATIC) or not file.is_file():
            route.fulfill(status=404, body="not found")
            return
        route.fulfill(
            status=200,
            content_type=mimetypes.guess_type(file.name)[0] or "text/plain",
            body=file.read_bytes(),
        )

    page.route(f"{ORIGIN}/**", handle)
    page.add_init_script("sessionStorage.setItem('dptrain.token', 'test-token-0123456789')")
    return page


def test_the_scripts_parse() -> None:
    for script in sorted(STATIC.glob("*.js")):
        proc = subprocess.run(["node", "--check", str(script)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{script.name}: {proc.stderr}"


def test_a_sweep_page_ranks_trials_charts_them_and_links_the_best(browser: Browser) -> None:
    requests: list[str] = []

    def api(path: str, query: dict[str, list[str]]) -> tuple[int, Any]:
        if path == f"/v1/sweeps/{SWEEP_ID}":
            return 200, SWEEP
        if path.startswith("/v1/jobs/") and path.endswith("/metrics"):
            return 200, _series(path.split("/")[3])
        return 404, {"detail": "not found"}

    page = _open(browser, api, requests)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{ORIGIN}/#/sweeps/{SWEEP_ID}")

    expect(page.locator("#sweep-state")).to_have_text("succeeded")
    expect(page.locator("#sweep-title")).to_have_text(f"Sweep {HOSTILE}")  # as text, never markup
    rows = page.locator("#sweep-trials tr")
    expect(rows).to_have_count(4)
    assert [rows.nth(i).get_attribute("data-trial") for i in range(4)] == ["1", "3", "0", "2"]
    expect(rows.nth(0).locator(".badge.best")).to_have_text("best")
    expect(page.locator("#sweep-trials .badge.best")).to_have_count(1)
    expect(rows.nth(3).locator("[data-status]")).to_have_text("pruned")
    expect(rows.nth(1)).to_contain_text(HOSTILE)
    expect(page.locator("#sweep-trials-table thead")).to_contain_text("hyperparameters.lr")

    # The best trials with an objective, best first, in the compare view's own link format.
    href = page.locator("#sweep-compare").get_attribute("href")
    assert href == "#/compare?ids=job0001abcdef,job0003abcdef,job0000abcdef", href

    # One objective line per trial with points, the objective asked for by name; one scatter a parameter.
    expect(page.locator('[data-chart="sweep-objective"]')).to_have_attribute("data-series", "4")
    metrics = [r for r in requests if "/metrics?" in r]
    assert len(metrics) >= 4 and all("name=eval%2Floss" in r for r in metrics), requests
    scatters = page.locator('[data-chart="sweep-scatter"]')
    expect(scatters).to_have_count(2)
    for i in range(2):
        expect(scatters.nth(i)).to_have_attribute("data-points", "3")  # the pruned trial has no objective
        expect(scatters.nth(i).locator("canvas")).to_have_count(1)
    assert page.evaluate("window.pwned") is None
    REPORTS.mkdir(exist_ok=True)
    page.screenshot(path=str(REPORTS / "dashboard-sweep.png"), full_page=True)

    # Every trial is a job labelled sweep=<id>: the job list's own label filter lists them.
    assert page.locator("#sweep-jobs").get_attribute("href") == f"#/?label=sweep%3D{SWEEP_ID}"

    # The link opens the compare view that exists, with the ids it was given.
    page.locator("#sweep-compare").click()
    expect(page.locator("#compare-jobs")).to_be_attached()
    assert errors == [], errors
    page.close()


@pytest.mark.parametrize(
    ("status", "body", "shown"),
    [
        (404, {"detail": "sweep not found"}, "404 sweep not found"),
        (404, {"detail": "Not Found"}, "404 Not Found"),  # an API without sweeps at all
        (502, "bad gateway", "502"),
    ],
)
def test_a_missing_sweep_or_api_shows_the_error(browser: Browser, status: int, body: Any, shown: str) -> None:
    requests: list[str] = []
    page = _open(browser, lambda _path, _q: (status, body), requests)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{ORIGIN}/#/sweeps/{SWEEP_ID}")
    expect(page.locator("#sweep-error")).to_contain_text("Could not load the sweep")
    expect(page.locator("#sweep-error")).to_contain_text(shown)
    expect(page.locator("#sweep-trials tr")).to_have_count(0)
    assert errors == [] and requests == [f"/v1/sweeps/{SWEEP_ID}?"], (errors, requests)
    page.close()


def test_a_sweep_that_failed_on_its_own_says_why(browser: Browser) -> None:
    failed = {**SWEEP, "state": "failed", "error": f"trial 4's submit was refused (403): {HOSTILE}"}
    page = _open(browser, lambda path, _q: (200, failed) if path.startswith("/v1/sweeps/") else (200, {}), [])
    page.goto(f"{ORIGIN}/#/sweeps/{SWEEP_ID}")
    expect(page.locator("#sweep-state")).to_have_text("failed")
    expect(page.locator("#sweep-failure")).to_have_text(failed["error"])  # as text, never markup
    assert page.evaluate("window.pwned") is None
    page.close()
