"""Route of a running job's stacks: `GET /v1/jobs/{id}/stacks`."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import Query, Request

from api_schemas import JobStacks
from service.deps import CurrentUser, SessionDep, run_in_transaction, run_read
from service.errors import Conflict, NotFound, error_responses
from service.jobs import stacks
from service.params import JobId
from service.routing import v1_router

router = v1_router("jobs")
# How often a waiting request looks for its dump: the runner reports every report interval (~1 s).
POLL_SECONDS = 0.25


@router.get("/{job_id}/stacks", response_model=JobStacks, responses=error_responses(NotFound, Conflict))
async def get_stacks(
    job_id: JobId,
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    wait: Annotated[
        float,
        Query(
            ge=0, le=30, description="Seconds to wait for the workers' fresh dump before answering the last."
        ),
    ] = 10,
) -> JobStacks:
    """Every thread of every rank of a running job, as py-spy reads them; 409 unless it runs."""
    since = await run_in_transaction(session, stacks.request_stacks, user=user, job_id=job_id)
    deadline = anyio.current_time() + wait
    while True:
        found = await run_read(request, stacks.read_stacks, job_id=job_id, since=since)
        if found.fresh or anyio.current_time() >= deadline:
            return found
        await anyio.sleep(POLL_SECONDS)
