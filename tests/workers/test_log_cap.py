"""A job's log in the database is bounded: DPTRAIN_MAX_LOG_BYTES_PER_JOB across attempts, and each line.

Past the cap, lines are dropped with one marker saying so, and the attempt's end counts the drops.
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from service.models import Job, LogLine
from tests.conftest import job_spec
from workers.reporting.log_budget import LogBudget, line_bytes
from workers.reporting.reporter import Reporter
from workers.reporting.tail import _MAX_LINE_BYTES, MAX_LINE_CHARS, Tail

SPEC = job_spec(name="chatty", hyperparameters={"global_batch_size": 4, "steps": 3})
TOKEN = "t" * 32
DROPPED = re.compile(r"attempt (\d+) dropped (\d+) log lines \((\d+) bytes\)")


class TestLongLines:
    def test_a_5_mb_line_is_cut_with_a_marker_naming_what_was_dropped(self, tmp_path: Path) -> None:
        path = tmp_path / "rank0.log"
        path.write_bytes(b"x" * (5 << 20) + b"\nnext\n")
        line, after = Tail(path).read_lines()
        assert line.startswith("x" * MAX_LINE_CHARS), line[:50]
        assert line.endswith(f" [dptrain: line cut, {(5 << 20) - MAX_LINE_CHARS} more bytes dropped]"), line[
            -80:
        ]
        assert after == "next", "the next line is whole"

    def test_a_line_without_newline_is_not_held_whole_while_it_grows(self, tmp_path: Path) -> None:
        path = tmp_path / "rank0.log"
        tail = Tail(path)
        with path.open("ab") as f:
            for _ in range(5):
                f.write(b"y" * (1 << 20))
                f.flush()
                assert tail.read_lines() == [], "no newline yet"
                assert len(tail.pending) <= _MAX_LINE_BYTES, len(tail.pending)
        (line,) = tail.read_lines(final=True)
        assert (
            line
            == "y" * MAX_LINE_CHARS + f" [dptrain: line cut, {(5 << 20) - MAX_LINE_CHARS} more bytes dropped]"
        )

    def test_short_lines_are_untouched(self, tmp_path: Path) -> None:
        path = tmp_path / "rank0.log"
        path.write_text("a\r\nb\n" + "é" * MAX_LINE_CHARS + "\n")
        assert Tail(path).read_lines() == ["a", "b", "é" * MAX_LINE_CHARS]


class TestBudget:
    def test_lines_are_kept_until_the_cap_then_one_marker_and_a_final_count(self) -> None:
        budget = LogBudget(cap=100, job_id="j", attempt=2)
        budget.start(stored=40, nodes=1)
        rows = [{"job_id": "j", "attempt": 2, "rank": 0, "line": "x" * 9} for _ in range(10)]
        kept = budget.admit(rows)
        assert [r["line"] for r in kept[:6]] == ["x" * 9] * 6, "60 bytes were left: six lines of 9"
        assert len(kept) == 7 and "reached DPTRAIN_MAX_LOG_BYTES_PER_JOB (100 bytes)" in kept[6]["line"], kept
        assert budget.admit([{"job_id": "j", "attempt": 2, "rank": 0, "line": "y"}]) == [], (
            "after a drop, none"
        )
        (summary,) = budget.admit([], final=True)
        assert DROPPED.search(summary["line"]).groups() == ("2", "5", "37"), summary  # type: ignore[union-attr]
        assert budget.admit([], final=True) == [], "counted once"

    def test_the_nodes_of_an_attempt_share_what_is_left(self) -> None:
        budgets = [LogBudget(cap=1000, job_id="j", attempt=1) for _ in range(4)]
        for b in budgets:
            b.start(stored=200, nodes=4)
        kept = sum(
            line_bytes(r["line"])
            for b in budgets
            for r in b.admit([{"line": "z" * 10}] * 100)
            if r["line"] == "z" * 10
        )
        assert 200 + kept <= 1000, kept


def _running(client: TestClient, db: Session) -> str:
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    db.query(Job).filter_by(id=job_id).update(
        {"status": JobStatus.RUNNING.value, "attempt": 1, "claim_token": TOKEN}
    )
    db.commit()
    return job_id


def _stored(db: Session, job_id: str) -> list[LogLine]:
    db.expire_all()
    return list(db.query(LogLine).filter_by(job_id=job_id).order_by(LogLine.id))


def test_the_cap_counts_across_attempts(
    client: TestClient, sessions: sessionmaker[Session], db: Session, tmp_path: Path
) -> None:
    job_id = _running(client, db)
    cap = 2000
    for attempt in (1, 2):
        run_dir = tmp_path / f"a{attempt}"
        (run_dir / "logs").mkdir(parents=True)
        (run_dir / "logs" / "rank0.log").write_text(
            "".join(f"attempt {attempt} line {i:04d}\n" for i in range(150))
        )
        reporter = Reporter(
            sessions=sessions,
            job_id=job_id,
            attempt=attempt,
            claim_token=TOKEN,
            run_dir=run_dir,
            max_log_bytes=cap,
        )
        reporter.collect()
        assert reporter.flush()
        reporter.collect(final=True)
        assert reporter.flush()
    lines = _stored(db, job_id)
    data = [ln.line for ln in lines if ln.rank == 0]
    markers = [ln.line for ln in lines if ln.rank is None]
    assert sum(line_bytes(x) for x in data) <= cap, "the users' lines stay under the cap"
    assert all(x.startswith("attempt 1 ") for x in data), "attempt 2 found the cap reached"
    assert len(markers) == 4, f"a marker and a count for each attempt: {markers}"
    counts = [DROPPED.search(m) for m in markers if DROPPED.search(m)]
    assert [(m.group(1), m.group(2)) for m in counts if m] == [("1", str(150 - len(data))), ("2", "150")], (
        markers
    )
