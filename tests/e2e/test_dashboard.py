"""The dashboard in a real browser: Playwright drives Debian's Chromium against a Redis + PostgreSQL stack.

The stack has one worker with one slot, which makes the story deterministic: a long job holds the slot
(running), a short job submitted after it waits (queued), the long job is cancelled from its detail page,
and the short one then runs to `succeeded` while the list page watches. The short one evaluates and keeps
its best checkpoint: its page draws the evaluation chart and badges the best checkpoint, where the long
one's says it has no evaluation. A second test compares two runs that differ in their learning rate.
Screenshots go to test-reports/.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.api_fixtures import ADMIN_TOKEN
from tests.conftest import job_spec
from tests.e2e.helpers import ROOT
from tests.e2e.stack import Stack

pytestmark = pytest.mark.e2e

REPORTS = ROOT / "test-reports"
LOSS_RGB = (37, 99, 235)  # the loss series' stroke, #2563eb in detail.js
EVAL_LOSS_RGB = (220, 38, 38)  # eval/loss, the evaluation chart's first series: #dc2626 in detail.js
DATA_WAIT_RGB = (180, 83, 9)  # data_wait_s, #b45309 in detail.js
COMPARE_RGB = [(37, 99, 235), (220, 38, 38)]  # the first two jobs' colours in compare.js: #2563eb, #dc2626

# Counts canvas pixels of one colour: the series line, not the axes and grid uPlot also draws.
_COUNT_PIXELS = """([selector, rgb]) => {
  const canvas = document.querySelector(selector + ' canvas');
  if (!canvas) return -1;
  const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  let n = 0;
  for (let i = 0; i < data.length; i += 4) {
    if (data[i + 3] > 200 && Math.abs(data[i] - rgb[0]) < 40 && Math.abs(data[i + 1] - rgb[1]) < 40
        && Math.abs(data[i + 2] - rgb[2]) < 40) n++;
  }
  return n;
}"""


def _submit(stack: Stack, name: str, *, evaluate: bool = False, **hp: Any) -> str:
    # Evaluating at the checkpoints' steps: each checkpoint is a candidate for the best one.
    evaluation = {"evaluation": {"every_steps": 20, "max_batches": 2}} if evaluate else {}
    best = {"keep_best": {"metric": "eval/loss", "mode": "min"}} if evaluate else {}
    spec = job_spec(
        name=name,
        hyperparameters={"global_batch_size": 32, "lr": 0.05, "steps": 40, **hp},
        resources={"processes_per_node": 2, "device": "cpu"},
        engine={"log_every_steps": 1},
        checkpoint={"every_steps": 20, "keep_last": 2, **best},
        labels={"suite": "dashboard"},
        **evaluation,
    )
    r = stack.http.post("/v1/jobs", json=spec)
    assert r.status_code == 201, f"expected 201 for {name}, got {r.status_code}: {r.text}"
    return str(r.json()["id"])


def _expect_status(
    stack: Stack, page: Page, job_id: str, status: str, timeout_ms: float, row: str = "tr"
) -> None:
    """Wait for the status badge of `job_id` on the page; on failure say what the job and processes said."""
    badge = page.locator(f'{row}[data-job-id="{job_id}"] .badge, .head .badge').first
    try:
        expect(badge).to_have_text(status, timeout=timeout_ms)
    except AssertionError as exc:
        job = stack.http.get(f"/v1/jobs/{job_id}").json()
        raise AssertionError(
            f"job {job_id}: expected the page to show {status!r}; the API says {job.get('status')!r}, "
            f"error {job.get('error')}\n{exc}\n{stack.procs.logs()}"
        ) from None


def _wait_for_line(
    page: Page, selector: str, what: str, timeout: float = 60, rgb: tuple[int, int, int] = LOSS_RGB
) -> int:
    deadline = time.monotonic() + timeout
    count = -1
    while time.monotonic() < deadline:
        count = page.evaluate(_COUNT_PIXELS, [selector, list(rgb)])
        if count > 50:
            return int(count)
        time.sleep(0.5)
    raise AssertionError(f"{what}: expected the line drawn in {selector} (> 50 pixels of it), got {count}")


def test_watch_cancel_and_inspect_jobs_in_the_browser(stack: Stack, browser: Browser) -> None:
    REPORTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    base = str(stack.http.base_url)

    # Nothing but the sign-in form without a token; a wrong token is refused.
    page.goto(base)
    expect(page.locator("#signin-view")).to_be_visible()
    expect(page.locator("#view")).to_be_hidden()
    page.fill("#token", "not-the-token-0123456789")
    page.click("button[type=submit]")
    expect(page.locator("#signin-error")).to_contain_text("refused")
    page.fill("#token", ADMIN_TOKEN)
    page.click("button[type=submit]")
    expect(page.locator("#jobs")).to_be_visible()

    # A command that set no hyperparameters.steps has no total: the list shows its step, no bar and
    # no fraction (never "0/100"). 64 ranks keep it queued on this one-slot worker until cancelled.
    script = {"name": "ui-script", "command": ["python", "-V"], "resources": {"processes_per_node": 64}}
    r = stack.http.post("/v1/jobs", json=script)
    assert r.status_code == 201, r.text
    script_row = page.locator(f'tr[data-job-id="{r.json()["id"]}"]')
    expect(script_row.locator(".progress-label")).to_have_text("step 0", timeout=10_000)
    expect(script_row.locator(".progress")).to_have_count(0)
    assert stack.http.post(f"/v1/jobs/{r.json()['id']}/cancel").status_code == 200

    # A long job takes the worker's only slot; a short one queues behind it.
    long_id = _submit(stack, "ui-long", steps=10_000_000)
    long_row = page.locator(f'tr[data-job-id="{long_id}"]')
    _expect_status(stack, page, long_id, "running", 60_000)
    short_id = _submit(stack, "ui-short", evaluate=True)
    short_row = page.locator(f'tr[data-job-id="{short_id}"]')
    _expect_status(stack, page, short_id, "queued", 10_000)
    expect(short_row).to_contain_text("suite=dashboard")

    # The running job's page draws its loss live; its cancel button stops it.
    long_row.locator("a").click()
    expect(page.locator(".head h1")).to_have_text("ui-long")
    _wait_for_line(page, '[data-chart="loss"]', "running job")
    expect(page.locator("#eval-note")).to_contain_text("no evaluation")
    # Its stacks button asks the worker where every rank is (py-spy, from outside the sandbox).
    page.click("#stacks-button")
    expect(page.locator("#stacks")).to_contain_text("  thread ", timeout=30_000)
    expect(page.locator("#stacks")).to_contain_text("request at")
    page.screenshot(path=str(REPORTS / "dashboard-running.png"), full_page=True)
    page.click("#cancel")
    _expect_status(stack, page, long_id, "cancelled", 30_000)
    assert stack.http.get(f"/v1/jobs/{long_id}").json()["status"] == "cancelled"

    # Back on the list, the queued job runs to the end.
    page.click('[data-nav="jobs"]')
    _expect_status(stack, page, short_id, "running", 60_000)
    _expect_status(stack, page, short_id, "succeeded", 120_000)
    expect(short_row.locator(".progress-label")).to_have_text("40/40")

    # Its page: chart, timeline, checkpoints with the recorded sha256, both ranks' logs.
    short_row.locator("a").click()
    expect(page.locator(".head .badge")).to_have_text("succeeded")
    _wait_for_line(page, '[data-chart="loss"]', "finished job")
    # How long its steps waited for data, charted beside the throughput.
    _wait_for_line(page, '[data-chart="data_wait_s"]', "finished job's data wait", rgb=DATA_WAIT_RGB)
    expect(page.locator("#timeline tr")).to_have_count(3)  # submitted -> queued, running, succeeded
    checkpoints = stack.http.get(f"/v1/jobs/{short_id}/checkpoints").json()["items"]
    steps = [c["step"] for c in checkpoints]
    assert steps == [20, 40], f"expected checkpoints at steps 20 and 40, got {checkpoints}"
    for c in checkpoints:
        expect(page.locator(f'#checkpoints tr[data-step="{c["step"]}"]')).to_contain_text(c["sha256"])
    expect(page.locator("#latest-metrics")).to_contain_text("loss")

    # Its evaluations (at steps 20 and 40) drawn beside the loss, and the better one's checkpoint
    # badged as the best.
    evals = stack.http.get(f"/v1/jobs/{short_id}/metrics", params={"name": "eval/loss"}).json()["series"]
    points = evals.get("eval/loss", [])
    assert [s for s, _ in points] == [20, 40], f"expected eval/loss at steps 20 and 40, got {evals}"
    best_step = min(points, key=lambda p: p[1])[0]
    assert [c["step"] for c in checkpoints if c["best"]] == [best_step], (
        f"expected only the checkpoint of the lowest eval/loss ({points}) best, got {checkpoints}"
    )
    _wait_for_line(page, '[data-chart="eval"]', "finished job's evaluation", rgb=EVAL_LOSS_RGB)
    expect(page.locator("#eval-note")).to_be_hidden()
    expect(page.locator("#latest-metrics")).to_contain_text("eval/loss")
    expect(page.locator(f'#checkpoints tr[data-step="{best_step}"] .badge.best')).to_have_text("best")
    expect(page.locator("#checkpoints .badge.best")).to_have_count(1)
    expect(page.locator("#logs")).to_contain_text("rank1|")
    expect(page.locator("#cancel")).to_be_hidden()
    page.screenshot(path=str(REPORTS / "dashboard.png"), full_page=True)

    # Continue: the same spec again, from its newest checkpoint (step 40: nothing left to run), on
    # a page of its own that links back to it.
    page.click("#continue")
    expect(page.locator("#init-from")).to_contain_text(f"{short_id} step 40")
    continued = stack.http.get("/v1/jobs?label=suite=dashboard").json()["items"][0]
    assert continued["spec"]["init_from"] == {"job": short_id, "step": None, "best": False, "resume": True}
    assert continued["name"] == "ui-short" and continued["init_checkpoint"]["step"] == 40, continued

    # A command's outputs: what it wrote to DPTRAIN_OUTPUT_DIR is listed on its page, with its sha256.
    writes = "import os; open(os.environ['DPTRAIN_OUTPUT_DIR'] + '/notes.txt', 'w').write('kept')"
    r = stack.http.post("/v1/jobs", json={"name": "ui-outputs", "command": ["python", "-c", writes]})
    assert r.status_code == 201, r.text
    outputs_id = r.json()["id"]
    page.goto(f"{base}#/jobs/{outputs_id}")
    expect(page.locator(".head .badge")).to_have_text("succeeded", timeout=60_000)
    kept = hashlib.sha256(b"kept").hexdigest()
    expect(page.locator('#artifacts tr[data-path="notes.txt"]')).to_contain_text(kept, timeout=10_000)

    # The worker that ran them reports in.
    page.click('[data-nav="workers"]')
    expect(page.locator("#workers-body tr").first.locator(".badge")).to_have_text("alive", timeout=30_000)
    page.screenshot(path=str(REPORTS / "dashboard-workers.png"), full_page=True)

    # Sign out: the data is gone from the page.
    page.click("#signout")
    expect(page.locator("#signin-view")).to_be_visible()
    expect(page.locator("#view")).to_be_hidden()
    assert errors == [], f"expected no script errors in the page, got {errors}"


def test_compare_two_runs_in_the_browser(stack: Stack, browser: Browser) -> None:
    REPORTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(str(stack.http.base_url))
    page.fill("#token", ADMIN_TOKEN)
    page.click("button[type=submit]")

    # Two runs that differ in their learning rate only (and name); the worker runs one after the other.
    low = _submit(stack, "ui-lr-low", evaluate=True, lr=0.05)
    high = _submit(stack, "ui-lr-high", evaluate=True, lr=0.1)
    compare = page.locator("#compare")
    page.locator(f'tr[data-job-id="{low}"] input.pick').check()
    expect(compare).to_be_disabled()
    page.locator(f'tr[data-job-id="{high}"] input.pick').check()
    expect(compare).to_have_text("Compare (2)")
    expect(page.locator(f'tr[data-job-id="{low}"] input.pick')).to_be_checked()  # kept across redraws
    page.screenshot(path=str(REPORTS / "dashboard-compare-pick.png"))
    compare.click()
    expect(page).to_have_url(re.compile(re.escape(f"#/compare?ids={low},{high}") + "$"))

    # Opened while the second one still waits for the slot, the page follows both to the end: the
    # loss of each is drawn as it comes.
    loss = page.locator('[data-chart="compare-loss"]')
    for job_id in (low, high):
        _expect_status(stack, page, job_id, "succeeded", 180_000, row="#compare-jobs tr")
    expect(loss).to_have_attribute("data-series", "2")

    # The address reloads to the same comparison: a loss line per job and, evaluation being the first
    # figure offered, an eval/loss line per job.
    page.reload()
    expect(loss).to_have_attribute("data-series", "2")
    expect(loss.locator(".u-legend .u-series")).to_have_count(3)  # step, and one per job
    expect(loss.locator(".u-legend")).to_contain_text(f"ui-lr-low ({low[:8]})")
    expect(loss.locator(".u-legend")).to_contain_text(f"ui-lr-high ({high[:8]})")
    expect(page.locator("#compare-metric")).to_have_value("eval/loss")
    expect(page.locator('[data-chart="compare-metric"]')).to_have_attribute("data-series", "2")
    for i, rgb in enumerate(COMPARE_RGB):
        _wait_for_line(page, '[data-chart="compare-loss"]', f"compared job {i}'s loss", rgb=rgb)
        _wait_for_line(page, '[data-chart="compare-metric"]', f"compared job {i}'s eval/loss", rgb=rgb)

    # What changed: the learning rate, with each job's value; what did not is only counted.
    lr_row = page.locator('#compare-diff tr[data-path="hyperparameters.lr"]')
    expect(lr_row.locator("td")).to_have_text(["hyperparameters.lr", "0.05", "0.1"])
    expect(page.locator('#compare-diff tr[data-path="hyperparameters.steps"]')).to_have_count(0)
    expect(page.locator("#compare-diff tbody tr")).to_have_count(1)
    expect(page.locator("#compare-same")).to_contain_text("settings identical in all 2 jobs")
    page.screenshot(path=str(REPORTS / "dashboard-compare.png"), full_page=True)
    # One job is no comparison: the page says what to do instead of drawing one line.
    page.goto(f"{stack.http.base_url}#/compare?ids={low}")
    expect(page.locator("#view")).to_contain_text("Pick two or more jobs")
    expect(page.locator('[data-chart="compare-loss"]')).to_have_count(0)
    assert errors == [], f"expected no script errors in the page, got {errors}"
