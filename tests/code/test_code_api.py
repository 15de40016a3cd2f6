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
from sqlalchemy import delete, func, select, update

from dptrain.client import Client
from rank_contract.layout import code_archive, code_folder
from service.config import Settings
from service.models import Checkpoint, CodeArchive, CodeUpload, Job, User
from service.models.base import utcnow
from service.sweeps import driver
from tests.api_fixtures import as_user
from tests.backends import BACKENDS, sessions_of
from workers.node.reconciler import purge_expired

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
    folder = code_folder(artifacts(api))
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
        assert code_archive(artifacts(api), sha).read_bytes() == body

    def test_a_streamed_body_without_content_length_is_stored(self, api: TestClient) -> None:
        body, sha = archive("x = 1\n")
        r = api.put(f"/v1/code/{sha}", content=chunked(body), headers=GZIP)
        assert r.status_code == 201, r.text
        assert code_archive(artifacts(api), sha).read_bytes() == body

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
        assert api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **bea}).status_code == 201
        assert api.get(f"/v1/code/{sha}", headers=bea).status_code == 200, "an uploader of stored bytes too"
        assert api.get(f"/v1/code/{sha}", headers=cas).status_code == 404

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


def job_naming(sha: str, name: str = "c", **more: Any) -> dict[str, Any]:
    """A command job whose code is the archive `sha`."""
    return {"name": name, "command": ["python", "train.py"], "code": {"sha256": sha}, **more}


def sweep_naming(sha: str, **overrides: Any) -> dict[str, Any]:
    """A sweep of command jobs whose base names the archive `sha`."""
    body: dict[str, Any] = {
        "name": "s",
        "base": job_naming(sha),
        "space": {"env.MODE": {"choice": ["a", "b"]}},
        "objective": {"metric": "loss", "direction": "minimize"},
        "max_trials": 2,
        "max_concurrent_trials": 1,
    }
    return body | overrides


def code_answers(api: TestClient, sha: str, headers: dict[str, str]) -> tuple[int, int]:
    """The statuses of HEAD and GET of the archive for whoever `headers` name."""
    url = f"/v1/code/{sha}"
    return api.head(url, headers=headers).status_code, api.get(url, headers=headers).status_code


