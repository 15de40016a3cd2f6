"""The CLI's read commands: `--output json` everywhere, log lines whole and inert, download, watch."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_schemas import JobStatus
from rank_contract.layout import JobFiles
from service.jobs import lifecycle
from service.models import Checkpoint, Job, LogLine, Metric
from tests.api_fixtures import register_node
from tests.backends import sessions_of
from tests.cli.conftest import dptrain
from workers.attempt.outputs import Limits, record

# A traceback line a user's code may print: rich markup, a link, an escape sequence, a C1 CSI.
HOSTILE = "KeyError: '[/]' [bold red]x[/] [link=http://evil]click[/link] \x1b]0;pwned\x07\x1b[2J\x9b31m end"
LONG = "step 7 " + "x" * 400


@pytest.fixture
def job_id(api: TestClient, spec_file: Callable[..., Path]) -> str:
    """A submitted job."""
    r = dptrain("submit", spec_file(name="read-me"))
    assert r.exit_code == 0, r.output
    return r.stdout.strip()


def add_rows(api: TestClient, *rows: Any) -> None:
    """Write `rows` (log lines, metrics, checkpoints) as the worker's reporter would."""
    with sessions_of(api).begin() as s:
        s.add_all(rows)


def test_log_lines_are_printed_whole_and_inert(api: TestClient, job_id: str) -> None:
    add_rows(
        api,
        LogLine(job_id=job_id, attempt=1, rank=0, line=HOSTILE),
        LogLine(job_id=job_id, attempt=1, rank=1, line=LONG),
        LogLine(job_id=job_id, attempt=1, rank=None, line="launcher\tdone"),
    )
    r = dptrain("logs", job_id)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    expected = "KeyError: '[/]' [bold red]x[/] [link=http://evil]click[/link] ]0;pwned[2J31m end"
    assert lines == [f"rank0 {expected}", f"rank1 {LONG}", "launcher launcher\tdone"], lines
    assert "\x1b" not in r.stdout and "\x9b" not in r.stdout and "\x07" not in r.stdout

    r = dptrain("logs", job_id, "--rank", "1", "--output", "json")
    (record,) = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert record["line"] == LONG and record["rank"] == 1


def test_every_read_command_speaks_json(api: TestClient, job_id: str) -> None:
    status = json.loads(dptrain("status", job_id, "--output", "json").stdout)
    assert status["id"] == job_id and status["status"] == "queued" and status["spec"]["name"] == "read-me"
    listed = json.loads(dptrain("list", "--output", "json").stdout)
    assert [j["id"] for j in listed] == [job_id]
    assert json.loads(dptrain("checkpoints", job_id, "--output", "json").stdout) == []
    cancelled = json.loads(dptrain("cancel", job_id, "--output", "json").stdout)
    assert cancelled["status"] == "cancelled"
    text = dptrain("status", job_id)
    assert text.exit_code == 0 and f"{job_id}  read-me  cancelled  step 0/4" in text.stdout, text.stdout


def test_list_pages_through_to_the_limit(api: TestClient, spec_file: Callable[..., Path]) -> None:
    ids = [dptrain("submit", spec_file(name=f"job-{i}")).stdout.strip() for i in range(3)]
    listed = json.loads(dptrain("list", "--limit", "2", "--output", "json").stdout)
    assert [j["id"] for j in listed] == ids[::-1][:2], "newest first, as many as asked"
    table = dptrain("list").stdout
    assert all(i in table for i in ids), table


def test_download_writes_the_checkpoint_of_a_step(api: TestClient, job_id: str, tmp_path: Path) -> None:
    root = Path(api.app.state.settings.artifacts)
    files = {}
    for step in (2, 4):
        path = root / "jobs" / job_id / "checkpoints" / f"ckpt-{step:09d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"state at {step}".encode())
        files[step] = path
    add_rows(
        api,
        *(
            Checkpoint(
                job_id=job_id,
                attempt=1,
                step=step,
                path=str(path),
                size_bytes=path.stat().st_size,
                sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
            )
            for step, path in files.items()
        ),
    )
    out = tmp_path / "model.pt"
    r = dptrain("download", job_id, "--step", "2", "-o", out)
    assert r.exit_code == 0 and out.read_bytes() == b"state at 2", r.output
    r = dptrain("download", job_id, "-o", out, "--output", "json")
    assert json.loads(r.stdout)["checkpoint"]["step"] == 4 and out.read_bytes() == b"state at 4"
    r = dptrain("download", job_id, "--step", "3", "-o", tmp_path / "none.pt")
    assert r.exit_code == 3 and "no checkpoint at step 3" in r.stderr and not (tmp_path / "none.pt").exists()

    files[4].write_bytes(b"corrupted")
    r = dptrain("download", job_id, "-o", out)
    assert r.exit_code != 0 and out.read_bytes() == b"state at 4", "a bad download never replaces the file"


