"""Thin routes of `/v1/jobs`: parse, call the service, answer."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Header, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BeforeValidator
from sqlalchemy.orm import Session

from api_schemas import (
    CheckpointList,
    Job,
    JobList,
    JobSpec,
    JobStatus,
    LogLine,
    LogPage,
    MetricSeries,
    Timeline,
)
from service.deps import (
    CurrentUser,
    SchedulerDep,
    SessionDep,
    SettingsDep,
    after_commit,
    run_in_transaction,
    run_read,
    token_check,
)
from service.downloads import attachment
from service.errors import (
    Conflict,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    error_responses,
    invalid_field,
)
from service.etag import conditional, conditional_json
from service.jobs import events, metrics_repository, repository, service, submit
from service.jobs.checkpoint_files import open_checkpoint
from service.jobs.poll_cache import JobPollCache
from service.models import Job as JobRow
from service.params import CheckpointId, Int32, Int64, JobId, Text
from service.routing import v1_router
from service.strict_json import parsed_body

router = v1_router("jobs")
_NOT_MODIFIED: dict[int | str, dict[str, object]] = {304: {"description": "Not modified (If-None-Match)"}}
_REPLAY: dict[int | str, dict[str, object]] = {
    200: {"model": Job, "description": "A replay: the job this Idempotency-Key created"}
}


async def _env_grant(request: Request, user: CurrentUser, settings: SettingsDep) -> None:
    # A dependency, so that the gate's grant checks run before the body's own rules (see refuse_early).
    submit.refuse_early(parsed_body(request), user=user, settings=settings)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=Job,
    responses=_REPLAY | error_responses(Conflict, Forbidden, NotFound, PayloadTooLarge),
    dependencies=[Depends(_env_grant)],
)
async def submit_job(
    spec: JobSpec,
    response: Response,
    session: SessionDep,
    user: CurrentUser,
    scheduler: SchedulerDep,
    settings: SettingsDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=255,
            pattern=r"^[\x21-\x7e]+$",
            description="Retry-safe submit: the same key and spec answer 200 with the same job; "
            "the same key with another spec 409.",
        ),
    ] = None,
) -> Job:
    """Submit a job; it is queued, and placement starts it on free nodes once committed."""

    def accept(session: Session) -> tuple[JobRow, bool, int | None]:
        job, created = submit.submit(session, user=user, spec=spec, settings=settings, key=idempotency_key)
        if created:
            after_commit(session, scheduler.kick)
        return job, created, service.queue_position(session, job=job)

    # Async with the insert, the commit and the publish in one threadpool hop (see get_job).
    job, created, position = await run_in_transaction(session, accept)
    if not created:
        response.status_code = status.HTTP_200_OK
    return service.to_schema(job, owner=user.name, position=position)


def _iso_8601(value: object) -> object:
    # pydantic would also read a bare number as a Unix time; the documented format is ISO-8601.
    if isinstance(value, str) and not re.match(r"^\d{4}-\d{2}-\d{2}", value):
        raise ValueError("expected an ISO-8601 date-time")
    return value


def _invalid_query(field: str, message: str, value: object) -> RequestValidationError:
    return invalid_field(("query", field), message, value)


@router.get("", response_model=JobList, responses=_NOT_MODIFIED)
def list_jobs(
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    settings: SettingsDep,
    limit: Annotated[Int64 | None, Query(ge=1, description="Page size, up to DPTRAIN_MAX_PAGE_SIZE.")] = None,
    cursor: str | None = None,
    status: JobStatus | None = None,
    label: Annotated[
        list[Text] | None, Query(description="`key=value`, repeatable: jobs carrying all of them.")
    ] = None,
    updated_since: Annotated[
        datetime | None,
        BeforeValidator(_iso_8601),
        Query(description="Only jobs whose `updated_at` is strictly later."),
    ] = None,
) -> Response:
    """List jobs newest first; pass `next_cursor` back as `cursor` for the next page."""
    if limit is not None and limit > settings.max_page_size:
        raise _invalid_query("limit", f"limit must be at most {settings.max_page_size}", limit)
    size = min(limit or settings.default_page_size, settings.max_page_size)
    try:
        labels = service.parse_labels(label or [])
    except ValueError as exc:
        raise _invalid_query("label", str(exc), label) from exc
    try:
        page = service.list_jobs(
            session,
            user=user,
            limit=size,
            cursor=cursor,
            status=status,
            labels=labels,
            updated_since=updated_since,
        )
    except ValueError as exc:
        raise _invalid_query("cursor", str(exc), cursor) from exc
    return conditional_json(request, page)


@router.get("/{job_id}", response_model=Job, responses=error_responses(NotFound) | _NOT_MODIFIED)
async def get_job(job_id: JobId, request: Request, user: CurrentUser, settings: SettingsDep) -> Response:
    """One job; answers 304 when `If-None-Match` holds its current ETag."""
    # The hot path of every client that polls: answered from this process's job cache when it
    # can (no database round trip, no threadpool hop), else with one query in one hop. The ETag
    # comes from the row version, so a 304 never builds a body that nobody keeps.
    cache: JobPollCache = request.app.state.poll_cache
    hit = cache.get(job_id)
    if hit is not None and service.can_see(user, owner_id=hit.owner_id):
        return conditional(request, etag=hit.etag, render=lambda: hit.body)
    seen_seq = cache.seq
    job, owner, position = await run_read(request, service.get_visible_with_owner, user=user, job_id=job_id)
    etag = service.job_etag(job, owner=owner, position=position)

    def render() -> bytes:
        return service.to_schema(job, owner=owner, position=position).model_dump_json().encode()

    if not cache.accepts(seen_seq):
        return conditional(request, etag=etag, render=render)  # built only for a 200
    body = render()
    # A queued job's position moves with other jobs, which no notification of its own row reports:
    # kept no longer than a placement interval, so a poll shows it at most that old.
    max_age = settings.schedule_interval_seconds if job.status == JobStatus.QUEUED.value else None
    cache.put(job_id, owner_id=job.owner_id, etag=etag, body=body, seen_seq=seen_seq, max_age=max_age)
    return conditional(request, etag=etag, render=lambda: body)


@router.get("/{job_id}/timeline", response_model=Timeline, responses=error_responses(NotFound))
def get_timeline(job_id: JobId, session: SessionDep, user: CurrentUser) -> Timeline:
    """The job's status changes, oldest first."""
    return service.timeline(session, user=user, job_id=job_id)