class TestOwnership:
    """An archive is usable by whoever uploaded its bytes (and admins): its hash alone is no claim."""

    def test_another_users_archive_is_refused_as_if_absent_until_its_bytes_are_uploaded(
        self, api: TestClient
    ) -> None:
        body, sha = archive()
        _, absent = archive("never uploaded\n")
        ann, bea = new_user(api, "ann"), new_user(api, "bea")
        assert api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **ann}).status_code == 201
        assert api.post("/v1/jobs", json=job_naming(sha), headers=ann).status_code == 201, "the uploader's"
        theirs = api.post("/v1/jobs", json=job_naming(sha), headers=bea)
        missing = api.post("/v1/jobs", json=job_naming(absent), headers=bea)
        assert theirs.status_code == 422, f"a hash read off a spec or a CI log runs nothing: {theirs.text}"
        (entry,) = theirs.json()["detail"]
        assert entry["loc"] == ["body", "code", "sha256"] and "uploaded by you" in entry["msg"], entry
        assert (theirs.status_code, theirs.text.replace(sha, absent)) == (
            missing.status_code,
            missing.text,
        ), "refused word for word as an archive that does not exist"
        assert code_answers(api, sha, bea) == (404, 404), "neither fetched nor confirmed to exist"
        assert api.get(f"/v1/code/{sha}", headers=bea).json() == {
            "error": "NotFound",
            "detail": f"no code archive {sha}",
        }
        head, unknown = api.head(f"/v1/code/{sha}", headers=bea), api.head(f"/v1/code/{absent}", headers=bea)
        assert dict(head.headers) == dict(unknown.headers), "HEAD tells nothing an unknown archive would not"
        assert code_answers(api, sha, ann) == (200, 200), "the uploader"
        assert code_answers(api, sha, {}) == (200, 200), "an admin"
        assert api.post("/v1/jobs", json=job_naming(sha, "by-admin")).status_code == 201, "an admin names any"
        # The same bytes uploaded again make bea an uploader too; 201, as for bytes never seen, so
        # the answer does not tell her that ann had them.
        assert api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **bea}).status_code == 201
        assert code_answers(api, sha, bea) == (200, 200)
        assert api.post("/v1/jobs", json=job_naming(sha), headers=bea).status_code == 201
        assert code_answers(api, sha, ann) == (200, 200), "ann keeps hers"
        assert api.post("/v1/jobs", json=job_naming(sha, "again"), headers=ann).status_code == 201
        assert api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **bea}).status_code == 200, (
            "an uploader's upload again is 200: nothing to prove"
        )

    def test_a_body_that_is_not_the_archive_claims_nothing(self, api: TestClient) -> None:
        body, sha = archive()
        ann, bea = new_user(api, "ann"), new_user(api, "bea")
        assert api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **ann}).status_code == 201
        forged = api.put(f"/v1/code/{sha}", content=gzip.compress(b"not it"), headers={**GZIP, **bea})
        assert forged.status_code == 422 and forged.json()["detail"][0]["loc"] == ["path", "sha256"], (
            f"the bytes must hash to the path's sha256 even when the server holds it: {forged.text}"
        )
        assert code_answers(api, sha, bea) == (404, 404)
        assert api.post("/v1/jobs", json=job_naming(sha), headers=bea).status_code == 422

    def test_owning_a_job_that_names_anothers_archive_grants_nothing(self, api: TestClient) -> None:
        """A job that named another's archive before this rule (or by an admin's hand) reads, reruns none."""
        body, sha = archive()
        ann, bea = new_user(api, "ann"), new_user(api, "bea")
        assert api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **ann}).status_code == 201
        jid = api.post("/v1/jobs", json=job_naming(sha, "old")).json()["id"]
        with sessions_of(api).begin() as s:
            bea_id = s.execute(select(User.id).where(User.name == "bea")).scalar_one()
            s.execute(update(Job).where(Job.id == jid).values(owner_id=bea_id))
        assert api.get(f"/v1/jobs/{jid}", headers=bea).status_code == 200, "bea owns the job"
        assert code_answers(api, sha, bea) == (404, 404), "but not the archive it names"
        spec = api.get(f"/v1/jobs/{jid}", headers=bea).json()["spec"]
        again = api.post("/v1/jobs", json={**spec, "init_from": {"job": jid, "resume": True}}, headers=bea)
        assert again.status_code == 422 and again.json()["detail"][0]["loc"] == ["body", "code", "sha256"], (
            f"a continuation names the archive again, and is checked again: {again.text}"
        )

    def test_continuing_a_job_keeps_working_for_its_uploader_and_an_admin(self, api: TestClient) -> None:
        body, sha = archive()
        ann = new_user(api, "ann")
        assert api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **ann}).status_code == 201
        jid = api.post("/v1/jobs", json=job_naming(sha), headers=ann).json()["id"]
        checkpoint(api, jid, step=3)
        for who, headers in (("ann", ann), ("admin", {})):
            client = Client("http://testserver", token=None)
            client.http = TestClient(api.app, headers=headers or dict(api.headers))
            job = client.continue_job(jid)
            assert job.spec.code is not None and job.spec.code.sha256 == sha, f"{who}: {job.spec}"

    def test_the_sdk_uploads_then_submits_the_same_tree_for_two_users(
        self, api: TestClient, tmp_path: Path
    ) -> None:
        work = tmp_path / "work"
        work.mkdir()
        (work / "train.py").write_text("print('hello')\n")
        shas, sent = set(), []
        for name in ("ann", "bea"):
            client = Client("http://testserver", token=None)
            client.http = TestClient(api.app, headers=new_user(api, name))
            job = client.submit({"name": name, "command": ["python", "train.py"]}, workdir=work)
            assert job.spec.code is not None
            shas.add(job.spec.code.sha256)
            sent.append(client.upload_code(work).uploaded)
        assert len(shas) == 1 and sent == [False, False], f"one tree; each user an uploader now: {sent}"

    def test_a_sweep_naming_anothers_archive_is_refused_in_its_base_and_its_space(
        self, api: TestClient
    ) -> None:
        (body, sha), (own, own_sha) = archive(), archive("mine\n")
        ann, bea = new_user(api, "ann"), new_user(api, "bea")
        assert api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **ann}).status_code == 201
        assert api.put(f"/v1/code/{own_sha}", content=own, headers={**GZIP, **bea}).status_code == 201
        base = api.post("/v1/sweeps", json=sweep_naming(sha), headers=bea)
        assert base.status_code == 422, base.text
        assert base.json()["detail"][0]["loc"] == ["body", "base", "code", "sha256"], base.text
        space = {"code.sha256": {"choice": [own_sha, sha]}}
        chosen = api.post("/v1/sweeps", json=sweep_naming(own_sha, space=space), headers=bea)
        assert chosen.status_code == 422, chosen.text
        assert chosen.json()["detail"][0]["loc"] == ["body", "space", "code.sha256"], chosen.text
        assert api.get("/v1/sweeps", headers=bea).json()["items"] == []
        assert api.post("/v1/sweeps", json=sweep_naming(sha), headers=ann).status_code == 201, "ann's own"

    def test_a_trial_is_checked_again_and_a_refusal_fails_the_sweep(self, api: TestClient) -> None:
        body, sha = archive()
        ann = new_user(api, "ann")
        assert api.put(f"/v1/code/{sha}", content=body, headers={**GZIP, **ann}).status_code == 201
        sweep = api.post("/v1/sweeps", json=sweep_naming(sha), headers=ann).json()
        sessions, settings = sessions_of(api), api.app.state.settings  # type: ignore[attr-defined]
        # Between the sweep's submit and its first trial, ann is no uploader any more (as when
        # retention took the archive no job named yet): the trial's own check refuses it.
        with sessions.begin() as s:
            s.execute(delete(CodeUpload).where(CodeUpload.sha256 == sha))
        driver.run_once(sessions=sessions, settings=settings)
        shown = api.get(f"/v1/sweeps/{sweep['id']}", headers=ann).json()
        assert shown["state"] == "failed" and shown["trials"] == [], shown
        assert (
            "trial 0's submit was refused (422)" in shown["error"] and "uploaded by you" in shown["error"]
        ), shown["error"]


def checkpoint(api: TestClient, job_id: str, *, step: int) -> None:
    """A checkpoint file of the job and its row, as a worker records one."""
    folder = artifacts(api) / "jobs" / job_id / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ckpt-{step:09d}.pt"
    path.write_bytes(b"weights")
    sha = hashlib.sha256(b"weights").hexdigest()
    with sessions_of(api).begin() as s:
        s.add(
            Checkpoint(
                job_id=job_id,
                attempt=1,
                step=step,
                path=str(path),
                size_bytes=7,
                sha256=sha,
                created_at=utcnow(),
            )
        )


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
    folder = code_folder(artifacts(api))
    folder.mkdir(parents=True, exist_ok=True)
    stale, live = folder / ".upload-dead.part", folder / ".upload-live.part"
    for part in (stale, live):
        part.write_bytes(b"\x1f\x8b half")
    day_ago = time.time() - 86_400 - 60
    os.utime(stale, (day_ago, day_ago))
    purge_expired(sessions=sessions_of(api), retention_days=0, artifacts=artifacts(api))
    assert not stale.exists(), "an upload a dead API process left behind is litter"
    assert live.exists(), "an upload still being received is left alone"
