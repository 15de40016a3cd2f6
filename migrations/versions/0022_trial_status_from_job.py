"""trial status from its job: drop sweep_trials.state, which could disagree with the job's status

A trial showed `pruned` with no objective when its job had finished every step and succeeded (the
pruner decided while the job ended). The status is now its job's; a trial whose job succeeded but
whose objective the old driver never recorded gets it from the job's metric, while it is still kept.

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-28 13:00:00.000000
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

trials = sa.table(
    "sweep_trials",
    sa.column("id", sa.Integer()),
    sa.column("sweep_id", sa.String()),
    sa.column("job_id", sa.String()),
    sa.column("state", sa.String()),
    sa.column("objective", sa.Float()),
)
sweeps = sa.table("sweeps", sa.column("id", sa.String()), sa.column("spec", sa.JSON()))
jobs = sa.table("jobs", sa.column("id", sa.String()), sa.column("status", sa.String()))
metrics = sa.table(
    "metrics",
    sa.column("job_id", sa.String()),
    sa.column("name", sa.String()),
    sa.column("step", sa.BigInteger()),
    sa.column("attempt", sa.Integer()),
    sa.column("value", sa.Float()),
)


def _metric(spec: Any) -> str | None:
    # JSONB comes back parsed; SQLite's JSON column through a plain table may come back as text.
    if isinstance(spec, str):
        spec = json.loads(spec)
    objective = spec.get("objective") if isinstance(spec, dict) else None
    return objective.get("metric") if isinstance(objective, dict) else None


def upgrade() -> None:
    conn = op.get_bind()
    lost = conn.execute(
        sa.select(trials.c.id, trials.c.job_id, sweeps.c.spec)
        .join(sweeps, sweeps.c.id == trials.c.sweep_id)
        .join(jobs, jobs.c.id == trials.c.job_id)
        .where(trials.c.objective.is_(None), jobs.c.status == "succeeded")
    ).all()
    for trial_id, job_id, spec in lost:
        metric = _metric(spec)
        if metric is None:
            continue
        # The value at the last step, the newest attempt's (as the driver records it).
        value = conn.execute(
            sa.select(metrics.c.value)
            .where(metrics.c.job_id == job_id, metrics.c.name == metric)
            .order_by(metrics.c.step.desc(), metrics.c.attempt.desc())
            .limit(1)
        ).scalar()
        if value is not None:
            conn.execute(sa.update(trials).where(trials.c.id == trial_id).values(objective=value))
    with op.batch_alter_table("sweep_trials", schema=None) as batch_op:
        batch_op.drop_column("state")


def downgrade() -> None:
    with op.batch_alter_table("sweep_trials", schema=None) as batch_op:
        batch_op.add_column(sa.Column("state", sa.String(length=16), server_default="active", nullable=False))
    # The state 0020 kept, from the job's status: complete only with an objective.
    status = sa.select(jobs.c.status).where(jobs.c.id == trials.c.job_id).scalar_subquery()
    state = sa.case(
        (status.in_(["queued", "running"]), "active"),
        ((status == "succeeded") & trials.c.objective.is_not(None), "complete"),
        (status == "pruned", "pruned"),
        else_="failed",
    )
    op.get_bind().execute(sa.update(trials).values(state=state))
    with op.batch_alter_table("sweep_trials", schema=None) as batch_op:
        batch_op.alter_column("state", server_default=None)
