"""The API's token -> user cache: revocations elsewhere land within its TTL, here at once."""

from __future__ import annotations

import asyncio
import hashlib

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service.auth.cache import TokenCache
from service.models import User
from service.models.base import utcnow
from service.users import repository
from tests.api_fixtures import add_user, as_user


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _user_id(db: Session, name: str) -> int:
    user = repository.by_name(db, name=name)
    assert user is not None
    return user.id


def test_a_revocation_made_by_another_process_is_refused_within_the_ttl(
    client: TestClient, db: Session
) -> None:
    clock = FakeClock()
    client.app.state.token_cache = TokenCache(ttl=1.0, clock=clock)  # type: ignore[attr-defined]
    token = add_user(db, "ivy")
    assert client.get("/v1/users/me", headers=as_user(token)).status_code == 200
    # Straight in the database, as the CLI or another API process would: this process hears nothing.
    repository.revoke_tokens(db, user_id=_user_id(db, "ivy"), now=utcnow())
    db.commit()
    clock.now += 0.5
    r = client.get("/v1/users/me", headers=as_user(token))
    assert r.status_code == 200, f"within the TTL the cached user may still answer, got {r.status_code}"
    clock.now += 0.6
    r = client.get("/v1/users/me", headers=as_user(token))
    assert r.status_code == 401, f"once the entry expired the revocation must hold, got {r.status_code}"


def test_a_token_refused_once_works_as_soon_as_it_is_issued(client: TestClient, db: Session) -> None:
    token = "dpt_not-yet-issued-0123456789abcdef"
    assert client.get("/v1/users/me", headers=as_user(token)).status_code == 401
    add_user(db, "jay")
    repository.add_token(
        db, user_id=_user_id(db, "jay"), token_hash=hashlib.sha256(token.encode()).hexdigest()
    )
    db.commit()
    r = client.get("/v1/users/me", headers=as_user(token))
    assert r.status_code == 200, f"unknown tokens are never cached, got {r.status_code}"


def test_concurrent_misses_share_one_lookup_and_a_revocation_meanwhile_is_not_undone() -> None:
    cache = TokenCache(ttl=60.0)
    user = User(id=7, name="kim", is_admin=False)
    calls = 0
    release = asyncio.Event()

    async def load() -> User | None:
        nonlocal calls
        calls += 1
        await release.wait()
        return user

    async def scenario() -> list[User | None]:
        waiters = [asyncio.ensure_future(cache.user_for("h", load)) for _ in range(20)]
        await asyncio.sleep(0)
        cache.forget_user(7)  # a revocation commits while the lookup is in flight
        release.set()
        return await asyncio.gather(*waiters)

    answers = asyncio.run(scenario())
    assert calls == 1, f"20 concurrent misses of one token must share one lookup, made {calls}"
    assert answers == [user] * 20
    assert cache.get("h") is None, "a lookup that began before a revocation must not be cached"
