"""The submit's code policy: DPTRAIN_USER_CODE, the user's grant, the allow-list, the archives held."""

from __future__ import annotations

import gzip
import hashlib
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from service.config import Settings
from service.models import CodeArchive
from service.models.base import utcnow
from tests.api_fixtures import SPEC, as_user
from tests.backends import BACKENDS, sessions_of

ARCHIVE = gzip.compress(b"not really a tar, but gzip")
SHA = hashlib.sha256(ARCHIVE).hexdigest()
ALLOWED = "team_a.models"


@pytest.fixture(params=BACKENDS)
def api(request: pytest.FixtureRequest) -> TestClient:
    """An admin's client on PostgreSQL, then on SQLite, with one allowed prefix and one archive stored."""
    backend = "client" if request.param == "postgresql" else "sqlite_client"
    client: TestClient = request.getfixturevalue(backend)
    set_mode(client, "uploaded")
    r = client.put(f"/v1/code/{SHA}", content=ARCHIVE, headers={"Content-Type": "application/gzip"})
    assert r.status_code == 201, r.text
    return client


def set_mode(api: TestClient, mode: str) -> None:
    """Run the app with DPTRAIN_USER_CODE=`mode` from the next request on."""
    settings: Settings = api.app.state.settings  # type: ignore[attr-defined]
    update_ = {"user_code": mode, "allowed_entrypoints": ALLOWED}
    api.app.state.settings = settings.model_copy(update=update_)  # type: ignore[attr-defined]


def user(api: TestClient, name: str, *, can_run_code: bool) -> dict[str, str]:
    """Headers of a new user."""
    r = api.post("/v1/users", json={"name": name, "can_run_code": can_run_code})
    assert r.status_code == 201, r.text
    return as_user(r.json()["token"])


CODE = {"sha256": SHA}
# Each way a spec runs user code.
KINDS: dict[str, dict[str, Any]] = {
    "command with code": {"name": "c", "command": ["python", "train.py"], "code": CODE},
    "entrypoint in code": {"name": "e", "entrypoint": "train:plan", "code": CODE},
    "command": {"name": "c", "command": ["python", "-m", "team_a.models.train"]},
    "allowed entrypoint": {"name": "e", "entrypoint": f"{ALLOWED}.resnet:plan"},
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_user_not_granted_code_may_run_only_recipes(api: TestClient, kind: str) -> None:
    eve = user(api, "eve", can_run_code=False)
    r = api.post("/v1/jobs", json=KINDS[kind], headers=eve)
    assert r.status_code == 403, r.text
    assert "user eve may not run code" in r.json()["detail"] and "dptrain users grant eve" in r.text, r.text
    assert api.post("/v1/jobs", json=SPEC, headers=eve).status_code == 201, "a recipe needs no grant"


@pytest.mark.parametrize("kind", KINDS)
def test_uploaded_mode_runs_every_kind_for_a_granted_user(api: TestClient, kind: str) -> None:
    fay = user(api, "fay", can_run_code=True)
    # Her own upload of the archive: a spec names only an archive its submitter uploaded.
    put = api.put(f"/v1/code/{SHA}", content=ARCHIVE, headers={"Content-Type": "application/gzip", **fay})
    assert put.status_code == 201, put.text
    r = api.post("/v1/jobs", json=KINDS[kind], headers=fay)
    assert r.status_code == 201, r.text
    assert r.json()["spec"].get("code") == KINDS[kind].get("code"), "the stored spec keeps its code"


@pytest.mark.parametrize("kind", KINDS)
def test_off_runs_no_user_code_even_for_an_admin(api: TestClient, kind: str) -> None:
    set_mode(api, "off")
    r = api.post("/v1/jobs", json=KINDS[kind])
    assert r.status_code == 403 and "DPTRAIN_USER_CODE=off" in r.json()["detail"], r.text
    assert api.post("/v1/jobs", json=SPEC).status_code == 201, "recipes still run"


def test_allowlist_runs_only_installed_entrypoints(api: TestClient) -> None:
    set_mode(api, "allowlist")
    for kind in ("command with code", "entrypoint in code", "command"):
        r = api.post("/v1/jobs", json=KINDS[kind])
        assert r.status_code == 403, f"{kind}: {r.text}"
        assert "DPTRAIN_USER_CODE=allowlist" in r.json()["detail"], r.text
    assert api.post("/v1/jobs", json=KINDS["allowed entrypoint"]).status_code == 201
    r = api.post("/v1/jobs", json={"name": "e", "entrypoint": "os:system"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "entrypoint"], r.text
    assert f"DPTRAIN_ALLOWED_ENTRYPOINTS: {ALLOWED}" in r.json()["detail"][0]["msg"], r.text


def test_an_entrypoint_without_code_must_be_under_the_prefixes(api: TestClient) -> None:
    r = api.post("/v1/jobs", json={"name": "e", "entrypoint": "train:plan"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "entrypoint"], r.text


def test_code_the_server_does_not_hold_is_422_at_its_field(api: TestClient) -> None:
    unknown = "f" * 64
    r = api.post("/v1/jobs", json={**KINDS["command with code"], "code": {"sha256": unknown}})
    assert r.status_code == 422, r.text
    (entry,) = r.json()["detail"]
    assert entry["loc"] == ["body", "code", "sha256"], entry
    expected = f"no code archive {unknown} uploaded by you; upload it first with PUT /v1/code/{unknown}"
    assert entry["msg"] == expected, entry


def test_a_submit_marks_its_archive_used(api: TestClient) -> None:
    long_ago = utcnow() - timedelta(days=30)
    with sessions_of(api).begin() as s:
        s.execute(update(CodeArchive).where(CodeArchive.sha256 == SHA).values(last_used_at=long_ago))
    assert api.post("/v1/jobs", json=KINDS["command with code"]).status_code == 201
    with sessions_of(api)() as s:
        used = s.execute(select(CodeArchive.last_used_at).where(CodeArchive.sha256 == SHA)).scalar_one()
    assert used > utcnow() - timedelta(minutes=5), f"last used {used}, not at the submit"
