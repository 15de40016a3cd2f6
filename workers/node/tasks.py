"""The thin Celery task: a placed node of a job in, the run handed to the runner."""

from __future__ import annotations

from service.config import get_settings
from service.dispatch import RUN_NODE_TASK
from workers.attempt.runner import run_node
from workers.node.celery_app import app


@app.task(name=RUN_NODE_TASK)
def run_node_task(job_id: str, attempt: int, node_rank: int, endpoint: str = "") -> str | None:
    """Run this node's part of an attempt; a stale or duplicate delivery returns None and runs nothing."""
    status = run_node(
        job_id=job_id, attempt=attempt, node_rank=node_rank, settings=get_settings(), endpoint=endpoint
    )
    return status.value if status else None
