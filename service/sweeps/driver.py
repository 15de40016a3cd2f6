"""The sweep driver: run with each placement round, it ends, prunes and starts each sweep's trials.

Optuna samples and prunes, but its study lives in memory, rebuilt each round from the trial rows
(parameters, objective, the metric's steps): Optuna's RDB storage keeps its own Alembic
`alembic_version` in the same database, which would clash with dptrain's migrations. A trial's row
and its job are written in one transaction under the sweep's row lock, and the sampler of trial n
is seeded by (seed, n): a restart loses no trial and asks for none twice.
"""

from __future__ import annotations

import logging
from typing import Any

import optuna
from fastapi.exceptions import RequestValidationError
from optuna.trial import FrozenTrial, TrialState, create_trial
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobSpec, JobStatus
from service.config import Settings
from service.errors import ServiceError
from service.jobs import repository as job_repository
from service.jobs import service as jobs
from service.jobs import submit
from service.models import Job, SweepTrial, User
from service.models import Sweep as SweepRow
from service.models.base import utcnow
from service.scheduling.queue import QueueFull
from service.sweeps import repository, space
from service.sweeps.service import trial_spec

log = logging.getLogger(__name__)
optuna.logging.set_verbosity(optuna.logging.WARNING)


def _sampler(spec: dict[str, Any], number: int) -> optuna.samplers.BaseSampler:
    seed = None if spec.get("seed") is None else (int(spec["seed"]) * 100_003 + number) % 2**31
    kind = spec.get("sampler", "random")
    if kind == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if kind == "grid":
        return optuna.samplers.GridSampler(space.grid(spec["space"]), seed=spec.get("seed"))
    return optuna.samplers.RandomSampler(seed=seed)


def _pruner(spec: dict[str, Any]) -> optuna.pruners.BasePruner | None:
    options = spec.get("pruner") or {}
    kind = options.get("type", "none")
    if kind == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=options.get("n_startup_trials", 2),
            n_warmup_steps=options.get("n_warmup_steps", 0),
        )
    if kind == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=options.get("min_resource", 1), reduction_factor=options.get("reduction_factor", 3)
        )
    return None


def _rungs(spec: dict[str, Any], steps: list[tuple[int, float]]) -> dict[str, Any]:
    """ASHA's record of the rungs a trial reached: its value at the first step at or past each rung's."""
    options = spec.get("pruner") or {}
    if options.get("type") != "asha" or not steps:
        return {}
    # What SuccessiveHalvingPruner keeps in a stored trial's system attributes, rebuilt from the metrics.
    attrs: dict[str, Any] = {}
    rung, last = 0, steps[-1][0]
    while (at := options.get("min_resource", 1) * options.get("reduction_factor", 3) ** rung) <= last:
        attrs[f"completed_rung_{rung}"] = next(value for step, value in steps if step >= at)
        rung += 1
    return attrs


def _frozen(
    trial: SweepTrial,
    *,
    dists: dict[str, Any],
    steps: list[tuple[int, float]],
    attrs: dict[str, Any] | None = None,
) -> FrozenTrial:
    state = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED, "failed": TrialState.FAIL}
    frozen = create_trial(
        state=state.get(trial.state, TrialState.RUNNING),
        value=trial.objective if trial.state == "complete" else None,
        params=trial.params,
        distributions=dists,
        intermediate_values=dict(steps),
        system_attrs=attrs,
    )
    frozen.number = trial.number
    return frozen


