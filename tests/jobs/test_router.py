"""The jobs API against real PostgreSQL with the migrations applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service.config import Settings
from service.models import Checkpoint, Job, JobTransition, LogLine, Metric
from tests.api_fixtures import SPEC, RecordingScheduler, submit
from workers.engine.checkpoint import checkpoint_name


class TestSubmit:
    def test_submit_stores_a_queued_job_and_kicks_placement_after_commit(
        self, client: TestClient, scheduler: RecordingScheduler, db: Session
    ) -> None:
        job = submit(client)
        assert job["status"] == "queued"
        assert job["owner"] == "admin"
        assert job["progress"] == {"step": 0, "total_steps": 4}
        assert job["attempt"] == 0 and job["error"] is None
        assert job["spec"]["hyperparameters"]["hidden_size"] == 16, "recipe extras are kept"
        assert job["spec"]["engine"]["bucket_cap_mb"] == 25.0, "defaults are filled in"
        assert scheduler.kicks == 1, "placement is asked to look at the new job"
        row = db.get(Job, job["id"])
        assert row is not None and row.status == "queued"
        timeline = db.query(JobTransition).filter_by(job_id=job["id"]).all()
        assert [(t.from_status, t.to_status) for t in timeline] == [(None, "queued")]

    def test_get_and_unknown_job(self, client: TestClient) -> None:
        job = submit(client)
        r = client.get(f"/v1/jobs/{job['id']}")
        assert r.status_code == 200 and r.json()["id"] == job["id"]
        r = client.get("/v1/jobs/doesnotexist")
        assert r.status_code == 404
        assert r.json() == {"error": "NotFound", "detail": "job 'doesnotexist' not found"}

    def test_every_v1_route_needs_a_valid_token(self, client: TestClient) -> None:
        for method, path in [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/x/metrics")]:
            r = client.request(method, path, headers={"Authorization": ""}, json=SPEC)
            assert r.status_code == 401, f"{method} {path} without a token: {r.status_code}"
            assert r.headers.get("www-authenticate") == "Bearer"
            r = client.request(method, path, headers={"Authorization": "Bearer wrong"}, json=SPEC)
            assert r.status_code == 401, f"{method} {path} with a bad token: {r.status_code}"
        assert client.get("/healthz", headers={"Authorization": ""}).status_code == 200


class TestList:
    def test_newest_first_with_keyset_cursor(self, client: TestClient) -> None:
        ids = [submit(client, name=f"j{i}")["id"] for i in range(5)]
        seen: list[str] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 2}
            if cursor:
                params["cursor"] = cursor
            page = client.get("/v1/jobs", params=params).json()
            seen += [j["id"] for j in page["items"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == list(reversed(ids)), "pages must cover every job once, newest first"

    def test_status_filter_and_bad_cursor(self, client: TestClient) -> None:
        a = submit(client)
        client.post(f"/v1/jobs/{a['id']}/cancel")
        submit(client)
        page = client.get("/v1/jobs", params={"status": "cancelled"}).json()
        assert [j["id"] for j in page["items"]] == [a["id"]]
        r = client.get("/v1/jobs", params={"cursor": "!!notacursor"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "cursor"]
        r = client.get("/v1/jobs", params={"status": "sleeping"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "status"]


class TestCancel:
    def test_queued_job_is_cancelled_at_once_and_twice_is_409(self, client: TestClient) -> None:
        job = submit(client)
        r = client.post(f"/v1/jobs/{job['id']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        assert r.json()["finished_at"] is not None
        r = client.post(f"/v1/jobs/{job['id']}/cancel")
        assert r.status_code == 409 and r.json()["error"] == "InvalidTransition"

    def test_running_job_gets_a_stop_request(self, client: TestClient, db: Session) -> None:
        job = submit(client)
        db.query(Job).filter_by(id=job["id"]).update({"status": "running", "attempt": 1})
        db.commit()
        r = client.post(f"/v1/jobs/{job['id']}/cancel")
        assert r.status_code == 200
        assert r.json()["status"] == "running" and r.json()["cancel_requested"] is True


class TestRunOutputs:
    def test_metrics_logs_and_checkpoints(
        self, client: TestClient, db: Session, settings: Settings, tmp_path: Path
    ) -> None:
        job = submit(client)
        jid = job["id"]
        db.add_all(
            [Metric(job_id=jid, attempt=1, name="loss", step=s, value=1.0 / s) for s in (1, 2, 3)]
            + [Metric(job_id=jid, attempt=1, name="lr", step=s, value=0.1) for s in (1, 2, 3)]
            + [LogLine(job_id=jid, attempt=1, rank=r, line=f"hello from {r}") for r in (0, 1, 0)]
        )
        ckpt_dir = settings.artifacts / "jobs" / jid / "checkpoints"
        ckpt_dir.mkdir(parents=True)
        path = ckpt_dir / checkpoint_name(3)
        torch.save({"model": {"w": torch.ones(2)}, "iter": 3}, path)
        outside = tmp_path / "outside.pt"
        outside.write_bytes(b"secret")
        db.add(
            Checkpoint(
                job_id=jid, attempt=1, step=3, path=str(path), size_bytes=path.stat().st_size, sha256="a" * 64
            )
        )
        db.add(Checkpoint(job_id=jid, attempt=1, step=4, path=str(outside), size_bytes=6, sha256="b" * 64))
        db.commit()

        series = client.get(f"/v1/jobs/{jid}/metrics").json()["series"]
        assert series["loss"] == [[1, 1.0], [2, 0.5], [3, 1.0 / 3]]
        assert client.get(f"/v1/jobs/{jid}/metrics", params={"since_step": 2, "name": "loss"}).json()[
            "series"
        ] == {"loss": [[3, 1.0 / 3]]}

        page = client.get(f"/v1/jobs/{jid}/logs", params={"rank": 0}).json()
        assert [ln["line"] for ln in page["items"]] == ["hello from 0", "hello from 0"]
        first = client.get(f"/v1/jobs/{jid}/logs", params={"limit": 1}).json()
        rest = client.get(f"/v1/jobs/{jid}/logs", params={"after": first["next_cursor"]}).json()
        assert [ln["line"] for ln in first["items"] + rest["items"]] == [
            "hello from 0",
            "hello from 1",
            "hello from 0",
        ]

        items = client.get(f"/v1/jobs/{jid}/checkpoints").json()["items"]
        assert [c["step"] for c in items] == [3, 4]
        r = client.get(f"/v1/jobs/{jid}/checkpoints/{items[0]['id']}/download")
        assert r.status_code == 200 and r.content == path.read_bytes()
        r = client.get(f"/v1/jobs/{jid}/checkpoints/{items[1]['id']}/download")
        assert r.status_code == 404, "a path outside the artifact root must never be served"
        assert client.get(f"/v1/jobs/{jid}/checkpoints/999999/download").status_code == 404
        # A rank swaps a link to another job's checkpoint (inside the root) in for its own file.
        other = settings.artifacts / "jobs" / "someone-else.pt"
        other.write_bytes(b"another user's weights")
        path.unlink()
        path.symlink_to(other)
        r = client.get(f"/v1/jobs/{jid}/checkpoints/{items[0]['id']}/download")
        assert r.status_code == 404, "a link must never be followed, even to a file inside the root"
