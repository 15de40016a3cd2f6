"""Placement in one place: every job, single- or multi-node, starts here and nowhere else.

`schedule_once` decides under row locks in one transaction (moving each placed job to `running`
with a new attempt and writing its job_nodes rows), and only after that commits sends each chosen
node its own start message on that node's queue, through a sender thread (service/dispatch.py) that
tries a publish the broker refused again every few seconds. A message lost after all (its process
died first, or the broker dropped it) is sent again by the reconciler (`republish_unstarted`); a
node that never joins ends the attempt at the rendezvous timeout.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobError, JobStatus
from service.config import Settings
from service.dispatch import Dispatcher, NodeStart
from service.jobs import lifecycle
from service.jobs.stored import INVALID_SPEC
from service.models.base import utcnow
from service.scheduling import queue_repository, repository
from service.scheduling.placement import Decision, Node, Pending, decide, never_fits
from service.scheduling.repository import Queued, Unreadable, Wait

log = logging.getLogger(__name__)

# A node counts as live for placement while its heartbeat is younger than this many beats: tighter
# than the attempt lease, so a job restarting after a node died is not placed on that node again.
LIVE_BEATS = 3


@dataclass(frozen=True)
class Placed:
    """A job placed by one round, with the start messages to send once committed."""

    job_id: str
    starts: list[NodeStart]


NO_PORT = "waiting for a free rendezvous port (every DPTRAIN_RENDEZVOUS_PORT_* port is in use)"
NO_UID = (
    "waiting for a free uid (every DPTRAIN_CLUSTER_RANK_UID_RANGE uid is held by a running multi-node job)"
)


def live_after(settings: Settings) -> timedelta:
    """How recent a heartbeat must be for placement to use the node."""
    return timedelta(seconds=LIVE_BEATS * settings.worker_heartbeat_seconds)


def place(session: Session, *, settings: Settings) -> list[Placed]:
    """One placement round in the caller's transaction; returns what to start once it commits."""
    now = utcnow()
    workers = repository.lock_live_nodes(session, beat_after=now - live_after(settings))
    used = repository.used_slots(session)
    nodes = [
        Node(
            name=w.name, device=w.device, slots=w.slots, free=w.slots - used.get(w.name, 0), address=w.address
        )
        for w in workers
    ]
    # First, so that a job that fits again is among the heads read next, this same round.
    _judge_unplaceable(session, nodes=nodes)
    running = repository.running_per_owner(session)
    queued, unreadable = queued_heads(session, running=running, settings=settings)
    for job_id, problem in unreadable:
        _fail_unreadable(session, job_id=job_id, problem=problem)
    if not queued:
        return []
    pending = [
        Pending(
            job_id=q.job_id,
            owner_id=q.owner_id,
            device=q.needs.device,
            nodes=q.needs.nodes,
            processes_per_node=q.needs.processes_per_node,
        )
        for q in queued
    ]
    # Heads are never flagged unplaceable (that is judged above, a group per shape).
    before = {q.job_id: Wait(q.queued_reason or "") for q in queued}
    decisions = decide(
        pending,
        nodes=nodes,
        running=running,
        max_running=settings.max_running_jobs_per_user,
    )
    ports = repository.ports_in_use(session)
    uids = repository.rank_uids_in_use(session)
    chosen: list[tuple[Pending, Decision, Multi | None]] = []
    waits: dict[str, Wait] = {}
    for job, decision in zip(pending, decisions, strict=True):
        if not decision.placed:
            wait = Wait(decision.reason or "", decision.unplaceable)
            if decision.reason is not None and wait != before[job.job_id]:
                waits[job.job_id] = wait
            continue
        multi = None
        if job.nodes > 1:
            port = _free_port(ports, settings=settings)
            uid = _free_uid(uids, settings=settings)
            if port is None or uid is None:
                waits[job.job_id] = Wait(NO_PORT if port is None else NO_UID)
                continue
            ports.add(port)
            uids.add(uid)
            multi = Multi(port=port, rank_uid=uid)
        chosen.append((job, decision, multi))
    placed = _start(session, chosen=chosen)
    repository.set_reasons(session, waits=waits)
    return placed


def queued_heads(
    session: Session, *, running: dict[int, int], settings: Settings
) -> tuple[list[Queued], list[Unreadable]]:
    """The queued jobs a round looks at, in placement order, and those whose stored spec it cannot read.

    Each owner's first `max_running + 1` queued jobs of each device kind (one if the owner is at
    its limit), unplaceable ones left out. No more could matter this round: of an owner's jobs of
    one kind, at most `max_running` start, and the first one that fits but not now holds up every
    later job of that kind. So one owner's thousands of queued jobs never hide another's.
    """
    limit = settings.max_running_jobs_per_user
    at_limit = {owner for owner, n in running.items() if n >= limit}
    rows = queue_repository.heads(session, per_owner=limit + 1, at_limit=at_limit)
    queued, unreadable = [], []
    for row in rows:
        needs = repository.needs_of(row.spec_kind, row.resources)
        if isinstance(needs, str):
            unreadable.append(Unreadable(row.job_id, needs))
        else:
            queued.append(Queued(row.job_id, row.owner_id, needs, row.queued_reason))
    return queued, unreadable