def test_watch_follows_to_the_end_and_exits_like_wait(
    api: TestClient, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def sleep(_seconds: float) -> None:
        with sessions_of(api).begin() as s:
            s.add(Metric(job_id=job_id, attempt=1, name="loss", step=4, value=0.125))
            lifecycle.transition(s, job_id=job_id, src=JobStatus.QUEUED, dst=JobStatus.RUNNING)
            lifecycle.transition(
                s,
                job_id=job_id,
                src=JobStatus.RUNNING,
                dst=JobStatus.SUCCEEDED,
                values={"step": 4, "latest_metrics": {"loss": 0.125}},
            )

    monkeypatch.setattr("dptrain.client.time.sleep", sleep)
    r = dptrain("watch", job_id)
    assert r.exit_code == 0, r.output
    assert "succeeded" in r.stdout and "loss" in r.stdout and "0.125" in r.stdout, r.stdout


def test_a_job_no_node_can_hold_warns_and_ends_wait_with_exit_5(
    api: TestClient, spec_file: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dptrain.client.time.sleep", lambda _s: None)
    r = dptrain("submit", spec_file(), "--wait", "--unplaceable-timeout", "0", "--timeout", "60")
    assert r.exit_code == 5, r.output
    said = " ".join(r.stderr.split())
    assert "warning: no live node" in said and "stays queued" in said, r.stderr
    job = api.get(f"/v1/jobs/{r.stdout.strip()}").json()
    assert job["status"] == "queued" and job["unplaceable"] is True


def test_status_says_where_a_queued_job_stands(api: TestClient, spec_file: Callable[..., Path]) -> None:
    register_node(sessions_of(api), name="roomy", slots=8)
    first, second = (dptrain("submit", spec_file(name=n)).stdout.strip() for n in ("one", "two"))
    text = dptrain("status", second)
    assert text.exit_code == 0 and "queued: #2 in the cpu queue" in text.stdout, text.stdout


def test_status_names_the_error_type_and_rank_and_whether_the_job_restarts(
    api: TestClient, job_id: str
) -> None:
    error = {"type": "ProcessKilled", "message": "rank 1 was killed by SIGKILL", "rank": 1, "traceback": None}
    with sessions_of(api).begin() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.error = error
    text = dptrain("status", job_id)
    assert "restarting after: ProcessKilled on rank 1: rank 1 was killed by SIGKILL" in text.stdout, (
        text.stdout
    )
    with sessions_of(api).begin() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.status, job.error = "failed", {**error, "type": "AssertionError", "message": "assert 64 % 3 == 0"}
    text = dptrain("status", job_id)
    assert "error: AssertionError on rank 1: assert 64 % 3 == 0" in text.stdout, text.stdout


def test_artifacts_are_listed_and_downloaded_checked(api: TestClient, job_id: str, tmp_path: Path) -> None:
    out = JobFiles(Path(api.app.state.settings.artifacts), job_id).outputs
    (out / "samples").mkdir(parents=True)
    (out / "samples" / "[bold]a.txt").write_bytes(b"generated text")
    limits = Limits(max_bytes=1 << 20, max_files=10)
    assert record(sessions_of(api), job_id=job_id, attempt=1, directory=out, limits=limits) is None
    r = dptrain("artifacts", job_id)
    assert r.exit_code == 0, r.output
    assert "samples/[bold]a.txt" in r.stdout, "a path the script named is shown as it is"
    listed = json.loads(dptrain("artifacts", job_id, "--output", "json").stdout)
    sha256 = hashlib.sha256(b"generated text").hexdigest()
    assert listed == [{"path": "samples/[bold]a.txt", "size_bytes": 14, "sha256": sha256}]
    dest = tmp_path / "got.txt"
    r = dptrain("download", job_id, "--artifact", "samples/[bold]a.txt", "-o", dest)
    assert r.exit_code == 0, r.output
    assert dest.read_bytes() == b"generated text"
    r = dptrain("download", job_id, "--artifact", "nope.bin", "-o", tmp_path / "nope")
    assert r.exit_code == 3 and "no artifact" in r.stderr, r.output
    assert not (tmp_path / "nope").exists()
