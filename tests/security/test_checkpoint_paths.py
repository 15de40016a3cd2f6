"""A checkpoint row's file is its job's own file of its step, whatever path the row holds, on both databases.

Rows written by older versions hold the path a rank reported, which a forged event pointed at other
jobs' files; downloads and init_from pins derive the file from the row's job and step instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.models import Checkpoint
from service.users import service as users
from tests.api_fixtures import SPEC, as_user
from tests.backends import BACKENDS, client_on, sessions_of


@pytest.fixture(params=BACKENDS)
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    """An admin's client on PostgreSQL, then on SQLite."""
    yield from client_on(request, tmp_path)


def _user(api: TestClient, name: str) -> dict[str, str]:
    with sessions_of(api).begin() as s:
        return as_user(users.create(s, name=name, admin=False).token)


def _job(api: TestClient, headers: dict[str, str]) -> str:
    r = api.post("/v1/jobs", json=SPEC, headers=headers)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _row(api: TestClient, job_id: str, step: int, path: Path | str) -> None:
    with sessions_of(api).begin() as s:
        s.add(Checkpoint(job_id=job_id, attempt=1, step=step, path=str(path), size_bytes=6, sha256="c" * 64))


def _items(api: TestClient, job_id: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = api.get(f"/v1/jobs/{job_id}/checkpoints", headers=headers).json()["items"]
    return items


def test_a_stored_path_to_another_jobs_files_serves_and_pins_nothing(api: TestClient) -> None:
    root = Path(api.app.state.settings.artifacts)  # type: ignore[attr-defined]
    bob, alice = _user(api, "bob"), _user(api, "alice")
    bob_job, alice_job = _job(api, bob), _job(api, alice)
    bob_dir = root / "jobs" / bob_job
    files = {
        bob_dir / "checkpoints" / "ckpt-000000001.pt": b"BOB-CKPT",
        bob_dir / "attempt-1" / "node-0" / "spec.json": b'{"env": {"WANDB_API_KEY": "BOB-ENV"}}',
        bob_dir / "outputs" / "model.bin": b"BOB-OUTPUT",
    }
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    # Bob's own row, stored with a path that is not where his file is: his file is still his.
    _row(api, bob_job, 1, "/somewhere/else.pt")
    # Alice's rows, as an older version stored them from her ranks' forged events.
    for step, path in enumerate(files, start=1):
        _row(api, alice_job, step, path)

    for item in _items(api, alice_job, alice):
        r = api.get(f"/v1/jobs/{alice_job}/checkpoints/{item['id']}/download", headers=alice)
        assert r.status_code == 404 and b"BOB" not in r.content, (
            f"step {item['step']}: {r.status_code} {r.content!r}"
        )
    for step in (1, 2, 3):
        r = api.post("/v1/jobs", json={**SPEC, "init_from": {"job": alice_job, "step": step}}, headers=alice)
        assert r.status_code == 422 and "no longer available" in r.text, f"init_from step {step}: {r.text}"
    assert not any((root / "jobs").glob("*/init/*")), "nothing of Bob's is pinned for Alice"

    (item,) = _items(api, bob_job, bob)
    r = api.get(f"/v1/jobs/{bob_job}/checkpoints/{item['id']}/download", headers=bob)
    assert r.status_code == 200 and r.content == b"BOB-CKPT", "a job's own file of the step is served"
    r = api.post("/v1/jobs", json={**SPEC, "init_from": {"job": bob_job}}, headers=bob)
    assert r.status_code == 201, r.text
    (pinned,) = (root / "jobs" / r.json()["id"] / "init").glob("ckpt-*.pt")
    assert pinned.read_bytes() == b"BOB-CKPT", "init_from pins the job's own file of the step"
