"""A job no live node could ever hold says so at once (submit answer, GET) and while it holds (each round)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.models import Worker
from service.models.base import utcnow
from service.scheduling.service import schedule_once
from tests.api_fixtures import SPEC, RecordingDispatcher, register_node
from tests.conftest import job_spec

NO_NODE = "no live node can hold this job: it needs 1 node with 3 free cpu slots; no live cpu node"
TOO_SMALL = (
    "no live node can hold this job: it needs 1 node with 3 free cpu slots; "
    "1 live cpu node, the largest with 2 slots"
)


def _wide(name: str = "wide") -> dict[str, Any]:
    return job_spec(
        SPEC, name=name, resources={"processes_per_node": 3}, hyperparameters={"global_batch_size": 12}
    )


def _flags(job: dict[str, Any]) -> tuple[str, bool, list[str], str | None]:
    return job["status"], job["unplaceable"], job["warnings"], job["queued_reason"]


def _round(sessions: sessionmaker[Session], settings: Settings) -> list[str]:
    return schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=settings)


class TestTheSubmitAnswer:
    def test_with_no_live_node_it_warns(self, client: TestClient) -> None:
        r = client.post("/v1/jobs", json=_wide())
        assert r.status_code == 201, r.text
        assert _flags(r.json()) == ("queued", True, [NO_NODE], NO_NODE), r.json()
        shown = client.get(f"/v1/jobs/{r.json()['id']}").json()
        assert _flags(shown) == ("queued", True, [NO_NODE], NO_NODE), "GET says it too, before any round"

    def test_a_node_too_small_is_named_with_its_size(
        self, client: TestClient, sessions: sessionmaker[Session]
    ) -> None:
        register_node(sessions, name="small", slots=2)
        job = client.post("/v1/jobs", json=_wide()).json()
        assert _flags(job) == ("queued", True, [TOO_SMALL], TOO_SMALL), job

    def test_a_job_that_fits_gets_no_warning(
        self, client: TestClient, sessions: sessionmaker[Session]
    ) -> None:
        register_node(sessions, name="roomy", slots=4)
        job = client.post("/v1/jobs", json=_wide()).json()
        assert _flags(job) == ("queued", False, [], None), job

    def test_an_idempotent_replay_warns_as_well(self, client: TestClient) -> None:
        key = {"Idempotency-Key": "unplaceable-once"}
        first = client.post("/v1/jobs", json=_wide(), headers=key)
        again = client.post("/v1/jobs", json=_wide(), headers=key)
        assert (first.status_code, again.status_code) == (201, 200), (first.text, again.text)
        assert again.json()["warnings"] == [NO_NODE], again.json()

    def test_nodes_of_another_device_do_not_count(
        self, client: TestClient, sessions: sessionmaker[Session]
    ) -> None:
        register_node(sessions, name="gpu", slots=8, device="cuda")
        assert client.post("/v1/jobs", json=_wide()).json()["warnings"] == [NO_NODE]


class TestEachRound:
    def test_a_node_that_joins_clears_the_flag_and_one_that_goes_stale_sets_it(
        self, client: TestClient, sessions: sessionmaker[Session], db: Session, settings: Settings
    ) -> None:
        one = settings.model_copy(update={"max_running_jobs_per_user": 1})
        register_node(sessions, name="small", slots=2)
        # A first job fills the owner's limit, so the wide one stays queued once it could run.
        first = client.post(
            "/v1/jobs", json=job_spec(SPEC, name="first", resources={"processes_per_node": 1})
        )
        wide = client.post("/v1/jobs", json=_wide()).json()
        assert _round(sessions, one) == [first.json()["id"]]
        before = client.get(f"/v1/jobs/{wide['id']}")
        assert _flags(before.json()) == ("queued", True, [TOO_SMALL], TOO_SMALL), before.json()

        register_node(sessions, name="big", slots=4)
        assert _round(sessions, one) == [], "the owner's limit still holds it"
        after = client.get(f"/v1/jobs/{wide['id']}")
        waiting = "waiting: its owner has 1 jobs running, the limit is 1"
        assert _flags(after.json()) == ("queued", False, [], waiting), after.json()
        assert after.headers["ETag"] != before.headers["ETag"], "a poller must see the flag change"

        with sessions.begin() as s:
            s.query(Worker).filter_by(name="big").update({"last_heartbeat": utcnow() - timedelta(minutes=1)})
        assert _round(sessions, one) == []
        again = client.get(f"/v1/jobs/{wide['id']}").json()
        assert _flags(again) == ("queued", True, [TOO_SMALL], TOO_SMALL), "its only fitting node went stale"

    def test_a_placed_job_is_no_longer_flagged(
        self, client: TestClient, sessions: sessionmaker[Session], settings: Settings
    ) -> None:
        wide = client.post("/v1/jobs", json=_wide()).json()
        assert wide["unplaceable"], wide
        register_node(sessions, name="big", slots=4)
        assert _round(sessions, settings) == [wide["id"]]
        shown = client.get(f"/v1/jobs/{wide['id']}").json()
        assert _flags(shown) == ("running", False, [], None), shown


def test_on_sqlite_too(sqlite_client: TestClient) -> None:
    job = sqlite_client.post("/v1/jobs", json=_wide()).json()
    assert _flags(job) == ("queued", True, [NO_NODE], NO_NODE), f"the embedded service's database: {job}"
