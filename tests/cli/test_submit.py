"""`dptrain submit --wait` exits by how the job ended, and writes a JUnit report of it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from api_schemas import JobStatus
from service.jobs import lifecycle
from service.models import Job
from tests.backends import sessions_of
from tests.cli.conftest import dptrain, flat

FAILURE = {"type": "ValueError", "message": "bad batch", "rank": 1, "traceback": "Traceback\nValueError: bad"}


def finish_on_first_poll(
    monkeypatch: pytest.MonkeyPatch, api: TestClient, status: JobStatus | None, **values: Any
) -> None:
    """The CLI's first wait between polls starts the job and ends it in `status` (None: never)."""

    def sleep(_seconds: float) -> None:
        if status is None:
            return
        with sessions_of(api).begin() as s:
            job_id = s.scalars(select(Job.id)).one()
            lifecycle.transition(s, job_id=job_id, src=JobStatus.QUEUED, dst=JobStatus.RUNNING)
            lifecycle.transition(s, job_id=job_id, src=JobStatus.RUNNING, dst=status, values=values)

    monkeypatch.setattr("dptrain_cli.main.time.sleep", sleep)


@pytest.mark.parametrize(
    ("status", "values", "code"),
    [
        (JobStatus.SUCCEEDED, {"step": 4, "latest_metrics": {"loss": 0.25}}, 0),
        (JobStatus.FAILED, {"error": FAILURE}, 1),
        (JobStatus.CANCELLED, {}, 4),
    ],
)
def test_wait_exits_by_how_the_job_ended(
    api: TestClient,
    monkeypatch: pytest.MonkeyPatch,
    spec_file: Callable[..., Path],
    tmp_path: Path,
    status: JobStatus,
    values: dict[str, Any],
    code: int,
) -> None:
    finish_on_first_poll(monkeypatch, api, status, **values)
    report = tmp_path / "report.xml"
    r = dptrain("submit", spec_file(name="ci-run"), "--wait", "--junit", report)
    assert r.exit_code == code, f"{status.value}: expected exit {code}, got {r.exit_code}: {r.output}"
    job_id = r.stdout.splitlines()[0]
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == status.value
    case = ET.parse(report).getroot().find("testcase")
    assert case is not None and case.get("name") == job_id and case.get("classname") == "dptrain.ci-run"
    children = {c.tag: c for c in case}
    if status is JobStatus.SUCCEEDED:
        assert set(children) == {"system-out"} and "loss = 0.25" in (children["system-out"].text or "")
    elif status is JobStatus.FAILED:
        assert children["failure"].get("type") == "ValueError" and "ValueError: bad" in flat(r.stderr), (
            r.output
        )
    else:
        assert children["failure"].get("type") == "Cancelled"


def test_a_timeout_exits_2_says_the_job_keeps_running_and_reports_an_error(
    api: TestClient, monkeypatch: pytest.MonkeyPatch, spec_file: Callable[..., Path], tmp_path: Path
) -> None:
    finish_on_first_poll(monkeypatch, api, None)
    report = tmp_path / "report.xml"
    r = dptrain("submit", spec_file(), "--wait", "--timeout", "0.01", "--junit", report)
    assert r.exit_code == 2, r.output
    job_id = r.stdout.strip()
    said = flat(r.stderr)
    assert "keeps running" in said and f"dptrain cancel {job_id} stops it" in said, r.stderr
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "queued", "a timeout does not cancel the job"
    case = ET.parse(report).getroot().find("testcase")
    assert case is not None and [c.tag for c in case] == ["error", "system-out"]
    assert case[0].get("type") == "Timeout"


def test_a_spec_the_api_refuses_exits_3_and_submits_nothing(
    api: TestClient, spec_file: Callable[..., Path], tmp_path: Path
) -> None:
    report = tmp_path / "report.xml"
    r = dptrain("submit", spec_file(recipe="no-such-recipe"), "--wait", "--junit", report)
    assert r.exit_code == 3 and "unknown recipe" in flat(r.stderr), r.output
    assert api.get("/v1/jobs").json()["items"] == [] and not report.exists()


def test_junit_without_wait_is_refused_before_anything_is_sent(
    api: TestClient, spec_file: Callable[..., Path], tmp_path: Path
) -> None:
    r = dptrain("submit", spec_file(), "--junit", tmp_path / "report.xml")
    assert r.exit_code == 3 and "--junit needs --wait" in flat(r.stderr), r.output
    assert api.get("/v1/jobs").json()["items"] == []


def test_without_wait_the_id_is_all_stdout_holds(api: TestClient, spec_file: Callable[..., Path]) -> None:
    r = dptrain("submit", spec_file())
    assert r.exit_code == 0, r.output
    assert api.get(f"/v1/jobs/{r.stdout.strip()}").json()["status"] == "queued", r.stdout


def test_a_failed_job_s_error_prints_verbatim_and_inert(
    api: TestClient, monkeypatch: pytest.MonkeyPatch, spec_file: Callable[..., Path]
) -> None:
    # What a rank's error may hold: rich markup (a `[/]` would raise MarkupError or hide what follows),
    # an escape sequence clearing the screen, a window title, a one-byte CSI.
    message = "'[/]' \x1b[31mred[/red]"
    traceback = "\n".join(
        [
            "Traceback (most recent call last):",
            '  File "t.py", line 3',
            "KeyError: '[/]' \x1b[2J\x1b]0;t\x07\x9b1m end",
        ]
    )
    error = {"type": "KeyError", "message": message, "rank": 0, "traceback": traceback}
    finish_on_first_poll(monkeypatch, api, JobStatus.FAILED, error=error)
    expected = [
        "KeyError on rank 0: '[/]' [31mred[/red]",
        "Traceback (most recent call last):",
        '  File "t.py", line 3',
        "KeyError: '[/]' [2J]0;t1m end",
    ]
    r = dptrain("submit", spec_file(name="hostile"), "--wait")
    assert r.exit_code == 1, r.output
    assert "\n".join(expected) in r.stderr, f"expected the error whole on stderr:\n{r.stderr}"
    job_id = r.stdout.splitlines()[0]
    assert r.stdout.splitlines()[1:] == [f"job {job_id} failed at step 0"], r.stdout
    shown = dptrain("status", job_id)
    assert shown.exit_code == 0, shown.output
    assert "\n".join(["error: " + expected[0], *expected[1:]]) in shown.stdout, shown.stdout
    for text in (r.stdout, r.stderr, shown.stdout):
        assert not {"\x1b", "\x07", "\x9b"} & set(text), repr(text)
