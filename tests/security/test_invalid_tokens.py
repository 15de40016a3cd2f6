"""Invalid bearer tokens are limited per client address before each costs a database lookup (issue 30)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service import deps
from service.config import Settings
from tests.api_fixtures import add_user, as_user


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every token hash the API looks up in the database, in order."""
    seen: list[str] = []
    real = deps.user_for_token_hash

    def counting(session: Session, *, token_hash: str) -> Any:
        seen.append(token_hash)
        return real(session, token_hash=token_hash)

    monkeypatch.setattr(deps, "user_for_token_hash", counting)
    return seen


def test_300_distinct_invalid_tokens_from_one_address_cost_a_bounded_number_of_lookups(
    client: TestClient, db: Session, settings: Settings, lookups: list[str]
) -> None:
    start = time.monotonic()
    codes = [client.get("/v1/jobs", headers=as_user(f"not-a-token-{i:04d}")).status_code for i in range(300)]
    elapsed = time.monotonic() - start
    assert set(codes) == {401, 429}, f"expected 401s, then 429s: {sorted(set(codes))}"
    burst, rate = settings.auth_failure_burst, settings.auth_failures_per_second
    assert codes[:burst] == [401] * burst, f"the first {burst} are looked up: {codes[:burst]}"
    # The bucket refills at `rate` while the requests are made: at most that many more lookups.
    bound = burst + math.ceil(elapsed * rate) + 1
    assert len(lookups) <= bound, f"{len(lookups)} database lookups for 300 invalid tokens, over {bound}"
    assert codes.count(429) >= 300 - bound, codes

    r = client.get("/v1/jobs", headers=as_user("not-a-token-last"))
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, (r.status_code, r.headers)
    assert "from this address" in r.json()["detail"], r.text

    # Someone else, from another address, with a token this process has not looked up yet.
    token = add_user(db, "olga")
    other = TestClient(client.app, client=("192.0.2.7", 40000))
    before = len(lookups)
    assert other.get("/v1/jobs", headers=as_user(token)).status_code == 200
    assert len(lookups) == before + 1, "a valid token from another address is looked up as ever"


def test_a_valid_token_gives_its_try_back(client: TestClient, db: Session, settings: Settings) -> None:
    # A user whose token is looked up again and again (the cache expires) never runs out of tries.
    client.app.state.token_cache.ttl = 0  # type: ignore[attr-defined]
    token = add_user(db, "pia")
    codes = [
        client.get("/v1/jobs", headers=as_user(token)).status_code
        for _ in range(settings.auth_failure_burst + 5)
    ]
    assert codes == [200] * len(codes), codes