@router.post("/{job_id}/cancel", response_model=Job, responses=error_responses(NotFound))
def cancel_job(job_id: JobId, request: Request, session: SessionDep, user: CurrentUser) -> Job:
    """Cancel a job: a queued one never starts, a running one is stopped by its worker."""
    job = service.cancel(session, user=user, job_id=job_id)
    # This process's next poll shows the cancel at once, without waiting for the notification
    # (which still comes, and is what other API processes go by).
    cache: JobPollCache = request.app.state.poll_cache
    after_commit(session, lambda: cache.invalidate(job_id))
    return service.present(session, jobs=[job])[0]


@router.get("/{job_id}/metrics", response_model=MetricSeries, responses=error_responses(NotFound))
def get_metrics(
    job_id: JobId,
    session: SessionDep,
    user: CurrentUser,
    since_step: Annotated[Int64 | None, Query(ge=-1)] = None,
    name: Annotated[Text | None, Query(description="Comma-separated metric names.")] = None,
    max_points: Annotated[
        int | None,
        Query(
            ge=2,
            le=100_000,
            description="Downsample longer series: the min and max point of each of max_points // 2 "
            "equal-width step buckets (global min and max always kept).",
        ),
    ] = None,
) -> MetricSeries:
    """Metric series of a job, `[step, value]` per name, optionally only after `since_step`."""
    service.get_visible(session, user=user, job_id=job_id)
    series = metrics_repository.metric_series(
        session,
        job_id=job_id,
        since_step=since_step,
        names=[n for n in (name or "").split(",") if n],
        max_points=max_points,
    )
    return MetricSeries(job_id=job_id, series=series)