def tick(session: Session, *, sweep_id: str, settings: Settings) -> int:
    """One round of one sweep (the caller commits): end, prune, then start trials; how many started."""
    sweep = repository.get(session, sweep_id=sweep_id, lock=True)
    if sweep is None or sweep.state != "running":
        return 0
    spec = sweep.spec
    owner = session.get(User, sweep.owner_id)
    assert owner is not None
    metric = spec["objective"]["metric"]
    dists = space.distributions(spec["space"])
    direction = spec["objective"]["direction"]
    study = optuna.create_study(direction=direction)
    pruner = _pruner(spec)
    rows = repository.trials(session, sweep_id=sweep.id)
    # A finished trial's steps matter only to a pruner (its intermediate values): one query for all.
    wanted = [job.id for trial, job in rows if job is not None and (trial.state == "active" or pruner)]
    series = repository.series_of(session, job_ids=wanted, name=metric)
    running: list[tuple[SweepTrial, Job, list[tuple[int, float]]]] = []
    frozen: list[FrozenTrial] = []
    for trial, job in rows:
        steps = series.get(job.id, []) if job is not None else []
        if trial.state == "active":
            _end_if_done(trial, job, steps)
        if trial.state == "active" and job is not None:
            running.append((trial, job, steps))
        frozen.append(_frozen(trial, dists=dists, steps=steps, attrs=_rungs(spec, steps)))
    study.add_trials([f for f in frozen if f.state.is_finished()])
    if pruner is not None:
        for trial, job, steps in running:
            live = bool(steps) and job.status == JobStatus.RUNNING.value and not job.cancel_requested
            if live and _prunes(
                pruner, direction=direction, others=frozen, trial=trial, dists=dists, steps=steps
            ):
                trial.state = "pruned"
                # The job cancel path, flagged so that its run ends `pruned`.
                job_repository.request_cancel(session, job_id=job.id, prune=True)
    # A pruned trial's ranks hold their slot until its cancel has stopped them.
    active = sum(
        1
        for trial, job in rows
        if trial.state == "active" or (job is not None and not JobStatus(job.status).is_terminal())
    )
    for f in frozen:
        if not f.state.is_finished():
            study.add_trial(f)
    number, started = len(rows), 0
    while active < spec["max_concurrent_trials"] and number < spec["max_trials"]:
        try:
            if not _start(
                session, sweep=sweep, owner=owner, study=study, number=number, dists=dists, settings=settings
            ):
                break
        except TrialRefused as exc:
            # Refused for good (the owner lost a grant, the server gained a rule): the sweep
            # fails saying why, rather than trying again every round; its running trials are stopped.
            _fail(session, sweep=sweep, owner=owner, error=str(exc))
            return started
        active += 1
        number += 1
        started += 1
    if number >= spec["max_trials"] and active == 0:
        # max_trials have ended: the sweep is decided.
        sweep.state = "succeeded" if any(t.state == "complete" for t, _ in rows) else "failed"
        sweep.finished_at = utcnow()
    session.flush()
    return started


def _prunes(
    pruner: optuna.pruners.BasePruner,
    *,
    direction: str,
    others: list[FrozenTrial],
    trial: SweepTrial,
    dists: dict[str, Any],
    steps: list[tuple[int, float]],
) -> bool:
    """Optuna's decision on one running trial, in a study of the others and of it (stored, no rungs yet)."""
    study = optuna.create_study(direction=optuna.study.StudyDirection[direction.upper()])
    study.add_trials([f for f in others if f.number != trial.number])
    study.add_trial(_frozen(trial, dists=dists, steps=steps))
    return bool(pruner.prune(study, study.get_trials(deepcopy=False)[-1]))


def _end_if_done(trial: SweepTrial, job: Job | None, steps: list[tuple[int, float]]) -> None:
    if job is None:
        trial.state = "failed"
        return
    status = JobStatus(job.status)
    if not status.is_terminal():
        return
    if status is JobStatus.SUCCEEDED and steps:
        trial.state, trial.objective = "complete", steps[-1][1]
    else:
        trial.state = "failed"


class TrialRefused(Exception):
    """A trial's submit was refused for a reason that waiting does not change."""


def _start(
    session: Session,
    *,
    sweep: SweepRow,
    owner: User,
    study: optuna.Study,
    number: int,
    dists: dict[str, Any],
    settings: Settings,
) -> bool:
    """Ask Optuna for trial `number` and submit its job as the owner; False if the owner's limits say wait.

    TrialRefused if its submit would be refused now: each trial is checked as a submit of its own
    would be (the owner's grants and the server's rules may have changed since the sweep's submit).
    """
    study.sampler = _sampler(sweep.spec, number)
    asked = study.ask(dists)
    params = dict(asked.params)
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
    sweep.state, sweep.error, sweep.finished_at = "failed", error, utcnow()
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
