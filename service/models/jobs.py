"""Jobs and what their runs report: state transitions, metrics, checkpoints, artifacts, log lines."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Float,
    ForeignKey,
    Index,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, BigId, utcnow


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        # Keyset pagination, newest first, per owner and overall.
        Index("ix_jobs_owner_created", "owner_id", "created_at", "id"),
        Index("ix_jobs_created", "created_at", "id"),
        # The claim counts an owner's running jobs (the per-user limit).
        Index("ix_jobs_owner_status", "owner_id", "status"),
        # One job per (owner, Idempotency-Key): concurrent retries of a submit create one job.
        # NULL keys (submits without the header) never collide.
        UniqueConstraint("owner_id", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
        # Queue positions, and the fair key of a submit (migration 0010).
        Index(
            "ix_jobs_queue",
            "device",
            "priority",
            "fair_key",
            "created_at",
            "id",
            postgresql_where=text("status = 'queued' AND NOT unplaceable"),
            sqlite_where=text("status = 'queued' AND NOT unplaceable"),
        ),
        Index(
            "ix_jobs_queue_owner",
            "owner_id",
            "device",
            "priority",
            "fair_key",
            postgresql_where=text("status = 'queued'"),
            sqlite_where=text("status = 'queued'"),
        ),
        # Counts by status, and a status-filtered page in keyset order without a sort.
        Index("ix_jobs_status_created", "status", "created_at", "id"),
        # `updated_since` polling, and the start-delay histogram of /metrics.
        Index("ix_jobs_updated_at", "updated_at"),
        Index("ix_jobs_started_at", "started_at"),
        # `label=k=v` filters use `labels @> {...}`; a GIN index only exists on PostgreSQL.
        Index(
            "ix_jobs_labels",
            "labels",
            postgresql_using="gin",
            postgresql_ops={"labels": "jsonb_path_ops"},
        ).ddl_if(dialect="postgresql"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    # Written only by service.jobs.lifecycle.transition().
    status: Mapped[str] = mapped_column(String(16))
    spec: Mapped[dict[str, Any]]
    priority: Mapped[int] = mapped_column(default=0)
    labels: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Bumped by every UPDATE (onupdate), so ETags, `updated_since` and the event stream see every
    # change a client can see, whichever code path made it.
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    attempt: Mapped[int] = mapped_column(default=0)
    # The last attempt that may still be restarted: the spec's max_restarts, plus one for each attempt
    # its worker's shutdown ended (workers/attempt/end.py: not counted against the job).
    max_restarts: Mapped[int] = mapped_column(default=0)
    step: Mapped[int] = mapped_column(default=0)
    # NULL: a command that set no `hyperparameters.steps` (its progress is the last reported step).
    total_steps: Mapped[int | None]
    error: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    latest_metrics: Mapped[dict[str, Any]]
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    # Set with cancel_requested by a sweep's pruner: the stopped run ends `pruned`, not `cancelled`.
    prune_requested: Mapped[bool] = mapped_column(default=False, server_default=false())
    # Fencing token of the current attempt: every write a worker makes carries it, so a stale
    # worker (a duplicate delivery, a lost lease) can never overwrite a newer attempt's state.
    claim_token: Mapped[str | None] = mapped_column(String(32), default=None)
    worker: Mapped[str | None] = mapped_column(String(255), default=None)
    # The submit's `Idempotency-Key` and the sha256 of its canonical spec (a replay must match it).
    idempotency_key: Mapped[str | None] = mapped_column(String(255), default=None)
    request_hash: Mapped[str | None] = mapped_column(String(64), default=None)
    # Why placement has not started this queued job yet (e.g. "waiting for 2 nodes with 2 free cpu
    # slots"); NULL once placed.
    queued_reason: Mapped[str | None] = mapped_column(Text, default=None)
    # No set of live nodes could ever hold this queued job (placement.never_fits; queued_reason then
    # says what it needs and what the nodes offer). Set at submit, kept current by every placement
    # round, cleared when placed; shown only while the job is queued.
    unplaceable: Mapped[bool] = mapped_column(default=False)
    # The spec's `resources.device`, as a column: queues are per device kind (head-of-line blocking,
    # queue positions), and placement partitions by it without reading every spec.
    device: Mapped[str] = mapped_column(String(8), default="cpu")
    # The job's place in its (device, priority) queue, set at submit: one more than its owner's last
    # queued job there, and never before the queue's current head. Ordering by it takes each owner's
    # first queued job, then each owner's second, and so on (service/scheduling/queue.py).
    fair_key: Mapped[int] = mapped_column(BigInteger, default=0)
    # The spec's `init_from` as resolved at submit: the source job and step, the pinned file (a hard
    # link under this job's folder, service/jobs/init_from.py) and the sha256 its attempts verify.
    # No foreign key: the source may be deleted, the pinned file stays this job's.
    init_job: Mapped[str | None] = mapped_column(String(32), default=None)
    init_step: Mapped[int | None] = mapped_column(BigInteger, default=None)
    init_path: Mapped[str | None] = mapped_column(Text, default=None)
    init_sha256: Mapped[str | None] = mapped_column(String(64), default=None)
    # How the current attempt has its `environment` (api_schemas.job_views.EnvironmentBuild), written
    # by its node 0: `preparing` with its start, then `ready` with the key, the build's time and
    # whether the worker's cache had it. NULL for a job without one (or before its first attempt).
    environment_state: Mapped[dict[str, Any] | None] = mapped_column(default=None)


class JobTransition(Base):
    """The state timeline of a job, one row per status change."""

    __tablename__ = "job_transitions"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    from_status: Mapped[str | None] = mapped_column(String(16))
    to_status: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[int]
    reason: Mapped[str | None] = mapped_column(Text, default=None)


class Metric(Base):
    __tablename__ = "metrics"
    __table_args__ = (
        # A series in (step, id) order straight from the index: "last write of a step wins" and
        # downsampling need no sort.
        Index("ix_metrics_job_name_step_id", "job_id", "name", "step", "id"),
        # The event stream reads "points after the last id it sent" of one job.
        Index("ix_metrics_job_id_id", "job_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int]
    name: Mapped[str] = mapped_column(String(128))
    step: Mapped[int] = mapped_column(BigInteger)
    value: Mapped[float] = mapped_column(Float)


class MetricRollup(Base):
    """The summary of one aligned block of a metric series, kept by the writer of its points.

    Level `level` cuts steps into blocks of `service.jobs.rollups_repository.block_size(level)`;
    `block` is `step // size`. The row holds what the points of the block (the last write of each
    step) give the downsampled query: how many, the first and last step, and the minimum and maximum
    point (the earliest step among equal values). A block with few points has no row: a missing row
    means "read the level below" (or the raw points), never "empty", so a stored row must be exact.
    """

    __tablename__ = "metric_rollups"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    level: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    block: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    points: Mapped[int]
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    min_step: Mapped[int] = mapped_column(BigInteger)
    min_value: Mapped[float] = mapped_column(Float)
    max_step: Mapped[int] = mapped_column(BigInteger)
    max_value: Mapped[float] = mapped_column(Float)
    # At least the id of every point in the block (the job's newest id when the row was written): a
    # reader that must leave out points after some id (`up_to_id`) skips rows above it.
    max_id: Mapped[int] = mapped_column(BigInteger)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int]
    step: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # The job's best checkpoint under `checkpoint.keep_best` (at most one row of a job).
    best: Mapped[bool] = mapped_column(default=False)


class JobArtifact(Base):
    """A regular file of the job's DPTRAIN_OUTPUT_DIR, as the last scan after an attempt found it."""

    __tablename__ = "job_artifacts"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    # Relative to the outputs directory, '/'-separated; not a key: a long path must not outgrow an index.
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    # The attempt whose end scanned it.
    attempt: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class LogLine(Base):
    """One line of a rank's output (rank NULL: the launcher's own output)."""

    __tablename__ = "log_lines"
    __table_args__ = (Index("ix_log_lines_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int]
    rank: Mapped[int | None]
    line: Mapped[str] = mapped_column(Text)
