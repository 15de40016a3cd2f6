"""The downsampled metric query, answered from the rollups' whole blocks plus the raw points between.

A bucket of `metrics_repository.downsample` is covered top-down: the largest aligned blocks that
fit inside it, then smaller ones, and raw points only in the level-1 blocks that a bucket edge cuts
(under `block_size(1)` steps each side). Each block gives its stored minimum and maximum point, so
a bucket's minimum is the minimum of its parts' minima: the same point `downsample` picks.

On PostgreSQL one statement does this for every bucket at once, assuming every block has its row,
and returns how many rows each bucket found per level; Python knows how many it should (geometry
alone), so a bucket that missed one (a sparse or pre-rollup block, or a row written after
`up_to_id`) is redone by the general path, which asks for blocks range by range and reads the
points of any block without a usable row. SQLite takes the general path for every bucket.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Integer,
    Select,
    Subquery,
    and_,
    bindparam,
    cast,
    func,
    literal,
    select,
    text,
    true,
    union,
    union_all,
)
from sqlalchemy.dialects.postgresql import ARRAY, distinct_on
from sqlalchemy.dialects.postgresql import array as pg_array
from sqlalchemy.orm import Session

from service.db import is_postgresql
from service.jobs.rollups_repository import BASE_STEPS, FANOUT, LEVELS, Key, block_size
from service.models import Metric, MetricRollup

# Under this many steps per bucket a bucket holds few whole blocks: reading the points costs as little.
MIN_BUCKET_STEPS = 2 * BASE_STEPS

Interval = tuple[int, int, int]  # (bucket, first step, last step), or (bucket, first block, last block)
Series = tuple[str, str, int | None]  # job_id, name, up_to_id
Found = dict[int, tuple[int, Key, Key]]  # bucket or range index -> (rows or points, minimum, maximum)


def bucket_intervals(*, lo: int, hi: int, buckets: int) -> list[Interval]:
    """The steps of each non-empty bucket of `metrics_repository.bucket_of` over [lo, hi]."""
    width = hi - lo + 1
    # Step s is in bucket b when b * width <= (s - lo) * buckets < (b + 1) * width.
    bounds = [lo - (-b * width // buckets) for b in range(buckets + 1)]
    return [(b, bounds[b], bounds[b + 1] - 1) for b in range(buckets) if bounds[b] < bounds[b + 1]]


def downsampled(
    session: Session, *, job_id: str, name: str, lo: int, hi: int, max_points: int, up_to_id: int | None
) -> list[tuple[int, float]] | None:
    """`downsample` of a series' points in steps [lo, hi], from the rollups.

    None when buckets are too narrow for blocks to help: the caller then reads the points.
    """
    buckets = max_points // 2
    if hi - lo + 1 < buckets * MIN_BUCKET_STEPS:
        return None
    series = (job_id, name, up_to_id)
    intervals = bucket_intervals(lo=lo, hi=hi, buckets=buckets)
    low: dict[int, Key] = {}
    high: dict[int, Key] = {}
    redo = intervals
    if is_postgresql(session) and lo >= 0:  # the SQL's integer division truncates: floor for steps >= 0
        # The planner cannot see how few rows each joined range holds and costs these statements in
        # the millions, past `jit_above_cost`: compiling them took longer than running them.
        session.execute(text("SET LOCAL jit = off"))
        found, counts = _all_buckets_pg(session, series=series, lo=lo, hi=hi, buckets=buckets)
        expected = _expected_rows(intervals)
        none = (0,) * LEVELS
        redo = [iv for iv in intervals if counts.get(iv[0], none) != expected[iv[0]]]
        for bucket in found.keys() - {b for b, _, _ in redo}:
            _, low[bucket], high[bucket] = found[bucket]
    if redo:
        for bucket, (_, lo_key, hi_key) in _by_ranges(session, series=series, intervals=redo).items():
            low[bucket], high[bucket] = lo_key, hi_key
    chosen = {step: value for value, step in low.values()} | {-neg: value for value, neg in high.values()}
    return sorted(chosen.items())


def _expected_rows(intervals: list[Interval]) -> dict[int, tuple[int, ...]]:
    """Rows per level (1 first) that cover each bucket: its blocks not inside a bigger one of it."""
    sizes = [block_size(level) for level in range(1, LEVELS + 1)]
    out: dict[int, tuple[int, ...]] = {}
    for bucket, first, last in intervals:
        inside = [max(0, (last + 1) // size + (-first // size)) for size in sizes]
        out[bucket] = (*(inside[i] - FANOUT * inside[i + 1] for i in range(LEVELS - 1)), inside[-1])
    return out


def _min_max(value: Any, step: Any) -> tuple[Any, Any]:
    """PostgreSQL aggregates of (value, step): min(ARRAY[v, s]) compares the value, then the step."""
    return func.min(pg_array([value, cast(step, Float)])), func.max(pg_array([value, -cast(step, Float)]))


def _all_buckets_pg(
    session: Session, *, series: Series, lo: int, hi: int, buckets: int
) -> tuple[Found, dict[int, tuple[int, ...]]]:
    """Every bucket's minimum and maximum, and the rows found per level, in one statement."""
    job_id, name, up_to_id = series
    params = {"job_id": job_id, "name": name, "lo": lo, "hi": hi, "buckets": buckets, "up_to_id": up_to_id}
    found: Found = {}
    counts: dict[int, tuple[int, ...]] = {}
    for b, *row in session.execute(_all_buckets_stmt(up_to_id is not None), params):
        counts[b] = tuple(row[:LEVELS])
        lv, ls, hv, hs = row[LEVELS:]
        found[b] = (0, (lv, int(ls)), (hv, int(hs)))
    return found, counts


