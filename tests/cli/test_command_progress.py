"""A job without a total (a command that set no `hyperparameters.steps`): its step, never a fraction."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

import pytest
import yaml
from fastapi.testclient import TestClient
from rich.console import Console

from api_schemas import Job, JobStatus
from dptrain_cli.follow import Progress, render
from dptrain_cli.junit import junit_report
from service.jobs import lifecycle
from tests.backends import sessions_of
from tests.cli.conftest import dptrain, flat

COMMAND: dict[str, Any] = {"name": "script", "command": ["python", "-m", "team.train"]}


def submit(tmp_path: Path, spec: dict[str, Any]) -> str:
    """`dptrain submit` of `spec`; the job's id."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = dptrain("submit", path)
    assert r.exit_code == 0, r.output
    return r.stdout.strip()


def succeed(api: TestClient, job_id: str, *, step: int) -> None:
    """End the job as its worker would, at `step`."""
    with sessions_of(api).begin() as s:
        lifecycle.transition(s, job_id=job_id, src=JobStatus.QUEUED, dst=JobStatus.RUNNING)
        lifecycle.transition(
            s, job_id=job_id, src=JobStatus.RUNNING, dst=JobStatus.SUCCEEDED, values={"step": step}
        )


def test_status_list_and_watch_show_the_step_without_a_total(
    api: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = submit(tmp_path, COMMAND)
    status = flat(dptrain("status", job_id).stdout)
    assert "queued step 0 attempt 0" in status and "/100" not in status, status
    listed = flat(dptrain("list").stdout)
    assert "│ queued │ 0 │" in listed and "0/" not in listed, listed
    monkeypatch.setattr("dptrain.client.time.sleep", lambda _s: succeed(api, job_id, step=12))
    watched = dptrain("watch", job_id)
    assert watched.exit_code == 0, watched.output
    assert "step 12" in watched.stdout and "12/" not in watched.stdout, watched.stdout


def test_a_command_that_sets_steps_shows_its_fraction(api: TestClient, tmp_path: Path) -> None:
    job_id = submit(tmp_path, {**COMMAND, "hyperparameters": {"steps": 40}})
    assert "step 0/40" in flat(dptrain("status", job_id).stdout)
    assert "0/40" in flat(dptrain("list").stdout)


def job(total: int | None, *, step: int = 7) -> Job:
    """A running command job at `step` of `total`."""
    now = "2026-11-26T09:00:00Z"
    return Job.model_validate(
        {
            "id": "j1",
            "name": "script",
            "status": "running",
            "spec": COMMAND,
            "owner": "admin",
            "created_at": now,
            "updated_at": now,
            "started_at": now,
            "finished_at": None,
            "progress": {"step": step, "total_steps": total},
            "attempt": 1,
            "error": None,
        }
    )


def shown(renderable: Any) -> str:
    """What rich prints for `renderable`, as plain text."""
    console = Console(width=100, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_the_watch_view_draws_no_fraction_without_a_total() -> None:
    assert "step 7" in shown(render(job(None), {})) and "/" not in shown(render(job(None), {}))
    assert "7/50" in shown(render(job(50), {}))


def test_the_wait_bar_counts_steps_without_a_total() -> None:
    for total, want in ((None, "━ 7 0:00"), (50, " 7/50 0:00")):
        bar = Progress(job(total))
        bar.update(job(total))
        task = bar.bar.tasks[0]
        assert task.total == total, task
        text = shown(bar.bar.get_renderable())
        assert want in text, text
        assert (total is None) == ("/" not in text), text


def test_the_junit_summary_has_no_invented_total() -> None:
    for total, want in ((None, "job j1 running at step 7"), (50, "job j1 running at step 7/50")):
        report = junit_report(job(total).model_dump(mode="json"), elapsed=1.0, timed_out=False)
        assert ET.fromstring(report).findtext("testcase/system-out") == want, report
