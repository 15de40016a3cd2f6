"""job change notifications: NOTIFY dptrain_jobs with the job id after every UPDATE or DELETE of a job

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22 18:00:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# Each API process keeps the JSON of the jobs it served (`service.jobs.poll_cache`) and drops a job's
# entry when this arrives. A trigger rather than a NOTIFY in our own code, so that no writer (the
# API, a worker's reporter, the reconciler, an operator's SQL) can change a job without telling
# the caches. NOTIFY is transactional: delivered at commit, never for a rolled-back change, and
# several for one job in one transaction are delivered once.
CHANNEL = "dptrain_jobs"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite (the embedded `dptrain up`) has no NOTIFY; the cache is off there
    op.execute(
        f"""
        CREATE FUNCTION dptrain_notify_job_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{CHANNEL}', OLD.id);
            RETURN NULL;
        END
        $$
        """
    )
    # OLD.id: a job's id never changes, and OLD is set for both UPDATE and DELETE.
    op.execute(
        "CREATE TRIGGER jobs_notify_changed AFTER UPDATE OR DELETE ON jobs "
        "FOR EACH ROW EXECUTE FUNCTION dptrain_notify_job_changed()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER jobs_notify_changed ON jobs")
    op.execute("DROP FUNCTION dptrain_notify_job_changed()")