def _judge_unplaceable(session: Session, *, nodes: list[Node]) -> None:
    """Judge again every job flagged unplaceable, a group per shape: clear it once nodes could hold it."""
    for group in queue_repository.unplaceable_groups(session):
        needs = repository.needs_of(group.spec_kind, group.resources)
        if isinstance(needs, str):
            # Let the heads read it, and fail it with this reason.
            queue_repository.set_group(session, group=group, reason=None, unplaceable=False)
            continue
        shape = Pending("", 0, needs.device, needs.nodes, needs.processes_per_node)
        never = never_fits(shape, nodes)
        if never is None or never != group.queued_reason:
            queue_repository.set_group(session, group=group, reason=never, unplaceable=never is not None)


def unplaceable_reason(session: Session, *, job: Pending, settings: Settings) -> str | None:
    """What a placement round now would say if no set of live nodes could ever hold `job`; else None."""
    # The same rule and liveness window as `place`, so a submit's answer and the next round agree.
    live = repository.live_nodes(session, beat_after=utcnow() - live_after(settings), device=job.device)
    return never_fits(job, [Node(name=w.name, device=w.device, slots=w.slots, free=w.slots) for w in live])


def _fail_unreadable(session: Session, *, job_id: str, problem: str) -> None:
    """End a queued job whose stored spec placement cannot read: it could never start."""
    error = JobError(type=INVALID_SPEC, message=problem)
    lifecycle.transition(
        session,
        job_id=job_id,
        src=JobStatus.QUEUED,
        dst=JobStatus.FAILED,
        reason=problem,
        values={"error": error.model_dump(mode="json")},
    )
    log.warning("job %s failed at placement: %s", job_id, problem)


def _free_port(ports: set[int], *, settings: Settings) -> int | None:
    for port in range(settings.rendezvous_port_min, settings.rendezvous_port_max + 1):
        if port not in ports:
            return port
    return None


def _free_uid(uids: set[int], *, settings: Settings) -> int | None:
    low, high = settings.cluster_rank_uids
    count = high - low + 1
    # From anywhere in the range: a uid just freed (its last node may still be ending its lease,
    # workers/sandbox/rank_uids.py) is then seldom the next one given.
    start = random.randrange(count)
    for i in range(count):
        if (uid := low + (start + i) % count) not in uids:
            return uid
    return None


class Multi(NamedTuple):
    """What placement gives a multi-node attempt beside its nodes: node 0's rendezvous port, one uid."""

    port: int
    rank_uid: int


def _start(session: Session, *, chosen: list[tuple[Pending, Decision, Multi | None]]) -> list[Placed]:
    """Move the chosen jobs to `running` with a new attempt on their nodes, in one claim and one INSERT
    of their job_nodes rows; a job that left `queued` since it was read is left out."""
    names = {job.job_id: [n.name for n in decision.nodes] for job, decision, _multi in chosen}
    attempts = lifecycle.claim_many(
        session,
        workers={job_id: nodes[0] for job_id, nodes in names.items()},
        reasons={job_id: f"placed on {', '.join(nodes)}" for job_id, nodes in names.items()},
    )
    now = utcnow()
    rows: list[dict[str, Any]] = []
    placed: list[Placed] = []
    for job, decision, multi in chosen:
        if (attempt := attempts.get(job.job_id)) is None:  # cancelled since it was read
            continue
        port = multi.port if multi is not None else None
        rows += [
            {
                "job_id": job.job_id,
                "node_rank": rank,
                "attempt": attempt,
                "worker": node.name,
                "slots": job.processes_per_node,
                "address": node.address,
                "port": port if rank == 0 else None,
                "rank_uid": multi.rank_uid if multi is not None else None,
                "placed_at": now,
                "started_at": None,
            }
            for rank, node in enumerate(decision.nodes)
        ]
        endpoint = f"{decision.nodes[0].address}:{port}" if port is not None else ""
        starts = [
            NodeStart(job_id=job.job_id, attempt=attempt, node_rank=rank, worker=name, endpoint=endpoint)
            for rank, name in enumerate(names[job.job_id])
        ]
        placed.append(Placed(job_id=job.job_id, starts=starts))
    if rows:
        repository.add_nodes(session, rows=rows)
    return placed


def send(dispatcher: Dispatcher, placed: list[Placed]) -> None:
    """Send the start messages of committed placements; a send that failed is the reconciler's to retry."""
    for p in placed:
        for start in p.starts:
            try:
                dispatcher.start_node(start)
            except Exception:  # noqa: BLE001 - the node row stays unstarted: republish_unstarted resends
                log.warning(
                    "job %s: sending node %d its start failed", start.job_id, start.node_rank, exc_info=True
                )


def schedule_once(
    *, sessions: sessionmaker[Session], dispatcher: Dispatcher, settings: Settings
) -> list[str]:
    """Run one placement round and send its start messages; returns the ids of the jobs placed."""
    with sessions.begin() as session:
        placed = place(session, settings=settings)
    send(dispatcher, placed)
    if placed:
        log.info("placed %d jobs: %s", len(placed), [p.job_id for p in placed])
    return [p.job_id for p in placed]


def republish_unstarted(
    *, sessions: sessionmaker[Session], dispatcher: Dispatcher, after_seconds: float
) -> list[NodeStart]:
    """Send again the start of every placed node its worker has not started for `after_seconds`."""
    now = utcnow()
    with sessions.begin() as session:
        due = repository.unstarted(session, placed_before=now - timedelta(seconds=after_seconds), now=now)
        starts = [
            NodeStart(
                job_id=j, attempt=a, node_rank=r, worker=w, endpoint=repository.endpoint(session, job_id=j)
            )
            for j, a, r, w in due
        ]
    send(dispatcher, [Placed(job_id=s.job_id, starts=[s]) for s in starts])
    if starts:
        log.info("sent %d node starts again: %s", len(starts), starts)
    return starts
