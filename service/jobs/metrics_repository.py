"""The jobs domain's reads of metric series: raw, since a step, and min/max downsampled."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import (
    ColumnElement,
    Float,
    Row,
    cast,
    func,
    select,
)
from sqlalchemy.dialects.postgresql import array as pg_array
from sqlalchemy.dialects.postgresql import distinct_on
from sqlalchemy.orm import Session

from service.db import is_postgresql
from service.jobs import downsample_repository
from service.models import Metric


def metric_series(
    session: Session,
    *,
    job_id: str,
    since_step: int | None,
    names: list[str] | None,
    max_points: int | None = None,
    up_to_id: int | None = None,
) -> dict[str, list[tuple[int, float]]]:
    """Metric points per name in step order, each series downsampled to `max_points` if given.

    The last value wins if an attempt re-reported a step; `up_to_id` leaves out later points.
    """
    # Querying by explicit names lets the (job_id, name, step, id) index jump straight to each
    # series' `since_step`, where "job_id = ? AND step > ?" would walk every point of the job.
    names = names or series_names(session, job_id=job_id)
    if not names:
        return {}
    if max_points is None:
        return _raw_series(session, job_id=job_id, since_step=since_step, names=names, up_to_id=up_to_id)
    where = _metric_filter(job_id=job_id, since_step=since_step, up_to_id=up_to_id)
    extents = {
        name: _extent(session, where=[*where, Metric.name == name], cap=max_points + 1) for name in names
    }
    small = [name for name, (n, _, _) in extents.items() if 0 < n <= max_points]
    out = (
        _raw_series(session, job_id=job_id, since_step=since_step, names=small, up_to_id=up_to_id)
        if small
        else {}
    )
    for name, (n, lo, hi) in extents.items():
        if n <= max_points:
            continue
        points = downsample_repository.downsampled(
            session, job_id=job_id, name=name, lo=lo, hi=hi, max_points=max_points, up_to_id=up_to_id
        )
        if points is not None:
            out[name] = points
        elif is_postgresql(session):
            out[name] = _downsampled_pg(session, where=where, name=name, lo=lo, hi=hi, max_points=max_points)
        else:
            # SQLite (the embedded service): read the series and bucket it here; slower, same answer.
            raw = _raw_series(session, job_id=job_id, since_step=since_step, names=[name], up_to_id=up_to_id)
            out[name] = downsample(raw.get(name, []), max_points=max_points)
    return dict(sorted(out.items()))


def series_names(session: Session, *, job_id: str) -> list[str]:
    """The job's metric names, one index probe per name (a loose index scan) however long the series."""
    names = select(func.min(Metric.name).label("name")).where(Metric.job_id == job_id).cte(recursive=True)
    after = select(func.min(Metric.name)).where(Metric.job_id == job_id, Metric.name > names.c.name)
    names = names.union_all(select(after.scalar_subquery()).where(names.c.name.is_not(None)))
    return [n for n in session.execute(select(names.c.name)).scalars() if n is not None]


def _extent(session: Session, *, where: list[ColumnElement[bool]], cap: int) -> tuple[int, int, int]:
    """(points up to `cap`, first step, last step) of one series: index probes, never a full count."""
    capped = select(Metric.id).where(*where).limit(cap).subquery()
    stmt = select(
        select(func.count()).select_from(capped).scalar_subquery(),
        select(func.min(Metric.step)).where(*where).scalar_subquery(),
        select(func.max(Metric.step)).where(*where).scalar_subquery(),
    )
    n, lo, hi = session.execute(stmt).one()
    return int(n), int(lo or 0), int(hi or 0)


def _metric_filter(*, job_id: str, since_step: int | None, up_to_id: int | None) -> list[ColumnElement[bool]]:
    where = [Metric.job_id == job_id]
    if since_step is not None:
        where.append(Metric.step > since_step)
    if up_to_id is not None:
        where.append(Metric.id <= up_to_id)
    return where


