"""The signature of a delivery: HMAC-SHA256 over `<timestamp>.<body>` with the webhook's secret."""

from __future__ import annotations

import hashlib
import hmac
import secrets

SIGNATURE_HEADER = "Dptrain-Signature"
TIMESTAMP_HEADER = "Dptrain-Timestamp"
DELIVERY_HEADER = "Dptrain-Delivery"
EVENT_HEADER = "Dptrain-Event"


def new_secret() -> str:
    """A fresh signing secret (256 random bits)."""
    return "whsec_" + secrets.token_urlsafe(32)


def signature(secret: str, *, timestamp: int, body: bytes) -> str:
    """The `Dptrain-Signature` value: `v1=` and the hex HMAC-SHA256 of `<timestamp>.<body>`."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()
