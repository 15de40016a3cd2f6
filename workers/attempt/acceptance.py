"""A node's start message accepted: its placement claimed, its stored spec validated, its run described.

The runner's first step, apart from it: the one place a start message meets the database before any
process starts, and the one place the stored spec becomes the typed JobSpec the rest reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobSpec, JobStatus
from service.config import Settings
from service.jobs import repository as jobs_repository
from service.jobs.stored import describe
from service.models.base import utcnow
from service.scheduling import repository as placement
from workers.attempt import init_checkpoint
from workers.attempt.launch import Rendezvous
from workers.attempt.node_run import Attempt, NodeRun


@dataclass(frozen=True)
class Unrunnable:
    """An accepted attempt whose stored spec today's JobSpec refuses: it ends with `error`, unrun."""

    att: Attempt
    error: JobError


def accept(
    sessions: sessionmaker[Session],
    *,
    job_id: str,
    attempt: int,
    node_rank: int,
    settings: Settings,
    endpoint: str,
) -> NodeRun | Unrunnable | None:
    """Accept node `node_rank` of `attempt` (None: stale or a duplicate) and build what it runs with."""
    with sessions.begin() as session:
        me = settings.node
        if not placement.accept(
            session, job_id=job_id, attempt=attempt, node_rank=node_rank, worker=me, now=utcnow()
        ):
            return None
        job = jobs_repository.get(session, job_id=job_id)
        if job is None or job.status != JobStatus.RUNNING.value or job.attempt != attempt:
            return None
        nodes = placement.nodes_of(session, job_id=job_id)
        att = Attempt(
            job_id=job_id,
            number=attempt,
            token=str(job.claim_token),
            max_restarts=job.max_restarts,
        )
        try:
            # Validated once, here: everything downstream reads the typed model and its defaults.
            spec = JobSpec.model_validate(job.spec)
        except ValidationError as exc:
            message = f"the stored spec does not validate: {describe(exc)}"
            return Unrunnable(att=att, error=JobError(type=ValidationError.__name__, message=message))
        nnodes = spec.resources.nodes
        rendezvous = None
        if nnodes > 1:
            host = next(n for n in nodes if n.node_rank == 0)
            rendezvous = Rendezvous(
                endpoint=endpoint or f"{host.address}:{host.port}",
                run_id=f"{job_id}-{attempt}",
                is_host=node_rank == 0,
                timeout_seconds=settings.rendezvous_timeout_seconds,
            )
        mine = next(n for n in nodes if n.node_rank == node_rank)
        return NodeRun(
            att=att,
            node_rank=node_rank,
            nnodes=nnodes,
            spec=spec,
            rendezvous=rendezvous,
            address=mine.address,
            init=init_checkpoint.of_row(
                job_id=job.init_job, step=job.init_step, path=job.init_path, sha256=job.init_sha256
            ),
            cluster_uid=mine.rank_uid if nnodes > 1 else None,
        )
