"""Stacks of a running job's ranks on demand: recorded as a request, answered from what its workers store.

The API cannot reach a worker's processes, so a request goes through the database like a cancel:
the runner's report loop reads it each flush (workers/reporting/reporter.py), dumps its node's ranks with
py-spy (workers/reporting/stacks.py) and stores the dump (service/jobs/stacks_repository.py).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from api_schemas import JobStacks, JobStatus, StackDump
from service.errors import Conflict
from service.jobs import stacks_repository
from service.jobs.service import get_visible
from service.models import User
from service.models.base import utcnow


def request_stacks(session: Session, *, user: User, job_id: str) -> datetime:
    """Ask a running job's workers for its ranks' stacks; when it was asked (404 unseen, 409 not running)."""
    job = get_visible(session, user=user, job_id=job_id)
    if job.status != JobStatus.RUNNING.value:
        raise Conflict(f"job {job_id!r} is {job.status}: stacks can be read only while it runs")
    now = utcnow()
    stacks_repository.request(session, job_id=job_id, now=now)
    return now


def read_stacks(session: Session, *, job_id: str, since: datetime) -> JobStacks:
    """The job's latest dumps; fresh if every one of them answers a request made at `since` or later."""
    rows = stacks_repository.latest(session, job_id=job_id)
    fresh = bool(rows) and all(r.requested_at is not None and r.requested_at >= since for r in rows)
    return JobStacks(job_id=job_id, fresh=fresh, dumps=[StackDump.model_validate(r.dump) for r in rows])
