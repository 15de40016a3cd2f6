"""The sweep driver: run with each placement round, it records, prunes and starts each sweep's trials.

Optuna samples and prunes in a study rebuilt each round from the trial rows and their jobs
(service.sweeps.study). A trial's row and its job are written in one transaction under the sweep's
row lock, and the sampler of trial n is seeded by (seed, n): a restart loses no trial and asks for
none twice. A trial's status is its job's and is never written here: the pruner only asks the job
to stop (the cancel path, flagged `prune`), and the job's worker decides how it ended. A job that
finished its work before the stop took effect ends `succeeded`, keeps its objective and counts as a
complete trial; one that was stopped ends `pruned`.
"""

from __future__ import annotations

import logging

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobSpec, JobStatus, SweepCreate, SweepState
from service.config import Settings
from service.errors import ServiceError
from service.jobs import repository as job_repository
from service.jobs import service as jobs
from service.jobs import submit
from service.models import Job, SweepTrial, User
from service.models import Sweep as SweepRow
from service.scheduling.queue import QueueFull
from service.sweeps import lifecycle, repository
from service.sweeps.service import status_of, trial_spec
from service.sweeps.study import Study, Trial

log = logging.getLogger(__name__)


def tick(session: Session, *, sweep_id: str, settings: Settings) -> int:
    """One round of one sweep (the caller commits): record, prune, then start trials; how many started."""
    sweep = repository.get(session, sweep_id=sweep_id, lock=True)
    if sweep is None or SweepState(sweep.state) is not SweepState.RUNNING:
        return 0
    spec = SweepCreate.model_validate(sweep.spec)
    owner = session.get(User, sweep.owner_id)
    assert owner is not None
    rows = repository.trials(session, sweep_id=sweep.id)
    # The metric's steps of every trial matter to a pruner; else only to a success whose objective
    # is not recorded yet. One query for all.
    wanted = [
        job.id
        for trial, job in rows
        if job is not None and (spec.pruner.type != "none" or _unrecorded(trial, job))
    ]
    series = repository.series_of(session, job_ids=wanted, name=spec.objective.metric)
    study_trials: list[Trial] = []
    for trial, job in rows:
        steps = series.get(job.id, []) if job is not None else []
        if job is not None and _unrecorded(trial, job) and steps:
            # Its result, kept on the row: the job's metric points are purged with its history.
            trial.objective = steps[-1][1]
        study_trials.append(
            Trial(
                number=trial.number,
                params=trial.params,
                status=status_of(job),
                objective=trial.objective,
                steps=steps,
            )
        )
    study = Study(spec, study_trials)
    for (trial, job), entry in zip(rows, study_trials, strict=True):
        if job is not None and _prunable(job, entry) and study.prunes(trial.number):
            # The job cancel path, flagged so that a run it stops ends `pruned`.
            job_repository.request_cancel(session, job_id=job.id, prune=True)
    # A trial holds its slot until its job has ended (a pruned one's, until its ranks have stopped).
    active = sum(1 for _trial, job in rows if not status_of(job).is_terminal())
    number, started = len(rows), 0
    while active < spec.max_concurrent_trials and number < spec.max_trials:
        try:
            if not _start(session, sweep=sweep, owner=owner, study=study, number=number, settings=settings):
                break
        except TrialRefused as exc:
            # Refused for good (the owner lost a grant, the server gained a rule): the sweep
            # fails saying why, rather than trying again every round; its running trials are stopped.
            _fail(session, sweep=sweep, owner=owner, error=str(exc))
            return started
        active += 1
        number += 1
        started += 1
    if number >= spec.max_trials and active == 0:
        # max_trials have ended: the sweep is decided, succeeded if any trial has a result.
        done = any(trial.objective is not None for trial, _job in rows)
        dst = SweepState.SUCCEEDED if done else SweepState.FAILED
        lifecycle.transition(session, sweep_id=sweep.id, src=SweepState.RUNNING, dst=dst)
    session.flush()
    return started


def _unrecorded(trial: SweepTrial, job: Job) -> bool:
    return trial.objective is None and job.status == JobStatus.SUCCEEDED.value


def _prunable(job: Job, trial: Trial) -> bool:
    """Whether the pruner may stop the trial's job now: running, not being stopped, short of its end."""
    # A job past its last step has nothing left to save, and a stop then could only race its final
    # checkpoint (the job would end `pruned` with every step run).
    at_end = job.total_steps is not None and job.step >= job.total_steps
    return trial.status is JobStatus.RUNNING and bool(trial.steps) and not job.cancel_requested and not at_end


class TrialRefused(Exception):
    """A trial's submit was refused for a reason that waiting does not change."""


def _start(
    session: Session,
    *,
    sweep: SweepRow,
    owner: User,
    study: Study,
    number: int,
    settings: Settings,
) -> bool:
    """Ask Optuna for trial `number` and submit its job as the owner; False if the owner's limits say wait.

    TrialRefused if its submit would be refused now: each trial is checked as a submit of its own
    would be (the owner's grants and the server's rules may have changed since the sweep's submit).
    """
    params = study.ask(number)
    try:
        spec = JobSpec.model_validate(trial_spec(sweep, number=number, params=params))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise TrialRefused(
            f"trial {number} ({params}) makes an invalid spec: {where}: {first['msg']}"
        ) from None
    try:
        with session.begin_nested():
            job, _ = submit.submit(
                session, user=owner, spec=spec, settings=settings, key=f"sweep:{sweep.id}:{number}"
            )
            repository.add_trial(
                session, trial=SweepTrial(sweep_id=sweep.id, number=number, job_id=job.id, params=params)
            )
    except QueueFull as exc:
        # The owner's queue cap holds the sweep back until a trial starts or ends.
        log.info("sweep %s: trial %d waits: %s", sweep.id, number, exc)
        return False
    except ServiceError as exc:
        raise TrialRefused(f"trial {number}'s submit was refused ({exc.status_code}): {exc}") from None
    except RequestValidationError as exc:
        # A 422 of the server's rules (an archive no longer stored, nor the owner's): final too.
        reason = "; ".join(str(e.get("msg", e)) for e in exc.errors())
        raise TrialRefused(f"trial {number}'s submit was refused (422): {reason}") from None
    return True


def _fail(session: Session, *, sweep: SweepRow, owner: User, error: str) -> None:
    log.warning("sweep %s failed: %s", sweep.id, error)
    # Read again: the trials this round started before the refusal are live too.
    for _trial, job in repository.trials(session, sweep_id=sweep.id):
        if job is not None and not JobStatus(job.status).is_terminal():
            jobs.cancel(session, user=owner, job_id=job.id)
    lifecycle.transition(
        session, sweep_id=sweep.id, src=SweepState.RUNNING, dst=SweepState.FAILED, error=error
    )
    session.flush()


def run_once(*, sessions: sessionmaker[Session], settings: Settings) -> bool:
    """One round over every running sweep, each in its own transaction; True if any job was submitted."""
    with sessions() as session:
        ids = repository.running_ids(session)
    started = 0
    for sweep_id in ids:
        try:
            with sessions.begin() as session:
                started += tick(session, sweep_id=sweep_id, settings=settings)
        except Exception:  # noqa: BLE001 - one broken sweep must not stop the others' rounds
            log.warning("sweep %s: round failed", sweep_id, exc_info=True)
    return started > 0
