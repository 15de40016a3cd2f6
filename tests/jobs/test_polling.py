"""Polling at scale: ETags and 304, updated_since, label filters, the timeline, log tails."""

from __future__ import annotations

from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from service.jobs import lifecycle, repository
from service.models import Job, LogLine
from tests.api_fixtures import submit


def _claim(sessions: sessionmaker[Session], job_id: str) -> str:
    """Claim a queued job the way a worker does; returns its fencing token."""
    with sessions.begin() as s:
        job = lifecycle.claim(s, job_id=job_id, worker="host:1")
        assert job is not None, f"job {job_id} should be claimable"
        return str(job.claim_token)


class TestETag:
    def test_job_answers_304_until_it_changes(self, client: TestClient) -> None:
        job = submit(client)
        r = client.get(f"/v1/jobs/{job['id']}")
        etag = r.headers.get("etag")
        assert r.status_code == 200 and etag, f"expected 200 with an ETag, got {r.status_code} {r.headers}"
        again = client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": etag})
        assert again.status_code == 304, f"expected 304 for a matching If-None-Match, got {again.status_code}"
        assert again.content == b"", f"a 304 has no body, got {again.content!r}"
        assert again.headers.get("etag") == etag, "a 304 repeats the ETag"
        client.post(f"/v1/jobs/{job['id']}/cancel")
        after = client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": etag})
        assert after.status_code == 200, f"expected 200 after a change, got {after.status_code}"
        assert after.headers["etag"] != etag and after.json()["status"] == "cancelled"

    def test_list_answers_304_until_a_job_on_the_page_changes(
        self, client: TestClient, sessions: sessionmaker[Session]
    ) -> None:
        job = submit(client)
        first = client.get("/v1/jobs")
        etag = first.headers["etag"]
        assert client.get("/v1/jobs", headers={"If-None-Match": f'"other", W/{etag}'}).status_code == 304, (
            "a weak or listed match must answer 304"
        )
        token = _claim(sessions, job["id"])
        r = client.get("/v1/jobs", headers={"If-None-Match": etag})
        assert r.status_code == 200, f"expected 200 after the job was claimed, got {r.status_code}"
        etag = r.headers["etag"]
        # A progress report by the worker is a change the client can see: the ETag must move.
        with sessions.begin() as s:
            assert repository.fenced_update(s, job_id=job["id"], claim_token=token, values={"step": 2})
        r = client.get("/v1/jobs", headers={"If-None-Match": etag})
        assert r.status_code == 200, f"expected 200 after progress, got {r.status_code}"
        assert r.json()["items"][0]["progress"]["step"] == 2
        # So is a stop request on a running job (no status change, only cancel_requested).
        etag, updated = r.headers["etag"], r.json()["items"][0]["updated_at"]
        client.post(f"/v1/jobs/{job['id']}/cancel")
        r = client.get("/v1/jobs", headers={"If-None-Match": etag})
        assert r.status_code == 200, f"expected 200 after a cancel request, got {r.status_code}"
        assert r.json()["items"][0]["updated_at"] > updated, "a cancel request moves updated_at"


class TestListFilters:
    def test_updated_since_returns_only_later_updates(self, client: TestClient, db: Session) -> None:
        old, new = submit(client, name="old"), submit(client, name="new")
        row = db.get(Job, old["id"])
        assert row is not None
        submitted = row.updated_at
        db.query(Job).filter_by(id=old["id"]).update({"updated_at": submitted - timedelta(hours=1)})
        db.commit()
        since = (submitted - timedelta(minutes=1)).isoformat()
        ids = [j["id"] for j in client.get("/v1/jobs", params={"updated_since": since}).json()["items"]]
        assert ids == [new["id"]], f"expected only the job updated after {since}, got {ids}"
        cancelled = client.post(f"/v1/jobs/{old['id']}/cancel").json()
        ids = [j["id"] for j in client.get("/v1/jobs", params={"updated_since": since}).json()["items"]]
        assert ids == [new["id"], old["id"]], f"a cancelled job counts as updated, got {ids}"
        exact = client.get("/v1/jobs", params={"updated_since": cancelled["updated_at"]}).json()["items"]
        assert old["id"] not in [j["id"] for j in exact], "updated_since is strictly later"
        r = client.get("/v1/jobs", params={"updated_since": "yesterday"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "updated_since"]

    def test_label_filter_needs_every_label(self, client: TestClient) -> None:
        both = submit(client, labels={"team": "vision", "tier": "gold"})
        submit(client, labels={"team": "vision"})
        submit(client, labels={"team": "nlp", "tier": "gold"})
        r = client.get("/v1/jobs", params=[("label", "team=vision"), ("label", "tier=gold")])
        ids = [j["id"] for j in r.json()["items"]]
        assert ids == [both["id"]], f"expected only the job with both labels, got {ids}"
        r = client.get("/v1/jobs", params={"label": "team"})
        assert r.status_code == 422, f"a label without '=' is refused, got {r.status_code}"
        assert r.json()["detail"][0]["loc"] == ["query", "label"]


def test_timeline_lists_status_changes_in_order(client: TestClient, sessions: sessionmaker[Session]) -> None:
    job = submit(client)
    token = _claim(sessions, job["id"])
    with sessions.begin() as s:
        lifecycle.transition(
            s, job_id=job["id"], src=JobStatus.RUNNING, dst=JobStatus.SUCCEEDED, claim_token=token
        )
    items = client.get(f"/v1/jobs/{job['id']}/timeline").json()["items"]
    got = [(t["from_status"], t["to_status"], t["attempt"]) for t in items]
    expected = [(None, "queued", 0), ("queued", "running", 1), ("running", "succeeded", 1)]
    assert got == expected, f"expected {expected}, got {got}"
    assert items[1]["reason"] == "placed on host:1"
    assert client.get("/v1/jobs/nope/timeline").status_code == 404


def test_log_tail_and_cursor(client: TestClient, db: Session) -> None:
    jid = submit(client)["id"]
    db.add_all([LogLine(job_id=jid, attempt=1, rank=i % 2, line=f"line {i}") for i in range(10)])
    db.commit()
    page = client.get(f"/v1/jobs/{jid}/logs", params={"tail": 3}).json()
    lines = [ln["line"] for ln in page["items"]]
    assert lines == ["line 7", "line 8", "line 9"], f"expected the last 3 lines in order, got {lines}"
    assert page["next_cursor"] == page["items"][-1]["id"]
    ranked = [
        ln["line"] for ln in client.get(f"/v1/jobs/{jid}/logs", params={"tail": 2, "rank": 0}).json()["items"]
    ]
    assert ranked == ["line 6", "line 8"], f"expected rank 0's last 2 lines, got {ranked}"
    db.add(LogLine(job_id=jid, attempt=1, rank=0, line="line 10"))
    db.commit()
    more = client.get(f"/v1/jobs/{jid}/logs", params={"after": page["next_cursor"]}).json()
    assert [ln["line"] for ln in more["items"]] == ["line 10"], "following with after reads on from the tail"
    r = client.get(f"/v1/jobs/{jid}/logs", params={"tail": 2, "after": 1})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "tail"], r.text
