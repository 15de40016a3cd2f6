"""`init_from` at submit: which checkpoint, who may name it (404), which it must have (422), pinned."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service.config import Settings
from service.models import Checkpoint, Job
from service.models.base import utcnow
from tests.api_fixtures import SPEC, add_user, as_user, submit


def _checkpoint(db: Session, settings: Settings, job_id: str, step: int, *, best: bool = False) -> str:
    """A checkpoint file of `job_id` (with its sha256 sidecar) and its row, as the worker records one."""
    folder = settings.artifacts / "jobs" / job_id / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ckpt-{step:09d}.pt"
    path.write_bytes(f"weights of step {step}".encode())
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(f"{sha}  {path.name}\n")
    db.add(
        Checkpoint(
            job_id=job_id,
            attempt=1,
            step=step,
            path=str(path),
            size_bytes=path.stat().st_size,
            sha256=sha,
            created_at=utcnow(),
            best=best,
        )
    )
    db.commit()
    return sha


@pytest.fixture
def source(client: TestClient, db: Session, settings: Settings) -> dict[str, Any]:
    """A job with checkpoints at steps 10 (its best), 20 and 30; their sha256s by step."""
    jid = str(submit(client)["id"])
    shas = {step: _checkpoint(db, settings, jid, step, best=step == 10) for step in (10, 20, 30)}
    return {"id": jid, "sha256": shas}


def _spec(init: dict[str, Any]) -> dict[str, Any]:
    return {**SPEC, "init_from": init}


@pytest.mark.parametrize(("init", "step"), [({}, 30), ({"step": 20}, 20), ({"best": True}, 10)])
def test_the_named_checkpoint_is_pinned_and_shown_on_the_job(
    client: TestClient,
    db: Session,
    settings: Settings,
    source: dict[str, Any],
    init: dict[str, Any],
    step: int,
) -> None:
    r = client.post("/v1/jobs", json=_spec({"job": source["id"], **init}))
    assert r.status_code == 201, r.text
    job = r.json()
    want = {"job": source["id"], "step": step, "sha256": source["sha256"][step]}
    assert job["init_checkpoint"] == want, job["init_checkpoint"]
    assert job["spec"]["init_from"] == {
        "job": source["id"],
        "step": init.get("step"),
        "best": "best" in init,
        "resume": False,
    }
    row = db.get(Job, job["id"])
    assert row is not None and row.init_path is not None
    pinned = Path(row.init_path)
    original = settings.artifacts / "jobs" / source["id"] / "checkpoints" / pinned.name
    assert pinned.parent == settings.artifacts.resolve() / "jobs" / job["id"] / "init"
    # A hard link (the same inode), with its sidecar: the source's pruning or deletion leaves it.
    assert os.path.samefile(pinned, original)
    assert pinned.with_name(pinned.name + ".sha256").exists()
    shutil.rmtree(settings.artifacts / "jobs" / source["id"])
    assert hashlib.sha256(pinned.read_bytes()).hexdigest() == source["sha256"][step]


def test_another_users_job_is_404_as_its_get_is(
    client: TestClient, db: Session, source: dict[str, Any]
) -> None:
    other = as_user(add_user(db, "other"))
    assert client.get(f"/v1/jobs/{source['id']}", headers=other).status_code == 404
    r = client.post("/v1/jobs", json=_spec({"job": source["id"]}), headers=other)
    assert r.status_code == 404, r.text
    assert source["id"] in r.json()["detail"] and "init_from.job" in r.json()["detail"]
    r = client.post("/v1/jobs", json=_spec({"job": "0" * 32}))
    assert r.status_code == 404, r.text


@pytest.mark.parametrize(
    ("init", "loc", "words"),
    [
        (
            {"step": 25},
            ["body", "init_from", "step"],
            "no checkpoint of step 25 (its checkpoints: 10, 20, 30)",
        ),
        ({"best": True}, ["body", "init_from", "best"], "no best checkpoint"),
    ],
)
def test_a_checkpoint_the_source_does_not_have_is_422_naming_the_field(
    client: TestClient, db: Session, source: dict[str, Any], init: dict[str, Any], loc: list[str], words: str
) -> None:
    if "best" in init:
        db.query(Checkpoint).filter_by(job_id=source["id"]).update({"best": False})
        db.commit()
    r = client.post("/v1/jobs", json=_spec({"job": source["id"], **init}))
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == loc and words in error["msg"], error


def test_a_source_without_checkpoints_or_whose_file_is_gone_is_422(
    client: TestClient, settings: Settings, source: dict[str, Any]
) -> None:
    bare = submit(client)["id"]
    r = client.post("/v1/jobs", json=_spec({"job": bare}))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "init_from", "job"], r.text
    (settings.artifacts / "jobs" / source["id"] / "checkpoints" / "ckpt-000000030.pt").unlink()
    r = client.post("/v1/jobs", json=_spec({"job": source["id"]}))
    assert r.status_code == 422 and "no longer available" in r.text, r.text


@pytest.mark.parametrize(
    ("init", "loc"),
    [
        ({"job": "x" * 32}, ["body", "init_from", "job"]),
        ({"job": "a" * 32, "step": 3, "best": True}, ["body", "init_from"]),
        ({"job": "a" * 32, "step": -1}, ["body", "init_from", "step"]),
        ({"job": "a" * 32, "resume": "yes"}, ["body", "init_from", "resume"]),
    ],
)
def test_a_malformed_init_from_is_422_naming_the_field(
    client: TestClient, init: dict[str, Any], loc: list[str]
) -> None:
    r = client.post("/v1/jobs", json=_spec(init))
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == loc, r.json()


def test_a_replay_answers_the_earlier_job_once_the_source_checkpoint_is_gone(
    client: TestClient, db: Session, settings: Settings, source: dict[str, Any]
) -> None:
    body, headers = _spec({"job": source["id"], "step": 20}), {"Idempotency-Key": "init-once"}
    first = client.post("/v1/jobs", json=body, headers=headers)
    assert first.status_code == 201, first.text
    db.query(Checkpoint).filter_by(job_id=source["id"]).delete()
    db.commit()
    shutil.rmtree(settings.artifacts / "jobs" / source["id"])
    again = client.post("/v1/jobs", json=body, headers=headers)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"], again.text
    other = client.post("/v1/jobs", json=_spec({"job": source["id"], "step": 30}), headers=headers)
    assert other.status_code == 409, other.text
