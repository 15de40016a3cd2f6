"""Metric rollups: the downsampled query built on them answers what the raw points give, exactly."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service.jobs import downsample_repository, repository, rollups_repository
from service.jobs.metrics_repository import bucket_of, downsample, max_metric_id, metric_series
from service.models import Job, Metric, MetricRollup
from service.models.base import utcnow
from tests.api_fixtures import submit

Batch = list[tuple[int, float]]


def _batches(rng: random.Random, *, points: int, spacing: int, start: int = 0) -> list[Batch]:
    """What attempts report: runs of steps in ticks, restarts that re-report from an earlier step.

    Values have one decimal, so equal values (ties) are common.
    """
    out: list[Batch] = []
    step, sent, top = start, 0, start
    while sent < points:
        size = rng.choice([1, 3, 50, 700, 2500])
        batch = [(step + k * spacing, round(rng.gauss(0, 1), 1)) for k in range(size)]
        step += size * spacing
        top = max(top, step)
        if rng.random() < 0.1:
            batch.append(rng.choice(batch))  # the same step twice in one tick: the later one wins
        out.append(batch)
        sent += len(batch)
        if rng.random() < 0.25:
            # A restart: the next attempt resumes from an older checkpoint and reports again.
            step = start + spacing * rng.randrange((top - start) // spacing + 1)
    return out


def _ingest(session: Session, job_id: str, name: str, batches: list[Batch]) -> dict[int, float]:
    """Write the batches through the worker's insert; the expected series (last write of a step)."""
    final: dict[int, float] = {}
    for batch in batches:
        rows = [{"job_id": job_id, "attempt": 1, "name": name, "step": s, "value": v} for s, v in batch]
        repository.add_metrics(session, rows=rows)
        final.update(batch)
    return final


def _expected(final: dict[int, float], *, since_step: int | None, max_points: int) -> Batch:
    points = sorted((s, v) for s, v in final.items() if since_step is None or s > since_step)
    assert len(points) > max_points, "the case must downsample"
    return downsample(points, max_points=max_points)


def _check(
    session: Session, job_id: str, final: dict[int, float], *, cases: list[tuple[int | None, int]]
) -> int:
    """Compare each (since_step, max_points) with the reference; how many went through the rollups."""
    used = 0
    for since_step, max_points in cases:
        got = metric_series(
            session, job_id=job_id, since_step=since_step, names=["loss"], max_points=max_points
        )
        want = _expected(final, since_step=since_step, max_points=max_points)
        assert got["loss"] == want, (
            f"since_step={since_step} max_points={max_points}: differs from the reference"
        )
        steps = [s for s in final if since_step is None or s > since_step]
        lo, hi = min(steps), max(steps)
        direct = downsample_repository.downsampled(
            session, job_id=job_id, name="loss", lo=lo, hi=hi, max_points=max_points, up_to_id=None
        )
        used += direct is not None
    return used


def test_bucket_intervals_are_the_buckets_of_bucket_of() -> None:
    rng = random.Random(7)
    for _ in range(200):
        lo = rng.randrange(-50, 1000)
        hi = lo + rng.randrange(0, 3000)
        buckets = rng.randrange(1, 300)
        got = {
            s: b
            for b, first, last in downsample_repository.bucket_intervals(lo=lo, hi=hi, buckets=buckets)
            for s in range(first, last + 1)
        }
        want = {s: bucket_of(s, lo=lo, hi=hi, buckets=buckets) for s in range(lo, hi + 1)}
        assert got == want, f"lo={lo} hi={hi} buckets={buckets}: intervals disagree with bucket_of"


