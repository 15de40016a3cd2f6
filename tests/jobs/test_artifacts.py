"""A job's artifacts through the API: recorded by the worker's scan, listed, streamed, never via a link."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from rank_contract.layout import JobFiles
from service.config import Settings
from service.models import JobArtifact
from tests.api_fixtures import add_user, as_user, submit
from workers.attempt.outputs import Limits, record

ROOMY = Limits(max_bytes=1 << 20, max_files=100)


@pytest.fixture
def job(client: TestClient, settings: Settings, sessions: sessionmaker[Session], tmp_path: Path) -> str:
    """A job whose outputs hold two files and a link to a secret, scanned as an attempt's end does."""
    jid = str(submit(client)["id"])
    out = JobFiles(settings.artifacts, jid).outputs
    (out / "final").mkdir(parents=True)
    (out / "ckpt.pt").write_bytes(b"weights" * 100)
    (out / "final" / "model name.bin").write_bytes(b"final")
    secret = tmp_path / "secret"
    secret.write_text("the worker's token")
    (out / "token").symlink_to(secret)
    assert record(sessions, job_id=jid, attempt=1, directory=out, limits=ROOMY) is None
    return jid


def test_the_list_gives_path_size_and_sha256_of_regular_files_only(client: TestClient, job: str) -> None:
    r = client.get(f"/v1/jobs/{job}/artifacts")
    assert r.status_code == 200
    assert r.json()["items"] == [
        {
            "path": "ckpt.pt",
            "size_bytes": 700,
            "sha256": hashlib.sha256(b"weights" * 100).hexdigest(),
        },
        {"path": "final/model name.bin", "size_bytes": 5, "sha256": hashlib.sha256(b"final").hexdigest()},
    ]


def test_a_download_streams_the_bytes_with_their_sha256(client: TestClient, job: str) -> None:
    r = client.get(f"/v1/jobs/{job}/artifacts/final/model name.bin")
    assert r.status_code == 200 and r.content == b"final"
    assert r.headers["X-Artifact-SHA256"] == hashlib.sha256(b"final").hexdigest()
    assert r.headers["content-type"] == "application/octet-stream"
    assert "model%20name.bin" in r.headers["content-disposition"]


@pytest.mark.parametrize(
    "path",
    ["token", "missing.bin", "final", "%2e%2e/%2e%2e/secret", "/etc/passwd", "a%00b", "final/./x", "a//b"],
)
def test_links_unknown_and_malformed_paths_are_refused(client: TestClient, job: str, path: str) -> None:
    r = client.get(f"/v1/jobs/{job}/artifacts/{path}")
    assert r.status_code in (404, 422), (r.status_code, r.text)
    assert "worker's token" not in r.text


def test_a_file_swapped_for_a_link_after_the_scan_is_not_served(
    client: TestClient, job: str, settings: Settings, tmp_path: Path
) -> None:
    out = JobFiles(settings.artifacts, job).outputs
    (out / "ckpt.pt").unlink()
    (out / "ckpt.pt").symlink_to(tmp_path / "secret")
    assert client.get(f"/v1/jobs/{job}/artifacts/ckpt.pt").status_code == 404
    # A linked folder on the way is refused too, even to a file of the same name.
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "model name.bin").write_text("not the job's")
    (out / "final" / "model name.bin").unlink()
    (out / "final").rmdir()
    (out / "final").symlink_to(tmp_path / "elsewhere")
    assert client.get(f"/v1/jobs/{job}/artifacts/final/model name.bin").status_code == 404


def test_another_users_job_has_no_artifacts_to_them(client: TestClient, job: str, db: Session) -> None:
    other = as_user(add_user(db, "other"))
    assert client.get(f"/v1/jobs/{job}/artifacts", headers=other).status_code == 404
    assert client.get(f"/v1/jobs/{job}/artifacts/ckpt.pt", headers=other).status_code == 404
    assert client.get("/v1/jobs/nosuchjob/artifacts").status_code == 404


def test_each_scan_replaces_the_last(
    client: TestClient, job: str, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    out = JobFiles(settings.artifacts, job).outputs
    (out / "ckpt.pt").unlink()
    (out / "step2.pt").write_bytes(b"2")
    assert record(sessions, job_id=job, attempt=2, directory=out, limits=ROOMY) is None
    items = client.get(f"/v1/jobs/{job}/artifacts").json()["items"]
    assert [i["path"] for i in items] == ["final/model name.bin", "step2.pt"]


def test_over_the_cap_nothing_is_recorded_and_the_error_names_size_and_limit(
    client: TestClient, job: str, settings: Settings, sessions: sessionmaker[Session], db: Session
) -> None:
    out = JobFiles(settings.artifacts, job).outputs
    error = record(sessions, job_id=job, attempt=2, directory=out, limits=Limits(max_bytes=100, max_files=9))
    assert error is not None and error.type == "OutputTooLarge"
    assert "at least 700 bytes" in error.message and "100 bytes" in error.message, error.message
    assert db.query(JobArtifact).filter_by(job_id=job).count() == 0
    assert client.get(f"/v1/jobs/{job}/artifacts").json()["items"] == []
