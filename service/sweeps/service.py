"""Sweeps: checked at submit (every point of the space makes a valid job), shown, listed, cancelled."""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from api_schemas import (
    JobSpec,
    JobStatus,
    Sweep,
    SweepBest,
    SweepCreate,
    SweepList,
    SweepState,
    SweepTrial,
)
from service.config import Settings
from service.errors import NotFound, invalid_field
from service.jobs import service as jobs
from service.jobs import submit
from service.models import Job, User
from service.models import Sweep as SweepRow
from service.models.base import utcnow
from service.sweeps import lifecycle, repository, space


def status_of(job: Job | None) -> JobStatus:
    """A trial's status: its job's (`failed` if the job is gone), never stored on the trial."""
    return JobStatus(job.status) if job is not None else JobStatus.FAILED


def trial_spec(sweep: SweepRow, *, number: int, params: dict[str, Any]) -> dict[str, Any]:
    """The whole job spec of trial `number`: the base with its parameters, name and sweep label."""
    spec = space.with_params(sweep.spec["base"], params)
    spec["name"] = f"{sweep.name}-{number}"
    spec["labels"] = {**(spec.get("labels") or {}), "sweep": sweep.id}
    return spec


def _loc(error: Any) -> str:
    return ".".join(str(part) for part in error["loc"])


def _check_point(row: SweepRow, params: dict[str, Any]) -> JobSpec:
    try:
        return JobSpec.model_validate(trial_spec(row, number=0, params=params))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = _loc(first)
        # The path whose value broke the spec, else the first path of the point (cross-field rules,
        # e.g. a global batch that does not divide by the ranks, name no single field).
        path = next((p for p in params if where == p or where.startswith(p + ".")), next(iter(params)))
        raise invalid_field(
            ("body", "space", path),
            f"{path}={params[path]!r} (with {params}) makes an invalid trial spec: {where}: {first['msg']}",
            params[path],
        ) from None
    except ValueError as exc:
        path = next(iter(params))
        raise invalid_field(("body", "space", path), str(exc), params[path]) from None


def check(session: Session, *, user: User, body: SweepCreate, row: SweepRow, settings: Settings) -> None:
    """422 naming the path if any checked point of the space makes an invalid job spec."""
    try:
        base = JobSpec.model_validate(trial_spec(row, number=0, params={}))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise invalid_field(("body", "base", *first["loc"]), first["msg"], first.get("input")) from None
    count = space.count(body.space)
    if count > space.MAX_POINTS:
        raise invalid_field(
            ("body", "space"),
            f"the space has {count} points to check (above {space.MAX_POINTS}): "
            "narrow an int range, or list the values wanted as a choice",
            None,
        )
    paths = list(body.space)
    # The submit gate on the base, and on each distinct setting of the paths outside the
    # hyperparameters (an `env.X`, `entrypoint` or `priority` choice), which alone can change its
    # answer: a trial the sweep would start is refused now, for the reason its own submit would be.
    code_at = _code_loc(paths)
    submit.gate(session, user=user, spec=base, settings=settings, code_at=code_at)
    beyond = [i for i, path in enumerate(paths) if not path.startswith("hyperparameters.")]
    checked: set[str] = set()
    for combo in space.points(body.space):
        spec = _check_point(row, dict(zip(paths, combo, strict=True)))
        setting = json.dumps([combo[i] for i in beyond])
        if beyond and setting not in checked:
            checked.add(setting)
            submit.gate(session, user=user, spec=spec, settings=settings, code_at=code_at)


def _code_loc(paths: list[str]) -> tuple[str, ...]:
    # Where a refused archive was named: the space's path that sets it, else the base.
    setting = next((p for p in paths if p == "code" or p.startswith("code.")), None)
    return ("body", "space", setting) if setting else ("body", "base", "code", "sha256")


