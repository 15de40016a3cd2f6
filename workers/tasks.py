"""The thin Celery task: a job id in, the run handed to the runner."""

from __future__ import annotations

from service.config import get_settings
from workers.celery_app import app
from workers.runner import run_attempt


@app.task(name="dptrain.run_job")
def run_job(job_id: str) -> str | None:
    """Claim and run one attempt of a job; a duplicate delivery returns None and runs nothing."""
    status = run_attempt(job_id=job_id, settings=get_settings())
    return status.value if status else None
