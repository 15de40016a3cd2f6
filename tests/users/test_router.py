"""Users and tokens: admins create users, tokens are shown once and stored hashed, revocation is immediate."""

from __future__ import annotations

import hashlib

from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import ApiToken, User
from tests.api_fixtures import add_user, as_user


class TestCreate:
    def test_an_admin_creates_a_user_whose_token_works_and_is_stored_hashed(
        self, client: TestClient, db: Session
    ) -> None:
        r = client.post("/v1/users", json={"name": "alice"})
        assert r.status_code == 201, f"expected 201, got {r.status_code}: {r.text}"
        body = r.json()
        assert (body["name"], body["admin"]) == ("alice", False), f"expected alice, non-admin: {body}"
        token = body["token"]
        me = client.get("/v1/users/me", headers=as_user(token))
        assert me.status_code == 200 and me.json()["name"] == "alice", f"the new token is alice's: {me.text}"
        user = db.execute(select(User).where(User.name == "alice")).scalar_one()
        stored = db.execute(select(ApiToken.token_hash).where(ApiToken.user_id == user.id)).scalars().all()
        assert stored == [hashlib.sha256(token.encode()).hexdigest()], (
            f"expected only the sha256 of the token stored, got {stored}"
        )
        assert token not in stored, "the token itself must never be stored"

    def test_a_taken_name_is_409_and_a_bad_name_422(self, client: TestClient) -> None:
        assert client.post("/v1/users", json={"name": "bob"}).status_code == 201
        r = client.post("/v1/users", json={"name": "bob", "admin": True})
        assert r.status_code == 409, f"expected 409 for a taken name, got {r.status_code}"
        assert r.json()["error"] == "Conflict" and "bob" in r.json()["detail"], r.json()
        r = client.post("/v1/users", json={"name": "no spaces"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "name"], r.text

    def test_a_non_admin_cannot_create_users(self, client: TestClient, db: Session) -> None:
        token = add_user(db, "carol")
        r = client.post("/v1/users", json={"name": "mallory", "admin": True}, headers=as_user(token))
        assert r.status_code == 403, f"expected 403 for a non-admin, got {r.status_code}: {r.text}"
        assert db.execute(select(User).where(User.name == "mallory")).first() is None, "no user was made"

    def test_an_admin_can_create_an_admin(self, client: TestClient) -> None:
        token = client.post("/v1/users", json={"name": "root2", "admin": True}).json()["token"]
        r = client.post("/v1/users", json={"name": "dave"}, headers=as_user(token))
        assert r.status_code == 201, f"a new admin can create users, got {r.status_code}"


class TestNamesIgnoreCase:
    def test_alice_after_alice_is_409_and_lookups_ignore_case(self, client: TestClient, db: Session) -> None:
        token = client.post("/v1/users", json={"name": "alice"}).json()["token"]
        r = client.post("/v1/users", json={"name": "Alice"})
        assert r.status_code == 409, f"Alice after alice must be 409, got {r.status_code}: {r.text}"
        assert r.json()["error"] == "Conflict" and "'alice'" in r.json()["detail"], r.json()
        assert db.execute(select(User.name).where(User.name == "Alice")).first() is None, "no user was made"
        r = client.patch("/v1/users/ALICE/permissions", json={"can_run_code": True})
        assert r.status_code == 200 and r.json()["name"] == "alice", (
            f"PATCH by any case finds alice: {r.text}"
        )
        r = client.post("/v1/users/Alice/tokens", headers=as_user(token))
        assert r.status_code == 201, f"alice may mint her own token under any case, got {r.status_code}"


class TestTokens:
    def test_revoking_is_immediate_for_every_token_of_the_user(self, client: TestClient, db: Session) -> None:
        first = add_user(db, "erin")
        second = client.post("/v1/users/erin/tokens").json()["token"]
        for t in (first, second):
            assert client.get("/v1/users/me", headers=as_user(t)).status_code == 200
        r = client.delete("/v1/users/erin/tokens")
        assert r.status_code == 204, f"expected 204, got {r.status_code}: {r.text}"
        for t in (first, second):
            r = client.get("/v1/jobs", headers=as_user(t))
            assert r.status_code == 401, f"a revoked token must get 401 at once, got {r.status_code}"
            assert r.headers.get("www-authenticate") == "Bearer", r.headers
        fresh = client.post("/v1/users/erin/tokens").json()["token"]
        assert client.get("/v1/users/me", headers=as_user(fresh)).status_code == 200, (
            "an admin can give a revoked user a new token"
        )

    def test_minting_past_the_live_token_cap_is_409_saying_why(self, client: TestClient, db: Session) -> None:
        settings = client.app.state.settings  # type: ignore[attr-defined]
        client.app.state.settings = settings.model_copy(update={"max_tokens_per_user": 2})  # type: ignore[attr-defined]
        token = add_user(db, "hugo")  # live token 1 of 2
        assert client.post("/v1/users/hugo/tokens", headers=as_user(token)).status_code == 201
        r = client.post("/v1/users/hugo/tokens", headers=as_user(token))
        assert r.status_code == 409, f"a third live token is over the cap of 2, got {r.status_code}: {r.text}"
        assert r.json()["error"] == "Conflict" and "2 live tokens" in r.json()["detail"], r.json()
        assert client.delete("/v1/users/hugo/tokens").status_code == 204
        r = client.post("/v1/users/hugo/tokens")
        assert r.status_code == 201, f"revoked tokens do not count, got {r.status_code}: {r.text}"

    def test_a_user_manages_only_their_own_tokens(self, client: TestClient, db: Session) -> None:
        frank, grace = add_user(db, "frank"), add_user(db, "grace")
        for method in ("POST", "DELETE"):
            r = client.request(method, "/v1/users/grace/tokens", headers=as_user(frank))
            assert r.status_code == 404, (
                f"{method} on another user's tokens: expected 404, got {r.status_code}"
            )
        assert client.get("/v1/users/me", headers=as_user(grace)).status_code == 200, (
            "grace's token survives frank's attempt"
        )
        mine = client.post("/v1/users/frank/tokens", headers=as_user(frank))
        assert mine.status_code == 201, f"a user may issue their own token, got {mine.status_code}"
        r = client.delete("/v1/users/frank/tokens", headers=as_user(frank))
        assert r.status_code == 204, f"a user may revoke their own tokens, got {r.status_code}"
        assert client.get("/v1/users/me", headers=as_user(frank)).status_code == 401

    def test_unknown_user_is_404(self, client: TestClient) -> None:
        for method in ("POST", "DELETE"):
            r = client.request(method, "/v1/users/nobody/tokens")
            assert r.status_code == 404, f"{method} for an unknown user: expected 404, got {r.status_code}"

    def test_me(self, client: TestClient) -> None:
        me = client.get("/v1/users/me").json()
        assert (me["name"], me["admin"]) == ("admin", True), f"the bootstrap token is the admin's: {me}"


class TestCanRunCode:
    def test_an_admin_creates_a_user_who_may_run_code(self, client: TestClient) -> None:
        r = client.post("/v1/users", json={"name": "kim", "can_run_code": True})
        assert r.status_code == 201 and r.json()["can_run_code"] is True, r.text
        me = client.get("/v1/users/me", headers=as_user(r.json()["token"])).json()
        assert (me["name"], me["admin"], me["can_run_code"]) == ("kim", False, True), me
        plain = client.post("/v1/users", json={"name": "lee"}).json()
        assert plain["can_run_code"] is False, "nobody runs code unless granted"
        r = client.post("/v1/users", json={"name": "max", "can_run_code": "yes"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "can_run_code"], r.text

    def test_an_admin_grants_and_withdraws_over_the_api(self, client: TestClient, db: Session) -> None:
        token = add_user(db, "ned")
        # Looked up now, so the token cache holds ned as he was.
        assert client.get("/v1/users/me", headers=as_user(token)).json()["can_run_code"] is False
        r = client.patch("/v1/users/ned/permissions", json={"can_run_code": True})
        assert r.status_code == 200 and r.json()["can_run_code"] is True, r.text
        assert client.get("/v1/users/me", headers=as_user(token)).json()["can_run_code"] is True, "at once"
        assert client.patch("/v1/users/ned/permissions", json={}).json()["can_run_code"] is True, (
            "left out: unchanged"
        )
        assert (
            client.patch("/v1/users/ned/permissions", json={"can_run_code": False}).json()["can_run_code"]
            is False
        )
        assert client.patch("/v1/users/nobody/permissions", json={"can_run_code": True}).status_code == 404

    def test_only_an_admin_grants(self, client: TestClient, db: Session) -> None:
        token = add_user(db, "oli")
        r = client.patch("/v1/users/oli/permissions", json={"can_run_code": True}, headers=as_user(token))
        assert r.status_code == 403, f"not even to themselves: {r.text}"
        assert db.execute(select(User.can_run_code).where(User.name == "oli")).scalar_one() is False
