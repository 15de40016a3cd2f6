"""`/v1/code`: archives stored once under their hash, streamed in under a cap, read by whom they concern."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from service.code.storage import archive_path, code_dir
from service.config import Settings
from service.models import CodeArchive, CodeUpload
from service.models.base import utcnow
from tests.api_fixtures import as_user
from tests.backends import BACKENDS, sessions_of
from workers.reconciler import purge_expired

LIMIT = 4096
LIMIT_TEXT = f"DPTRAIN_CODE_MAX_BYTES = {LIMIT} bytes"
GZIP = {"Content-Type": "application/gzip"}


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A small archive cap, so that 413s cost a few kilobytes."""
    return settings.model_copy(update={"code_max_bytes": LIMIT})


@pytest.fixture
def sqlite_settings() -> dict[str, Any]:
    """The same cap on SQLite."""
    return {"code_max_bytes": LIMIT}


@pytest.fixture(params=BACKENDS)
def api(request: pytest.FixtureRequest) -> TestClient:
    """An admin's client on PostgreSQL, then on SQLite."""
    return request.getfixturevalue("client" if request.param == "postgresql" else "sqlite_client")


def archive(text: str = "print('hello')\n") -> tuple[bytes, str]:
    """A .tar.gz holding train.py with `text`, and its sha256."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = text.encode()
        info = tarfile.TarInfo("train.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    body = buf.getvalue()
    return body, hashlib.sha256(body).hexdigest()


def new_user(api: TestClient, name: str, *, can_run_code: bool = True) -> dict[str, str]:
    """Headers of a new user, made by the admin over the API."""
    r = api.post("/v1/users", json={"name": name, "can_run_code": can_run_code})
    assert r.status_code == 201, r.text
    return as_user(r.json()["token"])


def artifacts(api: TestClient) -> Path:
    settings: Settings = api.app.state.settings  # type: ignore[attr-defined]
    return settings.artifacts


def stored(api: TestClient) -> tuple[list[str], int, int]:
    """The files in the code folder (temporary ones included), the archive rows, the uploader rows."""
    folder = code_dir(artifacts(api))
    files = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    with sessions_of(api)() as s:
        archives = s.execute(select(func.count()).select_from(CodeArchive)).scalar_one()
        uploads = s.execute(select(func.count()).select_from(CodeUpload)).scalar_one()
    return files, archives, uploads


def chunked(body: bytes) -> Iterator[bytes]:
    """The body as a stream: sent without a Content-Length."""
    for i in range(0, len(body), 1000):
        yield body[i : i + 1000]


class TestUpload:
    def test_an_archive_is_stored_once_under_its_hash(self, api: TestClient) -> None:
        body, sha = archive()
        missing = api.head(f"/v1/code/{sha}")
        assert missing.status_code == 404, "nothing stored yet"
        limit = str(api.app.state.settings.code_max_bytes)  # type: ignore[attr-defined]
        assert missing.headers["x-code-max-bytes"] == limit, "the limit is told before any upload"
        r = api.put(f"/v1/code/{sha}", content=body, headers=GZIP)
        assert r.status_code == 201, r.text
        head = api.head(f"/v1/code/{sha}")
        assert head.status_code == 200 and head.headers["content-length"] == str(len(body)), head.headers
        again = api.put(f"/v1/code/{sha}", content=body, headers=GZIP)
        assert again.status_code == 200, f"a second upload of the same bytes is 200: {again.text}"
        assert stored(api) == ([f"{sha}.tar.gz"], 1, 1), "one file, one archive row, one uploader"
        assert archive_path(artifacts(api), sha).read_bytes() == body

    def test_a_streamed_body_without_content_length_is_stored(self, api: TestClient) -> None:
        body, sha = archive("x = 1\n")
        r = api.put(f"/v1/code/{sha}", content=chunked(body), headers=GZIP)
        assert r.status_code == 201, r.text
        assert archive_path(artifacts(api), sha).read_bytes() == body

    def test_a_body_whose_hash_differs_is_422_at_the_path_and_not_kept(self, api: TestClient) -> None:
        body, sha = archive()
        _, other = archive("something else\n")
        r = api.put(f"/v1/code/{other}", content=body, headers=GZIP)
        assert r.status_code == 422, r.text
        (entry,) = r.json()["detail"]
        assert entry["loc"] == ["path", "sha256"] and sha in entry["msg"] and other in entry["msg"], entry
        assert stored(api) == ([], 0, 0), "nothing stored, no temporary file left"

    @pytest.mark.parametrize("streamed", [False, True], ids=["content-length", "chunked"])
    def test_an_archive_over_the_cap_is_413_naming_it(self, api: TestClient, streamed: bool) -> None:
        body = gzip.compress(b"") + b"\x00" * LIMIT
        sha = hashlib.sha256(body).hexdigest()
        r = api.put(f"/v1/code/{sha}", content=chunked(body) if streamed else body, headers=GZIP)
        assert r.status_code == 413, r.text
        assert LIMIT_TEXT in r.json()["detail"] and ".dptrainignore" in r.json()["detail"], r.text
        assert stored(api) == ([], 0, 0), "nothing stored, no temporary file left"

    def test_an_archive_of_exactly_the_cap_is_stored(self, api: TestClient) -> None:
        body = gzip.compress(b"")
        body += b"\x00" * (LIMIT - len(body))
        r = api.put(f"/v1/code/{hashlib.sha256(body).hexdigest()}", content=body, headers=GZIP)
        assert r.status_code == 201, r.text

    def test_a_body_that_is_not_gzip_is_422(self, api: TestClient) -> None:
        body = b"PK\x03\x04 a zip file"
        r = api.put(f"/v1/code/{hashlib.sha256(body).hexdigest()}", content=body, headers=GZIP)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"], r.text
        assert "gzip" in r.json()["detail"][0]["msg"], r.text
        assert stored(api) == ([], 0, 0)

    @pytest.mark.parametrize("bad", ["A" * 64, "a" * 63, "a" * 65, "g" * 64])
    def test_a_path_that_is_no_sha256_is_422(self, api: TestClient, bad: str) -> None:
        for method in ("PUT", "GET"):
            r = api.request(method, f"/v1/code/{bad}", content=b"\x1f\x8b")
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "sha256"], r.text

    def test_the_body_cap_of_json_routes_does_not_apply(self, api: TestClient) -> None:
        settings: Settings = api.app.state.settings  # type: ignore[attr-defined]
        api.app.state.settings = settings.model_copy(update={"code_max_bytes": 3 << 20})  # type: ignore[attr-defined]
        body = gzip.compress(b"") + bytes(range(256)) * (6 << 10)  # 1.5 MiB, over the 1 MiB JSON cap
        r = api.put(f"/v1/code/{hashlib.sha256(body).hexdigest()}", content=body, headers=GZIP)
        assert r.status_code == 201, r.text


class TestWhoMay:
    def test_only_whom_it_concerns_reads_an_archive(self, api: TestClient) -> None:
        body, sha = archive()
        ann, bea, cas = new_user(api, "ann"), new_user(api, "bea"), new_user(api, "cas")
        assert api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **ann}).status_code == 201
        mine = api.get(f"/v1/code/{sha}", headers=ann)
        assert mine.status_code == 200 and mine.content == body, mine.text
        assert mine.headers["x-code-sha256"] == sha
        other = api.get(f"/v1/code/{sha}", headers=bea)
        assert other.status_code == 404 and other.json()["detail"] == f"no code archive {sha}", (
            f"as for an unknown archive: existence is not told: {other.text}"
        )
        assert api.get(f"/v1/code/{sha}").content == body, "an admin reads every archive"
        assert api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **bea}).status_code == 200
        assert api.get(f"/v1/code/{sha}", headers=bea).status_code == 200, "an uploader of stored bytes too"
        assert api.get(f"/v1/code/{sha}", headers=cas).status_code == 404
        job = {"name": "c", "command": ["python", "train.py"], "code": {"sha256": sha}}
        assert api.post("/v1/jobs", json=job, headers=cas).status_code == 201
        assert api.get(f"/v1/code/{sha}", headers=cas).content == body, "the owner of a job that uses it"

    def test_a_user_not_granted_code_may_not_upload(self, api: TestClient) -> None:
        body, sha = archive()
        dan = new_user(api, "dan", can_run_code=False)
        r = api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **dan})
        assert r.status_code == 403 and "dptrain users grant dan --can-run-code" in r.json()["detail"], r.text
        assert stored(api) == ([], 0, 0)
        assert (
            api.patch("/v1/users/dan/permissions", json={"can_run_code": True}).json()["can_run_code"] is True
        )
        assert api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **dan}).status_code == 201

    @pytest.mark.parametrize("mode", ["off", "allowlist"])
    def test_no_uploads_unless_the_server_takes_uploaded_code(self, api: TestClient, mode: str) -> None:
        settings: Settings = api.app.state.settings  # type: ignore[attr-defined]
        api.app.state.settings = settings.model_copy(update={"user_code": mode})  # type: ignore[attr-defined]
        body, sha = archive()
        r = api.put(f"/v1/code/{sha}", content=body, headers=GZIP)
        assert r.status_code == 403 and f"DPTRAIN_USER_CODE={mode}" in r.json()["detail"], r.text

    def test_every_route_wants_a_token(self, api: TestClient) -> None:
        sha = "0" * 64
        for method in ("HEAD", "PUT", "GET"):
            r = api.request(method, f"/v1/code/{sha}", headers={"Authorization": ""})
            assert r.status_code == 401, f"{method}: {r.status_code}"


def test_retention_deletes_old_archives_no_job_uses(api: TestClient) -> None:
    (used, used_sha), (old, old_sha), (fresh, fresh_sha) = archive("a"), archive("b"), archive("c")
    for body, sha in ((used, used_sha), (old, old_sha), (fresh, fresh_sha)):
        assert api.put(f"/v1/code/{sha}", content=body, headers=GZIP).status_code == 201
    job = {"name": "u", "command": ["python", "train.py"], "code": {"sha256": used_sha}}
    assert api.post("/v1/jobs", json=job).status_code == 201
    sessions = sessions_of(api)
    with sessions.begin() as s:
        long_ago = utcnow() - timedelta(days=30)
        s.execute(update(CodeArchive).where(CodeArchive.sha256 != fresh_sha).values(last_used_at=long_ago))
    root = artifacts(api)
    purge_expired(sessions=sessions, retention_days=0, artifacts=root)
    assert stored(api)[1] == 3, "retention 0 keeps everything"
    purge_expired(sessions=sessions, retention_days=7, artifacts=root)
    files, archives, uploads = stored(api)
    assert files == sorted(f"{sha}.tar.gz" for sha in (used_sha, fresh_sha)), files
    assert (archives, uploads) == (2, 2), "the old unused archive's rows are gone, its uploads with it"
    assert api.head(f"/v1/code/{old_sha}").status_code == 404


def test_uploads_left_half_received_are_swept_after_a_day(api: TestClient) -> None:
    folder = code_dir(artifacts(api))
    folder.mkdir(parents=True, exist_ok=True)
    stale, live = folder / ".upload-dead.part", folder / ".upload-live.part"
    for part in (stale, live):
        part.write_bytes(b"\x1f\x8b half")
    day_ago = time.time() - 86_400 - 60
    os.utime(stale, (day_ago, day_ago))
    purge_expired(sessions=sessions_of(api), retention_days=0, artifacts=artifacts(api))
    assert not stale.exists(), "an upload a dead API process left behind is litter"
    assert live.exists(), "an upload still being received is left alone"
