"""Worker heartbeats: a beating worker is alive with its slots; one that stops beating is lost."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.models import Worker
from service.models.base import utcnow
from service.scheduling.service import schedule_once
from tests.api_fixtures import RecordingDispatcher, add_user, as_user, register_node, submit
from workers.node.heartbeat import Heartbeat


def test_heartbeat_then_alive_then_lost(
    client: TestClient, sessions: sessionmaker[Session], db: Session, settings: Settings
) -> None:
    heartbeat = Heartbeat(
        sessions=sessions, name="host-a:42", address="10.0.0.9", device="cpu", slots=2, interval=5.0
    )
    heartbeat.beat()
    job = submit(client)
    placed = schedule_once(sessions=sessions, dispatcher=RecordingDispatcher(), settings=settings)
    assert placed == [job["id"]], placed

    items = client.get("/v1/workers").json()["items"]
    assert [w["name"] for w in items] == ["host-a:42"], f"expected the one worker, got {items}"
    w = items[0]
    assert w["status"] == "alive", f"a fresh heartbeat is alive, got {w['status']}"
    assert (w["device"], w["slots"], w["free_slots"]) == ("cpu", 2, 0), f"expected cpu, 2 slots, 0 free: {w}"
    assert w["address"] == "10.0.0.9", w
    assert w["running_jobs"] == [job["id"]] and w["device_count"] >= 1, w
    assert 0 <= w["heartbeat_age_seconds"] < 60, w

    # Three missed beats (interval 5 s, the app's default): lost.
    db.query(Worker).filter_by(name="host-a:42").update({"last_heartbeat": utcnow() - timedelta(seconds=16)})
    db.commit()
    w = client.get("/v1/workers").json()["items"][0]
    assert w["status"] == "lost", f"a heartbeat 16 s old with a 5 s interval is lost, got {w['status']}"

    heartbeat.beat()
    w = client.get("/v1/workers").json()["items"][0]
    assert w["status"] == "alive", f"a new beat brings it back, got {w['status']}"


def test_a_stopped_heartbeat_removes_its_worker(sessions: sessionmaker[Session], db: Session) -> None:
    heartbeat = Heartbeat(
        sessions=sessions, name="host-b:7", address="10.0.0.9", device="cpu", slots=1, interval=5.0
    )
    heartbeat.stopped.set()
    heartbeat.run()  # in this thread: one beat, then the stop is seen and the row removed
    db.expire_all()
    assert db.get(Worker, "host-b:7") is None, "a worker that stops cleanly removes its row"


def test_only_admins_see_host_names_and_addresses(
    client: TestClient, sessions: sessionmaker[Session], db: Session
) -> None:
    # register_node records the host name "test-host": one node is named after it (the default),
    # the other was named by its operator.
    register_node(sessions, name="test-host", slots=2, address="10.0.0.7")
    register_node(sessions, name="gpu-a", slots=1, address="10.0.0.8")
    admin = client.get("/v1/workers").json()["items"]
    assert [(w["name"], w["hostname"], w["address"]) for w in admin] == [
        ("gpu-a", "test-host", "10.0.0.8"),
        ("test-host", "test-host", "10.0.0.7"),
    ], f"an admin sees every name, host name and address: {admin}"

    r = client.get("/v1/workers", headers=as_user(add_user(db, "una")))
    users = r.json()["items"]
    assert "test-host" not in r.text and "10.0.0." not in r.text, (
        f"a user must see no host or address: {r.text}"
    )
    assert all(w["hostname"] is None and w["address"] is None for w in users), users
    names = sorted(w["name"] for w in users)
    assert names[0] == "gpu-a" and names[1].startswith("node-") and len(names[1]) == 17, (
        f"a name that is not the host's stays, the host's becomes node-<12 hex>: {names}"
    )
    capacity = sorted((w["device"], w["slots"], w["free_slots"], w["status"]) for w in users)
    assert capacity == sorted((w["device"], w["slots"], w["free_slots"], w["status"]) for w in admin), (
        f"a user sees the same capacity as an admin: {users}"
    )
    again = client.get("/v1/workers", headers=as_user(add_user(db, "vera"))).json()["items"]
    assert sorted(w["name"] for w in again) == names, "the alias is the same on every look"


def test_a_worker_lists_the_environments_it_has_cached(
    client: TestClient, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    from workers.pyenv.environments import held, listed_environments

    def build(root: Path) -> None:
        (root / "blob").write_bytes(b"x" * 100)

    with held(cache=tmp_path, key="ab" * 32, build=build, poll=lambda: True, max_bytes=10**9):
        pass
    heartbeat = Heartbeat(
        sessions=sessions,
        name="host-env",
        address="10.0.0.9",
        device="cpu",
        slots=2,
        interval=5.0,
        environments=lambda: listed_environments(tmp_path),
    )
    heartbeat.beat()
    (w,) = client.get("/v1/workers").json()["items"]
    (env,) = w["cached_environments"]
    assert env["key"] == "ab" * 32 and env["bytes"] >= 100 and env["build_seconds"] >= 0, env