@functools.cache
def _all_buckets_stmt(up_to: bool) -> Select[Any]:
    """The statement of `_all_buckets_pg`, built once (bound parameters; SQLAlchemy caches its SQL)."""
    u = _candidates(up_to)
    bucket_col, level_col, lo_v, lo_s, hi_v, hi_s = u.c
    low, high = _min_max(lo_v, lo_s)[0], _min_max(hi_v, hi_s)[1]
    counts_per_level = (func.count().filter(level_col == level) for level in range(1, LEVELS + 1))
    return select(bucket_col, *counts_per_level, low[1], low[2], high[1], high[2]).group_by(bucket_col)


def _candidates(up_to: bool) -> Subquery:
    """(bucket, level, min value, min step, max value, max step) of every part of every bucket.

    Parts: the whole blocks of the top level, the whole children of every cut block of the level
    above, and the points (level 0) of every cut level-1 block. Parameters: job_id, name, lo, hi,
    buckets, up_to_id.
    """
    lo, hi, buckets = (bindparam(k, type_=BigInteger) for k in ("lo", "hi", "buckets"))

    def bucket(step: Any) -> Any:
        return (step - lo) * buckets // (hi - lo + 1)

    # A block that holds one of these steps past its own first step is cut by a bucket edge (or
    # by an end of the series): the first step of every bucket (as `bucket_intervals`), lo, hi + 1.
    g = func.generate_series(literal(1, BigInteger), buckets - 1).table_valued("b").render_derived("g")
    first_steps = lo + (g.c.b * (hi - lo + 1) + buckets - 1) // buckets
    edges = union(select(first_steps.label("p")).select_from(g), select(lo), select(hi + 1)).cte()

    def cut(size: int) -> Any:
        return select((edges.c.p // size).label("block")).where(edges.c.p % size != 0).distinct().subquery()

    r = MetricRollup
    parts = []
    for level in range(LEVELS, 0, -1):
        size = block_size(level)
        start, end = r.block * size, r.block * size + (size - 1)
        whole = [start >= lo, end <= hi, bucket(start) == bucket(end)]
        if up_to:
            whole.append(r.max_id <= bindparam("up_to_id"))  # a row that may count later points is missed
        cols = (bucket(start), literal(level), r.min_value, r.min_step, r.max_value, r.max_step)
        series_level = [r.job_id == bindparam("job_id"), r.name == bindparam("name"), r.level == level]
        if level == LEVELS:
            span = r.block.between((lo + (size - 1)) // size, (hi + 1) // size - 1)
            parts.append(select(*cols).where(*series_level, span, *whole))
        else:
            # The children of the blocks of the level above that an edge cuts (the others are whole
            # there, or outside the series).
            parents = cut(block_size(level + 1))
            children = r.block.between(parents.c.block * FANOUT, parents.c.block * FANOUT + (FANOUT - 1))
            # An index range scan per cut parent. The LIMIT (true: a parent has FANOUT children) keeps
            # the planner from flattening the LATERAL into a join that filtered every row of the level.
            rows = select(*cols).where(*series_level, children, *whole).limit(FANOUT).lateral()
            parts.append(select(*rows.c).select_from(parents).join(rows, true()))
    cut_blocks = cut(BASE_STEPS)
    block_start = cut_blocks.c.block * BASE_STEPS
    steps = Metric.step.between(
        func.greatest(block_start, lo), func.least(block_start + (BASE_STEPS - 1), hi)
    )
    where = [Metric.job_id == bindparam("job_id"), Metric.name == bindparam("name"), steps]
    if up_to:
        where.append(Metric.id <= bindparam("up_to_id"))
    points = (
        select(Metric.step, Metric.value)
        .where(*where)
        .ext(distinct_on(Metric.step))
        .order_by(Metric.step.desc(), Metric.id.desc())  # a backward scan of the index, no sort
        .lateral()
    )
    p = points.c
    parts.append(
        select(bucket(p.step), literal(0), p.value, p.step, p.value, p.step)
        .select_from(cut_blocks)
        .join(points, true())
    )
    return union_all(*parts).subquery()


# --- the general path: range by range, any block may lack its row ---------------------------------


def _by_ranges(session: Session, *, series: Series, intervals: list[Interval]) -> Found:
    """Each bucket's minimum and maximum over its step interval, descending where a row is missing."""
    out: Found = {}

    def take(bucket: int, hit: tuple[int, Key, Key]) -> None:
        _fold(out, bucket, hit)

    pending = intervals
    for level in range(LEVELS, 0, -1):
        size = block_size(level)
        whole: list[Interval] = []  # (bucket, first block, last block)
        rest: list[Interval] = []
        for bucket, a, b in pending:
            first, last = -(-a // size), (b + 1) // size - 1
            if first > last:
                rest.append((bucket, a, b))
                continue
            whole.append((bucket, first, last))
            if a < first * size:
                rest.append((bucket, a, first * size - 1))
            if (last + 1) * size <= b:
                rest.append((bucket, (last + 1) * size, b))
        found = _block_summaries(session, series=series, level=level, ranges=whole) if whole else {}
        gaps: list[Interval] = []
        for i, (bucket, first, last) in enumerate(whole):
            if i in found:
                take(bucket, found[i])
            if found.get(i, (0,))[0] < last - first + 1:
                gaps.append((bucket, first, last))
        if gaps:
            rest += _uncovered(session, series=series, level=level, ranges=gaps)
        pending = rest
    if pending:
        for i, hit in _raw_summaries(session, series=series, intervals=pending).items():
            take(pending[i][0], hit)
    return out


def _fold(found: Found, key: int, hit: tuple[int, Key, Key]) -> None:
    if key in found:
        n, lo_prev, hi_prev = found[key]
        found[key] = (n + hit[0], min(lo_prev, hit[1]), max(hi_prev, hit[2]))
    else:
        found[key] = hit


def _ranges(session: Session, spans: list[tuple[int, int]]) -> tuple[Any, Any, Any, Any]:
    """A table of (i, a, b): index and bounds of each span, one bound parameter whatever their number."""
    if is_postgresql(session):
        t = (
            func.unnest(
                bindparam("span_i", list(range(len(spans))), ARRAY(Integer)),
                bindparam("span_a", [a for a, _ in spans], ARRAY(BigInteger)),
                bindparam("span_b", [b for _, b in spans], ARRAY(BigInteger)),
            )
            .table_valued("i", "a", "b")
            .render_derived()
        )
        return t, t.c.i, t.c.a, t.c.b
    # SQLite: json_each() of [[a, b], ...] gives each pair with its array index as `key`.
    j = func.json_each(bindparam("spans", json.dumps(spans))).table_valued("key", "value")
    return j, j.c.key, func.json_extract(j.c.value, "$[0]"), func.json_extract(j.c.value, "$[1]")


def _block_summaries(session: Session, *, series: Series, level: int, ranges: list[Interval]) -> Found:
    """Per range of blocks: how many usable rows, their minimum and their maximum."""
    job_id, name, up_to_id = series
    r = MetricRollup
    src, i, a, b = _ranges(session, [(first, last) for _, first, last in ranges])
    on = [r.job_id == job_id, r.name == name, r.level == level, r.block.between(a, b)]
    if up_to_id is not None:
        on.append(r.max_id <= up_to_id)  # a row that may count later points is read as missing
    found: Found = {}
    if is_postgresql(session):
        low, high = _min_max(r.min_value, r.min_step)[0], _min_max(r.max_value, r.max_step)[1]
        cols = (i, func.count(), low[1], low[2], high[1], high[2])
        stmt = select(*cols).select_from(src).join(r, and_(*on)).group_by(i)
        for idx, n, lv, ls, hv, hs in session.execute(stmt):
            found[int(idx)] = (int(n), (lv, int(ls)), (hv, int(hs)))
        return found
    stmt = select(i, r.min_value, r.min_step, r.max_value, r.max_step).select_from(src).join(r, and_(*on))
    for idx, lv, ls, hv, hs in session.execute(stmt):
        _fold(found, int(idx), (1, (lv, ls), (hv, -hs)))
    return found


def _uncovered(session: Session, *, series: Series, level: int, ranges: list[Interval]) -> list[Interval]:
    """The step intervals of the blocks in `ranges` that have no usable row."""
    job_id, name, up_to_id = series
    r = MetricRollup
    src, i, a, b = _ranges(session, [(first, last) for _, first, last in ranges])
    on = [r.job_id == job_id, r.name == name, r.level == level, r.block.between(a, b)]
    if up_to_id is not None:
        on.append(r.max_id <= up_to_id)
    present: dict[int, list[int]] = {}
    for idx, block in session.execute(select(i, r.block).select_from(src).join(r, and_(*on))):
        present.setdefault(int(idx), []).append(block)
    size = block_size(level)
    out: list[Interval] = []
    for idx, (bucket, first, last) in enumerate(ranges):
        start = first
        for block in [*sorted(present.get(idx, [])), last + 1]:
            if block > start:
                out.append((bucket, start * size, block * size - 1))
            start = block + 1
    return out


def _raw_summaries(session: Session, *, series: Series, intervals: list[Interval]) -> Found:
    """Per step interval: the number of points, their minimum and maximum (last write of a step)."""
    job_id, name, up_to_id = series
    src, i, a, b = _ranges(session, [(first, last) for _, first, last in intervals])
    where: list[ColumnElement[bool]] = [
        Metric.job_id == job_id,
        Metric.name == name,
        Metric.step.between(a, b),
    ]
    if up_to_id is not None:
        where.append(Metric.id <= up_to_id)
    found: Found = {}
    if is_postgresql(session):
        points = (
            select(Metric.step, Metric.value)
            .where(*where)
            .ext(distinct_on(Metric.step))
            .order_by(Metric.step.desc(), Metric.id.desc())  # a backward scan of the index, no sort
            .lateral()
        )
        low, high = _min_max(points.c.value, points.c.step)
        stmt = (
            select(i, func.count(), low[1], low[2], high[1], high[2])
            .select_from(src)
            .join(points, true())
            .group_by(i)
        )
        for idx, n, lv, ls, hv, hs in session.execute(stmt):
            found[int(idx)] = (int(n), (lv, int(ls)), (hv, int(hs)))
        return found
    last: dict[tuple[int, int], float] = {}
    stmt = select(i, Metric.step, Metric.value).select_from(src).join(Metric, and_(*where))
    for idx, step, value in session.execute(stmt.order_by(i, Metric.step, Metric.id)):
        last[(int(idx), step)] = value  # ordered by id within a step: the last write wins
    for (idx, step), value in last.items():
        _fold(found, idx, (1, (value, step), (value, -step)))
    return found
