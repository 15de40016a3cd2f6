"""Metric queries: since_step, and downsampling that keeps each bucket's min and max."""

from __future__ import annotations

import math
import random

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service.jobs.metrics_repository import downsample
from service.models import Metric
from tests.api_fixtures import submit


def _series(n: int, *, seed: int = 0) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    return [(s, math.sin(s / 37.0) + rng.gauss(0, 0.3)) for s in range(1, n + 1)]


def _store(db: Session, job_id: str, name: str, points: list[tuple[int, float]]) -> None:
    db.add_all([Metric(job_id=job_id, attempt=1, name=name, step=s, value=v) for s, v in points])
    db.commit()


class TestDownsampling:
    def test_bounds_min_max_and_order(self, client: TestClient, db: Session) -> None:
        jid = submit(client)["id"]
        loss = _series(2000)
        _store(db, jid, "loss", loss)
        _store(db, jid, "lr", [(s, 0.1) for s in range(1, 41)])
        got = client.get(f"/v1/jobs/{jid}/metrics", params={"max_points": 100}).json()["series"]
        points = [tuple(p) for p in got["loss"]]
        assert 0 < len(points) <= 100, f"expected at most 100 points, got {len(points)}"
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), "points come in step order, one per step"
        stored = dict(loss)
        assert all(stored[s] == v for s, v in points), "every point returned is a stored point"
        low, high = min(loss, key=lambda p: p[1]), max(loss, key=lambda p: p[1])
        assert low in points and high in points, f"global min {low} and max {high} must be kept"
        assert got["lr"] == [[s, 0.1] for s in range(1, 41)], "a series under the limit comes back untouched"

    def test_postgresql_and_python_paths_agree(self, client: TestClient, db: Session) -> None:
        jid = submit(client)["id"]
        points = _series(1003, seed=3)
        # An odd step spacing and a re-reported step (the later attempt's value wins).
        points = [(s * 3 + 7, v) for s, v in points]
        _store(db, jid, "loss", points)
        _store(db, jid, "loss", [(points[10][0], 99.0)])
        expected_input = dict(points) | {points[10][0]: 99.0}
        for max_points in (2, 3, 64, 1001):
            got = client.get(f"/v1/jobs/{jid}/metrics", params={"max_points": max_points}).json()
            expected = downsample(sorted(expected_input.items()), max_points=max_points)
            assert [tuple(p) for p in got["series"]["loss"]] == expected, (
                f"max_points={max_points}: SQL answer differs from the reference downsample"
            )

    def test_since_step_applies_before_downsampling(self, client: TestClient, db: Session) -> None:
        jid = submit(client)["id"]
        _store(db, jid, "loss", _series(500))
        got = client.get(f"/v1/jobs/{jid}/metrics", params={"since_step": 400, "max_points": 10}).json()
        steps = [s for s, _ in got["series"]["loss"]]
        assert steps and min(steps) > 400 and len(steps) <= 10, f"expected <=10 steps after 400, got {steps}"
        raw = client.get(f"/v1/jobs/{jid}/metrics", params={"since_step": 495}).json()["series"]["loss"]
        assert [s for s, _ in raw] == [496, 497, 498, 499, 500], f"since_step is exclusive, got {raw}"
        r = client.get(f"/v1/jobs/{jid}/metrics", params={"max_points": 1})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "max_points"], r.text


def test_reference_downsample_keeps_short_series_and_extremes() -> None:
    assert downsample([(1, 1.0), (2, 2.0)], max_points=2) == [(1, 1.0), (2, 2.0)]
    flat = [(s, 5.0) for s in range(100)]
    out = downsample(flat, max_points=10)
    assert out == [(s, 5.0) for s in range(0, 100, 20)], f"ties go to the earliest step, got {out}"
