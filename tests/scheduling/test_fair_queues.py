"""Fair queues: one user's flood hides nobody's job, priority needs an admin, the queued cap, positions."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobSpec
from service.app import create_app
from service.config import Settings
from service.db import session_factory
from service.errors import ServiceError
from service.jobs import submit
from service.jobs.poll_cache import JobPollCache
from service.models import Job, User
from service.scheduling.queue import QueueFull
from service.scheduling.service import schedule_once
from service.users import service as users
from tests.api_fixtures import (
    ADMIN_TOKEN,
    SPEC,
    RecordingDispatcher,
    RecordingScheduler,
    add_user,
    as_user,
    register_node,
)
from tests.conftest import job_spec


def _spec(name: str, *, ppn: int = 1, priority: int = 0, device: str = "cpu") -> dict[str, Any]:
    return job_spec(
        SPEC,
        name=name,
        priority=priority,
        resources={"processes_per_node": ppn, "device": device},
        hyperparameters={"global_batch_size": 8 * ppn},
    )


def _round(sessions: sessionmaker[Session], settings: Settings) -> list[str]:
    return schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=settings)


def _user(session: Session, name: str) -> User:
    return session.execute(select(User).where(User.name == name)).scalar_one()


@pytest.fixture
def capped(settings: Settings, sessions: sessionmaker[Session]) -> Iterator[TestClient]:
    """The admin's client of an app whose users may each have 2 jobs queued."""
    app = create_app(settings.model_copy(update={"max_queued_per_user": 2}), scheduler=RecordingScheduler())
    app.state.session_factory = sessions
    with TestClient(app, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as c:
        yield c


class TestAFlood:
    def test_another_users_job_starts_in_the_next_round(
        self, client: TestClient, sessions: sessionmaker[Session], db: Session, settings: Settings
    ) -> None:
        register_node(sessions, name="n", slots=4)
        add_user(db, "flood")
        granted = client.patch("/v1/users/flood/permissions", json={"max_priority": 1000})
        assert granted.status_code == 200 and granted.json()["max_priority"] == 1000, granted.text
        # More than the 500 a round used to read, all ahead of anyone at priority 0: two that start,
        # 520 no node can hold, and 40 more that their owner's running limit holds back.
        flood_settings = settings.model_copy(
            update={"max_queued_per_user": 0, "max_running_jobs_per_user": 2}
        )
        with sessions.begin() as s:
            flood = _user(s, "flood")
            shapes = [1] * 2 + [8] * 520 + [1] * 40
            for i, ppn in enumerate(shapes):
                spec = JobSpec.model_validate(_spec(f"flood-{i}", ppn=ppn, priority=1000))
                submit.submit(s, user=flood, spec=spec, settings=flood_settings)
        first = _round(sessions, flood_settings)
        assert len(first) == 2, f"the flood's owner runs its limit of 2: {first}"

        ann = client.post("/v1/jobs", json=_spec("ordinary"), headers=as_user(add_user(db, "ann")))
        assert ann.status_code == 201, ann.text
        assert _round(sessions, flood_settings) == [ann.json()["id"]], "the ordinary job starts at once"
        waiting = db.execute(
            select(Job.queued_reason)
            .where(Job.status == "queued", ~Job.unplaceable)
            .order_by(Job.fair_key, Job.created_at)
            .limit(1)
        ).scalar_one()
        assert waiting == "waiting: its owner has 2 jobs running, the limit is 2", waiting
        unplaceable = db.execute(select(func.count()).where(Job.unplaceable, Job.status == "queued"))
        assert unplaceable.scalar_one() == 520

    def test_a_job_that_fits_again_is_placed_in_the_same_round(
        self, client: TestClient, sessions: sessionmaker[Session], settings: Settings
    ) -> None:
        wide = client.post("/v1/jobs", json=_spec("wide", ppn=3)).json()
        assert wide["unplaceable"] and wide["queue_position"] is None, wide
        register_node(sessions, name="big", slots=4)
        assert _round(sessions, settings) == [wide["id"]]


class TestPriority:
    def test_a_user_cannot_raise_priority_without_an_admin(self, client: TestClient, db: Session) -> None:
        bob = as_user(add_user(db, "bob"))
        r = client.post("/v1/jobs", json=_spec("urgent", priority=5), headers=bob)
        assert r.status_code == 403, r.text
        detail = r.json()["detail"]
        assert "priority 5 is above the highest priority user bob may submit, 0" in detail, detail
        assert "dptrain users grant bob --max-priority 5" in detail, detail
        assert client.post("/v1/jobs", json=_spec("humble", priority=-3), headers=bob).status_code == 201

        refused = client.patch("/v1/users/bob/permissions", json={"max_priority": 5}, headers=bob)
        assert refused.status_code == 403, "only an admin grants it"
        assert client.get("/v1/users/me", headers=bob).json()["max_priority"] == 0
        assert client.patch("/v1/users/bob/permissions", json={"max_priority": 5}).status_code == 200
        assert client.post("/v1/jobs", json=_spec("urgent", priority=5), headers=bob).status_code == 201
        assert client.post("/v1/jobs", json=_spec("more", priority=6), headers=bob).status_code == 403
        assert client.post("/v1/jobs", json=_spec("admin", priority=1000)).status_code == 201, "admins may"

    def test_a_ceiling_out_of_range_names_the_field(self, client: TestClient, db: Session) -> None:
        add_user(db, "cid")
        r = client.patch("/v1/users/cid/permissions", json={"max_priority": 1001})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "max_priority"], r.text


