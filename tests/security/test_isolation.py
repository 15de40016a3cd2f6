"""Owner isolation: another non-admin gets 404 on every job route, lists are filtered, admins see all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from rank_contract.layout import JobFiles
from service.config import Settings
from service.models import Checkpoint, JobArtifact, LogLine, Metric
from service.scheduling.service import schedule_once
from tests.api_fixtures import SPEC, RecordingDispatcher, add_user, as_user
from workers.engine.checkpoint import checkpoint_name
from workers.node.heartbeat import Heartbeat


def _v1_routes(client: TestClient) -> list[tuple[str, str]]:
    """Every (method, path) of /v1 the app publishes: a new route is checked without editing this file."""
    paths = client.get("/openapi.json").json()["paths"]
    return sorted((m.upper(), p) for p, ops in paths.items() if p.startswith("/v1/") for m in ops)


def _job_routes(client: TestClient) -> list[tuple[str, str]]:
    return [(m, p) for m, p in _v1_routes(client) if p.startswith("/v1/jobs/{job_id}")]


@pytest.fixture
def two_users(client: TestClient, db: Session, settings: Settings) -> dict[str, Any]:
    """Alice and Bob (non-admins), each with a job that has metrics, logs, a checkpoint and an artifact."""
    tokens = {"alice": add_user(db, "alice"), "bob": add_user(db, "bob")}
    jobs = {}
    for name, token in tokens.items():
        r = client.post("/v1/jobs", json=SPEC, headers=as_user(token))
        assert r.status_code == 201, r.text
        jid = r.json()["id"]
        path = settings.artifacts / "jobs" / jid / "checkpoints" / checkpoint_name(1)
        path.parent.mkdir(parents=True)
        path.write_bytes(b"weights")
        artifact = JobFiles(settings.artifacts, jid).outputs / "model.bin"
        artifact.parent.mkdir(parents=True)
        artifact.write_bytes(b"model")
        db.add_all(
            [
                JobArtifact(job_id=jid, attempt=1, path="model.bin", size_bytes=5, sha256="d" * 64),
                Metric(job_id=jid, attempt=1, name="loss", step=1, value=1.0),
                LogLine(job_id=jid, attempt=1, rank=0, line="hi"),
                Checkpoint(job_id=jid, attempt=1, step=1, path=str(path), size_bytes=7, sha256="c" * 64),
            ]
        )
        db.commit()
        ckpt = client.get(f"/v1/jobs/{jid}/checkpoints", headers=as_user(token)).json()["items"][0]
        jobs[name] = {"id": jid, "checkpoint": ckpt["id"]}
    return {"tokens": tokens, "jobs": jobs}


def _url(path: str, job: dict[str, Any]) -> str:
    url = path.replace("{job_id}", job["id"]).replace("{checkpoint_id}", str(job["checkpoint"]))
    return url.replace("{path}", "model.bin")


class TestCrossOwner:
    def test_every_job_route_answers_404_to_another_non_admin(
        self, client: TestClient, two_users: dict[str, Any]
    ) -> None:
        routes = _job_routes(client)
        assert len(routes) >= 8, f"expected every /v1/jobs/{{id}} route, found {routes}"
        bob = as_user(two_users["tokens"]["bob"])
        alices_job = two_users["jobs"]["alice"]
        for method, path in routes:
            r = client.request(method, _url(path, alices_job), headers=bob)
            assert r.status_code == 404, (
                f"bob {method} {path} on alice's job: expected 404, got {r.status_code}"
            )
            assert r.json()["error"] == "NotFound", r.text
        job = client.get(f"/v1/jobs/{alices_job['id']}").json()
        assert job["status"] == "queued" and not job["cancel_requested"], f"bob's cancel did nothing: {job}"

    def test_the_owner_and_an_admin_reach_every_route(
        self, client: TestClient, two_users: dict[str, Any]
    ) -> None:
        alice = as_user(two_users["tokens"]["alice"])
        for who, headers in (("alice", alice), ("admin", {})):
            for method, path in _job_routes(client):
                if method == "POST":  # cancel: checked once below, it changes the job
                    continue
                url = _url(path, two_users["jobs"]["alice"])
                if path.endswith("/events"):
                    # The stream of a queued job never ends; its status line is all we need.
                    client.post(f"/v1/jobs/{two_users['jobs']['alice']['id']}/cancel", headers=alice)
                r = client.request(method, url, headers=headers)
                # Reached all the same: the stacks are only a running job's, and this one is queued.
                expected = 409 if path.endswith("/stacks") else 200
                assert r.status_code == expected, (
                    f"{who} {method} {path}: expected {expected}, got {r.status_code}"
                )

    def test_lists_show_only_ones_own_jobs_and_admins_all(
        self, client: TestClient, two_users: dict[str, Any]
    ) -> None:
        for name in ("alice", "bob"):
            page = client.get("/v1/jobs", headers=as_user(two_users["tokens"][name])).json()
            ids = [j["id"] for j in page["items"]]
            assert ids == [two_users["jobs"][name]["id"]], f"{name} must see only their job, got {ids}"
        ids = {j["id"] for j in client.get("/v1/jobs").json()["items"]}
        expected = {two_users["jobs"]["alice"]["id"], two_users["jobs"]["bob"]["id"]}
        assert expected <= ids, f"an admin sees every job: expected {expected} among {ids}"

    def test_workers_show_only_ones_own_running_jobs(
        self,
        client: TestClient,
        two_users: dict[str, Any],
        sessions: sessionmaker[Session],
        settings: Settings,
    ) -> None:
        Heartbeat(
            sessions=sessions, name="w:1", address="10.0.0.9", device="cpu", slots=4, interval=5.0
        ).beat()
        placed = schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=settings)
        assert set(placed) >= {two_users["jobs"][n]["id"] for n in ("alice", "bob")}, placed
        for name in ("alice", "bob"):
            items = client.get("/v1/workers", headers=as_user(two_users["tokens"][name])).json()["items"]
            running = [j for w in items for j in w["running_jobs"]]
            assert running == [two_users["jobs"][name]["id"]], f"{name} sees only their own: {running}"


class TestBadTokens:
    @pytest.mark.parametrize("auth", ["", "Bearer", "Bearer wrong-token", "Basic YTpi", "bearer  "])
    def test_every_v1_route_answers_401_with_www_authenticate(self, client: TestClient, auth: str) -> None:
        routes = _v1_routes(client)
        assert len(routes) >= 14, f"expected every /v1 route, found {routes}"
        fake = {"id": "0" * 32, "checkpoint": 1}
        for method, path in routes:
            url = _url(path, fake).replace("{name}", "admin")
            r = client.request(method, url, headers={"Authorization": auth}, json={})
            assert r.status_code == 401, f"{method} {path} with {auth!r}: expected 401, got {r.status_code}"
            assert r.headers.get("www-authenticate") == "Bearer", f"{method} {path}: {r.headers}"


def test_artifact_paths_cannot_escape_the_root(
    client: TestClient, db: Session, settings: Settings, tmp_path: Path
) -> None:
    jid = client.post("/v1/jobs", json=SPEC).json()["id"]
    (settings.artifacts / "jobs" / jid).mkdir(parents=True)
    secret = tmp_path / "secret.pt"
    secret.write_bytes(b"secret")
    escapes = ["/etc/passwd", str(settings.artifacts / "jobs" / jid / ".." / ".." / ".." / "secret.pt")]
    link = settings.artifacts / "jobs" / jid / "link.pt"
    link.symlink_to(secret)
    escapes.append(str(link))
    for step, path in enumerate(escapes):
        db.add(Checkpoint(job_id=jid, attempt=1, step=step, path=path, size_bytes=6, sha256="d" * 64))
    db.commit()
    for item in client.get(f"/v1/jobs/{jid}/checkpoints").json()["items"]:
        r = client.get(f"/v1/jobs/{jid}/checkpoints/{item['id']}/download")
        path = escapes[item["step"]]
        assert r.status_code == 404, f"{path} is outside the artifact root: expected 404, got {r.status_code}"
        assert b"secret" not in r.content and b"root:" not in r.content, "no byte of the file is served"
