"""Sending one delivery: claim it, check where its URL leads now, POST it signed, record the outcome."""

from __future__ import annotations

import ipaddress
import json
import time
from datetime import timedelta

import httpx
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.models.base import utcnow
from service.webhooks import repository, urls
from service.webhooks.signing import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    signature,
)

# A claimed delivery is another sender's again this long after its attempt's timeout, should this
# sender die while sending.
LEASE_MARGIN_SECONDS = 30.0
# The most of a receiver's error answer kept as `last_error`.
ERROR_CHARS = 500


def deliver(*, sessions: sessionmaker[Session], settings: Settings, delivery_id: str) -> float | None:
    """Make one attempt at a due delivery; the seconds until its retry, None if no retry is due."""
    with sessions.begin() as session:
        claimed = repository.claim(
            session,
            delivery_id=delivery_id,
            now=utcnow(),
            lease_seconds=settings.webhook_timeout_seconds + LEASE_MARGIN_SECONDS,
        )
    if claimed is None:
        return None  # delivered, failed, deleted, or another sender holds it
    status_code, error = send(claimed, settings=settings)
    now = utcnow()
    delay = None
    if error is not None and claimed.attempts < settings.webhook_max_attempts:
        delay = backoff(claimed.attempts, settings=settings)
    with sessions.begin() as session:
        repository.record_attempt(
            session,
            claimed=claimed,
            now=now,
            status_code=status_code,
            error=error,
            retry_at=now + timedelta(seconds=delay) if delay is not None else None,
        )
    return delay


def backoff(attempts: int, *, settings: Settings) -> float:
    """Seconds before the attempt after `attempts` failed ones: doubling from the base, capped."""
    return min(settings.webhook_backoff_seconds * 2 ** (attempts - 1), settings.webhook_backoff_max_seconds)


def send(claimed: repository.Claimed, *, settings: Settings) -> tuple[int | None, str | None]:
    """POST the delivery once: (the answer's status if any, None on a 2xx else why it failed)."""
    try:
        parts, addresses = urls.checked(
            claimed.url, allow=urls.allowed_networks(settings.webhook_allow_networks)
        )
    except urls.UnsafeUrl as exc:
        # Checked again now, after resolving: a name that pointed elsewhere at registration may not
        # lead here now (DNS rebinding). Retried, as a name that resolves nowhere may come back.
        return None, f"refused: {exc}"
    body = json.dumps(claimed.payload, separators=(",", ":"), sort_keys=True).encode()
    timestamp = int(time.time())
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "dptrain-webhooks/1",
        DELIVERY_HEADER: claimed.id,
        EVENT_HEADER: claimed.event,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: signature(claimed.secret, timestamp=timestamp, body=body),
        # The name the URL gave, while the connection goes to the address just checked.
        "Host": parts.netloc.rpartition("@")[2],
    }
    address = addresses[0]
    host = f"[{address}]" if isinstance(address, ipaddress.IPv6Address) else str(address)
    port = f":{parts.port}" if parts.port else ""
    target = parts._replace(netloc=f"{host}{port}").geturl()
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    try:
        # No redirects: a 3xx could lead anywhere, the metadata service included; it counts as a failure.
        timeout = settings.webhook_timeout_seconds
        with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
            answer = client.post(target, content=body, headers=headers, extensions=extensions)
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
    if 200 <= answer.status_code < 300:
        return answer.status_code, None
    return answer.status_code, f"HTTP {answer.status_code}: {answer.text[:ERROR_CHARS]}"