def create(session: Session, *, user: User, body: SweepCreate, settings: Settings) -> SweepRow:
    """Record a running sweep after checking its space; the driver then creates its trials."""
    row = SweepRow(
        id=uuid.uuid4().hex,
        name=body.name,
        owner_id=user.id,
        state=SweepState.RUNNING.value,
        spec=body.model_dump(mode="json"),
        created_at=utcnow(),
    )
    check(session, user=user, body=body, row=row, settings=settings)
    repository.add(session, sweep=row)
    return row


def get_visible(session: Session, *, user: User, sweep_id: str) -> SweepRow:
    """A sweep the user may see, or NotFound (never saying that another's exists)."""
    sweep = repository.get(session, sweep_id=sweep_id, owner_id=None if user.is_admin else user.id)
    if sweep is None:
        raise NotFound(f"no sweep {sweep_id}")
    return sweep


def present(session: Session, *, sweep: SweepRow, owner: str, steps: bool = True) -> Sweep:
    """The API's view of a sweep: its trials (with their objective's steps) and the best."""
    spec = SweepCreate.model_validate(sweep.spec)
    trials: list[SweepTrial] = []
    rows = repository.trials(session, sweep_id=sweep.id)
    # The dashboard polls this while a sweep runs: every trial's series in one query.
    ids = [job.id for _trial, job in rows if job is not None] if steps else []
    by_job = repository.series_of(session, job_ids=ids, name=spec.objective.metric)
    for trial, job in rows:
        series = by_job.get(job.id, []) if (steps and job) else None
        trials.append(
            SweepTrial(
                number=trial.number,
                job_id=trial.job_id,
                params=trial.params,
                status=status_of(job).value,
                objective=trial.objective,
                steps=series,
            )
        )
    done = [t for t in trials if t.objective is not None and t.status == JobStatus.SUCCEEDED.value]
    best = None
    if done:
        pick = min if spec.objective.direction == "minimize" else max
        top = pick(done, key=lambda t: t.objective or 0.0)
        assert top.objective is not None
        best = SweepBest(number=top.number, job_id=top.job_id, params=top.params, objective=top.objective)
    return Sweep(
        id=sweep.id,
        name=sweep.name,
        owner=owner,
        state=SweepState(sweep.state),
        spec=spec,
        trials=trials,
        best=best,
        created_at=sweep.created_at,
        finished_at=sweep.finished_at,
        error=sweep.error,
    )


def _owner(session: Session, sweep: SweepRow) -> str:
    session_user = session.get(User, sweep.owner_id)
    return session_user.name if session_user else "?"


def shown(session: Session, *, user: User, sweep_id: str) -> Sweep:
    """GET /v1/sweeps/{id}."""
    sweep = get_visible(session, user=user, sweep_id=sweep_id)
    return present(session, sweep=sweep, owner=_owner(session, sweep))


def listed(session: Session, *, user: User, limit: int, cursor: str | None) -> SweepList:
    """A page of the sweeps the user may see, newest first (trials without their steps)."""
    after = repository.decode_cursor(cursor) if cursor else None
    rows = repository.page(session, owner_id=None if user.is_admin else user.id, limit=limit + 1, after=after)
    page, more = list(rows[:limit]), len(rows) > limit
    return SweepList(
        items=[present(session, sweep=s, owner=_owner(session, s), steps=False) for s in page],
        next_cursor=repository.encode_cursor(page[-1]) if more else None,
    )


def cancel(session: Session, *, user: User, sweep_id: str) -> SweepRow:
    """Cancel a sweep: no new trials, and its queued and running trials are cancelled."""
    sweep = get_visible(session, user=user, sweep_id=sweep_id)
    sweep = repository.get(session, sweep_id=sweep.id, lock=True) or sweep
    if SweepState(sweep.state).is_terminal():
        return sweep
    for _trial, job in repository.trials(session, sweep_id=sweep.id):
        if job is not None and not JobStatus(job.status).is_terminal():
            jobs.cancel(session, user=user, job_id=job.id)
    return (
        lifecycle.transition(session, sweep_id=sweep.id, src=SweepState.RUNNING, dst=SweepState.CANCELLED)
        or sweep
    )
