"""The outbox publishes the ids of committed deliveries only, once."""

from __future__ import annotations

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from service.webhooks import outbox


def test_only_committed_deliveries_are_published_once() -> None:
    published: list[str] = []
    session = Session(create_engine("sqlite://"), info={outbox.PUBLISHER: published.extend})
    session.begin()
    session.info[outbox.PENDING] = ["rolled-back"]
    session.rollback()
    session.begin()
    session.info[outbox.PENDING] = ["closed-without-commit"]
    session.close()
    session.begin()
    session.info[outbox.PENDING] = ["committed"]
    session.commit()
    session.begin()
    session.commit()
    assert published == ["committed"]