@router.get("/{job_id}/logs", response_model=LogPage, responses=error_responses(NotFound))
def get_logs(
    job_id: JobId,
    session: SessionDep,
    user: CurrentUser,
    settings: SettingsDep,
    after: Annotated[Int64 | None, Query(ge=0, description="Cursor: the last line id already read.")] = None,
    rank: Annotated[Int32 | None, Query(ge=0)] = None,
    limit: Annotated[
        Int64 | None, Query(ge=1, description="Page size, up to DPTRAIN_MAX_LOG_PAGE_SIZE.")
    ] = None,
    tail: Annotated[
        int | None, Query(ge=1, le=10_000, description="The last `tail` lines instead; not with `after`.")
    ] = None,
) -> LogPage:
    """Per-rank output of a job, in order, from the cursor on (or its last `tail` lines)."""
    if tail is not None and after is not None:
        raise _invalid_query("tail", "tail and after cannot be used together", tail)
    if limit is not None and limit > settings.max_log_page_size:
        raise _invalid_query("limit", f"limit must be at most {settings.max_log_page_size}", limit)
    service.get_visible(session, user=user, job_id=job_id)
    if tail is not None:
        rows = repository.log_tail(session, job_id=job_id, rank=rank, tail=tail)
    else:
        size = min(limit or 1000, settings.max_log_page_size)
        rows = list(repository.log_lines(session, job_id=job_id, after=after, rank=rank, limit=size))
    items = [LogLine(id=r.id, rank=r.rank, attempt=r.attempt, line=r.line) for r in rows]
    return LogPage(items=items, next_cursor=items[-1].id if items else after)


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses=error_responses(NotFound) | {200: {"content": {"text/event-stream": {}}}},
)
def job_events(
    job_id: JobId,
    request: Request,
    session: SessionDep,
    user: CurrentUser,
    settings: SettingsDep,
    since_step: Annotated[
        Int64 | None, Query(ge=-1, description="First metrics event: points after it.")
    ] = None,
    max_points: Annotated[
        int | None, Query(ge=2, le=100_000, description="First metrics event: downsampled to this.")
    ] = None,
) -> StreamingResponse:
    """Server-sent events of a job (`job`, `metrics`, `checkpoint`, then `end`) until it finishes."""
    # 404 before the stream starts; the request's session is closed once this returns, and each
    # poll of the stream opens its own.
    service.get_visible(session, user=user, job_id=job_id)
    state = events.StreamState(job_id=job_id, since_step=since_step, max_points=max_points)
    # Starlette's StreamingResponse, not sse-starlette: it already cancels the generator when the
    # client disconnects (under uvicorn at once; under ASGI 2.4 servers at the next write, a
    # keep-alive at the latest), and the keep-alive comment must follow silence, not a clock.
    return StreamingResponse(
        events.stream(
            sessions=request.app.state.session_factory,
            state=state,
            poll_seconds=settings.sse_poll_seconds,
            authorized=token_check(request),
        ),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, responses=error_responses(NotFound))
def list_checkpoints(job_id: JobId, session: SessionDep, user: CurrentUser) -> CheckpointList:
    """Checkpoints of a job, oldest first."""
    service.get_visible(session, user=user, job_id=job_id)
    return CheckpointList(items=service.checkpoint_infos(repository.checkpoints(session, job_id=job_id)))


_CHECKPOINT_FILE: dict[int | str, dict[str, object]] = {
    200: {
        "description": "The checkpoint's bytes",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        "headers": {
            "X-Checkpoint-SHA256": {"description": "sha256 of the file, hex", "schema": {"type": "string"}}
        },
    }
}


@router.get(
    "/{job_id}/checkpoints/{checkpoint_id}/download",
    response_class=StreamingResponse,
    responses=_CHECKPOINT_FILE | error_responses(NotFound),
)
def download_checkpoint(
    job_id: JobId, checkpoint_id: CheckpointId, session: SessionDep, user: CurrentUser, settings: SettingsDep
) -> StreamingResponse:
    """The checkpoint file; open it with `torch.load(f, weights_only=True)`."""
    ckpt = service.get_checkpoint(session, user=user, job_id=job_id, checkpoint_id=checkpoint_id)
    # The file of this job and step in this job's own folder, never the row's path, nor through a
    # link: a rank may swap a link to another job's checkpoint in for its own file.
    f = open_checkpoint(settings.artifacts, job_id=ckpt.job_id, step=ckpt.step)
    if f is None:
        raise NotFound(f"checkpoint file of {checkpoint_id} is no longer available")
    return attachment(f, name=f"{job_id}-step{ckpt.step}.pt", headers={"X-Checkpoint-SHA256": ckpt.sha256})