@pytest.mark.parametrize(("seed", "spacing"), [(1, 1), (2, 1), (3, 7), (4, 100)])
def test_rollup_query_equals_the_raw_computation(
    client: TestClient, db: Session, seed: int, spacing: int
) -> None:
    rng = random.Random(seed)
    job_id = submit(client)["id"]
    final = _ingest(
        db, job_id, "loss", _batches(rng, points=12_000, spacing=spacing, start=rng.randrange(50))
    )
    steps = sorted(final)
    mid = steps[len(steps) // 3] + rng.randrange(-5, 5)
    cases = [(None, 2), (None, 3), (None, 20), (None, 101), (None, 300), (mid, 10), (mid, 64), (-1, 2000)]
    used = _check(db, job_id, final, cases=cases)
    assert used >= 4, f"expected most cases to go through the rollups, {used} did"


def test_rows_are_what_a_rebuild_from_the_raw_points_gives(
    client: TestClient, db: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(11)
    job_id = submit(client)["id"]
    for name, spacing in (("loss", 1), ("lr", 3), ("eval", 250)):
        _ingest(db, job_id, name, _batches(rng, points=6_000, spacing=spacing))

    def rows() -> set[tuple[object, ...]]:
        r = MetricRollup
        cols = (r.name, r.level, r.block, r.points, r.first_step, r.last_step)
        stmt = select(*cols, r.min_step, r.min_value, r.max_step, r.max_value).where(r.job_id == job_id)
        return {tuple(row) for row in db.execute(stmt)}

    kept = rows()
    assert kept, "ingest must have written rollups"
    monkeypatch.setattr(rollups_repository, "REBUILD_BATCH", 50)  # writes while still reading points
    written = rollups_repository.rebuild(db, job_id=job_id)
    assert written == len(kept) and rows() == kept, "rows kept at ingest must equal a rebuild from the points"
    sparse = {row for row in kept if row[0] == "eval"}
    assert sparse and all(row[1] == 3 for row in sparse), (
        "a series every 250 steps only fills 4,096-step blocks"
    )


def test_up_to_id_leaves_out_later_points_even_inside_rollups(client: TestClient, db: Session) -> None:
    rng = random.Random(5)
    job_id = submit(client)["id"]
    final = _ingest(db, job_id, "loss", _batches(rng, points=8_000, spacing=1))
    top = max_metric_id(db, job_id=job_id)
    # Later points: new steps, and rewritten old ones (with values that would win every bucket).
    later = [(s, 100.0) for s in range(0, 8_000, 97)] + [(s, -100.0) for s in range(13, 8_000, 89)]
    _ingest(db, job_id, "loss", [later, [(max(final) + k, 50.0) for k in range(1, 400)]])
    for max_points in (20, 200):
        got = metric_series(
            db, job_id=job_id, since_step=None, names=["loss"], max_points=max_points, up_to_id=top
        )
        assert got["loss"] == _expected(final, since_step=None, max_points=max_points), (
            f"max_points={max_points}: points after up_to_id must not count"
        )


def test_points_written_without_rollups_are_read_raw(client: TestClient, db: Session) -> None:
    """Points from before the rollups (or written in bulk): a missing row is read from the points."""
    rng = random.Random(9)
    job_id = submit(client)["id"]
    old = [(s, round(rng.gauss(0, 1), 1)) for s in range(0, 6_000)]
    db.add_all([Metric(job_id=job_id, attempt=1, name="loss", step=s, value=v) for s, v in old])
    db.flush()
    final = dict(old) | _ingest(db, job_id, "loss", _batches(rng, points=5_000, spacing=1, start=6_000))
    _check(db, job_id, final, cases=[(None, 20), (None, 150), (3_000, 40)])


def test_purge_deletes_the_rollups_with_the_points(client: TestClient, db: Session) -> None:
    job_id = submit(client)["id"]
    _ingest(db, job_id, "loss", [[(s, float(s)) for s in range(100)]])
    db.query(Job).filter_by(id=job_id).update(
        {"status": "succeeded", "finished_at": utcnow() - timedelta(days=9)}
    )
    assert repository.purge_history(db, finished_before=utcnow() - timedelta(days=7)) == 1
    left = (
        db.query(MetricRollup).filter_by(job_id=job_id).count(),
        db.query(Metric).filter_by(job_id=job_id).count(),
    )
    assert left == (0, 0), f"expected no rollups and no points left, got {left}"


@pytest.fixture
def sqlite_sessions(sqlite_client: TestClient) -> tuple[TestClient, sessionmaker[Session]]:
    return sqlite_client, sqlite_client.app.state.session_factory  # type: ignore[attr-defined]


def test_rollup_query_equals_the_raw_computation_on_sqlite(
    sqlite_sessions: tuple[TestClient, sessionmaker[Session]],
) -> None:
    client, sessions = sqlite_sessions
    rng = random.Random(21)
    job_id = submit(client)["id"]
    with sessions.begin() as s:
        final = _ingest(s, job_id, "loss", _batches(rng, points=10_000, spacing=2))
    with sessions() as s:
        top = max_metric_id(s, job_id=job_id)
    with sessions.begin() as s:
        _ingest(s, job_id, "loss", [[(k, 99.0) for k in range(0, 4_000, 31)]])
    with sessions() as s:
        used = _check(
            s, job_id, final | {k: 99.0 for k in range(0, 4_000, 31)}, cases=[(None, 20), (500, 64)]
        )
        assert used == 2, "both cases must go through the rollups on SQLite too"
        got = metric_series(s, job_id=job_id, since_step=None, names=["loss"], max_points=30, up_to_id=top)
        assert got["loss"] == _expected(final, since_step=None, max_points=30), "up_to_id on SQLite"


def test_a_dense_series_is_answered_by_one_statement(
    client: TestClient, db: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every bucket of a series written through ingest finds all its rows: no bucket is redone."""
    rng = random.Random(13)
    job_id = submit(client)["id"]
    final = _ingest(db, job_id, "loss", _batches(rng, points=20_000, spacing=1, start=16))
    redone: list[object] = []
    general = downsample_repository._by_ranges
    monkeypatch.setattr(
        downsample_repository,
        "_by_ranges",
        lambda session, *, series, intervals: (
            redone.extend(intervals) or general(session, series=series, intervals=intervals)
        ),
    )
    _check(db, job_id, final, cases=[(None, 200), (777, 64)])
    assert redone == [], f"{len(redone)} buckets went to the general path"
