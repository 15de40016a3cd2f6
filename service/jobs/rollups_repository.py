"""Metric rollups: per-block summaries of each metric series, kept by the transaction that writes points.

Level l (1..LEVELS) cuts a series' steps into aligned blocks of `block_size(l)` steps. A row sums
up the points of one block (the last write of each step): how many, the first and last step, and
the minimum and maximum point, the earliest step among equal values; exactly what `downsample`
keeps of a bucket, and it combines: the minimum of a union is the minimum of the parts' minima.
`downsample_repository` answers the downsampled query from these rows.

A block with fewer than MIN_POINTS points has no row (a sparse series would otherwise store about
a row per point). So a missing row means "read the level below, or the raw points", never "empty",
and the one invariant is that a stored row is exact: every write of points goes through `record`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    and_,
    delete,
    func,
    or_,
    select,
)
from sqlalchemy.orm import Session

from service.db import insert_for
from service.models import Metric, MetricRollup

BASE_STEPS = 16
FANOUT = 16
LEVELS = 3  # blocks of 16, 256 and 4,096 steps
MIN_POINTS = 4
REBUILD_BATCH = 5_000  # rows per write while rebuilding

Key = tuple[float, int]  # (value, step) of a minimum; (value, -step) of a maximum: tuple order picks


def block_size(level: int) -> int:
    """Steps per block at `level` (1 is the finest)."""
    return BASE_STEPS * FANOUT ** (level - 1)


@dataclass(slots=True)
class Summary:
    """What a row says about a set of points of one series."""

    points: int
    first_step: int
    last_step: int
    low: Key  # (value, step) of the minimum, the earliest step among equal values
    high: Key  # (value, -step) of the maximum, likewise

    def add(self, other: Summary) -> None:
        """Fold in a summary of other points (no step in common with these)."""
        self.points += other.points
        self.first_step = min(self.first_step, other.first_step)
        self.last_step = max(self.last_step, other.last_step)
        self.low = min(self.low, other.low)
        self.high = max(self.high, other.high)

    def copy(self) -> Summary:
        """An independent copy."""
        return Summary(self.points, self.first_step, self.last_step, self.low, self.high)


def summarize(points: Iterable[tuple[int, float]], *, size: int) -> dict[int, Summary]:
    """Summaries of `points` (one per step) per block of `size` steps."""
    out: dict[int, Summary] = {}
    for step, value in points:
        s = out.get(step // size)
        if s is None:
            out[step // size] = Summary(1, step, step, (value, step), (value, -step))
            continue
        # `Summary.add` inlined: this loop runs once per point written.
        s.points += 1
        s.first_step = min(s.first_step, step)
        s.last_step = max(s.last_step, step)
        if (value, step) < s.low:
            s.low = (value, step)
        if (value, -step) > s.high:
            s.high = (value, -step)
    return out


def _parents(children: dict[int, Summary]) -> dict[int, Summary]:
    """The next level's summaries, from this level's (block sizes nest: step // a // b == step // ab)."""
    out: dict[int, Summary] = {}
    for block, s in children.items():
        parent = out.get(block // FANOUT)
        if parent is None:
            out[block // FANOUT] = s.copy()
        else:
            parent.add(s)
    return out


def _levels(points: Iterable[tuple[int, float]]) -> list[dict[int, Summary]]:
    """Summaries per block of every level, index 0 being level 1."""
    levels = [summarize(points, size=BASE_STEPS)]
    while len(levels) < LEVELS:
        levels.append(_parents(levels[-1]))
    return levels


# --- maintenance, in the transaction that writes the points ---------------------------------------


def record(
    session: Session, *, job_id: str, rows: Sequence[dict[str, Any]], before_id: int, max_id: int
) -> None:
    """Bring the rollups of the blocks that `rows` (just inserted, in order) touched up to date.

    `before_id` is the job's newest point id before the insert and `max_id` after it: the points
    up to `before_id` are the ones already there, which an overwritten step or a new row must read.
    """
    batches: dict[str, dict[int, float]] = {}
    for row in rows:
        # Rows are inserted in list order, so a step given twice keeps its later value (larger id).
        batches.setdefault(row["name"], {})[int(row["step"])] = float(row["value"])
    fresh = {name: _levels(batch.items()) for name, batch in batches.items()}
    stored = _stored(
        session, job_id=job_id, blocks={name: [set(lv) for lv in f] for name, f in fresh.items()}
    )
    merged: dict[tuple[str, int, int], Summary] = {}
    redo: list[tuple[str, int, int]] = []
    for name, levels in fresh.items():
        for level, blocks in enumerate(levels, start=1):
            for block, new in blocks.items():
                old = stored.get((name, level, block))
                if old is not None and old.last_step < new.first_step:
                    # Appended after every step the row knows: nothing it counted is overwritten.
                    old.add(new)
                    merged[(name, level, block)] = old
                else:
                    # No row (a new or a sparse block) or steps rewritten: the points already
                    # there count too, the batch's replacing theirs step by step.
                    redo.append((name, level, block))
    if redo:
        prior = _prior_points(session, job_id=job_id, blocks=redo, before_id=before_id)
        before = {}
        for name, points in prior.items():
            for step in batches[name]:
                points.pop(step, None)
            before[name] = _levels(points.items())
        for name, level, block in redo:
            s = fresh[name][level - 1][block].copy()
            if name in before and block in before[name][level - 1]:
                s.add(before[name][level - 1][block])
            merged[(name, level, block)] = s
    _upsert(
        session,
        rows=[
            _row(job_id=job_id, name=name, level=level, block=block, summary=s, max_id=max_id)
            # In key order: two writers (a fenced-out attempt and its successor) lock rows alike.
            for (name, level, block), s in sorted(merged.items())
            if s.points >= MIN_POINTS
        ],
    )


def _upsert(session: Session, *, rows: list[dict[str, Any]]) -> None:
    if rows:
        stmt = insert_for(session, MetricRollup)
        keys = ("job_id", "name", "level", "block")
        stmt = stmt.on_conflict_do_update(
            index_elements=list(keys), set_={c: stmt.excluded[c] for c in rows[0] if c not in keys}
        )
        session.execute(stmt, rows)  # an executemany, as repository.add_metrics


def _stored(
    session: Session, *, job_id: str, blocks: dict[str, list[set[int]]]
) -> dict[tuple[str, int, int], Summary]:
    """The stored rows of the touched blocks (read by range of blocks, one statement)."""
    r = MetricRollup
    ranges = [
        and_(r.name == name, r.level == level, r.block.between(min(b), max(b)))
        for name, levels in blocks.items()
        for level, b in enumerate(levels, start=1)
        if b
    ]
    cols = (r.points, r.first_step, r.last_step, r.min_value, r.min_step, r.max_value, r.max_step)
    stmt = select(r.name, r.level, r.block, *cols).where(r.job_id == job_id, or_(*ranges))
    return {
        (name, level, block): Summary(points, first, last, (lo_v, lo_s), (hi_v, -hi_s))
        for name, level, block, points, first, last, lo_v, lo_s, hi_v, hi_s in session.execute(stmt)
        if block in blocks[name][level - 1]
    }


def _prior_points(
    session: Session, *, job_id: str, blocks: list[tuple[str, int, int]], before_id: int
) -> dict[str, dict[int, float]]:
    """Per name, the points up to `before_id` in the given blocks: the last write of each step."""
    spans = sorted(
        (name, b * block_size(level), (b + 1) * block_size(level) - 1) for name, level, b in blocks
    )
    runs: list[list[Any]] = []
    for name, a, b in spans:  # merge overlapping and adjacent spans: a block and its parent are one read
        if runs and runs[-1][0] == name and a <= runs[-1][2] + 1:
            runs[-1][2] = max(runs[-1][2], b)
        else:
            runs.append([name, a, b])
    stmt = (
        select(Metric.name, Metric.step, Metric.value)
        .where(
            Metric.job_id == job_id,
            Metric.id <= before_id,
            or_(*(and_(Metric.name == name, Metric.step.between(a, b)) for name, a, b in runs)),
        )
        .order_by(Metric.name, Metric.step, Metric.id)
    )
    out: dict[str, dict[int, float]] = {}
    for name, step, value in session.execute(stmt):
        out.setdefault(name, {})[step] = value
    return out


def _row(*, job_id: str, name: str, level: int, block: int, summary: Summary, max_id: int) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "name": name,
        "level": level,
        "block": block,
        "points": summary.points,
        "first_step": summary.first_step,
        "last_step": summary.last_step,
        "min_value": summary.low[0],
        "min_step": summary.low[1],
        "max_value": summary.high[0],
        "max_step": -summary.high[1],
        "max_id": max_id,
    }


def rebuild(session: Session, *, job_id: str) -> int:
    """Recompute every rollup of a job from its raw points (e.g. after writing points in bulk SQL).

    Returns the number of rows written; the result equals what `record` keeps at ingest. Reads one
    top-level block of points at a time.
    """
    session.execute(delete(MetricRollup).where(MetricRollup.job_id == job_id))
    max_id = int(session.execute(select(func.max(Metric.id)).where(Metric.job_id == job_id)).scalar() or 0)
    stmt = (
        select(Metric.name, Metric.step, Metric.value)
        .where(Metric.job_id == job_id)
        .order_by(Metric.name, Metric.step, Metric.id)
        .execution_options(yield_per=20_000)
    )
    top = block_size(LEVELS)
    written = 0
    rows: list[dict[str, Any]] = []
    chunk: dict[int, float] = {}
    key: tuple[str, int] | None = None

    def flush() -> None:
        assert key is not None
        rows.extend(
            _row(job_id=job_id, name=key[0], level=level, block=block, summary=s, max_id=max_id)
            for level, blocks in enumerate(_levels(chunk.items()), start=1)
            for block, s in blocks.items()
            if s.points >= MIN_POINTS
        )

    for name, step, value in session.execute(stmt):
        if key is not None and key != (name, step // top):
            flush()
            chunk = {}
            if len(rows) >= REBUILD_BATCH:
                _upsert(session, rows=rows)
                written, rows = written + len(rows), []
        key = (name, step // top)
        chunk[step] = value  # ordered by id within a step: the last write wins
    if key is not None:
        flush()
    _upsert(session, rows=rows)
    return written + len(rows)


def delete_for_jobs(session: Session, *, job_ids: list[str]) -> None:
    """Forget the rollups of these jobs (their points are being deleted)."""
    if job_ids:
        session.execute(delete(MetricRollup).where(MetricRollup.job_id.in_(job_ids)))
