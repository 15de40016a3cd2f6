"""Evaluation figures and best checkpoints from the ranks' events to the API, on both databases.

The reporter marks a best checkpoint and clears the previous one in the batch's transaction; the
resync before a restart takes the mark from the engine's `best-step` file; `eval/<name>` series
(a `/` in the name) go through every metric path: rows, series, name filters, rollups, the job's
latest metrics and the event stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from rank_contract.layout import RunFiles
from service.jobs import downsample_repository, repository
from service.jobs.metrics_repository import downsample, metric_series
from service.models import Job
from tests.api_fixtures import submit
from tests.backends import BACKENDS, client_on, sessions_of
from workers.attempt.checkpoint_rows import sync_checkpoints
from workers.attempt.node_run import Attempt
from workers.engine.checkpoint import CheckpointManager, best_marker, checkpoint_name
from workers.engine.events import CheckpointEvent, EventWriter, MetricsEvent
from workers.reporting.reporter import Reporter

TOKEN = "t" * 32


@pytest.fixture(params=BACKENDS)
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    """An admin's client of the app on PostgreSQL (rolled back) or a fresh SQLite file."""
    yield from client_on(request, tmp_path)


def _running(client: TestClient, sessions: sessionmaker[Session], *, attempt: int = 1) -> str:
    job_id = str(submit(client)["id"])
    with sessions.begin() as s:
        s.query(Job).filter_by(id=job_id).update(
            {"status": JobStatus.RUNNING.value, "attempt": attempt, "claim_token": TOKEN}
        )
    return job_id


def _saved(directory: Path, step: int, **fields: Any) -> CheckpointEvent:
    """A checkpoint file with its sidecar (what the resync verifies), and the event of saving it."""
    path = directory / checkpoint_name(step)
    path.write_bytes(b"weights %d" % step)
    digest = f"{step:064d}"
    CheckpointManager.sidecar_for(path).write_text(f"{digest}  {path.name}\n")
    return CheckpointEvent(step=step, size_bytes=path.stat().st_size, sha256=digest, **fields)


def _report(sessions: sessionmaker[Session], job_id: str, run_dir: Path, *events: Any) -> Reporter:
    """Write `events` as rank 0 and ship them in one batch (one transaction); files in run_dir/../ckpt."""
    writer = EventWriter(RunFiles(run_dir).rank_events(0), 0)
    writer.emit_many(list(events))
    writer.close()
    reporter = Reporter(
        sessions=sessions,
        job_id=job_id,
        attempt=1,
        claim_token=TOKEN,
        run_dir=run_dir,
        checkpoint_dir=run_dir.parent / "ckpt",
    )
    reporter.collect()
    assert reporter.flush(), "the batch must commit"
    return reporter


def _best_steps(client: TestClient, job_id: str) -> list[int]:
    items = client.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
    return [c["step"] for c in items if c["best"]]


def test_a_new_best_checkpoint_takes_the_mark_from_the_previous_one(api: TestClient, tmp_path: Path) -> None:
    sessions = sessions_of(api)
    job_id = _running(api, sessions)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    # One batch: a best at step 2, a plain save at 4; then a new best at 6 that prunes step 4.
    _report(sessions, job_id, run_a, _saved(ckpt, 2, best=True), _saved(ckpt, 4))
    assert _best_steps(api, job_id) == [2], "a checkpoint saved as the best is listed best"
    _report(sessions, job_id, run_b, _saved(ckpt, 6, best=True, deleted=[4]))
    items = api.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
    assert [(c["step"], c["best"]) for c in items] == [(2, False), (6, True)], (
        f"expected the new best marked, the previous one cleared and the pruned one gone: {items}"
    )


def test_the_resync_before_a_restart_takes_the_mark_from_the_best_step_file(
    api: TestClient, tmp_path: Path
) -> None:
    sessions = sessions_of(api)
    job_id = _running(api, sessions, attempt=2)
    # Attempt 1 reported step 2 as its best, then (killed before its events were read) saved steps
    # 4 and 6, of which 4 became the best: only the marker file says so.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _report(sessions, job_id, tmp_path / "run1", _saved(ckpt, 2, best=True))
    _saved(ckpt, 4)
    _saved(ckpt, 6)
    best_marker(ckpt).write_text("4\n")
    att = Attempt(job_id=job_id, number=2, token=TOKEN, max_restarts=1)
    sync_checkpoints(sessions, att=att, directory=ckpt, attempt=1)
    items = api.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
    assert [(c["step"], c["best"]) for c in items] == [(2, False), (4, True), (6, False)], items

    # The best file pruned by hand (the marker now names nothing): no checkpoint is the best.
    (ckpt / checkpoint_name(4)).unlink()
    sync_checkpoints(sessions, att=att, directory=ckpt, attempt=1)
    assert _best_steps(api, job_id) == [], "a marker naming a missing file marks nothing"


def test_eval_series_go_through_every_metric_path(api: TestClient, tmp_path: Path) -> None:
    sessions = sessions_of(api)
    job_id = _running(api, sessions)
    steps = (10, 20, 30)
    events = [MetricsEvent(step=s, values={"loss": 3.0 / s, "lr": 0.1}) for s in range(1, 31)]
    events += [MetricsEvent(step=s, values={"eval/loss": 2.0 / s, "eval/accuracy": s / 40}) for s in steps]
    _report(sessions, job_id, tmp_path / "run", *sorted(events, key=lambda e: e.step))

    want = {"eval/accuracy": [[s, s / 40] for s in steps], "eval/loss": [[s, 2.0 / s] for s in steps]}
    url = f"/v1/jobs/{job_id}/metrics"
    series = api.get(url).json()["series"]
    assert {k: v for k, v in series.items() if k.startswith("eval/")} == want, series
    got = api.get(url, params={"name": "eval/loss,eval/accuracy", "since_step": 10}).json()["series"]
    assert got == {k: v[1:] for k, v in want.items()}, f"a name filter and since_step on eval/: {got}"
    got = api.get(f"{url}?name=eval%2Floss&max_points=2").json()["series"]
    assert got == {"eval/loss": [[10, 0.2], [30, 2.0 / 30]]}, f"an encoded name, downsampled: {got}"
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["latest_metrics"] == {"loss": 0.1, "lr": 0.1, "eval/loss": 2.0 / 30, "eval/accuracy": 0.75}

    with sessions.begin() as s:
        s.query(Job).filter_by(id=job_id).update({"status": JobStatus.SUCCEEDED.value})
    with api.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert any('"eval/loss":[[10,0.2]' in line for line in lines), f"eval/loss in the event stream: {lines}"


def test_a_dense_eval_series_is_downsampled_from_its_rollups(client: TestClient, db: Session) -> None:
    job_id = submit(client)["id"]
    name = "eval/top-5.acc"
    points = [(s, float((s * 7919) % 101)) for s in range(8192)]
    repository.add_metrics(
        db, rows=[{"job_id": job_id, "attempt": 1, "name": name, "step": s, "value": v} for s, v in points]
    )
    direct = downsample_repository.downsampled(
        db, job_id=job_id, name=name, lo=0, hi=8191, max_points=64, up_to_id=None
    )
    want = downsample(points, max_points=64)
    assert direct == want, "the rollups of a series named eval/... answer as the raw points do"
    got = metric_series(db, job_id=job_id, since_step=None, names=[name], max_points=64)
    assert got == {name: want}