def _raw_series(
    session: Session, *, job_id: str, since_step: int | None, names: list[str] | None, up_to_id: int | None
) -> dict[str, list[tuple[int, float]]]:
    stmt = select(Metric.name, Metric.step, Metric.value).where(
        *_metric_filter(job_id=job_id, since_step=since_step, up_to_id=up_to_id)
    )
    if names:
        stmt = stmt.where(Metric.name.in_(names))
    stmt = stmt.order_by(Metric.name, Metric.step, Metric.id)
    series: dict[str, dict[int, float]] = {}
    for name, step, value in session.execute(stmt):
        series.setdefault(name, {})[step] = value
    return {name: sorted(points.items()) for name, points in series.items()}


def bucket_of(step: int, *, lo: int, hi: int, buckets: int) -> int:
    """Which of `buckets` equal-width buckets over steps [lo, hi] holds `step` (the SQL does the same)."""
    return ((step - lo) * buckets) // (hi - lo + 1)


def downsample(points: list[tuple[int, float]], *, max_points: int) -> list[tuple[int, float]]:
    """Min and max point of each of `max_points // 2` equal-width step buckets, in step order.

    Ties go to the earliest step. The result has at most `max_points` points and always holds the
    series' global minimum and maximum.
    """
    if len(points) <= max_points:
        return points
    lo, hi, buckets = points[0][0], points[-1][0], max_points // 2
    keep: dict[int, tuple[tuple[float, int], tuple[float, int]]] = {}
    for step, value in points:
        b = bucket_of(step, lo=lo, hi=hi, buckets=buckets)
        low, high = keep.get(b, ((value, step), (value, -step)))
        keep[b] = (min(low, (value, step)), max(high, (value, -step)))
    chosen = {step: value for (value, step), _ in keep.values()}
    chosen |= {-neg: value for _, (value, neg) in keep.values()}
    return sorted(chosen.items())


def _downsampled_pg(
    session: Session, *, where: list[ColumnElement[bool]], name: str, lo: int, hi: int, max_points: int
) -> list[tuple[int, float]]:
    """`downsample` in one pass of PostgreSQL over the (job_id, name, step) index."""
    points = (
        select(Metric.step, Metric.value)
        .where(*where, Metric.name == name)
        .ext(distinct_on(Metric.step))
        # Both descending: a backward scan of (job_id, name, step, id), no sort.
        .order_by(Metric.step.desc(), Metric.id.desc())
        .subquery()
    )
    buckets = max_points // 2
    bucket = ((points.c.step - lo) * buckets) // (hi - lo + 1)
    step = cast(points.c.step, Float)
    # min(ARRAY[value, step]) compares value first, then step: the bucket's minimum, earliest first,
    # without sorting the bucket; max(ARRAY[value, -step]) the same for the maximum.
    stmt = select(
        func.min(pg_array([points.c.value, step])), func.max(pg_array([points.c.value, -step]))
    ).group_by(bucket)
    chosen: dict[int, float] = {}
    for low, high in session.execute(stmt):
        chosen[int(low[1])] = low[0]
        chosen[-int(high[1])] = high[0]
    return sorted(chosen.items())


def max_metric_id(session: Session, *, job_id: str) -> int:
    """The id of the job's newest metric point, 0 if none (the event stream's starting cursor)."""
    return int(session.execute(select(func.max(Metric.id)).where(Metric.job_id == job_id)).scalar() or 0)


def metrics_after(
    session: Session, *, job_id: str, after_id: int, limit: int
) -> Sequence[Row[int, str, int, float]]:
    """(id, name, step, value) of the job's points after `after_id`, in insertion order."""
    stmt = (
        select(Metric.id, Metric.name, Metric.step, Metric.value)
        .where(Metric.job_id == job_id, Metric.id > after_id)
        .order_by(Metric.id)
        .limit(limit)
    )
    return session.execute(stmt).all()
