"""Request limits: body size (413), per-user rate (429 with Retry-After), page size (422 naming `limit`)."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service.limits import TokenBuckets
from tests.api_fixtures import SPEC, add_user, as_user


class TestBodyLimit:
    def test_a_declared_oversize_body_is_413_and_nothing_is_stored(self, client: TestClient) -> None:
        limit = client.app.state.settings.max_request_body_bytes  # type: ignore[attr-defined]
        big = {**SPEC, "labels": {f"k{i}": "v" * 250 for i in range(64)}, "pad": "x" * limit}
        r = client.post("/v1/jobs", json=big)
        assert r.status_code == 413, f"expected 413 for a body over {limit} bytes, got {r.status_code}"
        assert r.json() == {"error": "PayloadTooLarge", "detail": f"request body exceeds {limit} bytes"}
        assert client.get("/v1/jobs").json()["items"] == [], "no job was created"

    def test_a_chunked_body_without_content_length_is_counted(self, client: TestClient) -> None:
        limit = client.app.state.settings.max_request_body_bytes  # type: ignore[attr-defined]

        def chunks() -> Iterator[bytes]:
            yield b'{"name": "x", "recipe": "mlp", "pad": "'
            for _ in range(limit // 65536 + 2):
                yield b"x" * 65536
            yield b'"}'

        r = client.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413, (
            f"expected 413 for a chunked body over {limit} bytes, got {r.status_code}"
        )

    def test_a_body_under_the_limit_passes(self, client: TestClient) -> None:
        r = client.post("/v1/jobs", json=SPEC)
        assert r.status_code == 201, f"an ordinary submit passes the limit, got {r.status_code}: {r.text}"


class TestRateLimit:
    def test_a_token_over_its_burst_gets_429_with_retry_after_and_others_do_not(
        self, client: TestClient, db: Session
    ) -> None:
        # A tiny rate: the bucket cannot refill by a whole token during the test.
        client.app.state.rate_limiter = TokenBuckets(rate=0.001, burst=3)  # type: ignore[attr-defined]
        other = add_user(db, "ivan")
        codes = [client.get("/v1/jobs").status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429], f"expected a burst of 3 then 429, got {codes}"
        r = client.get("/v1/jobs")
        assert r.status_code == 429 and r.json()["error"] == "TooManyRequests", r.text
        assert int(r.headers["retry-after"]) >= 1, f"Retry-After in whole seconds, got {r.headers}"
        assert client.get("/v1/jobs", headers=as_user(other)).status_code == 200, (
            "another user has their own bucket"
        )

    def test_the_tokens_of_one_user_share_one_bucket(self, client: TestClient, db: Session) -> None:
        token = add_user(db, "ilse")
        second = client.post("/v1/users/ilse/tokens").json()["token"]
        client.app.state.rate_limiter = TokenBuckets(rate=0.001, burst=3)  # type: ignore[attr-defined]
        codes = [
            client.get("/v1/jobs", headers=as_user(t)).status_code for t in (token, second, token, second)
        ]
        assert codes == [200, 200, 200, 429], f"two tokens of one user spend one burst of 3, got {codes}"
        third = client.post("/v1/users/ilse/tokens").json()["token"]
        r = client.get("/v1/jobs", headers=as_user(third))
        assert r.status_code == 429, f"a freshly minted token brings no fresh burst, got {r.status_code}"
        assert "user" in r.json()["detail"], r.json()

    def test_the_bucket_refills_at_its_rate(self) -> None:
        now = [0.0]
        buckets = TokenBuckets(rate=2.0, burst=2, clock=lambda: now[0])
        assert [buckets.take("t") for _ in range(2)] == [None, None]
        wait = buckets.take("t")
        assert wait == 0.5, f"one token comes back after 1/rate = 0.5 s, got {wait}"
        now[0] += 0.5
        assert buckets.take("t") is None, "after 0.5 s one request passes"
        assert buckets.take("t") is not None, "and only one"

    def test_zero_rate_means_no_limit(self) -> None:
        buckets = TokenBuckets(rate=0, burst=1)
        assert all(buckets.take("t") is None for _ in range(1000)), "rate 0 turns the limit off"


class TestPageSize:
    def test_limit_over_the_maximum_is_422_naming_limit(self, client: TestClient) -> None:
        settings = client.app.state.settings  # type: ignore[attr-defined]
        job = client.post("/v1/jobs", json=SPEC).json()
        for path, maximum in (
            ("/v1/jobs", settings.max_page_size),
            (f"/v1/jobs/{job['id']}/logs", settings.max_log_page_size),
        ):
            r = client.get(path, params={"limit": maximum + 1})
            assert r.status_code == 422, f"{path}?limit={maximum + 1}: expected 422, got {r.status_code}"
            assert r.json()["detail"][0]["loc"] == ["query", "limit"], r.json()
            r = client.get(path, params={"limit": maximum})
            assert r.status_code == 200, f"{path}?limit={maximum} is allowed, got {r.status_code}"
