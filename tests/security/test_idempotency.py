"""`Idempotency-Key` on POST /v1/jobs: one job per key and spec, 409 for another spec, safe under races."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.app import create_app
from service.config import Settings
from service.db import session_factory
from service.models import Job
from tests.api_fixtures import ADMIN_TOKEN, SPEC, RecordingScheduler, add_user, as_user


class TestReplay:
    def test_the_same_key_and_spec_answer_200_with_the_same_job_published_once(
        self, client: TestClient, scheduler: RecordingScheduler
    ) -> None:
        first = client.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "k-1"})
        assert first.status_code == 201, f"expected 201 for a new key, got {first.status_code}: {first.text}"
        # The same spec spelled differently (defaults written out, keys reordered) is the same request.
        spelled = {**dict(reversed(list(SPEC.items()))), "priority": 0, "max_restarts": 0}
        again = client.post("/v1/jobs", json=spelled, headers={"Idempotency-Key": "k-1"})
        assert again.status_code == 200, f"expected 200 for a replay, got {again.status_code}: {again.text}"
        assert again.json()["id"] == first.json()["id"], "a replay answers the original job"
        assert scheduler.kicks == 1, f"placement kicked once (for the new job), got {scheduler.kicks}"

    def test_the_same_key_with_another_spec_is_409_naming_the_key(self, client: TestClient) -> None:
        assert client.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "k-2"}).status_code == 201
        r = client.post("/v1/jobs", json={**SPEC, "name": "other"}, headers={"Idempotency-Key": "k-2"})
        assert r.status_code == 409, f"expected 409, got {r.status_code}: {r.text}"
        assert r.json()["error"] == "Conflict" and "k-2" in r.json()["detail"], r.json()

    def test_keys_belong_to_their_user(self, client: TestClient, db: Session) -> None:
        token = add_user(db, "judy")
        a = client.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "shared"})
        b = client.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "shared", **as_user(token)})
        assert (a.status_code, b.status_code) == (201, 201), "one user's key never answers another's job"
        assert a.json()["id"] != b.json()["id"]

    def test_without_a_key_every_submit_is_a_new_job(self, client: TestClient) -> None:
        ids = {client.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(2)}
        assert len(ids) == 2, "no key, no deduplication"

    @pytest.mark.parametrize("key", [b"", b"x" * 256, b"has space", "ünïcode".encode()])
    def test_a_malformed_key_is_422(self, client: TestClient, key: bytes) -> None:
        r = client.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": key})  # type: ignore[dict-item]
        assert r.status_code == 422, f"key {key!r}: expected 422, got {r.status_code}"
        assert r.json()["detail"][0]["loc"] == ["header", "idempotency-key"], r.json()


@pytest.fixture(scope="module")
def committed_app(own_database: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Settings]:
    """The real app on a database of its own: every request commits, as in production."""
    tmp = tmp_path_factory.mktemp("idem")
    settings = Settings(
        database_url=own_database,
        broker_url="memory://",
        artifact_root=tmp / "artifacts",
        bootstrap_token=ADMIN_TOKEN,  # type: ignore[arg-type]
    )
    return create_app(settings, scheduler=RecordingScheduler()), settings


def test_concurrent_retries_create_exactly_one_job(committed_app: tuple[Any, Settings]) -> None:
    app, settings = committed_app
    n = 8
    barrier = threading.Barrier(n)
    results: list[tuple[int, str]] = []
    lock = threading.Lock()
    with TestClient(app, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as client:

        def retry() -> None:
            barrier.wait(timeout=30)
            r = client.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "race"})
            with lock:
                results.append((r.status_code, r.json().get("id", r.text)))

        threads = [threading.Thread(target=retry) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    codes = sorted(code for code, _ in results)
    assert codes == [200] * (n - 1) + [201], f"expected one 201 and {n - 1} replays, got {codes}"
    assert len({job_id for _, job_id in results}) == 1, f"every answer is the same job: {results}"
    with session_factory(settings)() as session:
        count = session.execute(select(func.count()).where(Job.idempotency_key == "race")).scalar()
    assert count == 1, f"exactly one job row for the key, got {count}"
    assert app.state.scheduler.kicks == 1, f"placement kicked once: {app.state.scheduler.kicks}"
