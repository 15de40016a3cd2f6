"""Placement at cluster scale: a round over 10,000 queued jobs of 100 users and 1,000 nodes; submit to placed.

    python -m bench.placement [--smoke] [--json OUT]

In a throwaway database (migrated to head, dropped afterwards), rows only, no processes:

- 1,000 worker nodes beating now, 8 slots each, one in ten `cuda`;
- 100 users with 100 queued jobs each (10,000), made by INSERT ... SELECT from one job submitted
  through the app: shapes cycle through 1x8, 1x4, 2x8 and 1x2 cpu, 1x8 cuda, and 1x16 cpu, which no
  node can hold (flagged unplaceable with the reason a round gives, as a submit records it). User 0
  floods at priority 1000 (as an admin may grant), the others queue at 0; fair keys as submits give;
- running jobs on 2 full cpu nodes each: 80 users at their limit of 4, 20 with 2 (room for 2 more),
  so a round reads every owner's heads, places about 40 jobs and explains the rest.

`placement_round_ms`: `service.scheduling.service.place()` in a transaction rolled back afterwards
(the same state every time, commit left out), median of N. The node heartbeats are refreshed before
each. Two more sizes (4x the queued jobs; 4x the nodes) are in the notes, for docs/cluster.md.

`submit_to_placed_p99_ms`: the real app in-process (FastAPI TestClient) with its own placement
thread, on that database after one committed round (the cluster's room then taken): a user with no
jobs submits a 1x1 cpu job (`POST /v1/jobs`, which kicks placement), and the time until its row is
`running` (polled every 5 ms) is taken; then it is finished, freeing its slot. Submits come at
random intervals of 0 to 1 s, as arrivals would, so some wait out the scheduler's 0.5 s gap.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, insert, select, text
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from bench.common import (
    BENCH_TOKEN,
    Result,
    cli,
    percentile,
    result,
    scratch_database,
    spread,
)
from bench.metrics import NullScheduler
from service.app import create_app
from service.config import Settings
from service.db import session_factory
from service.dispatch import NodeStart
from service.jobs import lifecycle
from service.models import Job, JobNode, User, Worker
from service.models.base import utcnow
from service.scheduling.placement import Node, Pending, never_fits
from service.scheduling.service import place
from service.users import service as users

ROUND_BAR_MS = 100.0
P99_BAR_MS = 1000.0
SLOTS = 8
LIMIT = 4
# (device, nodes, processes_per_node): the queued jobs cycle through these; the last fits no node.
SHAPES = [("cpu", 1, 8), ("cpu", 1, 4), ("cpu", 2, 8), ("cpu", 1, 2), ("cuda", 1, 8), ("cpu", 1, 16)]
SPEC = {
    "name": "bench-placement",
    "recipe": "mlp",
    "hyperparameters": {"global_batch_size": 8, "steps": 10},
    "resources": {"processes_per_node": 1},
}


class NullDispatcher:
    """No broker: the start messages go nowhere (no worker runs these jobs)."""

    def start_node(self, start: NodeStart) -> None:
        """Drop it."""


def _settings(url: str, tmp: str) -> Settings:
    return Settings(
        database_url=url,
        broker_url="memory://",
        artifact_root=Path(tmp) / "artifacts",
        bootstrap_token=BENCH_TOKEN,  # type: ignore[arg-type]
        rate_limit_per_second=0,
        poll_cache=False,
        max_queued_per_user=0,
        max_running_jobs_per_user=LIMIT,
    )


def seed(sessions: sessionmaker[Session], *, template: str, users: int, queued: int, nodes: int) -> None:
    """Nodes, users, their queued jobs and running jobs, as the module's docstring says."""
    now = utcnow()
    workers: list[dict[str, Any]] = [
        {
            "name": f"node-{i:05d}",
            "hostname": f"host-{i}",
            "address": f"10.{i // 250}.{i % 250}.1",
            "device": "cuda" if i % 10 == 9 else "cpu",
            "device_count": SLOTS,
            "slots": SLOTS,
            "started_at": now,
            "last_heartbeat": now,
        }
        for i in range(nodes)
    ]
    live = [Node(w["name"], w["device"], SLOTS, SLOTS) for w in workers]
    reasons = [never_fits(Pending("", 0, d, n, p), [x for x in live if x.device == d]) for d, n, p in SHAPES]
    shapes = ", ".join(
        f"({i}, '{d}', {n}, {p}, {'NULL' if r is None else repr(r)})"
        for i, ((d, n, p), r) in enumerate(zip(SHAPES, reasons, strict=True))
    )
    with sessions.begin() as s:
        s.execute(insert(Worker), workers)
        s.execute(insert(User), [{"name": f"user-{u:03d}"} for u in range(users)])
        ids = s.execute(select(User.id).where(User.name.like("user-%")).order_by(User.name)).scalars().all()
        s.execute(text("CREATE TEMP TABLE bench_owners (k int, id int) ON COMMIT DROP"))
        s.execute(
            text("INSERT INTO bench_owners VALUES (:k, :id)"), [{"k": k, "id": i} for k, i in enumerate(ids)]
        )
        cols = [c.name for c in Job.__table__.columns]
        varying = {
            "id": "md5(g::text || 'queued')",
            "name": "'queued-' || g",
            "status": "'queued'",
            "finished_at": "NULL",
            "owner_id": "o.id",
            "priority": "CASE WHEN o.k = 0 THEN 1000 ELSE 0 END",
            "device": "sh.device",
            "fair_key": f"g / {users}",
            "created_at": "t.created_at + g * interval '1 millisecond'",
            "updated_at": "t.updated_at",
            "spec": "jsonb_set(t.spec, '{resources}', jsonb_build_object("
            "'device', sh.device, 'nodes', sh.nodes, 'processes_per_node', sh.ppn))",
            "unplaceable": "sh.reason IS NOT NULL",
            "queued_reason": "sh.reason",
            "idempotency_key": "NULL",
        }
        select_list = ", ".join(varying.get(c, f"t.{c}") for c in cols)
        s.execute(
            text(
                f"WITH sh (i, device, nodes, ppn, reason) AS (VALUES {shapes}) "  # noqa: S608 - our own text
                f"INSERT INTO jobs ({', '.join(cols)}) SELECT {select_list} "
                "FROM jobs t, generate_series(0, :n - 1) g "
                f"JOIN bench_owners o ON o.k = g % {users} JOIN sh ON sh.i = (g / {users}) % {len(SHAPES)} "
                "WHERE t.id = :tid"
            ),
            {"n": queued, "tid": template},
        )
        _running(s, owners=list(ids), cpu=[w["name"] for w in workers if w["device"] == "cpu"])
    engine = sessions.kw["bind"]
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE jobs"))
        conn.execute(text("VACUUM ANALYZE job_nodes"))


