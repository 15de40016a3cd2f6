"""Metrics ingest through the worker's reporting path, and the API's heavy reads, on PostgreSQL.

    python -m bench.metrics [--smoke] [--json OUT]

In a throwaway database (migrated to head, dropped afterwards):

- ingest: rank 0's events file gets `metrics` events as the engine writes them (4 values each:
  loss, lr, samples_per_s, step_time_s), a chunk at a time, and the worker's `Reporter` ships
  each chunk (`collect()` then `flush()`, exactly what the runner does every report tick). Points
  per second = points / seconds spent in collect + flush (writing the file is the engine's cost);
- seeding: 100,000 jobs (copies of one real submitted job, INSERT ... SELECT generate_series) and a
  1,000,000-point `loss` series for one job (bulk SQL, so its rollups are then rebuilt from the
  points: the rows ingest would have kept, see `rollups_repository.rebuild`), then ANALYZE;
- queries, through the real API app in-process (FastAPI TestClient, so routing, auth, SQL and
  serialisation count): `GET /v1/jobs/{id}/metrics?name=loss&max_points=2000` and the first page of
  `GET /v1/jobs` (default page size) and a page deep in the list (by cursor). Median of N.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

from api_schemas import JobStatus
from bench.common import BENCH_TOKEN, Result, cli, result, scratch_database, spread
from service.app import create_app
from service.config import Settings
from service.jobs import rollups_repository
from service.models import Job
from workers.engine.events import MetricsEvent
from workers.reporting.reporter import Reporter

INGEST_BAR = 10_000.0
QUERY_BAR_MS = 100.0
VALUES_PER_EVENT = 4
SPEC = {
    "name": "bench-metrics",
    "recipe": "mlp",
    "hyperparameters": {"global_batch_size": 64, "steps": 1000, "lr": 0.05},
    "resources": {"processes_per_node": 1, "device": "cpu"},
}


class NullScheduler:
    """No placement (no worker runs these jobs, or rounds are timed by hand)."""

    def kick(self) -> None:
        """Ignore it."""


def ingest(url: str, job_id: str, *, points: int, chunk_points: int, base: Path) -> dict[str, Any]:
    """Ship `points` metric points through the Reporter, `chunk_points` per tick."""
    engine = create_engine(url)
    token = uuid.uuid4().hex
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE jobs SET claim_token = :t, status = :running, attempt = 1 WHERE id = :id"),
            {"t": token, "running": JobStatus.RUNNING.value, "id": job_id},
        )
    sessions = sessionmaker(engine, expire_on_commit=False)
    run_dir = base / "run"
    (run_dir / "events").mkdir(parents=True)
    (run_dir / "logs").mkdir(parents=True)
    reporter = Reporter(sessions=sessions, job_id=job_id, attempt=1, claim_token=token, run_dir=run_dir)
    events_file = run_dir / "events" / "rank0.jsonl"
    per_chunk = max(1, chunk_points // VALUES_PER_EVENT)
    step, spent, shipped, ticks = 0, 0.0, 0, 0
    with open(events_file, "a", encoding="utf-8") as f:
        while shipped < points:
            lines = []
            for _ in range(per_chunk):
                step += 1
                values = {"loss": 1 / step, "lr": 0.05, "samples_per_s": 1000.0 + step, "step_time_s": 0.01}
                lines.append(MetricsEvent(step=step, values=values).model_dump_json())
            f.write("\n".join(lines) + "\n")
            f.flush()
            start = time.perf_counter()
            reporter.collect()
            ok = reporter.flush()
            spent += time.perf_counter() - start
            assert ok, "the reporter could not write to the database"
            shipped += per_chunk * VALUES_PER_EVENT
            ticks += 1
    with engine.connect() as conn:
        stored = conn.execute(
            text("SELECT count(*) FROM metrics WHERE job_id = :id"), {"id": job_id}
        ).scalar()
    engine.dispose()
    assert stored == shipped, f"expected {shipped} points stored, found {stored}"
    return {"points": shipped, "seconds": spent, "ticks": ticks, "per_s": shipped / spent}


def seed(url: str, template_id: str, *, jobs: int, series_job: str, points: int) -> None:
    """Copy the template job `jobs` times and give `series_job` a `points`-long loss series."""
    cols = [c.name for c in Job.__table__.columns]
    varying = {
        "id": "substr(md5(g::text || 'bench'), 1, 32)",
        "name": "'bench-' || g",
        "created_at": "t.created_at - g * interval '1 second'",
        "updated_at": "t.updated_at - g * interval '1 second'",
        "idempotency_key": "NULL",
        "claim_token": "NULL",
    }
    select_list = ", ".join(varying.get(c, f"t.{c}") for c in cols)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO jobs ({', '.join(cols)}) SELECT {select_list} "  # noqa: S608 - our own column names
                "FROM jobs t, generate_series(1, :n) g WHERE t.id = :tid"
            ),
            {"n": jobs, "tid": template_id},
        )
        conn.execute(
            text(
                "INSERT INTO metrics (job_id, attempt, name, step, value) "
                "SELECT :job, 1, 'loss', g, 2.0 / (1 + g * 0.001) + random() * 0.05 "
                "FROM generate_series(1, :n) g"
            ),
            {"job": series_job, "n": points},
        )
    with sessionmaker(engine).begin() as session:
        rollups_repository.rebuild(session, job_id=series_job)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE jobs"))
        conn.execute(text("VACUUM ANALYZE metrics"))
        conn.execute(text("VACUUM ANALYZE metric_rollups"))
    engine.dispose()


def _median_ms(client: TestClient, path: str, repeats: int, check: Any = None) -> dict[str, Any]:
    times = []
    body: Any = None
    for _ in range(repeats + 1):  # the first one warms caches and is not counted
        start = time.perf_counter()
        r = client.get(path)
        elapsed = (time.perf_counter() - start) * 1000
        assert r.status_code == 200, f"GET {path}: expected 200, got {r.status_code} {r.text[:300]}"
        body = r.json()
        times.append(elapsed)
    if check is not None:
        check(body)
    return {"times_ms": times[1:], **spread(times[1:])}


def run(smoke: bool = False) -> dict[str, Result]:
    """Ingest, seed, query."""
    n_jobs, n_points = (1_000, 5_000) if smoke else (100_000, 1_000_000)
    ingest_points, chunk = (2_000, 1_000) if smoke else (200_000, 10_000)
    repeats = 3 if smoke else 21
    with scratch_database("dptrain_bench_metrics") as url, tempfile.TemporaryDirectory() as tmp:
        settings = Settings(
            database_url=url,
            broker_url="memory://",
            artifact_root=Path(tmp) / "artifacts",
            bootstrap_token=BENCH_TOKEN,  # type: ignore[arg-type]
            rate_limit_per_second=0,
        )
        app = create_app(settings, scheduler=NullScheduler())
        with TestClient(app, headers={"Authorization": f"Bearer {BENCH_TOKEN}"}) as client:
            ids = []
            for i in range(2):
                r = client.post("/v1/jobs", json={**SPEC, "name": f"bench-{i}"})
                assert r.status_code == 201, r.text
                ids.append(r.json()["id"])
            template, series_job = ids
            ing = ingest(url, template, points=ingest_points, chunk_points=chunk, base=Path(tmp))
            t0 = time.perf_counter()
            seed(url, template, jobs=n_jobs, series_job=series_job, points=n_points)
            seed_s = time.perf_counter() - t0

            def two_thousand(body: dict[str, Any]) -> None:
                n = len(body["series"]["loss"])
                assert 0 < n <= 2000, f"expected at most 2000 points, got {n}"

            query = _median_ms(
                client, f"/v1/jobs/{series_job}/metrics?name=loss&max_points=2000", repeats, two_thousand
            )
            first = _median_ms(client, "/v1/jobs", repeats)
            # A page deep in the list: follow the cursor of a page half-way down.
            mid = client.get("/v1/jobs?limit=200").json()
            cursor = mid["next_cursor"]
            deep = _median_ms(client, f"/v1/jobs?cursor={cursor}", repeats)
    common: dict[str, Any] = {"benchmark": "5. Metrics", "smoke": smoke}
    job_list = max(first, deep, key=lambda m: m["median"])
    return {
        "metrics_ingest_per_s": result(
            **common,
            compared=f"metric points written through `Reporter.collect()`+`flush()` ({chunk} per tick)",
            unit="points/s",
            value=ing["per_s"],
            bar=INGEST_BAR,
            higher_is_better=True,
            points=ing["points"],
            seconds=ing["seconds"],
            notes=[
                f"ingest: {ing['points']} points in {ing['ticks']} ticks, "
                f"{ing['seconds']:.2f} s in the reporter"
            ],
        ),
        "metrics_query_ms": result(
            **common,
            compared=f"`GET /v1/jobs/{{id}}/metrics?max_points=2000` over a {n_points:,}-point series",
            unit="ms",
            value=query["median"],
            low=query["min"],
            high=query["max"],
            bar=QUERY_BAR_MS,
            higher_is_better=False,
            repeats=repeats,
            notes=[f"seeded {n_jobs:,} jobs and {n_points:,} points in {seed_s:.1f} s; median of {repeats}"],
        ),
        "job_list_ms": result(
            **common,
            compared=f"`GET /v1/jobs` page (default size) with {n_jobs:,} jobs; "
            "worst of the first page and a deep one",
            unit="ms",
            value=job_list["median"],
            low=job_list["min"],
            high=job_list["max"],
            bar=QUERY_BAR_MS,
            higher_is_better=False,
            first_page_ms=first["median"],
            deep_page_ms=deep["median"],
            repeats=repeats,
        ),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """CLI entry point."""
    return cli("bench.metrics", __doc__, run, argv)


if __name__ == "__main__":
    main()
