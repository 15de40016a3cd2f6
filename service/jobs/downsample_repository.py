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
    TextClause,
    and_,
    bindparam,
    cast,
    func,
    select,
    text,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY, distinct_on
from sqlalchemy.dialects.postgresql import array as pg_array
from sqlalchemy.orm import Session

from service.db import is_postgresql
from service.jobs.rollups_repository import BASE_STEPS, FANOUT, LEVELS, Key, block_size
from service.models import Metric, MetricRollup

# Under this many steps per bucket a bucket holds few whole blocks: reading the points costs as little.
MIN_BUCKET_STEPS = 2 * BASE_STEPS
_SIZES = [block_size(level) for level in range(1, LEVELS + 1)]
# Below the top level a bucket has at most 2 * (FANOUT - 1) rows of a level (its two ragged ends).
_COUNT_BASE = 1024

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

    None when buckets are too narrow for blocks to help, or the series has no rollups: the caller
    then reads the points.
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
        if not any(counts.values()):
            return None  # no rollups at all (points from before them): one scan of the points is cheaper
        expected = _expected_rows(intervals)
        redo = [iv for iv in intervals if counts.get(iv[0], 0) != expected[iv[0]]]
        for bucket in found.keys() - {b for b, _, _ in redo}:
            _, low[bucket], high[bucket] = found[bucket]
    elif not _any_rollup(session, job_id=job_id, name=name):
        return None
    if redo:
        for bucket, (_, lo_key, hi_key) in _by_ranges(session, series=series, intervals=redo).items():
            low[bucket], high[bucket] = lo_key, hi_key
    chosen = {step: value for value, step in low.values()} | {-neg: value for value, neg in high.values()}
    return sorted(chosen.items())


def _any_rollup(session: Session, *, job_id: str, name: str) -> bool:
    r = MetricRollup
    stmt = select(r.block).where(r.job_id == job_id, r.name == name, r.level == LEVELS).limit(1)
    return session.execute(stmt).first() is not None