def _running(s: Session, *, owners: list[int], cpu: list[str]) -> None:
    """80% of the owners at their running limit, the rest with 2 running: each job on 2 full cpu nodes.

    At most 4/5 of the cpu nodes are taken (the smoke sizes have too few for every owner's jobs).
    """
    at_limit = len(owners) * 4 // 5
    jobs: list[dict[str, Any]] = []
    placed: list[tuple[str, int, str]] = []
    free = iter(cpu[: len(cpu) * 4 // 5])
    for k, owner in enumerate(owners):
        for _ in range(LIMIT if k < at_limit else 2):
            pair = [next(free, None), next(free, None)]
            if None in pair:
                break
            job_id = uuid.uuid4().hex
            jobs.append({"id": job_id, "owner_id": owner})
            placed += [(job_id, rank, str(w)) for rank, w in enumerate(pair)]
    running: dict[str, Any] = {"name": "running", "status": JobStatus.RUNNING.value, "spec": {}, "labels": {}}
    running |= {"total_steps": 10, "latest_metrics": {}, "attempt": 1, "started_at": utcnow()}
    s.execute(insert(Job), [j | running | {"claim_token": j["id"]} for j in jobs])
    now = utcnow()
    s.execute(
        insert(JobNode),
        [
            {"job_id": j, "node_rank": r, "attempt": 1, "worker": w, "slots": SLOTS, "address": "10.0.0.1"}
            | {"port": None, "placed_at": now, "started_at": now}
            for j, r, w in placed
        ],
    )


def _beat(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        s.execute(text("UPDATE workers SET last_heartbeat = now()"))


def rounds(sessions: sessionmaker[Session], settings: Settings, *, repeats: int) -> dict[str, Any]:
    """Time `place()` `repeats` times on the same state (each rolled back); ms, and how many it placed."""
    times, placed = [], 0
    for _ in range(repeats + 1):  # the first warms the caches and is not counted
        _beat(sessions)
        with sessions() as s:
            start = time.perf_counter()
            placed = len(place(s, settings=settings))
            times.append((time.perf_counter() - start) * 1000)
            s.rollback()
    return {"times_ms": times[1:], "placed": placed, **spread(times[1:])}


def size(*, users: int, queued: int, nodes: int, repeats: int, probes: int = 0) -> dict[str, Any]:
    """A database of this size: the round's figures, and with `probes` the submit-to-placed latencies."""
    with scratch_database("dptrain_bench_placement") as url, tempfile.TemporaryDirectory() as tmp:
        settings = _settings(url, tmp)
        sessions = session_factory(settings)
        # No placement thread while rounds are timed: its own rounds would race them for the locks.
        quiet = create_app(settings, scheduler=NullScheduler())
        with TestClient(quiet, headers={"Authorization": f"Bearer {BENCH_TOKEN}"}) as client:
            r = client.post("/v1/jobs", json=SPEC)
            assert r.status_code == 201, r.text
            template = r.json()["id"]
        with sessions.begin() as s:
            lifecycle.transition(s, job_id=template, src=JobStatus.QUEUED, dst=JobStatus.CANCELLED)
        seed(sessions, template=template, users=users, queued=queued, nodes=nodes)
        out = rounds(sessions, settings, repeats=repeats)
        with sessions.begin() as s:
            place(s, settings=settings)  # the cluster's room taken, every head's reason written
        out["steady"] = rounds(sessions, settings, repeats=repeats)
        if probes:
            app = create_app(settings, dispatcher=NullDispatcher())
            with TestClient(app) as client:
                out["latencies_ms"] = _probe(client, sessions, settings, probes=probes)
    return out


def _probe(
    client: TestClient, sessions: sessionmaker[Session], settings: Settings, *, probes: int
) -> list[float]:
    with sessions.begin() as s:
        token = users.create(s, name="probe", admin=False).token
    engine = create_engine(settings.database_url)
    status = text("SELECT status FROM jobs WHERE id = :id")
    rng = random.Random(6)
    latencies = []
    for i in range(probes):
        time.sleep(rng.uniform(0, 1.0))
        _beat(sessions)
        start = time.perf_counter()
        r = client.post(
            "/v1/jobs", json={**SPEC, "name": f"probe-{i}"}, headers={"Authorization": f"Bearer {token}"}
        )
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        deadline = start + 30
        with engine.connect() as conn:
            while conn.execute(status, {"id": job_id}).scalar_one() != JobStatus.RUNNING.value:
                assert time.perf_counter() < deadline, f"probe {job_id} not placed in 30 s"
                conn.rollback()
                time.sleep(0.005)
        latencies.append((time.perf_counter() - start) * 1000)
        with sessions.begin() as s:
            lifecycle.transition(s, job_id=job_id, src=JobStatus.RUNNING, dst=JobStatus.SUCCEEDED)
    engine.dispose()
    return latencies


def run(smoke: bool = False) -> dict[str, Result]:
    """The base size with its probes, then 4x the queued jobs and 4x the nodes."""
    repeats, probes = (3, 3) if smoke else (15, 40)
    # Smoke: as many nodes per user as the real size, so the probe finds its free node there too.
    base = (
        {"users": 10, "queued": 500, "nodes": 100}
        if smoke
        else {"users": 100, "queued": 10_000, "nodes": 1_000}
    )
    measured = {"base": size(**base, repeats=repeats, probes=probes)}
    measured["4x queued"] = size(**(base | {"queued": base["queued"] * 4}), repeats=repeats)
    measured["4x nodes"] = size(**(base | {"nodes": base["nodes"] * 4}), repeats=repeats)
    b, lat = measured["base"], measured["base"]["latencies_ms"]
    sizes = [
        f"{name}: {base['users']} users, "
        f"{(base['queued'] * (4 if name == '4x queued' else 1)):,} queued, "
        f"{(base['nodes'] * (4 if name == '4x nodes' else 1)):,} nodes: round median {m['median']:.1f} ms "
        f"(min {m['min']:.1f}, max {m['max']:.1f}), {m['placed']} placed; once that room is taken, "
        f"{m['steady']['median']:.1f} ms (min {m['steady']['min']:.1f}), {m['steady']['placed']} placed"
        for name, m in measured.items()
    ]
    common: dict[str, Any] = {"benchmark": "10. Placement at cluster scale", "smoke": smoke}
    return {
        "placement_round_ms": result(
            **common,
            compared=f"one placement round (`place()`, rolled back): {base['queued']:,} queued jobs of "
            f"{base['users']} users, {base['nodes']:,} nodes",
            unit="ms",
            value=b["median"],
            low=b["min"],
            high=b["max"],
            bar=ROUND_BAR_MS,
            higher_is_better=False,
            repeats=repeats,
            placed_per_round=b["placed"],
            steady_ms=b["steady"]["median"],
            sizes={
                k: {"median_ms": v["median"], "placed": v["placed"], "steady_ms": v["steady"]["median"]}
                for k, v in measured.items()
            },
            notes=sizes,
        ),
        "submit_to_placed_p99_ms": result(
            **common,
            compared="`POST /v1/jobs` (in-process app, its placement thread) to the job `running`, "
            "a 1x1 job of a user with none queued, into that queue",
            unit="ms",
            value=percentile(lat, 99),
            low=min(lat),
            high=max(lat),
            bar=P99_BAR_MS,
            higher_is_better=False,
            probes=len(lat),
            p50_ms=statistics.median(lat),
            notes=[
                f"submit to placed: p50 {statistics.median(lat):.0f} ms, max {max(lat):.0f} ms of {len(lat)}"
            ],
        ),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """CLI entry point."""
    return cli("bench.placement", __doc__, run, argv)


if __name__ == "__main__":
    main()
