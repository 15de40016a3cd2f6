"""What a rank writes never wedges its job's reports on PostgreSQL (issue 38, finding 3).

A NUL in one printed line used to make every report batch fail and retry forever: nothing stored,
the cancel never read. These run the reporter against the real PostgreSQL of the test run: bytes
from ranks arrive escaped; a row the database refuses anyway is dropped with one note and the
rest of its batch stored; an outage still keeps the batch; a cancel is read whatever the batch did.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from rank_contract.layout import RunFiles
from service.db import make_engine
from service.models import Job, JobTransition, LogLine, Metric
from tests.conftest import free_port, job_spec
from workers.attempt import end, watch
from workers.attempt.node_run import Attempt
from workers.reporting import reporter as reporting
from workers.reporting.reporter import Reporter

SPEC = job_spec(name="bytes", hyperparameters={"global_batch_size": 4, "steps": 3})
TOKEN = "t" * 32


def _running(client: TestClient, db: Session) -> str:
    """A job running its first attempt, with the timeline entry that started it."""
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    db.query(Job).filter_by(id=job_id).update(
        {"status": JobStatus.RUNNING.value, "attempt": 1, "claim_token": TOKEN}
    )
    db.add(JobTransition(job_id=job_id, from_status="queued", to_status="running", attempt=1))
    db.commit()
    return job_id


def _reporter(sessions: sessionmaker[Session], job_id: str, run_dir: Path, **kw: Any) -> Reporter:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    RunFiles(run_dir).rank_events(0).parent.mkdir(parents=True, exist_ok=True)
    return Reporter(sessions=sessions, job_id=job_id, attempt=1, claim_token=TOKEN, run_dir=run_dir, **kw)


def _append(run_dir: Path, *, log: bytes = b"", events: list[dict[str, Any]] | None = None) -> None:
    with (run_dir / "logs" / "rank0.log").open("ab") as f:
        f.write(log)
    with RunFiles(run_dir).rank_events(0).open("a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events or []))


def _lines(db: Session, job_id: str) -> list[str]:
    db.expire_all()
    return [ln.line for ln in db.query(LogLine).filter_by(job_id=job_id).order_by(LogLine.id)]


def _points(db: Session, job_id: str) -> list[tuple[str, int]]:
    return sorted((m.name, m.step) for m in db.query(Metric).filter_by(job_id=job_id))


def _reason(db: Session, job_id: str) -> str:
    db.expire_all()
    started = db.query(JobTransition).filter_by(job_id=job_id, to_status="running").one()
    return started.reason or ""


def test_control_bytes_from_a_rank_are_stored_escaped_and_progress_moves(
    client: TestClient, sessions: sessionmaker[Session], db: Session, tmp_path: Path
) -> None:
    job_id = _running(client, db)
    reporter = _reporter(sessions, job_id, tmp_path)
    _append(
        tmp_path,
        log=b"x\x00y \x1b[2J\x07 del\x7f \xc2\x85 end\n",
        events=[
            {"type": "metrics", "step": 1, "values": {"loss\u0000evil": 1.5, "ok": 2.0}},
            {"type": "metrics", "step": 2, "values": {"ok": 3.0}},
            {"type": "warning", "rank": 0, "message": "careful\u0000\u001b[31m"},
            {
                "type": "error",
                "rank": 0,
                "error_type": "Bad\u0000",
                "message": "m\u0000",
                "traceback": "a\nb\u0000",
            },
        ],
    )
    reporter.collect()
    assert reporter.flush(), "a batch holding a rank's NUL bytes must be stored, not retried forever"

    assert _lines(db, job_id) == ["x\\x00y \\x1b[2J\\x07 del\\x7f \\x85 end"]
    assert _points(db, job_id) == [("loss\\x00evil", 1), ("ok", 1), ("ok", 2)]
    job = db.get(Job, job_id)
    assert job is not None and job.step == 2, "the job's progress moves"
    assert job.latest_metrics == {"loss\\x00evil": 1.5, "ok": 3.0}, job.latest_metrics
    assert "careful\\x00\\x1b[31m" in _reason(db, job_id), _reason(db, job_id)

    # The rank's error becomes the job's: stored escaped too, at the attempt's end.
    error = reporter.root_error()
    assert error is not None
    att = Attempt(job_id=job_id, number=1, token=TOKEN, max_restarts=0)
    assert end.end_abnormally(sessions, att=att, error=error) == JobStatus.FAILED
    db.expire_all()
    job = db.get(Job, job_id)
    assert job is not None and job.status == JobStatus.FAILED.value
    assert job.error is not None and (job.error["type"], job.error["message"], job.error["traceback"]) == (
        "Bad\\x00",
        "m\\x00",
        "a\nb\\x00",
    ), job.error


def test_a_refused_row_is_dropped_the_rest_of_its_batch_stored_and_the_refusal_noted_once(
    client: TestClient,
    sessions: sessionmaker[Session],
    db: Session,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rows the escaping would not have fixed: here, by switching it off.
    monkeypatch.setattr(reporting, "escape_text", lambda text, **_: text)
    monkeypatch.setattr(reporting, "escape_event", lambda event: event)
    job_id = _running(client, db)
    reporter = _reporter(sessions, job_id, tmp_path)
    lines = [f"line {i}" if i not in (57, 140) else f"line {i} \x00" for i in range(200)]
    events = [{"type": "metrics", "step": s, "values": {"ok": float(s)}} for s in range(1, 11)]
    events[4]["values"]["bad\u0000"] = 1.0
    _append(tmp_path, log="".join(f"{ln}\n" for ln in lines).encode(), events=events)
    reporter.collect()
    assert reporter.flush(), "the batch is written in parts, not kept for ever"

    kept = [ln for ln in lines if "\x00" not in ln]
    assert _lines(db, job_id) == kept, "every other line is stored, in order"
    assert _points(db, job_id) == [("ok", s) for s in range(1, 11)]
    job = db.get(Job, job_id)
    assert job is not None and job.step == 10, "the progress is written"
    assert reporter.refused_rows == 3
    assert _reason(db, job_id).count("the database refused") == 1, _reason(db, job_id)
    assert not reporter.pending

    _append(tmp_path, log=b"again \x00\nfine\n")
    reporter.collect()
    assert reporter.flush()
    assert _lines(db, job_id)[-1] == "fine"
    assert reporter.refused_rows == 4
    assert _reason(db, job_id).count("the database refused") == 1, "noted once, not per batch"


def test_an_outage_keeps_the_batch_and_it_is_stored_once_the_database_is_back(
    client: TestClient, sessions: sessionmaker[Session], db: Session, tmp_path: Path
) -> None:
    job_id = _running(client, db)
    # A PostgreSQL nobody answers at: every connection is refused, as while the server restarts.
    down = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x?connect_timeout=2")
    reporter = _reporter(sessionmaker(down), job_id, tmp_path)
    _append(tmp_path, log=b"one\ntwo\n", events=[{"type": "metrics", "step": 1, "values": {"ok": 1.0}}])
    reporter.collect()
    for _ in range(3):
        assert not reporter.flush(), "nothing can be written while the database is down"
    assert reporter.pending and reporter.refused_rows == 0, "an outage drops nothing"
    down.dispose()

    reporter.sessions = sessions  # the database is back
    assert reporter.flush()
    assert _lines(db, job_id) == ["one", "two"]
    assert _points(db, job_id) == [("ok", 1)]
    assert "refused" not in _reason(db, job_id)


def test_a_cancel_is_read_even_when_the_batch_cannot_be_written(
    client: TestClient,
    sessions: sessionmaker[Session],
    db: Session,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job_id = _running(client, db)
    reporter = _reporter(sessions, job_id, tmp_path)
    _append(tmp_path, events=[{"type": "metrics", "step": 1, "values": {"ok": 1.0}}])
    reporter.collect()
    db.query(Job).filter_by(id=job_id).update({"cancel_requested": True})
    db.commit()

    def broken(session: Session, *, rows: list[dict[str, Any]]) -> None:
        raise RuntimeError("the batch fails for a reason nobody foresaw")

    monkeypatch.setattr(reporting.repository, "add_metrics", broken)
    assert not reporter.flush(), "the batch is kept"
    assert reporter.state.cancel_requested, "the owner's cancel is seen all the same"


def test_a_stopping_worker_gives_up_on_the_last_reports_within_seconds(
    client: TestClient, db: Session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = _running(client, db)
    down = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x?connect_timeout=2")
    reporter = _reporter(sessionmaker(down), job_id, tmp_path)
    _append(tmp_path, log=b"last words\n")
    monkeypatch.setattr(watch.stopping, "is_set", lambda: True)  # SIGTERM reached the worker
    done = threading.Event()

    def last_reports() -> None:
        reporting.final_flush(reporter, interval=0.2, job_id=job_id)
        done.set()

    started = time.monotonic()
    threading.Thread(target=last_reports, daemon=True).start()
    finished = done.wait(30)
    if not finished:
        monkeypatch.setattr(reporter, "flush", lambda: True)  # end the loop, so the failure reads clean
        done.wait(30)
    assert finished, "a worker told to stop waited on an unreachable database for its last reports"
    assert time.monotonic() - started < 15
    down.dispose()


def test_warnings_without_end_add_a_bounded_number_of_notes_to_the_timeline(
    client: TestClient, sessions: sessionmaker[Session], db: Session, tmp_path: Path
) -> None:
    job_id = _running(client, db)
    reporter = _reporter(sessions, job_id, tmp_path)
    _append(tmp_path, events=[{"type": "warning", "rank": 0, "message": f"w{i}"} for i in range(500)])
    reporter.collect()
    assert reporter.flush()
    notes = _reason(db, job_id).split("; ")
    assert notes[: reporting.MAX_WARNING_NOTES] == [f"w{i}" for i in range(reporting.MAX_WARNING_NOTES)]
    assert notes[reporting.MAX_WARNING_NOTES :] == [
        "further warnings of attempt 1 are in the worker's log only"
    ]