def _expected_rows(intervals: list[Interval]) -> dict[int, int]:
    """Rows per level that cover each bucket (its blocks not inside a bigger one of it), packed."""
    ends = [(first, last + 1) for _, first, last in intervals]
    # Blocks of each level that lie inside each bucket; those inside a bigger one are not counted.
    inside = [[max(0, end // size + (-first // size)) for first, end in ends] for size in _SIZES]
    packed = [0] * len(intervals)
    for i in range(LEVELS):
        weight, above = _COUNT_BASE**i, inside[i + 1] if i + 1 < LEVELS else None
        for k, n in enumerate(inside[i]):
            packed[k] += weight * (n - FANOUT * above[k] if above is not None else n)
    return {iv[0]: p for iv, p in zip(intervals, packed, strict=True)}


def _all_buckets_pg(
    session: Session, *, series: Series, lo: int, hi: int, buckets: int
) -> tuple[Found, dict[int, int]]:
    """Every bucket's minimum and maximum, and its rows found per level (packed), in one statement."""
    job_id, name, up_to_id = series
    params = {"job_id": job_id, "name": name, "lo": lo, "hi": hi, "buckets": buckets, "width": hi - lo + 1}
    if up_to_id is not None:
        params["up_to_id"] = up_to_id
    found: Found = {}
    counts: dict[int, int] = {}
    for b, packed, lv, ls, hv, hs in session.execute(_all_buckets_sql(up_to_id is not None), params).all():
        counts[b] = int(packed)
        found[b] = (0, (lv, int(ls)), (hv, int(hs)))
    return found, counts


@functools.cache
def _all_buckets_sql(up_to: bool) -> TextClause:
    """The statement of `_all_buckets_pg` (PostgreSQL; block sizes are code constants, written in).

    Parts of a bucket: the whole blocks of the top level, the whole children of every block of the
    level above that an edge cuts, and the points (level 0) of every cut level-1 block. An edge is
    the first step of a bucket (as `bucket_intervals`) or an end of the series; a block holding one
    past its own first step is cut. Each cut block is read by an index range scan of its own.
    """

    def bucket(step: str) -> str:
        return f"(({step}) - :lo) * :buckets / :width"

    def whole(size: int) -> str:
        start, end = f"r.block * {size}", f"r.block * {size} + {size - 1}"
        usable = " AND r.max_id <= :up_to_id" if up_to else ""  # a row that may count later points
        return f"{start} >= :lo AND {end} <= :hi AND {bucket(start)} = {bucket(end)}{usable}"

    def cut(size: int) -> str:
        return f"(SELECT DISTINCT p / {size} AS block FROM edges WHERE p % {size} <> 0) AS cut"

    def rows(level: int) -> str:
        size = block_size(level)
        return (
            f"SELECT {bucket(f'r.block * {size}')} AS bucket, {level} AS level,"
            " r.min_value, r.min_step, r.max_value, r.max_step FROM metric_rollups AS r"
            f" WHERE r.job_id = :job_id AND r.name = :name AND r.level = {level} AND {whole(size)}"
        )

    top = block_size(LEVELS)
    parts = [f"{rows(LEVELS)} AND r.block BETWEEN (:lo + {top - 1}) / {top} AND (:hi + 1) / {top} - 1"]
    # The LIMIT (a block has FANOUT children) keeps the planner from flattening the LATERAL into a
    # join that filtered every row of the level instead of one index range scan per cut block.
    parts += [
        f"SELECT c.* FROM {cut(block_size(level + 1))} CROSS JOIN LATERAL ({rows(level)}"
        f" AND r.block BETWEEN cut.block * {FANOUT} AND cut.block * {FANOUT} + {FANOUT - 1}"
        f" LIMIT {FANOUT}) AS c"
        for level in range(LEVELS - 1, 0, -1)
    ]
    up_to_points = " AND m.id <= :up_to_id" if up_to else ""
    parts.append(
        f"SELECT {bucket('p.step')}, 0, p.value, p.step, p.value, p.step FROM {cut(BASE_STEPS)}"
        " CROSS JOIN LATERAL (SELECT DISTINCT ON (m.step) m.step, m.value FROM metrics AS m"
        " WHERE m.job_id = :job_id AND m.name = :name"
        f" AND m.step BETWEEN greatest(cut.block * {BASE_STEPS}, :lo)"
        f" AND least(cut.block * {BASE_STEPS} + {BASE_STEPS - 1}, :hi){up_to_points}"
        # Both descending: a backward scan of (job_id, name, step, id), no sort.
        " ORDER BY m.step DESC, m.id DESC) AS p"
    )
    # The rows per level packed in one sum (one aggregate per row instead of one per level): a
    # bucket has under _COUNT_BASE rows of each level but the top one, whose count is the high digit.
    weights = " ".join(f"WHEN {level} THEN {_COUNT_BASE ** (level - 1)}" for level in range(1, LEVELS + 1))
    counts = f"sum(CASE level {weights} ELSE 0 END)"
    low = "(min(ARRAY[min_value, CAST(min_step AS float8)]))"
    high = "(max(ARRAY[max_value, -CAST(max_step AS float8)]))"
    sql = (
        "WITH edges AS ("
        " SELECT :lo + (b * :width + :buckets - 1) / :buckets AS p FROM generate_series(1, :buckets - 1) AS b"
        " UNION SELECT :lo UNION SELECT :hi + 1),"
        f" parts AS ({' UNION ALL '.join(parts)})"
        # min(ARRAY[value, step]) orders by value, then step: the earliest among equal minima.
        f" SELECT bucket, {counts}, {low}[1], {low}[2], {high}[1], {high}[2] FROM parts GROUP BY bucket"
    )
    names = ["lo", "hi", "buckets", "width"] + (["up_to_id"] if up_to else [])
    return text(sql).bindparams(*(bindparam(n, type_=BigInteger) for n in names))


# --- the general path: range by range, any block may lack its row ---------------------------------


def _by_ranges(session: Session, *, series: Series, intervals: list[Interval]) -> Found:
    """Each bucket's minimum and maximum over its step interval, descending where a row is missing."""
    out: Found = {}
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
                _fold(out, bucket, found[i])
            if found.get(i, (0,))[0] < last - first + 1:
                gaps.append((bucket, first, last))
        if gaps:
            rest += _uncovered(session, series=series, level=level, ranges=gaps)
        pending = rest
    if pending:
        for i, hit in _raw_summaries(session, series=series, intervals=pending).items():
            _fold(out, pending[i][0], hit)
    return out


def _min_max(value: Any, step: Any) -> tuple[Any, Any]:
    """PostgreSQL aggregates of (value, step): min(ARRAY[v, s]) compares the value, then the step."""
    return func.min(pg_array([value, cast(step, Float)])), func.max(pg_array([value, -cast(step, Float)]))


def _fold(found: Found, key: int, hit: tuple[int, Key, Key]) -> None:
    if key in found:
        n, lo_prev, hi_prev = found[key]
        found[key] = (n + hit[0], min(lo_prev, hit[1]), max(hi_prev, hit[2]))
    else:
        found[key] = hit


# SQLite: a LEFT JOIN, so that the ranges are the outer loop and each one an index range scan. With
# an inner join SQLite's planner puts the series outside and json_each inside: every row of the
# level times every range. Rows of ranges that matched nothing are skipped.
_OUTER = {"isouter": True}


def _ranges(session: Session, spans: list[tuple[int, int]]) -> tuple[Any, Any, Any, Any]:
    """A table of (i, a, b): index and bounds of each span, one bound parameter whatever their number."""
    if is_postgresql(session):
        # Each column as one comma-separated text parameter: psycopg dumps a list parameter in
        # Python, element by element (a third of a second for a few thousand spans).
        def column(name: str, values: list[int]) -> Any:
            text_param: Any = bindparam(name, ",".join(map(str, values)))
            return cast(func.string_to_array(text_param, ","), ARRAY(BigInteger))

        firsts, lasts = [a for a, _ in spans], [b for _, b in spans]
        t = (
            func.unnest(
                column("span_i", list(range(len(spans)))), column("span_a", firsts), column("span_b", lasts)
            )
            .table_valued("i", "a", "b")
            .render_derived()
        )
        return t, t.c.i, t.c.a, t.c.b
    # SQLite: json_each() of [[a, b], ...] gives each pair with its array index as `key`.
    j = func.json_each(bindparam("spans", json.dumps(spans))).table_valued("key", "value")
    return j, j.c.key, func.json_extract(j.c.value, "$[0]"), func.json_extract(j.c.value, "$[1]")


def _usable(*, series: Series, level: int, a: Any, b: Any) -> list[ColumnElement[bool]]:
    """The rows of blocks a..b of one level of the series, minus those that may count later points."""
    job_id, name, up_to_id = series
    r = MetricRollup
    where = [r.job_id == job_id, r.name == name, r.level == level, r.block.between(a, b)]
    if up_to_id is not None:
        where.append(r.max_id <= up_to_id)  # read as missing: the level below decides
    return where


def _block_summaries(session: Session, *, series: Series, level: int, ranges: list[Interval]) -> Found:
    """Per range of blocks: how many usable rows, their minimum and their maximum."""
    r = MetricRollup
    src, i, a, b = _ranges(session, [(first, last) for _, first, last in ranges])
    where = _usable(series=series, level=level, a=a, b=b)
    found: Found = {}
    if is_postgresql(session):
        # OFFSET 0 keeps the LATERAL an index range scan per range: flattened into a join, the
        # planner filters every row of the level against every range.
        rows = select(r.min_value, r.min_step, r.max_value, r.max_step).where(*where).offset(0).lateral()
        low, high = (
            _min_max(rows.c.min_value, rows.c.min_step)[0],
            _min_max(rows.c.max_value, rows.c.max_step)[1],
        )
        cols = (i, func.count(), low[1], low[2], high[1], high[2])
        for idx, n, lv, ls, hv, hs in session.execute(
            select(*cols).select_from(src).join(rows, true()).group_by(i)
        ):
            found[int(idx)] = (int(n), (lv, int(ls)), (hv, int(hs)))
        return found
    stmt = (
        select(i, r.min_value, r.min_step, r.max_value, r.max_step)
        .select_from(src)
        .join(r, and_(*where), **_OUTER)
    )
    for idx, lv, ls, hv, hs in session.execute(stmt):
        if lv is not None:
            _fold(found, int(idx), (1, (lv, ls), (hv, -hs)))
    return found


def _uncovered(session: Session, *, series: Series, level: int, ranges: list[Interval]) -> list[Interval]:
    """The step intervals of the blocks in `ranges` that have no usable row."""
    r = MetricRollup
    src, i, a, b = _ranges(session, [(first, last) for _, first, last in ranges])
    where = _usable(series=series, level=level, a=a, b=b)
    if is_postgresql(session):
        rows = select(r.block).where(*where).offset(0).lateral()  # OFFSET 0: see _block_summaries
        stmt = select(i, rows.c.block).select_from(src).join(rows, true())
    else:
        stmt = select(i, r.block).select_from(src).join(r, and_(*where), **_OUTER)
    present: dict[int, list[int]] = {}
    for idx, block in session.execute(stmt):
        if block is not None:
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
    stmt = select(i, Metric.step, Metric.value).select_from(src).join(Metric, and_(*where), **_OUTER)
    for idx, step, value in session.execute(stmt.order_by(i, Metric.step, Metric.id)):
        if step is not None:
            last[(int(idx), step)] = value  # ordered by id within a step: the last write wins
    for (idx, step), value in last.items():
        _fold(found, idx, (1, (value, step), (value, -step)))
    return found