class TestQueuedCap:
    def test_the_cap_answers_409_with_the_reason_and_replays_do_not_count(
        self, capped: TestClient, sessions: sessionmaker[Session], db: Session, settings: Settings
    ) -> None:
        dan = as_user(add_user(db, "dan"))
        key = {"Idempotency-Key": "dan-1"}
        first = capped.post("/v1/jobs", json=_spec("a"), headers=dan | key)
        assert first.status_code == 201, first.text
        assert capped.post("/v1/jobs", json=_spec("b"), headers=dan).status_code == 201
        full = capped.post("/v1/jobs", json=_spec("c"), headers=dan)
        assert full.status_code == 409, full.text
        assert full.json() == {
            "error": "QueueFull",
            "detail": "user dan already has 2 jobs queued, the most DPTRAIN_MAX_QUEUED_PER_USER allows: "
            "submit again once some have started, or cancel some",
        }
        assert capped.post("/v1/jobs", json=_spec("a"), headers=dan | key).status_code == 200, "a replay"
        eve = as_user(add_user(db, "eve"))
        assert capped.post("/v1/jobs", json=_spec("e"), headers=eve).status_code == 201, "a cap per user"
        register_node(sessions, name="n", slots=1)
        assert _round(sessions, settings) == [first.json()["id"]]
        assert capped.post("/v1/jobs", json=_spec("c"), headers=dan).status_code == 201, "a place came free"


def test_racing_submits_of_one_user_never_pass_the_cap(own_database: str, tmp_path: Any) -> None:
    settings = Settings(database_url=own_database, home=tmp_path, max_queued_per_user=5)
    sessions = session_factory(settings)
    with sessions.begin() as s:
        users.create(s, name="racer", admin=False)
        racer = _user(s, "racer")
    spec = JobSpec.model_validate(_spec("race"))
    barrier = threading.Barrier(6)
    outcomes: list[str] = []

    def submit_three() -> None:
        barrier.wait(timeout=30)
        for _ in range(3):
            try:
                with sessions.begin() as s:
                    submit.submit(s, user=racer, spec=spec, settings=settings)
                outcomes.append("queued")
            except QueueFull:
                outcomes.append("full")
            except ServiceError as exc:  # pragma: no cover - shown in the assertion below
                outcomes.append(repr(exc))

    threads = [threading.Thread(target=submit_three) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(outcomes) == ["full"] * 13 + ["queued"] * 5, outcomes
    with sessions() as s:
        assert s.execute(select(func.count()).select_from(Job)).scalar_one() == 5


class TestQueuePosition:
    def test_positions_follow_priority_then_each_owners_turn_per_device_kind(
        self, client: TestClient, sessions: sessionmaker[Session], db: Session
    ) -> None:
        register_node(sessions, name="cpu", slots=4)
        register_node(sessions, name="gpu", slots=4, device="cuda")
        kim, leo = as_user(add_user(db, "kim")), as_user(add_user(db, "leo"))

        def post(name: str, who: dict[str, str] | None = None, **kw: Any) -> str:
            r = client.post("/v1/jobs", json=_spec(name, **kw), headers=who or {})
            assert r.status_code == 201, r.text
            return str(r.json()["id"])

        k1, k2, k3 = post("k1", kim), post("k2", kim), post("k3", kim)
        l1, l2 = post("l1", leo), post("l2", leo)
        urgent = post("urgent", priority=5)
        kc = post("kc", kim, device="cuda")
        never = post("never", kim, ppn=8)
        want = {urgent: 1, k1: 2, l1: 3, k2: 4, l2: 5, k3: 6, kc: 1, never: None}
        got = {j: client.get(f"/v1/jobs/{j}").json()["queue_position"] for j in want}
        assert got == want, f"expected {want}, got {got}"
        listed = {j["id"]: j["queue_position"] for j in client.get("/v1/jobs").json()["items"]}
        assert listed == want, "the list shows the same positions"

        before = client.get(f"/v1/jobs/{l1}")
        assert client.post(f"/v1/jobs/{k1}/cancel").status_code == 200
        again = client.get(f"/v1/jobs/{l1}", headers={"If-None-Match": before.headers["ETag"]})
        assert again.status_code == 200 and again.json()["queue_position"] == 2, (
            "a job ahead left: the position moved, and so did the ETag"
        )
        assert client.get(f"/v1/jobs/{k1}").json()["queue_position"] is None, "not queued: none"

    def test_the_poll_cache_keeps_a_queued_jobs_answer_only_briefly(self) -> None:
        now = [0.0]
        cache = JobPollCache(max_age=30.0, clock=lambda: now[0])
        cache.enable()
        cache.put("q", owner_id=1, etag='"q"', body=b"{}", seen_seq=cache.seq, max_age=2.0)
        cache.put("r", owner_id=1, etag='"r"', body=b"{}", seen_seq=cache.seq)
        now[0] = 2.5
        assert cache.get("q") is None and cache.get("r") is not None, "a position is at most 2 s old"
