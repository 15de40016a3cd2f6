"""The worker node process: its Celery app and task, its heartbeat, its housekeeping (reconciler)."""
